//! TLS for hub connections: `wss://` is WebSocket over TLS (rustls, with
//! the `ring` crypto provider), `ws://` is plain TCP and only for loopback.
//!
//! Devices dial through a [`NetConnector`]: it verifies a `wss://` hub's
//! certificate against the webpki (Mozilla) roots plus the
//! [`TlsConfig::extra_roots`] it was given, for the host named in the URL,
//! and refuses plain `ws://` to a host that is not loopback unless
//! [`TlsConfig::allow_plain_ws`] is set. The refusal is decided from the URL
//! alone, before any name lookup or connect.
//!
//! Hubs accept through a [`TlsListener`] wrapping another [`Listener`]
//! (usually a [`TcpAcceptor`]). Handshakes run concurrently, each under a
//! deadline, and only finished ones are handed to the hub: a client that
//! never speaks holds one of [`TlsListener::max_pending`] slots until its
//! deadline, never the accept loop. A failed or timed out handshake is
//! counted in [`TlsStats`], logged at `debug`, and the connection dropped;
//! it is never an accept error.
//!
//! [`TcpAcceptor`]: super::TcpAcceptor

use super::{BoxStream, Connector, Listener};
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{PrivateKeyDer, ServerName};

pub use tokio_rustls::rustls::pki_types::CertificateDer;
pub use tokio_rustls::rustls::ServerConfig;

/// Why a TLS configuration could not be made.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    /// A PEM file could not be read or parsed.
    #[error("cannot read {}: {reason}", path.display())]
    Pem {
        /// The file.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// The certificate file holds no `CERTIFICATE` section.
    #[error("{} holds no PEM certificate", path.display())]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// rustls refused the certificate chain and key, for example a key that
    /// does not belong to the certificate.
    #[error("the certificate and key do not make a TLS configuration: {0}")]
    Server(#[source] rustls::Error),
    /// An extra root certificate is not a usable trust anchor.
    #[error("extra root certificate #{index} is not usable: {source}")]
    Root {
        /// Its position in [`TlsConfig::extra_roots`].
        index: usize,
        /// Why rustls refused it.
        #[source]
        source: rustls::Error,
    },
    /// The crypto provider supports none of the default protocol versions
    /// (a bug in us: the `ring` provider supports both).
    #[error("TLS provider: {0}")]
    Provider(#[source] rustls::Error),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    // Chosen explicitly rather than through the process default, so another
    // crate enabling a second provider cannot make the choice ambiguous.
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A hub's TLS configuration from a certificate chain (leaf first) and its
/// private key (PKCS#8, PKCS#1 or SEC1), all DER.
///
/// # Errors
/// `Server` when rustls refuses them, for example a key that does not match
/// the leaf certificate.
pub fn server_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<ServerConfig>, TlsSetupError> {
    let config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsSetupError::Provider)?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(TlsSetupError::Server)?;
    Ok(Arc::new(config))
}

/// A hub's TLS configuration from PEM files: `cert` holds the chain, leaf
/// first (a `fullchain.pem`), `key` the leaf's private key.
///
/// # Errors
/// `Pem` when a file cannot be read or holds no key, `NoCertificate` when
/// `cert` holds no certificate, `Server` when the two do not fit.
pub fn server_config_from_pem(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsSetupError> {
    let pem_err = |path: &Path| {
        let path = path.to_path_buf();
        move |e: rustls::pki_types::pem::Error| TlsSetupError::Pem {
            path,
            reason: e.to_string(),
        }
    };
    let chain = CertificateDer::pem_file_iter(cert)
        .map_err(pem_err(cert))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem_err(cert))?;
    if chain.is_empty() {
        return Err(TlsSetupError::NoCertificate {
            path: cert.to_path_buf(),
        });
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(pem_err(key))?;
    server_config(chain, key)
}

/// What a device's [`NetConnector`] trusts and allows. The default trusts
/// only the webpki roots and dials plain `ws://` to loopback only.
#[derive(Clone, Debug, Default)]
pub struct TlsConfig {
    /// Root certificates (DER) trusted for `wss://` hubs besides the webpki
    /// roots: a private CA's, or a test hub's generated one.
    pub extra_roots: Vec<CertificateDer<'static>>,
    /// Dial plain `ws://` URLs to hosts that are not loopback. Off by
    /// default: such a connection crosses the network unauthenticated, so
    /// anyone on the path can pose as the hub or read its metadata.
    pub allow_plain_ws: bool,
}

/// The production connector: `wss://` over TLS, `ws://` as plain TCP to
/// loopback hosts (127.0.0.0/8, `::1`, `localhost`) only, unless allowed.
/// Cheap to clone.
#[derive(Clone)]
pub struct NetConnector {
    tls: tokio_rustls::TlsConnector,
    allow_plain_ws: bool,
}

impl std::fmt::Debug for NetConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetConnector")
            .field("allow_plain_ws", &self.allow_plain_ws)
            .finish_non_exhaustive()
    }
}

impl NetConnector {
    /// A connector trusting the webpki roots and `config.extra_roots`.
    ///
    /// # Errors
    /// `Root` when an extra root is not a certificate rustls can anchor on.
    pub fn new(config: TlsConfig) -> Result<NetConnector, TlsSetupError> {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        for (index, root) in config.extra_roots.into_iter().enumerate() {
            roots
                .add(root)
                .map_err(|source| TlsSetupError::Root { index, source })?;
        }
        let client = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(TlsSetupError::Provider)?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(NetConnector {
            tls: tokio_rustls::TlsConnector::from(Arc::new(client)),
            allow_plain_ws: config.allow_plain_ws,
        })
    }

    /// Whether this connector would dial `url`, decided from the URL alone
    /// (no name lookup, no connect): `wss://` with a host is fine; `ws://`
    /// is fine to a loopback host, or to any host when plain `ws://` is
    /// allowed.
    ///
    /// # Errors
    /// `PermissionDenied` for plain `ws://` to a host that is not loopback;
    /// `InvalidInput` for a URL that is not `ws://` or `wss://` or names no
    /// host.
    pub fn check_url(&self, url: &str) -> io::Result<()> {
        self.endpoint(url).map(|_| ())
    }

    /// Where `url` says to dial, if this connector's policy allows it.
    fn endpoint(&self, url: &str) -> io::Result<super::Endpoint> {
        let ep = super::Endpoint::parse(url)?;
        if ep.tls || self.allow_plain_ws || is_loopback_host(&ep.host) {
            return Ok(ep);
        }
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "refusing plain ws:// to {}, which is not loopback: use wss://, \
                 or set allow_plain_ws to send this connection unencrypted",
                ep.host
            ),
        ))
    }
}

impl Default for NetConnector {
    /// A connector trusting the webpki roots only, plain `ws://` to
    /// loopback only.
    fn default() -> Self {
        // Without extra roots the one possible error is a provider lacking
        // the default protocol versions, which `ring` does not.
        Self::new(TlsConfig::default())
            .expect("the ring provider supports the default TLS versions")
    }
}

/// Whether `host` (brackets already removed) is a loopback name: the
/// literal `localhost`, 127.0.0.0/8 or `::1`. Any other name counts as
/// remote, even one that resolves to loopback: the decision is made without
/// a lookup.
fn is_loopback_host(host: &str) -> bool {
    let host = host.strip_suffix('.').unwrap_or(host);
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) => v4.is_loopback(),
        Ok(IpAddr::V6(v6)) => v6.is_loopback(),
        Err(_) => false,
    }
}

impl Connector for NetConnector {
    /// Dial `url`: TCP, then for `wss://` a TLS handshake verifying the
    /// hub's certificate for the URL's host.
    ///
    /// A URL [`NetConnector::check_url`] refuses, or whose host is no TLS
    /// server name, fails at once: the returned future is ready on its
    /// first poll and nothing has touched the network.
    ///
    /// # Errors
    /// As `check_url`; the connect's I/O error; for `wss://`, `InvalidData`
    /// when the certificate is not trusted or not valid for the host
    /// (the message names the certificate error).
    fn connect(&self, url: &str) -> BoxFuture<'static, io::Result<BoxStream>> {
        let ready = |e| -> BoxFuture<'static, io::Result<BoxStream>> {
            Box::pin(std::future::ready(Err(e)))
        };
        let ep = match self.endpoint(url) {
            Ok(ep) => ep,
            Err(e) => return ready(e),
        };
        let tls = if ep.tls {
            match ServerName::try_from(ep.host.clone()) {
                Ok(name) => Some((self.tls.clone(), name)),
                Err(e) => {
                    return ready(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{} is not a TLS server name: {e}", ep.host),
                    ))
                }
            }
        } else {
            None
        };
        Box::pin(async move {
            let tcp = tokio::net::TcpStream::connect(ep.host_port()).await?;
            tcp.set_nodelay(true)?;
            match tls {
                None => Ok(Box::new(tcp) as BoxStream),
                Some((tls, name)) => Ok(Box::new(tls.connect(name, tcp).await?) as BoxStream),
            }
        })
    }
}

/// TLS handshakes a [`TlsListener`] has finished, failed and given up on.
/// Cheap to clone; every clone reads the same counters.
#[derive(Clone, Debug, Default)]
pub struct TlsStats {
    inner: Arc<TlsCounters>,
}

#[derive(Debug, Default)]
struct TlsCounters {
    handshakes: AtomicU64,
    failed: AtomicU64,
    timed_out: AtomicU64,
}

impl TlsStats {
    /// Handshakes completed and handed to the hub.
    pub fn handshakes(&self) -> u64 {
        self.inner.handshakes.load(Ordering::Relaxed)
    }

    /// Handshakes that failed: not TLS, a protocol error, or the client
    /// refused our certificate.
    pub fn failed(&self) -> u64 {
        self.inner.failed.load(Ordering::Relaxed)
    }

    /// Handshakes not finished within the deadline.
    pub fn timed_out(&self) -> u64 {
        self.inner.timed_out.load(Ordering::Relaxed)
    }
}

type Handshake = BoxFuture<'static, Option<(BoxStream, String)>>;

/// Serves TLS over the connections of another [`Listener`].
pub struct TlsListener<L> {
    inner: L,
    acceptor: tokio_rustls::TlsAcceptor,
    handshake_timeout: Duration,
    max_pending: usize,
    pending: FuturesUnordered<Handshake>,
    stats: TlsStats,
}

impl<L: Listener> TlsListener<L> {
    /// Handshakes in progress at once by default.
    pub const DEFAULT_MAX_PENDING: usize = 256;
    /// How long a client has to finish its handshake by default.
    pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

    /// Serve `config` over `inner`'s connections, with the default deadline
    /// and number of handshakes in progress.
    pub fn new(inner: L, config: Arc<ServerConfig>) -> Self {
        Self {
            inner,
            acceptor: tokio_rustls::TlsAcceptor::from(config),
            handshake_timeout: Self::DEFAULT_HANDSHAKE_TIMEOUT,
            max_pending: Self::DEFAULT_MAX_PENDING,
            pending: FuturesUnordered::new(),
            stats: TlsStats::default(),
        }
    }

    /// Give each client `timeout` to finish its handshake; after it the
    /// connection is dropped and counted in [`TlsStats::timed_out`].
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// Run at most `n` (at least 1) handshakes at once; while that many are
    /// in progress, no further connection is taken from the inner listener
    /// (they wait in its backlog).
    pub fn max_pending(mut self, n: usize) -> Self {
        self.max_pending = n.max(1);
        self
    }

    /// The handshake counters, readable after the listener is handed to the
    /// hub.
    pub fn stats(&self) -> TlsStats {
        self.stats.clone()
    }

    fn handshake(&self, stream: BoxStream, peer: String) -> Handshake {
        let acceptor = self.acceptor.clone();
        let limit = self.handshake_timeout;
        let stats = self.stats.inner.clone();
        Box::pin(async move {
            match tokio::time::timeout(limit, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => {
                    stats.handshakes.fetch_add(1, Ordering::Relaxed);
                    Some((Box::new(tls) as BoxStream, peer))
                }
                Ok(Err(e)) => {
                    stats.failed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    None
                }
                Err(_) => {
                    stats.timed_out.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%peer, ?limit, "TLS handshake timed out");
                    None
                }
            }
        })
    }
}

impl<L: Listener> Listener for TlsListener<L> {
    /// The next connection whose TLS handshake finished, with the inner
    /// listener's peer address. Handshakes make progress while this is
    /// polled; failed ones are counted and skipped, never returned.
    ///
    /// # Errors
    /// Only the inner listener's accept errors.
    ///
    /// # Cancel safety
    /// Cancel safe: handshakes in progress are kept in the listener, and the
    /// inner accept is cancel safe by the [`Listener`] contract.
    fn accept(&mut self) -> BoxFuture<'_, io::Result<(BoxStream, String)>> {
        Box::pin(async move {
            loop {
                let room = self.pending.len() < self.max_pending;
                let busy = !self.pending.is_empty();
                let accepted = {
                    let Self { inner, pending, .. } = &mut *self;
                    tokio::select! {
                        Some(done) = pending.next(), if busy => {
                            match done {
                                Some(ready) => return Ok(ready),
                                None => continue,
                            }
                        }
                        r = inner.accept(), if room => r?,
                    }
                };
                let (stream, peer) = accepted;
                let hs = self.handshake(stream, peer);
                self.pending.push(hs);
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts_are_localhost_127_slash_8_and_ipv6_one() {
        for host in [
            "localhost",
            "LocalHost",
            "localhost.",
            "127.0.0.1",
            "127.8.9.10",
            "::1",
        ] {
            assert!(is_loopback_host(host), "{host} is loopback");
        }
        for host in [
            "10.255.255.1",
            "128.0.0.1",
            "::2",
            "::ffff:127.0.0.1",
            "0.0.0.0",
            "hub.example",
            "localhost.example",
            "127.0.0.1.nip.io",
        ] {
            assert!(!is_loopback_host(host), "{host} is not loopback");
        }
    }

    #[test]
    fn check_url_refuses_plain_ws_to_remote_hosts_unless_allowed() {
        let strict = NetConnector::default();
        assert!(strict.check_url("ws://127.0.0.1:7400").is_ok());
        assert!(strict.check_url("ws://[::1]:7400/x").is_ok());
        assert!(strict.check_url("ws://localhost").is_ok());
        assert!(strict.check_url("wss://hub.example").is_ok());
        let refused = strict.check_url("ws://hub.example:7400").unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::PermissionDenied);
        assert!(refused.to_string().contains("hub.example"), "{refused}");
        assert_eq!(
            strict.check_url("loopback://ab").unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        let lax = NetConnector::new(TlsConfig {
            allow_plain_ws: true,
            ..TlsConfig::default()
        })
        .unwrap();
        assert!(lax.check_url("ws://hub.example:7400").is_ok());
    }

    #[test]
    fn an_extra_root_that_is_not_a_certificate_is_refused() {
        let err = NetConnector::new(TlsConfig {
            extra_roots: vec![CertificateDer::from(vec![1, 2, 3])],
            ..TlsConfig::default()
        })
        .unwrap_err();
        assert!(matches!(err, TlsSetupError::Root { index: 0, .. }), "{err}");
    }
}
