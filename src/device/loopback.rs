//! A device's loopback hub: a real [`Hub`] inside the device's own process,
//! for groups bound to no hub at all.
//!
//! DESIGN.md §4: a group with no hub commits through its loopback peer, so a
//! device can run a group alone and bind real hubs later. The loopback hub is
//! not a stand-in: it is the same [`Hub`] with the same publish,
//! compare-and-set and idempotency rules and the same authentication, reached
//! through an in-memory transport instead of TCP. Only its limits differ
//! (see [`loopback_limits`]).
//!
//! **URL.** `loopback://<hex of the device id>` ([`loopback_url`]). The
//! device signs it at authentication like any hub URL; it names no host and
//! is never dialled: [`RoutingConnector`] sends it to the in-memory
//! transport and refuses every other `loopback://` URL, and the TCP
//! connector refuses the scheme outright.
//!
//! **Storage.** The hub keeps its state in the device's own store under
//! [`LOOPBACK_HUB_PREFIX`] (through [`PrefixKv`]), so its commit log and
//! heads survive a restart of the device. It answers `accepted` only after
//! that store's flush covered the publish, as any hub does. At most one
//! loopback hub may run over one store at a time.
//!
//! **Lifecycle.** [`LoopbackHub::start`] starts the hub and its accept loop;
//! [`LoopbackHub::stop`] closes every connection, flushes and joins the
//! hub's tasks. Dropping a `LoopbackHub` without `stop` leaves the hub
//! running for as long as its tasks live: stop it.

use crate::clock::Clock;
use crate::hub::{Hub, HubConfig, HubStartError, Limits};
use crate::kv::{KvStore, PrefixKv};
use crate::rng::SharedRng;
use crate::transport::{memory_transport, BoxStream, Connector, MemoryConnector};
use crate::wire::DeviceId;
use futures::future::BoxFuture;
use std::io;
use std::sync::Arc;
use std::time::Duration;

/// The scheme of loopback hub URLs.
pub use crate::transport::LOOPBACK_SCHEME;

/// Where the loopback hub's keys live in the device's store.
pub const LOOPBACK_HUB_PREFIX: &[u8] = b"loopback-hub/";

/// Whether `url` names a loopback hub (any device's).
pub fn is_loopback(url: &str) -> bool {
    url.starts_with(LOOPBACK_SCHEME)
}

/// The URL of `device`'s loopback hub: `loopback://` and the device id in
/// lowercase hex.
pub fn loopback_url(device: &DeviceId) -> String {
    format!("{LOOPBACK_SCHEME}{device}")
}

/// The loopback hub's limits: [`Limits::unthrottled`] (a solo device is
/// never rate limited), with retention and subscription ceilings raised so
/// that the hub never refuses or forgets what a default remote hub would
/// keep.
///
/// Retention is measured on the wall clock, and a loopback hub is down
/// exactly when its device is: with a remote hub's seven days, a device
/// reopened after a long pause would find its own log frames and publish
/// records (which a journal replay needs) purged while it was away.
/// Subscriptions are counted per device, and every group of the device
/// subscribes its topics here. Payload, topic and log-depth limits stay the
/// defaults: a frame that fits a remote hub fits here.
pub fn loopback_limits() -> Limits {
    let ten_years = Duration::from_secs(10 * 365 * 24 * 3600);
    Limits {
        default_retention: ten_years,
        max_retention: ten_years,
        max_subscriptions: u32::MAX,
        ..Limits::unthrottled()
    }
}

/// A device's in-process hub, serving [`loopback_url`] of its device over an
/// in-memory transport.
pub struct LoopbackHub {
    hub: Hub,
    url: String,
    connector: MemoryConnector,
}

impl LoopbackHub {
    /// Start `device`'s loopback hub over `kv`, the device's own store (the
    /// hub uses only the keys under [`LOOPBACK_HUB_PREFIX`], and finds there
    /// what an earlier run left).
    ///
    /// Must be called inside a tokio runtime. Connect to it through
    /// [`LoopbackHub::connector`], usually by way of a [`RoutingConnector`].
    ///
    /// # Errors
    /// [`HubStartError`] when the hub refuses its configuration, which
    /// [`loopback_limits`] and [`loopback_url`] never cause.
    ///
    /// # Cancel safety
    /// Cancel safe: it does not wait on anything, so it is never dropped
    /// half way.
    pub async fn start(
        kv: Arc<dyn KvStore>,
        device: DeviceId,
        clock: Clock,
        rng: SharedRng,
    ) -> Result<LoopbackHub, HubStartError> {
        let url = loopback_url(&device);
        let store: Arc<dyn KvStore> = Arc::new(PrefixKv::new(kv, LOOPBACK_HUB_PREFIX));
        let mut config = HubConfig::new(url.clone());
        config.limits = loopback_limits();
        let hub = Hub::start(store, config, clock, rng)?;
        let (connector, listener) = memory_transport();
        hub.serve(listener);
        tracing::debug!(%url, "loopback hub started");
        Ok(LoopbackHub {
            hub,
            url,
            connector,
        })
    }

    /// The hub's URL, [`loopback_url`] of its device.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A connector reaching this hub, whatever URL it is given. Connects fail
    /// with `ConnectionRefused` once the hub is stopped.
    pub fn connector(&self) -> MemoryConnector {
        self.connector.clone()
    }

    /// The running hub, for metrics and tests.
    pub fn hub(&self) -> &Hub {
        &self.hub
    }

    /// Stop the hub: refuse new connections, close the open ones (answers
    /// already being made durable are still sent), flush the store and join
    /// the hub's tasks. Calling it again does nothing more.
    ///
    /// # Cancel safety
    /// Not cancel safe: call it to completion.
    pub async fn stop(&self) {
        self.hub.shutdown().await;
        tracing::debug!(url = %self.url, "loopback hub stopped");
    }
}

/// A [`Connector`] that sends the device's own loopback URL to its loopback
/// hub and every non-loopback URL to the wrapped connector.
///
/// Any other `loopback://` URL (another device's, or a stale one) is refused
/// with `ConnectionRefused`: a loopback hub is reachable only from inside its
/// own device, never through the network.
#[derive(Clone)]
pub struct RoutingConnector {
    fallback: Arc<dyn Connector>,
    loopback_url: String,
    loopback: MemoryConnector,
}

impl RoutingConnector {
    /// Route `loopback_url` (a trailing `/` is ignored) to `loopback` and
    /// non-loopback URLs to `fallback`.
    pub fn new(
        fallback: Arc<dyn Connector>,
        loopback_url: impl Into<String>,
        loopback: MemoryConnector,
    ) -> Self {
        let loopback_url = loopback_url.into().trim_end_matches('/').to_string();
        Self {
            fallback,
            loopback_url,
            loopback,
        }
    }

    /// The one loopback URL this connector reaches.
    pub fn loopback_url(&self) -> &str {
        &self.loopback_url
    }
}

impl Connector for RoutingConnector {
    /// # Errors
    /// `ConnectionRefused` for a loopback URL other than this device's, or
    /// when the loopback hub is stopped; otherwise the wrapped connector's
    /// errors.
    fn connect(&self, url: &str) -> BoxFuture<'static, io::Result<BoxStream>> {
        if !is_loopback(url) {
            return self.fallback.connect(url);
        }
        if url.trim_end_matches('/') == self.loopback_url {
            return self.loopback.connect(url);
        }
        let err = io::Error::new(
            io::ErrorKind::ConnectionRefused,
            format!(
                "{url} is not this device's loopback hub ({})",
                self.loopback_url
            ),
        );
        Box::pin(async move { Err(err) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{ClientError, ClientOptions, HubClient};
    use crate::kv::{MemKv, WriteBatch};
    use crate::testkit::{open_sled, signing_key, TestHub};
    use crate::transport::TcpConnector;
    use crate::wire::{
        ExpectedHead, FetchResult, HubError, Publish, PublishId, PublishOutcome, RetentionClass,
        TopicId,
    };
    use ed25519_dalek::SigningKey;

    fn device_of(key: &SigningKey) -> DeviceId {
        DeviceId(key.verifying_key().to_bytes())
    }

    fn log(id: u8, expected: ExpectedHead, payload: &[u8]) -> Publish {
        Publish {
            topic: TopicId::from("commits"),
            publish_id: PublishId([id; 32]),
            class: RetentionClass::Log,
            expected_head: expected,
            replay_only: false,
            retention_secs: None,
            payload: payload.to_vec(),
            writer: None,
        }
    }

    async fn start(kv: Arc<dyn KvStore>, key: &SigningKey) -> LoopbackHub {
        LoopbackHub::start(kv, device_of(key), Clock::System, SharedRng::seeded(7))
            .await
            .unwrap()
    }

    fn router(hub: &LoopbackHub) -> RoutingConnector {
        RoutingConnector::new(Arc::new(TcpConnector), hub.url(), hub.connector())
    }

    async fn client(
        connector: &RoutingConnector,
        url: &str,
        key: &SigningKey,
    ) -> Result<HubClient, ClientError> {
        HubClient::connect(connector, url, key, ClientOptions::default()).await
    }

    async fn fetch_all(c: &HubClient) -> FetchResult {
        c.fetch(&TopicId::from("commits"), 0, 100).await.unwrap()
    }

    fn payloads(f: &FetchResult) -> Vec<Vec<u8>> {
        f.messages.iter().map(|m| m.payload.clone()).collect()
    }

    #[test]
    fn loopback_urls_name_the_device() {
        let d = DeviceId([0xab; 32]);
        let url = loopback_url(&d);
        assert_eq!(url, format!("loopback://{}", "ab".repeat(32)));
        assert!(is_loopback(&url));
        assert!(!is_loopback("ws://127.0.0.1:1"));
        assert!(!is_loopback("wss://loopback/"));
        assert!(loopback_limits().validate().is_ok());
    }

    /// Authenticate, publish with the CAS, lose a stale CAS, fetch back.
    /// Returns the sequence numbers of the two accepted publishes.
    async fn publish_and_race(router: &RoutingConnector, key: &SigningKey) -> (u64, u64) {
        let url = router.loopback_url().to_string();
        let c = client(router, &url, key).await.unwrap();
        assert_eq!(c.device(), device_of(key));
        let first = c
            .publish(log(1, ExpectedHead::Empty, b"epoch 1"))
            .await
            .unwrap();
        let PublishOutcome::Accepted { seq, head } = first else {
            panic!("first commit must be accepted, got {first:?}");
        };
        assert_eq!(head, Some(seq));
        let second = c
            .publish(log(2, ExpectedHead::Seq(seq), b"epoch 2"))
            .await
            .unwrap();
        let PublishOutcome::Accepted { seq: seq2, .. } = second else {
            panic!("second commit must be accepted, got {second:?}");
        };
        // A rival built on the first head lost the epoch.
        let stale = c
            .publish(log(3, ExpectedHead::Seq(seq), b"rival"))
            .await
            .unwrap();
        assert_eq!(
            stale,
            PublishOutcome::HeadMismatch {
                current: Some(seq2)
            }
        );
        // A retry of an accepted publish is a duplicate, not a second frame.
        let again = c
            .publish(log(2, ExpectedHead::Seq(seq), b"epoch 2"))
            .await
            .unwrap();
        assert_eq!(again, PublishOutcome::Duplicate { seq: seq2 });
        let f = fetch_all(&c).await;
        assert_eq!(payloads(&f), vec![b"epoch 1".to_vec(), b"epoch 2".to_vec()]);
        assert_eq!(f.head, Some(seq2));
        c.close();
        (seq, seq2)
    }

    async fn survives_restart(kv: Arc<dyn KvStore>) {
        let key = signing_key(1);
        let hub = start(kv.clone(), &key).await;
        let (first, head) = publish_and_race(&router(&hub), &key).await;
        hub.stop().await;
        assert!(hub.connector().is_closed(), "a stopped hub accepts nothing");

        let hub = start(kv, &key).await;
        let r = router(&hub);
        let c = client(&r, hub.url(), &key).await.unwrap();
        let f = fetch_all(&c).await;
        assert_eq!(payloads(&f), vec![b"epoch 1".to_vec(), b"epoch 2".to_vec()]);
        assert_eq!(f.head, Some(head));
        // The CAS and the idempotency records came back too.
        assert_eq!(
            c.publish(log(4, ExpectedHead::Seq(first), b"late"))
                .await
                .unwrap(),
            PublishOutcome::HeadMismatch {
                current: Some(head)
            }
        );
        assert_eq!(
            c.publish(log(2, ExpectedHead::Seq(first), b"epoch 2"))
                .await
                .unwrap(),
            PublishOutcome::Duplicate { seq: head }
        );
        assert!(matches!(
            c.publish(log(5, ExpectedHead::Seq(head), b"epoch 3"))
                .await
                .unwrap(),
            PublishOutcome::Accepted { .. }
        ));
        c.close();
        hub.stop().await;
    }

    #[tokio::test]
    async fn loopback_commit_log_survives_restart_on_memkv() {
        let mem = MemKv::new();
        survives_restart(Arc::new(mem.clone())).await;
        // Everything accepted was flushed: a crash now loses none of it.
        mem.crash();
        let key = signing_key(1);
        let hub = start(Arc::new(mem), &key).await;
        let c = client(&router(&hub), hub.url(), &key).await.unwrap();
        assert_eq!(fetch_all(&c).await.messages.len(), 3);
        hub.stop().await;
    }

    #[tokio::test]
    async fn loopback_commit_log_survives_restart_on_sled() {
        let dir = tempfile::tempdir().unwrap();
        let kv: Arc<dyn KvStore> = Arc::new(open_sled(dir.path()).await.unwrap());
        survives_restart(kv.clone()).await;
        drop(kv);
        // And across a reopen of the sled directory itself.
        let kv: Arc<dyn KvStore> = Arc::new(open_sled(dir.path()).await.unwrap());
        let key = signing_key(1);
        let hub = start(kv, &key).await;
        let c = client(&router(&hub), hub.url(), &key).await.unwrap();
        assert_eq!(fetch_all(&c).await.messages.len(), 3);
        hub.stop().await;
    }

    #[tokio::test]
    async fn loopback_hub_keys_live_only_under_the_prefix() {
        let mem = MemKv::new();
        let mut b = WriteBatch::new();
        b.put(b"dir/own".to_vec(), b"device data".to_vec());
        b.put(b"loopback-hub0".to_vec(), b"neighbour".to_vec());
        mem.apply(&b).unwrap();
        let key = signing_key(2);
        let hub = start(Arc::new(mem.clone()), &key).await;
        publish_and_race(&router(&hub), &key).await;
        hub.stop().await;
        let all = mem.range(b"", None, usize::MAX).unwrap();
        let (ours, others): (Vec<_>, Vec<_>) = all
            .iter()
            .partition(|(k, _)| k.starts_with(LOOPBACK_HUB_PREFIX));
        assert!(ours.len() > 2, "the hub stored its log under the prefix");
        let others: Vec<_> = others.iter().map(|(k, _)| k.as_slice()).collect();
        assert_eq!(others, vec![&b"dir/own"[..], b"loopback-hub0"]);
    }

    #[tokio::test]
    async fn loopback_auth_signs_the_loopback_url() {
        let key = signing_key(3);
        let hub = start(Arc::new(MemKv::new()), &key).await;
        let r = router(&hub);
        // A trailing slash is the same hub.
        let c = client(&r, &format!("{}/", hub.url()), &key).await.unwrap();
        assert_eq!(c.url(), hub.url());
        c.ping().await.unwrap();
        c.close();
        // Reaching the hub under another name is refused by the hub itself:
        // the device signed a URL that is not the hub's.
        let other = loopback_url(&DeviceId([9; 32]));
        let direct = RoutingConnector::new(Arc::new(TcpConnector), other.clone(), hub.connector());
        let refused = client(&direct, &other, &key).await.err();
        assert!(
            matches!(refused, Some(ClientError::Hub(HubError::WrongHub { .. }))),
            "{refused:?}"
        );
        assert_eq!(hub.hub().metrics().auth_failures, 1);
        hub.stop().await;
    }

    #[tokio::test]
    async fn loopback_routing_sends_other_urls_to_the_wrapped_connector() {
        let remote = TestHub::start().await.unwrap();
        let key = signing_key(4);
        let hub = start(Arc::new(MemKv::new()), &key).await;
        let r = router(&hub);
        let c = client(&r, remote.url(), &key).await.unwrap();
        assert!(matches!(
            c.publish(log(1, ExpectedHead::Empty, b"remote"))
                .await
                .unwrap(),
            PublishOutcome::Accepted { .. }
        ));
        c.close();
        assert_eq!(remote.hub().metrics().accepted, 1);
        assert_eq!(hub.hub().metrics().connections, 0);
        hub.stop().await;
        remote.stop().await;
    }

    #[tokio::test]
    async fn loopback_routing_refuses_another_devices_loopback_url() {
        let key = signing_key(5);
        let hub = start(Arc::new(MemKv::new()), &key).await;
        let r = router(&hub);
        let other = loopback_url(&device_of(&signing_key(6)));
        let err = match r.connect(&other).await {
            Ok(_) => panic!("another device's loopback URL must be refused"),
            Err(e) => e,
        };
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
        assert!(matches!(
            client(&r, &other, &key).await,
            Err(ClientError::Connect { .. })
        ));
        // Not even a malformed one reaches the network.
        let err = match r.connect("loopback://").await {
            Ok(_) => panic!("a bare loopback URL must be refused"),
            Err(e) => e,
        };
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
        assert_eq!(hub.hub().metrics().connections, 0);
        hub.stop().await;
    }

    #[tokio::test]
    async fn loopback_connect_after_stop_is_refused() {
        let key = signing_key(7);
        let hub = start(Arc::new(MemKv::new()), &key).await;
        let r = router(&hub);
        hub.stop().await;
        let err = match r.connect(hub.url()).await {
            Ok(_) => panic!("a stopped loopback hub must refuse"),
            Err(e) => e,
        };
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
        // Stopping twice is harmless.
        hub.stop().await;
    }

    #[tokio::test]
    async fn only_the_loopback_scheme_was_added_to_the_url_checks() {
        let bad = Hub::start(
            Arc::new(MemKv::new()),
            HubConfig::new("http://hub.example"),
            Clock::System,
            SharedRng::seeded(1),
        );
        assert!(matches!(bad, Err(HubStartError::Url(_))));
        // A loopback URL never reaches the network through TCP.
        let err = match TcpConnector
            .connect(&loopback_url(&DeviceId([1; 32])))
            .await
        {
            Ok(_) => panic!("TCP must not dial a loopback URL"),
            Err(e) => e,
        };
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }
}
