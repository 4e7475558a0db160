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
use crate::hub::{Hub, HubConfig};
use crate::kv::{KvStore, SledKv};
use crate::rng::SharedRng;
use crate::transport::{
    server_config, CertificateDer, NetConnector, ServerConfig, TcpAcceptor, TlsConfig, TlsListener,
    TlsStats,
};
use ed25519_dalek::SigningKey;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio_rustls::rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};

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
    let mut tries = 0;
    loop {
        match SledKv::open(dir) {
            Ok(kv) => return Ok(kv),
            Err(e) if tries < 50 && e.to_string().contains("lock") => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => return Err(io::Error::other(e)),
        }
    }
}

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
    tls: Option<HubTls>,
    connector: NetConnector,
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
        let mut hub = Self::start_inner(&dir, "127.0.0.1:0", tls, configure).await?;
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
        Self::start_inner(dir, addr, None, configure).await
    }

    async fn start_inner(
        dir: &Path,
        addr: &str,
        tls: Option<(&TestCert, Duration)>,
        configure: impl FnOnce(&mut HubConfig),
    ) -> io::Result<TestHub> {
        let listener = TcpAcceptor::bind(addr).await?;
        let addr = listener.local_addr()?;
        let scheme = if tls.is_some() { "wss" } else { "ws" };
        let url = format!("{scheme}://{addr}");
        let mut config = HubConfig::new(url.clone());
        configure(&mut config);
        config.url = url.clone();
        let store: Arc<dyn KvStore> = Arc::new(open_sled(dir).await?);
        let hub = Hub::start(store, config, Clock::System, SharedRng::from_entropy())
            .map_err(io::Error::other)?;
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
            tls,
            connector,
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

/// A device in a temporary directory that can be closed and reopened.
pub struct TestDevice {
    device: Option<crate::device::Device>,
    dir: tempfile::TempDir,
    options: crate::device::DeviceOptions,
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
        let dir =
            tempfile::tempdir().map_err(|e| crate::device::DeviceError::Store(e.to_string()))?;
        let device = Self::start(dir.path(), &options).await?;
        Ok(TestDevice {
            device: Some(device),
            dir,
            options,
        })
    }

    async fn start(
        dir: &Path,
        options: &crate::device::DeviceOptions,
    ) -> Result<crate::device::Device, crate::device::DeviceError> {
        let kv = open_sled(dir)
            .await
            .map_err(|e| crate::device::DeviceError::Store(e.to_string()))?;
        crate::device::Device::open_store(Arc::new(kv), options.clone()).await
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
        self.device = Some(Self::start(self.dir.path(), &self.options).await?);
        Ok(())
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
