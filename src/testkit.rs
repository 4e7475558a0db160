//! What an app's integration test needs to run hubs on loopback in a few
//! lines.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! let hub = hubsync::testkit::TestHub::start().await?;
//! let client = hub.client(&hubsync::testkit::signing_key(1)).await.unwrap();
//! client.ping().await.unwrap();
//! hub.stop().await;
//! # Ok(()) }
//! ```
//!
//! A TLS hub serves a certificate made at run time; its clients, and
//! devices given [`TestHub::connector`], trust that certificate's root:
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! let hub = hubsync::testkit::TestHub::start_tls().await?;
//! assert!(hub.url().starts_with("wss://"));
//! let mut options = hubsync::testkit::device_options(&[hub.url().to_string()]);
//! options.connector = std::sync::Arc::new(hub.connector());
//! # Ok(()) }
//! ```

use crate::client::{ClientError, ClientOptions, HubClient};
use crate::clock::Clock;
use crate::hub::{Hub, HubConfig, PgHubStore};
use crate::kv::{Entries, KvError, KvStore, SledKv, WriteBatch};
use crate::rng::SharedRng;
use crate::transport::{
    server_config, BoxStream, CertificateDer, Connector, NetConnector, ServerConfig, TcpAcceptor,
    TcpConnector, TlsConfig, TlsListener, TlsStats,
};
use ed25519_dalek::SigningKey;
use futures::future::BoxFuture;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_rustls::rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};

mod cut;
mod postgres;
mod power;
pub use self::cut::{CutConnector, CutSwitch};
pub use self::postgres::TestPostgres;
pub use self::power::{PowerCutKv, PowerSwitch};

/// Which store a test hub keeps its data in, for tests that run one body
/// on each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestStore {
    /// sled in a temporary directory, as `hubsync hub --data DIR`.
    Sled,
    /// A fresh database on this process's [`TestPostgres`], as
    /// `hubsync hub --store postgres://...`.
    Postgres,
}

/// Where a test hub's data is.
#[derive(Clone, Debug)]
enum Location {
    Dir(PathBuf),
    /// A database URL, and how a hub's store on it runs.
    Postgres(String, crate::hub::PgOptions),
}

/// A deterministic signing key for tests: the same `n` gives the same device.
pub fn signing_key(n: u64) -> SigningKey {
    let mut seed = [0u8; 32];
    seed[..8].copy_from_slice(&n.to_le_bytes());
    seed[31] = 0x5a;
    SigningKey::from_bytes(&seed)
}

/// Open sled in `dir`, waiting briefly for a previous user in this process
/// to let go of its lock (sled releases it from a background thread).
pub async fn open_sled(dir: &Path) -> io::Result<SledKv> {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || SledKv::open_waiting(&dir, SLED_LOCK_PATIENCE))
        .await
        .map_err(io::Error::other)?
        .map_err(io::Error::other)
}

/// How long tests wait for sled's lock on a directory they reopen.
pub const SLED_LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);

/// A certificate authority made at run time, and a certificate it issued
/// for `localhost`, `127.0.0.1` and `::1`: what a TLS [`TestHub`] serves
/// and what its clients trust. Each call to [`TestCert::generate`] makes a
/// new authority, so a client trusting one refuses a hub serving another.
pub struct TestCert {
    root: CertificateDer<'static>,
    leaf: CertificateDer<'static>,
    key_der: Vec<u8>,
    leaf_pem: String,
    key_pem: String,
}

impl TestCert {
    /// Make a new authority (ECDSA P-256) and its certificate for the
    /// loopback names.
    ///
    /// # Errors
    /// When key generation or signing fails.
    pub fn generate() -> io::Result<TestCert> {
        use rcgen::{
            BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair,
            KeyUsagePurpose,
        };
        let gen = |e: rcgen::Error| io::Error::other(format!("test certificate: {e}"));
        let mut ca = CertificateParams::default();
        ca.distinguished_name
            .push(DnType::CommonName, "hubsync test CA");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca =
            CertifiedIssuer::self_signed(ca, KeyPair::generate().map_err(gen)?).map_err(gen)?;
        let names = ["localhost", "127.0.0.1", "::1"].map(String::from).to_vec();
        let mut leaf = CertificateParams::new(names).map_err(gen)?;
        leaf.distinguished_name
            .push(DnType::CommonName, "hubsync test hub");
        let key = KeyPair::generate().map_err(gen)?;
        let cert = leaf.signed_by(&key, &ca).map_err(gen)?;
        Ok(TestCert {
            root: ca.der().clone(),
            leaf: cert.der().clone(),
            key_der: key.serialize_der(),
            leaf_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// The authority's certificate (DER): what a client must trust.
    pub fn root(&self) -> &CertificateDer<'static> {
        &self.root
    }

    /// The hub's certificate in PEM, for `hubsync hub --tls-cert`.
    pub fn cert_pem(&self) -> &str {
        &self.leaf_pem
    }

    /// The hub's private key in PEM (PKCS#8), for `hubsync hub --tls-key`.
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// A hub's TLS configuration serving this certificate.
    ///
    /// # Errors
    /// When rustls refuses it (a bug in this kit).
    pub fn server_config(&self) -> io::Result<Arc<ServerConfig>> {
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()));
        server_config(vec![self.leaf.clone()], key).map_err(io::Error::other)
    }

    /// A device connector trusting this authority (plain `ws://` to
    /// loopback only, as in production).
    ///
    /// # Errors
    /// When rustls refuses the root (a bug in this kit).
    pub fn connector(&self) -> io::Result<NetConnector> {
        NetConnector::new(TlsConfig {
            extra_roots: vec![self.root.clone()],
            ..TlsConfig::default()
        })
        .map_err(io::Error::other)
    }
}

/// A TLS test hub's certificate authority and handshake counters.
struct HubTls {
    root: CertificateDer<'static>,
    stats: TlsStats,
}

/// A real hub on a loopback port with its sled store in a directory,
/// serving plain `ws://` or, started with [`TestHub::start_tls`], `wss://`.
pub struct TestHub {
    hub: Hub,
    addr: SocketAddr,
    url: String,
    dir: PathBuf,
    location: Location,
    tls: Option<HubTls>,
    connector: NetConnector,
    /// How the store is wrapped, again at each restart.
    wrap: Option<StoreWrap>,
    _temp: Option<Arc<tempfile::TempDir>>,
}

impl TestHub {
    /// Start a hub with default limits on a free port and a fresh temporary
    /// directory (removed when the hub is dropped).
    ///
    /// # Errors
    /// When no port or directory can be had.
    pub async fn start() -> io::Result<TestHub> {
        Self::start_with(|_| {}).await
    }

    /// Like [`TestHub::start`], letting `configure` change the configuration
    /// (the URL is set afterwards to the bound address).
    ///
    /// # Errors
    /// When no port or directory can be had.
    pub async fn start_with(configure: impl FnOnce(&mut HubConfig)) -> io::Result<TestHub> {
        let temp = Arc::new(tempfile::tempdir()?);
        let dir = temp.path().to_path_buf();
        let mut hub = Self::start_at(&dir, "127.0.0.1:0", configure).await?;
        hub._temp = Some(temp);
        Ok(hub)
    }

    /// Like [`TestHub::start_with`], on a new store of the kind `store`.
    ///
    /// # Errors
    /// When no port, directory or database can be had.
    pub async fn start_on(
        store: TestStore,
        configure: impl FnOnce(&mut HubConfig),
    ) -> io::Result<TestHub> {
        match store {
            TestStore::Sled => Self::start_with(configure).await,
            TestStore::Postgres => {
                let url = TestPostgres::shared()?.database().await?;
                // A small pool: many test hubs share one test server.
                let options = crate::hub::PgOptions {
                    pool_size: 4,
                    ..Default::default()
                };
                Self::start_on_database(&url, &options, configure).await
            }
        }
    }

    /// Start a hub on the PostgreSQL database `url` (as `hubsync hub
    /// --store URL --store-pool POOL`), on a free port.
    ///
    /// # Errors
    /// When no port can be had or the store cannot be opened.
    pub async fn start_on_database(
        url: &str,
        options: &crate::hub::PgOptions,
        configure: impl FnOnce(&mut HubConfig),
    ) -> io::Result<TestHub> {
        let temp = Arc::new(tempfile::tempdir()?);
        let location = Location::Postgres(url.to_string(), options.clone());
        let mut hub =
            Self::start_inner(temp.path(), &location, "127.0.0.1:0", None, None, configure).await?;
        hub._temp = Some(temp);
        Ok(hub)
    }

    /// Start another hub on `other`'s store (a new port), as a second
    /// `hubsync hub --store` process on the same PostgreSQL database; both
    /// serve the same devices and groups. A sled store cannot be shared
    /// (sled locks its directory): that start fails.
    ///
    /// # Errors
    /// When no port can be had or the store cannot be opened.
    pub async fn start_beside(
        other: &TestHub,
        configure: impl FnOnce(&mut HubConfig),
    ) -> io::Result<TestHub> {
        let temp = Arc::new(tempfile::tempdir()?);
        let mut hub = Self::start_inner(
            temp.path(),
            &other.location,
            "127.0.0.1:0",
            None,
            None,
            configure,
        )
        .await?;
        hub._temp = Some(temp);
        Ok(hub)
    }

    /// Stop the hub cleanly and start it again on the same store (and a new
    /// port), as an operator's restart does; a store started with
    /// [`start_wrapped`](Self::start_wrapped) is wrapped again. After a
    /// [`PowerSwitch::cut`] the stop's flush fails (the machine is off) and
    /// the hub boots again on what was flushed.
    ///
    /// # Errors
    /// When no port can be had or the store cannot be opened again.
    pub async fn restart(self, configure: impl FnOnce(&mut HubConfig)) -> io::Result<TestHub> {
        let dir = self.dir.clone();
        let location = self.location.clone();
        let wrap = self.wrap.clone();
        let temp = self.stop().await;
        let mut hub =
            Self::start_inner(&dir, &location, "127.0.0.1:0", None, wrap, configure).await?;
        hub._temp = temp;
        Ok(hub)
    }

    /// Start a TLS hub (`wss://127.0.0.1:<port>`) serving a certificate
    /// made now ([`TestCert::generate`]), with the default handshake
    /// deadline, on a fresh temporary directory.
    ///
    /// # Errors
    /// When no port, directory or certificate can be had.
    pub async fn start_tls() -> io::Result<TestHub> {
        let cert = TestCert::generate()?;
        Self::start_tls_with(
            &cert,
            TlsListener::<TcpAcceptor>::DEFAULT_HANDSHAKE_TIMEOUT,
            |_| {},
        )
        .await
    }

    /// Like [`TestHub::start_tls`], serving `cert`, giving each client
    /// `handshake_timeout` to finish its TLS handshake, and letting
    /// `configure` change the configuration (the URL is set afterwards).
    ///
    /// # Errors
    /// When no port or directory can be had.
    pub async fn start_tls_with(
        cert: &TestCert,
        handshake_timeout: Duration,
        configure: impl FnOnce(&mut HubConfig),
    ) -> io::Result<TestHub> {
        let temp = Arc::new(tempfile::tempdir()?);
        let dir = temp.path().to_path_buf();
        let tls = Some((cert, handshake_timeout));
        let location = Location::Dir(dir.clone());
        let mut hub =
            Self::start_inner(&dir, &location, "127.0.0.1:0", tls, None, configure).await?;
        hub._temp = Some(temp);
        Ok(hub)
    }

    /// Start a hub on `addr` over the store in `dir` (kept when dropped), for
    /// restarting a hub on the same directory and port.
    ///
    /// # Errors
    /// When the port is taken or the store cannot be opened.
    pub async fn start_at(
        dir: &Path,
        addr: &str,
        configure: impl FnOnce(&mut HubConfig),
    ) -> io::Result<TestHub> {
        let location = Location::Dir(dir.to_path_buf());
        Self::start_inner(dir, &location, addr, None, None, configure).await
    }

    /// Like [`TestHub::start_with`], with the hub's sled store seen through
    /// `wrap` (a [`FaultySwitch`], say, to make its writes fail on demand);
    /// every [`restart`](Self::restart) wraps it again.
    ///
    /// # Errors
    /// When no port or directory can be had.
    pub async fn start_wrapped(
        wrap: StoreWrap,
        configure: impl FnOnce(&mut HubConfig),
    ) -> io::Result<TestHub> {
        let temp = Arc::new(tempfile::tempdir()?);
        let dir = temp.path().to_path_buf();
        let location = Location::Dir(dir.clone());
        let mut hub =
            Self::start_inner(&dir, &location, "127.0.0.1:0", None, Some(wrap), configure).await?;
        hub._temp = Some(temp);
        Ok(hub)
    }

    async fn start_inner(
        dir: &Path,
        location: &Location,
        addr: &str,
        tls: Option<(&TestCert, Duration)>,
        wrap: Option<StoreWrap>,
        configure: impl FnOnce(&mut HubConfig),
    ) -> io::Result<TestHub> {
        let listener = TcpAcceptor::bind(addr).await?;
        let addr = listener.local_addr()?;
        let scheme = if tls.is_some() { "wss" } else { "ws" };
        let url = format!("{scheme}://{addr}");
        let mut config = HubConfig::new(url.clone());
        configure(&mut config);
        config.url = url.clone();
        let rng = SharedRng::from_entropy();
        let hub = match location {
            Location::Dir(dir) => {
                let mut store: Arc<dyn KvStore> = Arc::new(open_sled(dir).await?);
                if let Some(wrap) = &wrap {
                    store = wrap(store);
                }
                Hub::start(store, config, Clock::System, rng).map_err(io::Error::other)?
            }
            Location::Postgres(url, options) => {
                let store = PgHubStore::open(url, options, &rng)
                    .await
                    .map_err(io::Error::other)?;
                Hub::start_on(store, config, Clock::System, rng).map_err(io::Error::other)?
            }
        };
        let (tls, connector) = match tls {
            Some((cert, handshake_timeout)) => {
                let listener = TlsListener::new(listener, cert.server_config()?)
                    .handshake_timeout(handshake_timeout);
                let stats = listener.stats();
                hub.serve(listener);
                let root = cert.root().clone();
                (Some(HubTls { root, stats }), cert.connector()?)
            }
            None => {
                hub.serve(listener);
                (None, NetConnector::default())
            }
        };
        Ok(TestHub {
            hub,
            addr,
            url,
            dir: dir.to_path_buf(),
            location: location.clone(),
            tls,
            connector,
            wrap,
            _temp: None,
        })
    }

    /// The certificate authority a TLS hub's certificate chains to (DER),
    /// for a client to trust; `None` for a plain hub.
    pub fn tls_root(&self) -> Option<&CertificateDer<'static>> {
        self.tls.as_ref().map(|t| &t.root)
    }

    /// A TLS hub's handshake counters; `None` for a plain hub.
    pub fn tls_stats(&self) -> Option<&TlsStats> {
        self.tls.as_ref().map(|t| &t.stats)
    }

    /// The connector [`TestHub::client`] uses: a [`NetConnector`] that trusts
    /// this hub's root, if it has one. Set it as a test device's
    /// `DeviceOptions::connector`.
    pub fn connector(&self) -> NetConnector {
        self.connector.clone()
    }

    /// The URL devices dial.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The running hub.
    pub fn hub(&self) -> &Hub {
        &self.hub
    }

    /// The database URL of a hub on PostgreSQL; `None` on sled.
    pub fn database_url(&self) -> Option<String> {
        match &self.location {
            Location::Postgres(url, _) => Some(url.clone()),
            Location::Dir(_) => None,
        }
    }

    /// A client authenticated as `key`, over real TCP (and TLS for a TLS
    /// hub) through [`TestHub::connector`].
    ///
    /// # Errors
    /// As [`HubClient::connect`].
    pub async fn client(&self, key: &SigningKey) -> Result<HubClient, ClientError> {
        HubClient::connect(&self.connector, &self.url, key, ClientOptions::default()).await
    }

    /// Shut the hub down cleanly (flushed) and hand back the temporary
    /// directory, if the hub made one, so a restart can reuse it.
    pub async fn stop(self) -> Option<Arc<tempfile::TempDir>> {
        self.hub.shutdown().await;
        // Give sled a moment to release its lock after the last handle drops.
        drop(self.hub);
        self._temp
    }
}

/// Device options for tests: the device's hubs, fast reconnects and retries,
/// so tests spend their time on behaviour rather than on backoff.
pub fn device_options(hubs: &[String]) -> crate::device::DeviceOptions {
    let mut o = crate::device::DeviceOptions::new(hubs.to_vec());
    o.manager.link.backoff_base = std::time::Duration::from_millis(50);
    o.manager.link.backoff_max = std::time::Duration::from_millis(500);
    o.manager.link.stable_after = std::time::Duration::from_millis(200);
    o.manager.link.client.request_timeout = std::time::Duration::from_secs(5);
    o.outbox.retry_base = std::time::Duration::from_millis(50);
    o.outbox.retry_max = std::time::Duration::from_millis(500);
    o
}

/// Wraps the store a [`TestDevice`] opens (at every open and reopen), for
/// example in a [`FaultyKv`].
pub type StoreWrap = Arc<dyn Fn(Arc<dyn KvStore>) -> Arc<dyn KvStore> + Send + Sync>;

/// A device in a temporary directory that can be closed and reopened.
pub struct TestDevice {
    device: Option<crate::device::Device>,
    dir: tempfile::TempDir,
    options: crate::device::DeviceOptions,
    wrap: Option<StoreWrap>,
    log: Arc<Mutex<Vec<crate::device::Event>>>,
    /// Where in `log` the device's latest open begins.
    opened_at: usize,
}

/// Every event a [`TestDevice`] emitted from its latest open on, recorded
/// by an observer the device was opened with, so a test sees the events of
/// the open itself too (an [`EventStream`](crate::device::EventStream) only
/// sees those after it subscribed).
#[derive(Clone)]
pub struct EventLog {
    log: Arc<Mutex<Vec<crate::device::Event>>>,
    from: usize,
}

impl EventLog {
    /// The same log, but holding only events from now on.
    pub fn from_now(&self) -> EventLog {
        let len = self.log.lock().unwrap_or_else(|p| p.into_inner()).len();
        EventLog {
            log: self.log.clone(),
            from: len.max(self.from),
        }
    }

    /// The events so far, oldest first.
    pub fn snapshot(&self) -> Vec<crate::device::Event> {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        log.get(self.from..).map(<[_]>::to_vec).unwrap_or_default()
    }
}

impl TestDevice {
    /// Open a new device on `hubs` with [`device_options`].
    ///
    /// # Errors
    /// When the directory or the store cannot be had.
    pub async fn open(hubs: &[String]) -> Result<TestDevice, crate::device::DeviceError> {
        Self::open_with(device_options(hubs)).await
    }

    /// Open a new device with the given options.
    ///
    /// # Errors
    /// When the directory or the store cannot be had.
    pub async fn open_with(
        options: crate::device::DeviceOptions,
    ) -> Result<TestDevice, crate::device::DeviceError> {
        Self::open_inner(options, None).await
    }

    /// Open a new device with the given options over its sled store as
    /// `wrap` wraps it; every [`reopen`](Self::reopen) wraps it again.
    ///
    /// ```no_run
    /// # async fn demo(hubs: Vec<String>) {
    /// use hubsync::testkit::{device_options, FaultyKv, TestDevice};
    /// let faulty = FaultyKv::switch();
    /// let d = TestDevice::open_with_store(device_options(&hubs), faulty.store_wrap())
    ///     .await
    ///     .unwrap();
    /// faulty.fail(true); // every write of `d` fails from now on
    /// # }
    /// ```
    ///
    /// # Errors
    /// When the directory or the store cannot be had.
    pub async fn open_with_store(
        options: crate::device::DeviceOptions,
        wrap: StoreWrap,
    ) -> Result<TestDevice, crate::device::DeviceError> {
        Self::open_inner(options, Some(wrap)).await
    }

    async fn open_inner(
        options: crate::device::DeviceOptions,
        wrap: Option<StoreWrap>,
    ) -> Result<TestDevice, crate::device::DeviceError> {
        let dir =
            tempfile::tempdir().map_err(|e| crate::device::DeviceError::Store(e.to_string()))?;
        let mut options = options;
        let log = Arc::new(Mutex::new(Vec::new()));
        let record = log.clone();
        let inner = options.manager.observer.take();
        options.manager.observer = Some(crate::device::Observer(Arc::new(
            move |e: &crate::device::Event| {
                if let Some(o) = &inner {
                    (o.0)(e);
                }
                record
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(e.clone());
            },
        )));
        let device = Self::start(dir.path(), &options, wrap.as_ref()).await?;
        Ok(TestDevice {
            device: Some(device),
            dir,
            options,
            wrap,
            log,
            opened_at: 0,
        })
    }

    async fn start(
        dir: &Path,
        options: &crate::device::DeviceOptions,
        wrap: Option<&StoreWrap>,
    ) -> Result<crate::device::Device, crate::device::DeviceError> {
        let kv: Arc<dyn KvStore> = Arc::new(
            open_sled(dir)
                .await
                .map_err(|e| crate::device::DeviceError::Store(e.to_string()))?,
        );
        let kv = match wrap {
            Some(w) => w(kv),
            None => kv,
        };
        crate::device::Device::open_store(kv, options.clone()).await
    }

    /// Close the device and open it again from its directory, as a restart
    /// of the app would.
    ///
    /// # Errors
    /// When the store cannot be reopened.
    pub async fn reopen(&mut self) -> Result<(), crate::device::DeviceError> {
        if let Some(d) = self.device.take() {
            d.close().await;
        }
        self.opened_at = self.log.lock().unwrap_or_else(|p| p.into_inner()).len();
        self.device = Some(Self::start(self.dir.path(), &self.options, self.wrap.as_ref()).await?);
        Ok(())
    }

    /// The events of this device from its latest open (or reopen) on.
    pub fn event_log(&self) -> EventLog {
        EventLog {
            log: self.log.clone(),
            from: self.opened_at,
        }
    }

    /// Close the device (its directory stays until this value is dropped).
    pub async fn close(&mut self) {
        if let Some(d) = self.device.take() {
            d.close().await;
        }
    }

    /// The device's directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Invite `who` into `group`, trying again for up to `within` while
    /// `who` has no key package on the hubs yet (a device just opened may
    /// not have uploaded its own).
    ///
    /// # Errors
    /// The invite's error once it is another than `NoKeyPackage`, or
    /// `NoKeyPackage` still after `within`.
    pub async fn invite_when_ready(
        &self,
        group: crate::device::GroupId,
        who: crate::wire::DeviceId,
        within: Duration,
    ) -> Result<crate::device::lane::LaneResult, crate::device::lane::CommitError> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match self.invite(group, who).await {
                Err(crate::device::lane::CommitError::NoKeyPackage(_))
                    if tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                other => return other,
            }
        }
    }
}

impl std::ops::Deref for TestDevice {
    type Target = crate::device::Device;

    /// # Panics
    /// When the device is closed: reopen it first.
    fn deref(&self) -> &Self::Target {
        match &self.device {
            Some(d) => d,
            None => panic!("TestDevice used while closed; call reopen() first"),
        }
    }
}

/// A switch that makes the writes of a wrapped store fail on demand, as a
/// full disk or a failing device would: while it is on, every
/// [`KvStore::apply`] and [`KvStore::flush`] of a [`FaultyKv`] made with
/// [`FaultySwitch::wrap`] answers [`KvError::Engine`] and changes nothing;
/// reads always go through.
#[derive(Clone, Debug, Default)]
pub struct FaultySwitch {
    failing: Arc<AtomicBool>,
    refused: Arc<AtomicU64>,
}

impl FaultySwitch {
    /// Turn the failure on or off.
    pub fn fail(&self, on: bool) {
        self.failing.store(on, Ordering::SeqCst);
    }

    /// How many writes were refused so far (to check that a test really
    /// exercised the failure).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::SeqCst)
    }

    /// `inner` behind this switch.
    pub fn wrap(&self, inner: Arc<dyn KvStore>) -> Arc<dyn KvStore> {
        Arc::new(FaultyKv {
            inner,
            switch: self.clone(),
        })
    }

    /// [`wrap`](Self::wrap) as a [`StoreWrap`] for
    /// [`TestDevice::open_with_store`].
    pub fn store_wrap(&self) -> StoreWrap {
        let me = self.clone();
        Arc::new(move |kv| me.wrap(kv))
    }
}

/// A store whose writes fail while its [`FaultySwitch`] is on.
pub struct FaultyKv {
    inner: Arc<dyn KvStore>,
    switch: FaultySwitch,
}

impl FaultyKv {
    /// A new switch, off; wrap stores with [`FaultySwitch::wrap`].
    pub fn switch() -> FaultySwitch {
        FaultySwitch::default()
    }

    fn check(&self) -> Result<(), KvError> {
        if self.switch.failing.load(Ordering::SeqCst) {
            self.switch.refused.fetch_add(1, Ordering::SeqCst);
            return Err(KvError::Engine("injected write failure (testkit)".into()));
        }
        Ok(())
    }
}

impl KvStore for FaultyKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        self.inner.get(key)
    }

    fn range(&self, start: &[u8], end: Option<&[u8]>, limit: usize) -> Result<Entries, KvError> {
        self.inner.range(start, end, limit)
    }

    fn apply(&self, batch: &WriteBatch) -> Result<(), KvError> {
        self.check()?;
        self.inner.apply(batch)
    }

    fn flush(&self) -> Result<(), KvError> {
        self.check()?;
        self.inner.flush()
    }

    fn flush_blocks(&self) -> bool {
        self.inner.flush_blocks()
    }
}

/// Holds what one hub sends to a device, on demand: the connections that a
/// [`GatedConnector`] opens to its URL stop delivering received bytes while
/// the gate is held (the bytes wait, nothing is lost) and go on when it is
/// released. Writes always go through, so a request reaches the hub and is
/// acted on while its answer waits: a slow hub, or a crash between a
/// publish and its answer.
#[derive(Default)]
pub struct Gate {
    held: AtomicBool,
    /// When non-zero: hold as soon as one write of at least this many
    /// bytes has gone out.
    hold_after_write: AtomicUsize,
    wakers: Mutex<Vec<Waker>>,
}

impl Gate {
    /// Hold received bytes from now on.
    pub fn hold(&self) {
        self.held.store(true, Ordering::SeqCst);
    }

    /// Hold received bytes once a single write of at least `min_len` bytes
    /// went out (that write itself goes through): for example a commit
    /// publish, which is larger than the small requests around it.
    pub fn hold_after_write(&self, min_len: usize) {
        self.hold_after_write.store(min_len, Ordering::SeqCst);
    }

    /// Let everything through again (and disarm [`hold_after_write`]).
    ///
    /// [`hold_after_write`]: Gate::hold_after_write
    pub fn release(&self) {
        self.hold_after_write.store(0, Ordering::SeqCst);
        self.held.store(false, Ordering::SeqCst);
        let wakers = std::mem::take(&mut *self.wakers.lock().unwrap_or_else(|p| p.into_inner()));
        for w in wakers {
            w.wake();
        }
    }

    /// Whether received bytes are held now.
    pub fn is_held(&self) -> bool {
        self.held.load(Ordering::SeqCst)
    }

    fn wrote(&self, n: usize) {
        let min = self.hold_after_write.load(Ordering::SeqCst);
        if min > 0 && n >= min {
            self.hold_after_write.store(0, Ordering::SeqCst);
            self.hold();
        }
    }

    /// Pending (with the waker kept) while held.
    fn poll_open(&self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.is_held() {
            return Poll::Ready(());
        }
        self.wakers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(cx.waker().clone());
        // Released between the check and the registration: go on.
        if self.is_held() {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    }
}

/// A connector that reaches every hub over TCP, with the streams to one
/// URL behind a [`Gate`].
pub struct GatedConnector {
    inner: Arc<dyn Connector>,
    url: String,
    gate: Arc<Gate>,
}

impl GatedConnector {
    /// Streams to `url` (compared without a trailing `/`) go through `gate`;
    /// everything goes over TCP.
    pub fn new(url: &str, gate: Arc<Gate>) -> Self {
        Self {
            inner: Arc::new(TcpConnector),
            url: url.trim_end_matches('/').to_string(),
            gate,
        }
    }
}

impl Connector for GatedConnector {
    fn connect(&self, url: &str) -> BoxFuture<'static, io::Result<BoxStream>> {
        let fut = self.inner.connect(url);
        let gate = (url.trim_end_matches('/') == self.url).then(|| self.gate.clone());
        Box::pin(async move {
            let stream = fut.await?;
            Ok(match gate {
                Some(gate) => Box::new(GatedStream {
                    inner: stream,
                    gate,
                }) as BoxStream,
                None => stream,
            })
        })
    }
}

struct GatedStream {
    inner: BoxStream,
    gate: Arc<Gate>,
}

impl AsyncRead for GatedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.gate.poll_open(cx).is_pending() {
            return Poll::Pending;
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for GatedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &r {
            self.gate.wrote(*n);
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
