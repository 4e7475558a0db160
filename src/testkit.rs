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

use crate::client::{ClientError, ClientOptions, HubClient};
use crate::clock::Clock;
use crate::hub::{Hub, HubConfig};
use crate::kv::{KvStore, SledKv};
use crate::rng::SharedRng;
use crate::transport::{TcpAcceptor, TcpConnector};
use ed25519_dalek::SigningKey;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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

/// A real hub on a loopback port with its sled store in a directory.
pub struct TestHub {
    hub: Hub,
    addr: SocketAddr,
    url: String,
    dir: PathBuf,
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
        let listener = TcpAcceptor::bind(addr).await?;
        let addr = listener.local_addr()?;
        let url = format!("ws://{addr}");
        let mut config = HubConfig::new(url.clone());
        configure(&mut config);
        config.url = url.clone();
        let store: Arc<dyn KvStore> = Arc::new(open_sled(dir).await?);
        let hub = Hub::start(store, config, Clock::System, SharedRng::from_entropy())
            .map_err(io::Error::other)?;
        hub.serve(listener);
        Ok(TestHub {
            hub,
            addr,
            url,
            dir: dir.to_path_buf(),
            _temp: None,
        })
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

    /// A client authenticated as `key`, over real TCP.
    ///
    /// # Errors
    /// As [`HubClient::connect`].
    pub async fn client(&self, key: &SigningKey) -> Result<HubClient, ClientError> {
        HubClient::connect(&TcpConnector, &self.url, key, ClientOptions::default()).await
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
