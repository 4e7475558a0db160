//! The wire protocol between devices and hubs.
//!
//! Every WebSocket binary message is one frame: a kind byte followed by a
//! postcard-encoded body. Decoding is strict: the size is checked before
//! anything is parsed, an unknown kind or operation is named as such, and a
//! body with trailing bytes is refused. Nothing here panics on input.
//! `docs/protocol.md` is the reference for other implementations.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The newest protocol version this build speaks.
///
/// Version 2 added [`AuthOk::store_id`]; version 3 added
/// [`Publish::writer`] and writer-bound topics ([`TopicId::writer_bound`]);
/// version 4 made deliveries come from each subscription's cursor on the
/// topic: a [`Delivery`] is named and acknowledged by its topic and sequence
/// number ([`FrameRef`]), not by a per-device delivery id, so `Receive` and
/// `ReceiveStarted` carry nothing and `Ack` names frames; version 5 added
/// [`Request::Subscriptions`], many subscription changes in one request,
/// which devices rely on to follow groups by the thousand. Each changes how
/// those frames encode, so a build speaks only version 5 and an older peer is told
/// `UnsupportedVersion` (hub side) or [`ClientError::Version`] (client side)
/// instead of failing to decode.
///
/// [`ClientError::Version`]: crate::client::ClientError::Version
pub const PROTOCOL_VERSION: u16 = 5;
/// The oldest protocol version this build still accepts.
pub const MIN_PROTOCOL_VERSION: u16 = 5;
/// Domain separator of the signed authentication message.
pub const AUTH_DOMAIN: &[u8] = b"hubsync-auth-v1\0";

/// A device id: the device's ed25519 public key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DeviceId(pub [u8; 32]);

impl DeviceId {
    /// The 32 key bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Parse 64 hex characters.
    ///
    /// # Errors
    /// `None` when the text is not exactly 32 bytes of hex.
    pub fn from_hex(s: &str) -> Option<Self> {
        let bytes = hex::decode(s).ok()?;
        Some(DeviceId(bytes.try_into().ok()?))
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceId({})", &hex::encode(self.0)[..12])
    }
}

/// A hub store's identity: 16 random bytes drawn when the store was first
/// opened, kept in the store, the same on every later start over it.
///
/// A device that finds another identity behind the same hub URL is talking
/// to a store that knows nothing of what it saw before (its delivery ids,
/// heads and sequence numbers start again). A store restored from an older
/// copy of its own directory keeps its identity: see `docs/operations.md`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct StoreId(pub [u8; 16]);

impl StoreId {
    /// The 16 bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// Parse 32 hex characters.
    ///
    /// # Errors
    /// `None` when the text is not exactly 16 bytes of hex.
    pub fn from_hex(s: &str) -> Option<Self> {
        let bytes = hex::decode(s).ok()?;
        Some(StoreId(bytes.try_into().ok()?))
    }
}

impl fmt::Display for StoreId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for StoreId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StoreId({})", hex::encode(self.0))
    }
}

/// The first byte of a device's mailbox topic ([`TopicId::mailbox`]).
pub const MAILBOX_TOPIC_TAG: u8 = 0x01;

/// The first byte of a writer-bound topic ([`TopicId::writer_bound`]).
pub const WRITER_TOPIC_TAG: u8 = 0x02;

/// Domain separator of a writer-bound topic's name.
pub const WRITER_TOPIC_DOMAIN: &[u8] = b"hubsync-writer-topic-v1\0";

/// Domain separator of the message a writer key signs ([`writer_message`]).
pub const WRITER_PUBLISH_DOMAIN: &[u8] = b"hubsync-publish-v1\0";

/// An opaque topic id (1 to the hub's topic limit, 256 bytes by default).
///
/// Two forms are reserved, both 33 bytes; the hub, which knows nothing
/// else about topics, knows this much of them:
/// - [`MAILBOX_TOPIC_TAG`] followed by a device id is **the mailbox of that
///   device** ([`TopicId::mailbox`]): only that device may subscribe to it
///   or fetch it, anyone may post to it (mailbox class only, within a
///   per-sender rate), and its deliveries go to that device alone.
/// - [`WRITER_TOPIC_TAG`] followed by SHA-256 of [`WRITER_TOPIC_DOMAIN`] and
///   an ed25519 public key is **a topic only that key's holder may write**
///   ([`TopicId::writer_bound`]): every publish on it must carry a
///   [`WriterProof`] by that key, or it is refused `NotAuthorized` and
///   nothing is stored. Reading stays open to whoever knows the name.
///
/// Every other byte string is an ordinary topic.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TopicId(#[serde(with = "serde_bytes")] pub Vec<u8>);

impl TopicId {
    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The mailbox of `device`: [`MAILBOX_TOPIC_TAG`] followed by the 32
    /// bytes of the device id (33 bytes in all).
    pub fn mailbox(device: &DeviceId) -> TopicId {
        let mut b = Vec::with_capacity(33);
        b.push(MAILBOX_TOPIC_TAG);
        b.extend_from_slice(device.as_bytes());
        TopicId(b)
    }

    /// The topic only the holder of the ed25519 key `key` may write:
    /// [`WRITER_TOPIC_TAG`] followed by SHA-256([`WRITER_TOPIC_DOMAIN`] ‖
    /// `key`), 33 bytes in all. The name binds the key, so the hub checks a
    /// publish against the name alone and keeps no state for it: nothing a
    /// restart or a lost store could forget, and no first writer to squat.
    pub fn writer_bound(key: &[u8; 32]) -> TopicId {
        use sha2::{Digest, Sha256};
        let mut b = Vec::with_capacity(33);
        b.push(WRITER_TOPIC_TAG);
        b.extend_from_slice(
            &Sha256::new()
                .chain_update(WRITER_TOPIC_DOMAIN)
                .chain_update(key)
                .finalize(),
        );
        TopicId(b)
    }

    /// Whether this topic has the writer-bound form (whatever key it binds).
    pub fn is_writer_bound(&self) -> bool {
        self.0.len() == 33 && self.0[0] == WRITER_TOPIC_TAG
    }

    /// Whose mailbox this topic is, when it has the reserved form; `None`
    /// for every ordinary topic.
    pub fn mailbox_owner(&self) -> Option<DeviceId> {
        match self.0.split_first() {
            Some((&MAILBOX_TOPIC_TAG, rest)) => Some(DeviceId(<[u8; 32]>::try_from(rest).ok()?)),
            _ => None,
        }
    }
}

impl From<&[u8]> for TopicId {
    fn from(b: &[u8]) -> Self {
        TopicId(b.to_vec())
    }
}

impl From<&str> for TopicId {
    fn from(s: &str) -> Self {
        TopicId(s.as_bytes().to_vec())
    }
}

impl fmt::Debug for TopicId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = hex::encode(&self.0);
        write!(f, "TopicId({})", &h[..h.len().min(16)])
    }
}

/// A sender-chosen publish id, stable across retries of one publish
/// (typically a SHA-256 of the operation id and the topic).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PublishId(pub [u8; 32]);

impl fmt::Debug for PublishId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublishId({})", &hex::encode(self.0)[..12])
    }
}

/// How the hub keeps a published frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RetentionClass {
    /// Pushed to each current subscriber but the sender, kept until each acked
    /// it or retention ran out. Not readable with `fetch`, moves no head.
    Mailbox,
    /// Appended to the topic's ordered log, readable with `fetch`; moves the
    /// topic's head and is also pushed to subscribers.
    Log,
}

/// The compare-and-set condition of a log publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExpectedHead {
    /// Append whatever the head is.
    Unconditional,
    /// Append only if the topic never had a log publish.
    Empty,
    /// Append only if the head is this sequence number.
    Seq(u64),
}

/// A publish request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Publish {
    /// Where to publish.
    pub topic: TopicId,
    /// Idempotency key, stable across retries.
    pub publish_id: PublishId,
    /// Mailbox or log.
    pub class: RetentionClass,
    /// Compare-and-set on the head (log only; must be `Unconditional` for a
    /// mailbox publish).
    pub expected_head: ExpectedHead,
    /// Only re-deliver an earlier publish with this id: a hub that never saw
    /// the id answers `HistoryMissing` and stores nothing.
    pub replay_only: bool,
    /// How long to keep the frame; `None` takes the hub's default.
    pub retention_secs: Option<u64>,
    /// The opaque payload.
    #[serde(with = "serde_bytes")]
    pub payload: Vec<u8>,
    /// The writer key's proof, required on a writer-bound topic
    /// ([`TopicId::writer_bound`]) and ignored on any other.
    pub writer: Option<WriterProof>,
}

/// A writer key's signature on one publish ([`Publish::writer`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriterProof {
    /// The ed25519 public key the topic's name binds.
    pub key: [u8; 32],
    /// ed25519 signature over [`writer_message`] of the publish (64 bytes).
    #[serde(with = "serde_bytes")]
    pub signature: Vec<u8>,
}

/// Why a publish on a writer-bound topic was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WriterError {
    /// The publish carries no writer proof.
    #[error("a writer-bound topic needs a writer proof")]
    Missing,
    /// The proof's key is not the one the topic's name binds.
    #[error("the writer key is not the one this topic binds")]
    WrongKey,
    /// The signature does not verify under the key.
    #[error("the writer signature does not verify")]
    BadSignature,
}

/// What a writer key signs for one publish: [`WRITER_PUBLISH_DOMAIN`] ‖
/// topic length (u16 big-endian) ‖ topic ‖ publish id (32) ‖ class (0
/// mailbox, 1 log) ‖ SHA-256(payload). The compare-and-set head, the
/// retention and `replay_only` are left out: a retry under another head is
/// the same publish, and changing them gains a replayer nothing the
/// idempotency record does not already refuse.
pub fn writer_message(p: &Publish) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    let mut m = Vec::with_capacity(WRITER_PUBLISH_DOMAIN.len() + 2 + p.topic.0.len() + 65);
    m.extend_from_slice(WRITER_PUBLISH_DOMAIN);
    m.extend_from_slice(&(p.topic.0.len().min(u16::MAX as usize) as u16).to_be_bytes());
    m.extend_from_slice(&p.topic.0);
    m.extend_from_slice(&p.publish_id.0);
    m.push(match p.class {
        RetentionClass::Mailbox => 0,
        RetentionClass::Log => 1,
    });
    m.extend_from_slice(&Sha256::digest(&p.payload));
    m
}

impl Publish {
    /// Sign this publish with the writer key `key` (set [`Publish::writer`]).
    /// Call it last: the proof covers the topic, publish id, class and
    /// payload.
    pub fn sign_writer(&mut self, key: &ed25519_dalek::SigningKey) {
        use ed25519_dalek::Signer as _;
        let signature = key.sign(&writer_message(self)).to_bytes().to_vec();
        self.writer = Some(WriterProof {
            key: key.verifying_key().to_bytes(),
            signature,
        });
    }

    /// Check the writer proof a writer-bound topic needs; any publish on
    /// another topic passes. What the hub runs before it stores anything.
    pub fn check_writer(&self) -> Result<(), WriterError> {
        if !self.topic.is_writer_bound() {
            return Ok(());
        }
        let proof = self.writer.as_ref().ok_or(WriterError::Missing)?;
        if TopicId::writer_bound(&proof.key) != self.topic {
            return Err(WriterError::WrongKey);
        }
        let key = ed25519_dalek::VerifyingKey::from_bytes(&proof.key)
            .map_err(|_| WriterError::WrongKey)?;
        let sig = ed25519_dalek::Signature::from_slice(&proof.signature)
            .map_err(|_| WriterError::BadSignature)?;
        key.verify_strict(&writer_message(self), &sig)
            .map_err(|_| WriterError::BadSignature)
    }
}

/// What a publish did. A lost race is an outcome, not an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PublishOutcome {
    /// Stored durably under `seq`; `head` is the topic's head afterwards.
    Accepted {
        /// The frame's sequence number in its topic.
        seq: u64,
        /// The topic's head after this publish.
        head: Option<u64>,
    },
    /// The same id with the same content was accepted before, under `seq`;
    /// nothing was stored or delivered again.
    Duplicate {
        /// The original sequence number.
        seq: u64,
    },
    /// The compare-and-set failed; nothing was stored.
    HeadMismatch {
        /// The topic's current head.
        current: Option<u64>,
    },
    /// A `replay_only` publish whose id this hub never saw; nothing was stored.
    HistoryMissing,
}

/// One frame of a topic's log as `fetch` returns it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogFrame {
    /// Sequence number in the topic.
    pub seq: u64,
    /// Who published it (authenticated by the hub).
    pub sender: DeviceId,
    /// The publisher's idempotency key.
    pub publish_id: PublishId,
    /// The hub's wall clock at acceptance, in ms since the Unix epoch.
    pub published_at_ms: u64,
    /// The opaque payload.
    #[serde(with = "serde_bytes")]
    pub payload: Vec<u8>,
}

/// The answer to `fetch`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FetchResult {
    /// Log frames after the cursor, in order, at most the limit.
    pub messages: Vec<LogFrame>,
    /// The topic's head (sequence number of its last log publish), if any.
    pub head: Option<u64>,
    /// The oldest sequence number still held, if any.
    pub oldest: Option<u64>,
    /// True when frames after the cursor were trimmed away: the reader missed
    /// something it can no longer fetch.
    pub gap: bool,
}

/// A frame of a topic, as an acknowledgement names it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct FrameRef {
    /// The topic.
    pub topic: TopicId,
    /// The frame's sequence number in that topic.
    pub seq: u64,
}

/// A frame pushed on the receive stream. Every subscriber of a topic is
/// pushed the same bytes; it acknowledges the frame by its
/// [`FrameRef`] (topic and sequence number).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delivery {
    /// The topic it was published on.
    pub topic: TopicId,
    /// Its sequence number in that topic.
    pub seq: u64,
    /// Mailbox or log.
    pub class: RetentionClass,
    /// Who published it.
    pub sender: DeviceId,
    /// The publisher's idempotency key.
    pub publish_id: PublishId,
    /// The hub's wall clock at acceptance, in ms since the Unix epoch.
    pub published_at_ms: u64,
    /// The opaque payload.
    #[serde(with = "serde_bytes")]
    pub payload: Vec<u8>,
}

impl Delivery {
    /// What an acknowledgement of this frame names.
    pub fn frame_ref(&self) -> FrameRef {
        FrameRef {
            topic: self.topic.clone(),
            seq: self.seq,
        }
    }
}

/// A request from an authenticated device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Publish a frame.
    Publish(Publish),
    /// Read a topic's log after `after` (0 reads from the start).
    Fetch {
        /// The topic.
        topic: TopicId,
        /// Return frames with a sequence number above this.
        after: u64,
        /// At most this many frames (1 to 500).
        limit: u32,
    },
    /// Subscribe to a topic (durable, survives reconnects and hub restarts).
    Subscribe {
        /// The topic.
        topic: TopicId,
        /// How long frames wait for this subscriber; `None` takes the default.
        retention_secs: Option<u64>,
    },
    /// Drop a subscription.
    Unsubscribe {
        /// The topic.
        topic: TopicId,
    },
    /// Start (or replace) this device's receive stream: the hub pushes, for
    /// each of the device's subscriptions (and its own mailbox), every held
    /// frame after the subscription's cursor, then every new one.
    Receive,
    /// Acknowledge pushed frames (at most `max_acks` of them): a
    /// subscription's cursor moves past every frame pushed below the lowest
    /// one still unacknowledged, and frames behind it are not pushed again.
    Ack {
        /// The frames.
        frames: Vec<FrameRef>,
    },
    /// Add key packages to this device's pool, and optionally set its
    /// reusable last-resort package.
    UploadKeyPackages {
        /// Packages for the pool, each claimed once.
        packages: Vec<Vec<u8>>,
        /// The package handed out when the pool is empty.
        last_resort: Option<Vec<u8>>,
    },
    /// Claim one key package of another device.
    ClaimKeyPackage {
        /// Whose package.
        device: DeviceId,
    },
    /// How many key packages this device has on the hub.
    KeyPackageStatus,
    /// Liveness check.
    Ping,
    /// Replace this device's whole pool with `packages` (those stored are
    /// deleted in the same transaction), and set the last resort when
    /// given. A device uses it when the hub holds packages it no longer
    /// has the keys of (a hub restored from a backup brings back packages
    /// claimed since). Answered like `UploadKeyPackages`.
    ReplaceKeyPackages {
        /// The new pool.
        packages: Vec<Vec<u8>>,
        /// The package handed out when the pool is empty.
        last_resort: Option<Vec<u8>>,
    },
    /// The SHA-256 of each package in this device's pool, in claim order.
    ListKeyPackages,
    /// Many subscription changes in one request (since version 5), applied
    /// in order in one durable transaction, each taken or refused on its
    /// own: what `Subscribe` and `Unsubscribe` do for one topic. At most
    /// [`MAX_SUBSCRIPTION_CHANGES`] (`TooManyChanges`). Paced by the
    /// device's subscription bucket, not its publish bucket: a change that
    /// writes nothing (subscribing again with the same retention) costs
    /// nothing, so re-subscribing everything after a reconnect is cheap.
    Subscriptions {
        /// The changes, in order; a later change of a topic sees an
        /// earlier one.
        changes: Vec<SubscriptionChange>,
    },
}

/// The most changes one [`Request::Subscriptions`] may carry.
pub const MAX_SUBSCRIPTION_CHANGES: usize = 1000;

/// One change of a [`Request::Subscriptions`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SubscriptionChange {
    /// As [`Request::Subscribe`].
    Subscribe {
        /// The topic.
        topic: TopicId,
        /// How long frames wait for this subscriber; `None` takes the default.
        retention_secs: Option<u64>,
    },
    /// As [`Request::Unsubscribe`].
    Unsubscribe {
        /// The topic.
        topic: TopicId,
    },
}

impl SubscriptionChange {
    /// The topic it changes.
    pub fn topic(&self) -> &TopicId {
        match self {
            Self::Subscribe { topic, .. } | Self::Unsubscribe { topic } => topic,
        }
    }
}

/// What became of one [`SubscriptionChange`], in the order of the request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ChangeOutcome {
    /// The subscription exists with the retention asked for.
    Subscribed,
    /// No subscription is left; `existed` says whether there was one.
    Unsubscribed {
        /// Whether a subscription was removed.
        existed: bool,
    },
    /// Refused, nothing changed for this topic: `BadTopic`,
    /// `NotAuthorized`, `RetentionTooLong` or `TooManySubscriptions`.
    Refused(HubError),
}

/// The successful answer to a [`Request`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    /// Answer to `Publish`.
    Published(PublishOutcome),
    /// Answer to `Fetch`.
    Fetched(FetchResult),
    /// Answer to `Subscribe`.
    Subscribed,
    /// Answer to `Unsubscribe`; `existed` says whether there was one.
    Unsubscribed {
        /// Whether a subscription was removed.
        existed: bool,
    },
    /// Answer to `Receive`: deliveries follow as `Deliver` frames.
    ReceiveStarted,
    /// Answer to `Ack`.
    Acked {
        /// How many of the named frames were pushed on this device's current
        /// receive stream and not acknowledged before (others are ignored).
        removed: u32,
    },
    /// Answer to `UploadKeyPackages`: the pool size afterwards.
    KeyPackagesStored {
        /// Packages in the pool.
        pool: u32,
    },
    /// Answer to `ClaimKeyPackage`.
    KeyPackage {
        /// The package bytes.
        #[serde(with = "serde_bytes")]
        package: Vec<u8>,
        /// True when the pool was empty and this is the reusable last resort.
        last_resort: bool,
    },
    /// Answer to `KeyPackageStatus`.
    KeyPackageStatus {
        /// Packages in the pool.
        pool: u32,
        /// Whether a last-resort package is set.
        last_resort: bool,
    },
    /// Answer to `Ping`.
    Pong {
        /// The hub's wall clock, ms since the Unix epoch.
        server_time_ms: u64,
    },
    /// Answer to `ListKeyPackages`.
    KeyPackageDigests {
        /// SHA-256 of each pool package, in claim order.
        digests: Vec<[u8; 32]>,
    },
    /// Answer to `Subscriptions`: one outcome per change, in order.
    SubscriptionsChanged {
        /// The outcomes.
        outcomes: Vec<ChangeOutcome>,
    },
}

/// Every error a hub answers. Each names what went wrong; none changes state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum HubError {
    /// The frame could not be decoded.
    #[error("malformed frame: {reason}")]
    Malformed {
        /// What the decoder said.
        reason: String,
    },
    /// The frame exceeds the hub's maximum frame size.
    #[error("frame of {len} bytes exceeds the maximum of {max}")]
    FrameTooLarge {
        /// Frame size.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The first byte names no frame kind this hub knows.
    #[error("unknown frame kind {kind}")]
    UnknownFrameKind {
        /// The kind byte.
        kind: u8,
    },
    /// The request names no operation this hub knows.
    #[error("unknown operation {op}")]
    UnknownOperation {
        /// The operation index.
        op: u32,
    },
    /// A WebSocket text frame: the protocol is binary only.
    #[error("text frames are not part of the protocol")]
    TextFrame,
    /// A request before authentication.
    #[error("authenticate first")]
    NotAuthenticated,
    /// A second authentication on one connection.
    #[error("this connection is already authenticated")]
    AlreadyAuthenticated,
    /// The requested protocol version is outside what the hub speaks.
    #[error("protocol version {requested} unsupported; this hub speaks {min}..={max}")]
    UnsupportedVersion {
        /// What the device asked for.
        requested: u16,
        /// Oldest supported.
        min: u16,
        /// Newest supported.
        max: u16,
    },
    /// The signature does not verify under the claimed device key.
    #[error("signature does not verify")]
    BadSignature,
    /// The challenge nonce was not issued on this connection.
    #[error("this challenge was not issued on this connection")]
    UnknownChallenge,
    /// The challenge was already used.
    #[error("challenge already used")]
    ChallengeReplayed,
    /// The challenge expired before the answer arrived.
    #[error("challenge expired")]
    ChallengeExpired,
    /// The device signed for another hub URL.
    #[error("signed for hub {got}, this is {expected}")]
    WrongHub {
        /// This hub's URL.
        expected: String,
        /// The URL that was signed.
        got: String,
    },
    /// The payload exceeds the limit.
    #[error("payload of {len} bytes exceeds the maximum of {max}")]
    PayloadTooLarge {
        /// Payload size.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The topic id is empty or too long.
    #[error("topic id of {len} bytes is outside 1..={max}")]
    BadTopic {
        /// Topic length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A head condition on a mailbox publish, which has no head.
    #[error("a mailbox publish cannot carry a head condition")]
    HeadConditionOnMailbox,
    /// A token bucket is empty: too many requests from this device, to
    /// this topic, to this mailbox from this sender, key-package claims
    /// by this claimer or for this target, or subscription changes by this
    /// device.
    #[error("rate limited ({scope}); retry in {retry_after_ms} ms")]
    RateLimited {
        /// Which bucket: `device`, `topic`, `mailbox`, `claimer`, `target`
        /// or `subscriptions`.
        scope: String,
        /// When a token is available again.
        retry_after_ms: u64,
    },
    /// The device holds the maximum number of subscriptions.
    #[error("subscription limit of {max} reached")]
    TooManySubscriptions {
        /// The limit.
        max: u32,
    },
    /// The retention asked for exceeds the hub's maximum (never clamped).
    #[error("retention of {requested_secs} s exceeds the maximum of {max_secs} s")]
    RetentionTooLong {
        /// Requested seconds.
        requested_secs: u64,
        /// The limit.
        max_secs: u64,
    },
    /// A fetch limit outside 1..=max.
    #[error("fetch limit {requested} is outside 1..={max}")]
    BadFetchLimit {
        /// Requested.
        requested: u32,
        /// The limit.
        max: u32,
    },
    /// An ack naming too many frames.
    #[error("{count} frames in one ack exceeds the maximum of {max}")]
    TooManyAcks {
        /// Frames named.
        count: u64,
        /// The limit.
        max: u64,
    },
    /// A key package is empty or too large.
    #[error("key package of {len} bytes is outside 1..={max}")]
    BadKeyPackage {
        /// Size.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The upload would overfill this device's pool.
    #[error("key package pool holds {pool}, adding {adding} exceeds {max}")]
    KeyPackagePoolFull {
        /// Current pool size.
        pool: u32,
        /// Packages in the upload.
        adding: u32,
        /// The limit.
        max: u32,
    },
    /// The device has no key package left and no last resort.
    #[error("no key package available for that device")]
    NoKeyPackage,
    /// The same publish id was used before with different content.
    #[error("publish id already used with different content (seq {seq})")]
    Conflict {
        /// The original sequence number.
        seq: u64,
    },
    /// A newer receive stream for this device replaced this one.
    #[error("a newer receive stream replaced this one")]
    ReceiveReplaced,
    /// The hub is shutting down.
    #[error("hub is shutting down")]
    ShuttingDown,
    /// The hub's store failed; nothing was changed.
    #[error("hub internal error: {reason}")]
    Internal {
        /// What failed.
        reason: String,
    },
    /// The device may not do this: subscribe to or fetch another device's
    /// mailbox, or publish a log frame on a mailbox topic.
    #[error("not authorized")]
    NotAuthorized,
    /// The publish would take the payload bytes this device has stored on
    /// the hub (log and mailbox frames it published that are still held)
    /// over its quota; nothing was stored. Room comes back as its frames
    /// are acked, trimmed or expire.
    #[error("storage quota: {stored} bytes stored, adding {adding} exceeds {max}")]
    StorageQuotaExceeded {
        /// Payload bytes the device has stored now.
        stored: u64,
        /// Payload bytes of the refused publish.
        adding: u64,
        /// The quota.
        max: u64,
    },
    /// Not an answer but a notice on the receive stream: frames of `topic`
    /// after sequence number `after_seq` and up to `through_seq` were
    /// trimmed from its log (depth or retention) before this device was
    /// pushed them. They cannot be fetched either; the stream goes on with
    /// the frames after them.
    #[error("frames after {after_seq} through {through_seq} of a topic were trimmed before they were delivered")]
    FramesMissed {
        /// The topic.
        topic: TopicId,
        /// The last frame of the topic this stream had reached.
        after_seq: u64,
        /// The last frame trimmed.
        through_seq: u64,
    },
    /// The device mailbox posted to holds as many frames as it may: its
    /// owner has not received them yet. Nothing was stored; post again
    /// later.
    #[error("the mailbox holds {max} frames its owner has not received; try again later")]
    MailboxFull {
        /// The limit (`max_mailbox_frames`).
        max: u64,
    },
    /// A `Subscriptions` request with more changes than
    /// [`MAX_SUBSCRIPTION_CHANGES`]; nothing was changed. Split it.
    #[error("{count} subscription changes in one request exceeds the maximum of {max}")]
    TooManyChanges {
        /// Changes in the request.
        count: u64,
        /// The limit.
        max: u64,
    },
}

/// The hub's opening frame: a fresh challenge to sign.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Challenge {
    /// Oldest protocol version the hub speaks.
    pub min_version: u16,
    /// Newest protocol version the hub speaks.
    pub max_version: u16,
    /// Fresh random nonce, single use.
    pub nonce: [u8; 32],
    /// The hub's own URL, which the device must sign.
    pub hub_url: String,
    /// The challenge expires at this wall-clock time (ms since the Unix epoch).
    pub expires_at_ms: u64,
}

/// A device's answer to the challenge.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Auth {
    /// The protocol version the device will speak.
    pub version: u16,
    /// The device's public key.
    pub device: DeviceId,
    /// The nonce from the challenge.
    pub nonce: [u8; 32],
    /// The hub URL the device meant to reach.
    pub hub_url: String,
    /// The expiry from the challenge.
    pub expires_at_ms: u64,
    /// ed25519 signature over [`auth_message`] (64 bytes).
    #[serde(with = "serde_bytes")]
    pub signature: Vec<u8>,
}

/// The hub's acceptance of an [`Auth`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthOk {
    /// The authenticated device.
    pub device: DeviceId,
    /// The agreed protocol version.
    pub version: u16,
    /// The hub's wall clock.
    pub server_time_ms: u64,
    /// The hub's payload limit, so clients can refuse early.
    pub max_payload: u64,
    /// The identity of the hub's store (since protocol version 2).
    pub store_id: StoreId,
}

/// The bytes a device signs to authenticate.
pub fn auth_message(nonce: &[u8; 32], hub_url: &str, expires_at_ms: u64) -> Vec<u8> {
    let mut m = Vec::with_capacity(AUTH_DOMAIN.len() + 32 + 4 + hub_url.len() + 8);
    m.extend_from_slice(AUTH_DOMAIN);
    m.extend_from_slice(nonce);
    m.extend_from_slice(&(hub_url.len() as u32).to_be_bytes());
    m.extend_from_slice(hub_url.as_bytes());
    m.extend_from_slice(&expires_at_ms.to_be_bytes());
    m
}

/// A frame from a device to a hub.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientFrame {
    /// Kind 1: the answer to the challenge.
    Auth(Auth),
    /// Kind 2: a request; the hub answers with a `Response` of the same id.
    Request {
        /// Correlation id chosen by the device.
        id: u64,
        /// The operation.
        op: Request,
    },
}

/// A frame from a hub to a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerFrame {
    /// Kind 1: sent once, first, on every connection.
    Challenge(Challenge),
    /// Kind 2: authentication succeeded.
    AuthOk(AuthOk),
    /// Kind 3: the answer to the request with this id.
    Response {
        /// The request's correlation id.
        id: u64,
        /// The answer.
        result: Result<Response, HubError>,
    },
    /// Kind 4: a pushed delivery on the receive stream.
    Deliver(Delivery),
    /// Kind 5: an error tied to no request (a frame that could not be decoded,
    /// or a refused authentication).
    Error(HubError),
    /// Kind 6: the receive stream ended (for example it was replaced).
    ReceiveEnded(HubError),
}

/// Why a frame could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Zero bytes.
    #[error("empty frame")]
    Empty,
    /// Over the size limit; nothing was parsed.
    #[error("frame of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// Frame size.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The kind byte is unknown.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// The request's operation index is unknown.
    #[error("unknown operation {op} in request {id}")]
    UnknownOperation {
        /// The request id.
        id: u64,
        /// The operation index.
        op: u32,
    },
    /// The body does not decode as the kind says.
    #[error("malformed frame of kind {kind}: {reason}")]
    Malformed {
        /// The kind byte.
        kind: u8,
        /// What the decoder said.
        reason: String,
    },
}

impl From<DecodeError> for HubError {
    fn from(e: DecodeError) -> Self {
        match e {
            DecodeError::TooLarge { len, max } => HubError::FrameTooLarge {
                len: len as u64,
                max: max as u64,
            },
            DecodeError::UnknownKind(kind) => HubError::UnknownFrameKind { kind },
            DecodeError::UnknownOperation { op, .. } => HubError::UnknownOperation { op },
            other => HubError::Malformed {
                reason: other.to_string(),
            },
        }
    }
}

/// The number of [`Request`] variants; an operation index at or above this is
/// unknown.
const REQUEST_OPS: u32 = 13;

fn encode_body<T: Serialize>(kind: u8, body: &T) -> Vec<u8> {
    let out = vec![kind];
    // Serializing our own plain data types into a Vec cannot fail: postcard
    // only errors on unsupported serde features, which these types do not use.
    match postcard::to_extend(body, out) {
        Ok(v) => v,
        Err(e) => unreachable!("postcard cannot fail on wire types: {e}"),
    }
}

fn decode_body<T: DeserializeOwned>(kind: u8, body: &[u8]) -> Result<T, DecodeError> {
    let (value, rest) =
        postcard::take_from_bytes::<T>(body).map_err(|e| DecodeError::Malformed {
            kind,
            reason: e.to_string(),
        })?;
    if !rest.is_empty() {
        return Err(DecodeError::Malformed {
            kind,
            reason: format!("{} trailing bytes", rest.len()),
        });
    }
    Ok(value)
}

fn split_kind(bytes: &[u8], max: usize) -> Result<(u8, &[u8]), DecodeError> {
    if bytes.len() > max {
        return Err(DecodeError::TooLarge {
            len: bytes.len(),
            max,
        });
    }
    match bytes.split_first() {
        Some((kind, body)) => Ok((*kind, body)),
        None => Err(DecodeError::Empty),
    }
}

impl ClientFrame {
    /// Encode to the bytes of one WebSocket binary message.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            ClientFrame::Auth(a) => encode_body(1, a),
            ClientFrame::Request { id, op } => encode_body(2, &(id, op)),
        }
    }

    /// Decode one binary message of at most `max` bytes.
    ///
    /// # Errors
    /// A [`DecodeError`] naming what is wrong; never panics.
    pub fn decode(bytes: &[u8], max: usize) -> Result<Self, DecodeError> {
        let (kind, body) = split_kind(bytes, max)?;
        match kind {
            1 => Ok(ClientFrame::Auth(decode_body(kind, body)?)),
            2 => {
                // Peek at the id and operation index first, so an operation
                // from a newer protocol is named as such, with its request id.
                if let Ok(((id, op), _)) = postcard::take_from_bytes::<(u64, u32)>(body) {
                    if op >= REQUEST_OPS {
                        return Err(DecodeError::UnknownOperation { id, op });
                    }
                }
                let (id, op) = decode_body::<(u64, Request)>(kind, body)?;
                Ok(ClientFrame::Request { id, op })
            }
            k => Err(DecodeError::UnknownKind(k)),
        }
    }
}

impl ServerFrame {
    /// Encode to the bytes of one WebSocket binary message.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            ServerFrame::Challenge(c) => encode_body(1, c),
            ServerFrame::AuthOk(a) => encode_body(2, a),
            ServerFrame::Response { id, result } => encode_body(3, &(id, result)),
            ServerFrame::Deliver(d) => encode_body(4, d),
            ServerFrame::Error(e) => encode_body(5, e),
            ServerFrame::ReceiveEnded(e) => encode_body(6, e),
        }
    }

    /// Decode one binary message of at most `max` bytes.
    ///
    /// # Errors
    /// A [`DecodeError`] naming what is wrong; never panics.
    pub fn decode(bytes: &[u8], max: usize) -> Result<Self, DecodeError> {
        let (kind, body) = split_kind(bytes, max)?;
        Ok(match kind {
            1 => ServerFrame::Challenge(decode_body(kind, body)?),
            2 => ServerFrame::AuthOk(decode_body(kind, body)?),
            3 => {
                let (id, result) = decode_body(kind, body)?;
                ServerFrame::Response { id, result }
            }
            4 => ServerFrame::Deliver(decode_body(kind, body)?),
            5 => ServerFrame::Error(decode_body(kind, body)?),
            6 => ServerFrame::ReceiveEnded(decode_body(kind, body)?),
            k => return Err(DecodeError::UnknownKind(k)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample_publish() -> ClientFrame {
        ClientFrame::Request {
            id: 7,
            op: Request::Publish(Publish {
                topic: TopicId::from("t"),
                publish_id: PublishId([3; 32]),
                class: RetentionClass::Log,
                expected_head: ExpectedHead::Seq(4),
                replay_only: false,
                retention_secs: Some(60),
                payload: vec![1, 2, 3],
                writer: None,
            }),
        }
    }

    #[test]
    fn frames_round_trip() {
        let f = sample_publish();
        assert_eq!(ClientFrame::decode(&f.encode(), 1 << 20).unwrap(), f);
        let s = ServerFrame::Response {
            id: 9,
            result: Err(HubError::Conflict { seq: 2 }),
        };
        assert_eq!(ServerFrame::decode(&s.encode(), 1 << 20).unwrap(), s);
    }

    #[test]
    fn size_is_checked_before_decoding() {
        let bytes = sample_publish().encode();
        assert_eq!(
            ClientFrame::decode(&bytes, 4),
            Err(DecodeError::TooLarge {
                len: bytes.len(),
                max: 4
            })
        );
    }

    #[test]
    fn unknown_kinds_operations_and_trailing_bytes_are_named() {
        assert_eq!(ClientFrame::decode(&[], 10), Err(DecodeError::Empty));
        assert_eq!(
            ClientFrame::decode(&[9, 0], 10),
            Err(DecodeError::UnknownKind(9))
        );
        // kind 2, id 5, op 77
        assert_eq!(
            ClientFrame::decode(&[2, 5, 77], 10),
            Err(DecodeError::UnknownOperation { id: 5, op: 77 })
        );
        let mut bytes = sample_publish().encode();
        bytes.push(0);
        assert!(matches!(
            ClientFrame::decode(&bytes, 1 << 20),
            Err(DecodeError::Malformed { kind: 2, .. })
        ));
        let bytes = sample_publish().encode();
        assert!(matches!(
            ClientFrame::decode(&bytes[..bytes.len() - 2], 1 << 20),
            Err(DecodeError::Malformed { kind: 2, .. })
        ));
    }

    #[test]
    fn request_op_count_matches_the_enum() {
        // The last variant must have index REQUEST_OPS - 1.
        let bytes = ClientFrame::Request {
            id: 0,
            op: Request::Subscriptions { changes: vec![] },
        }
        .encode();
        assert_eq!(bytes, vec![2, 0, (REQUEST_OPS - 1) as u8, 0]);
    }

    #[test]
    fn store_id_shows_as_hex_and_parses_back() {
        let id = StoreId([0xab; 16]);
        assert_eq!(id.to_string(), "ab".repeat(16));
        assert_eq!(format!("{id:?}"), format!("StoreId({})", "ab".repeat(16)));
        assert_eq!(StoreId::from_hex(&id.to_string()), Some(id));
        assert_eq!(StoreId::from_hex("abcd"), None);
    }

    #[test]
    fn auth_ok_bytes_match_the_protocol_page() {
        // The worked example of docs/protocol.md, section 4.
        let ok = ServerFrame::AuthOk(AuthOk {
            device: DeviceId([0x11; 32]),
            version: 2,
            server_time_ms: 1_700_000_000_000,
            max_payload: 1_048_576,
            store_id: StoreId([0x5a; 16]),
        });
        let mut want = vec![0x02];
        want.extend([0x11; 32]);
        want.push(0x02);
        want.extend([0x80, 0xd0, 0x95, 0xff, 0xbc, 0x31]);
        want.extend([0x80, 0x80, 0x40]);
        want.extend([0x5a; 16]);
        assert_eq!(ok.encode(), want);
        assert_eq!(want.len(), 59);
        assert_eq!(ServerFrame::decode(&want, 1 << 20).unwrap(), ok);
        // A version 1 AuthOk (no store id) does not decode as version 2.
        assert!(ServerFrame::decode(&want[..want.len() - 16], 1 << 20).is_err());

        let started = ServerFrame::Response {
            id: 7,
            result: Ok(Response::ReceiveStarted),
        };
        assert_eq!(started.encode(), vec![0x03, 0x07, 0x00, 0x04]);
    }

    #[test]
    fn access_and_quota_bytes_match_the_protocol_page() {
        // The worked examples of docs/protocol.md, section 13.
        let refused = ServerFrame::Response {
            id: 7,
            result: Err(HubError::NotAuthorized),
        };
        assert_eq!(refused.encode(), vec![0x03, 0x07, 0x01, 0x1c]);
        let over = ServerFrame::Response {
            id: 7,
            result: Err(HubError::StorageQuotaExceeded {
                stored: 600,
                adding: 500,
                max: 1000,
            }),
        };
        assert_eq!(
            over.encode(),
            vec![0x03, 0x07, 0x01, 0x1d, 0xd8, 0x04, 0xf4, 0x03, 0xe8, 0x07]
        );
        let notice = ServerFrame::Error(HubError::FramesMissed {
            topic: TopicId::from("t"),
            after_seq: 5,
            through_seq: 25,
        });
        assert_eq!(notice.encode(), vec![0x05, 0x1e, 0x01, 0x74, 0x05, 0x19]);
        let full = ServerFrame::Response {
            id: 7,
            result: Err(HubError::MailboxFull { max: 1000 }),
        };
        assert_eq!(full.encode(), vec![0x03, 0x07, 0x01, 0x1f, 0xe8, 0x07]);
        for f in [refused, over, notice, full] {
            assert_eq!(ServerFrame::decode(&f.encode(), 1 << 20).unwrap(), f);
        }
    }

    /// The worked example of docs/protocol.md ("A writer-bound publish"):
    /// another implementation can check its own bytes against these.
    #[test]
    fn a_writer_bound_publish_encodes_as_the_protocol_document_says() {
        let key = ed25519_dalek::SigningKey::from_bytes(&[0x22; 32]);
        let topic = TopicId::writer_bound(&key.verifying_key().to_bytes());
        assert_eq!(
            hex::encode(&topic.0),
            "0261cb9d61b03b301e827b405d5612dd74dd4e61e5ecd0e3d5c0461080d4302c11"
        );
        let mut p = Publish {
            topic: topic.clone(),
            publish_id: PublishId([3; 32]),
            class: RetentionClass::Log,
            expected_head: ExpectedHead::Seq(4),
            replay_only: false,
            retention_secs: None,
            payload: vec![1, 2, 3],
            writer: None,
        };
        assert_eq!(writer_message(&p).len(), 119);
        p.sign_writer(&key);
        let proof = p.writer.clone().unwrap();
        assert_eq!(
            hex::encode(proof.key),
            "a09aa5f47a6759802ff955f8dc2d2a14a5c99d23be97f864127ff9383455a4f0"
        );
        assert_eq!(
            hex::encode(&proof.signature),
            "58bb3de7a30643d28d8ca40b1a259db9024be80a7e2f14e2068bf76e90015a8a\
             a3d3bd11ed19f1caf6e10ccb12d838d675804ef6e5ca2c0318f78968e6190a0f"
        );
        assert_eq!(p.check_writer(), Ok(()));
        let bytes = ClientFrame::Request {
            id: 7,
            op: Request::Publish(p.clone()),
        }
        .encode();
        let mut want = vec![0x02, 0x07, 0x00, 33];
        want.extend_from_slice(&topic.0);
        want.extend_from_slice(&[3; 32]);
        want.extend_from_slice(&[0x01, 0x02, 0x04, 0x00, 0x00, 0x03, 1, 2, 3]);
        want.push(0x01);
        want.extend_from_slice(&proof.key);
        want.push(64);
        want.extend_from_slice(&proof.signature);
        assert_eq!(bytes, want);
        assert_eq!(bytes.len(), 176);
    }

    #[test]
    fn the_mailbox_topic_form_names_its_device_and_nothing_else() {
        // The worked example of docs/protocol.md, section 9.
        let d = DeviceId([0x11; 32]);
        let t = TopicId::mailbox(&d);
        let mut want = vec![MAILBOX_TOPIC_TAG];
        want.extend([0x11; 32]);
        assert_eq!(t.0, want);
        assert_eq!(t.mailbox_owner(), Some(d));
        let sub = ClientFrame::Request {
            id: 7,
            op: Request::Subscribe {
                topic: t,
                retention_secs: None,
            },
        };
        let mut bytes = vec![0x02, 0x07, 0x02, 0x21, 0x01];
        bytes.extend([0x11; 32]);
        bytes.push(0x00);
        assert_eq!(sub.encode(), bytes);
        // One byte more or less, or another first byte: an ordinary topic.
        assert_eq!(TopicId(want[..32].to_vec()).mailbox_owner(), None);
        let mut longer = want.clone();
        longer.push(0);
        assert_eq!(TopicId(longer).mailbox_owner(), None);
        let mut other = want;
        other[0] = 0x02;
        assert_eq!(TopicId(other).mailbox_owner(), None);
        assert_eq!(TopicId::from("t").mailbox_owner(), None);
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = ClientFrame::decode(&bytes, 1 << 20);
            let _ = ServerFrame::decode(&bytes, 1 << 20);
        }
    }
}
