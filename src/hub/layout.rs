//! How the hub's state is laid out in its [`KvStore`].
//!
//! One keyspace, one leading tag byte per record type, numbers big-endian so
//! key order is numeric order. Topic ids are length-prefixed so that one
//! topic's keys never share a prefix with another's. Values are postcard.

use crate::kv::KvError;
use crate::wire::{DeviceId, PublishId, TopicId};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

const TOPIC_META: u8 = b'M';
const LOG_FRAME: u8 = b'L';
const MAILBOX_FRAME: u8 = b'X';
const PUBLISH_RECORD: u8 = b'P';
const SUBSCRIBER: u8 = b'S';
const DEVICE_SUBSCRIPTION: u8 = b's';
const DEVICE_META: u8 = b'D';
/// Stores written before protocol version 4 hold per-device delivery
/// records under b'd'; nothing reads them, and their expiry entries
/// ([`ExpiryKind::Delivery`]) remove them.
const CURSOR: u8 = b'C';
const KEY_PACKAGE_META: u8 = b'K';
const KEY_PACKAGE: u8 = b'k';
const EXPIRY: u8 = b'E';
const STORE_ID: u8 = b'I';
const DEVICE_USAGE: u8 = b'U';

/// The kind of record an expiry-index entry points at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExpiryKind {
    LogFrame = 1,
    MailboxFrame = 2,
    /// A per-device delivery record of a store written before protocol
    /// version 4: removed when due, nothing else.
    Delivery = 3,
    PublishRecord = 4,
}

impl ExpiryKind {
    fn from_byte(b: u8) -> Option<Self> {
        Some(match b {
            1 => ExpiryKind::LogFrame,
            2 => ExpiryKind::MailboxFrame,
            3 => ExpiryKind::Delivery,
            4 => ExpiryKind::PublishRecord,
            _ => return None,
        })
    }
}

fn topic_part(out: &mut Vec<u8>, topic: &TopicId) {
    // Topic length is bounded by the hub's limit (at most u16::MAX by config
    // validation), so the prefix is exact.
    out.extend_from_slice(&(topic.0.len() as u16).to_be_bytes());
    out.extend_from_slice(&topic.0);
}

fn key(tag: u8) -> Vec<u8> {
    vec![tag]
}

/// The store's identity: one key, the bare tag; its value is the 16 raw
/// bytes of the [`StoreId`](crate::wire::StoreId) (not postcard). Written
/// once, when a store without one is first opened, and never changed.
pub(crate) fn store_id() -> Vec<u8> {
    key(STORE_ID)
}

pub(crate) fn topic_meta(topic: &TopicId) -> Vec<u8> {
    let mut k = key(TOPIC_META);
    topic_part(&mut k, topic);
    k
}

pub(crate) fn log_prefix(topic: &TopicId) -> Vec<u8> {
    let mut k = key(LOG_FRAME);
    topic_part(&mut k, topic);
    k
}

pub(crate) fn log_frame(topic: &TopicId, seq: u64) -> Vec<u8> {
    let mut k = log_prefix(topic);
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

pub(crate) fn mailbox_frame(topic: &TopicId, seq: u64) -> Vec<u8> {
    let mut k = key(MAILBOX_FRAME);
    topic_part(&mut k, topic);
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

pub(crate) fn publish_record(topic: &TopicId, id: &PublishId) -> Vec<u8> {
    let mut k = key(PUBLISH_RECORD);
    topic_part(&mut k, topic);
    k.extend_from_slice(&id.0);
    k
}

pub(crate) fn subscriber_prefix(topic: &TopicId) -> Vec<u8> {
    let mut k = key(SUBSCRIBER);
    topic_part(&mut k, topic);
    k
}

pub(crate) fn subscriber(topic: &TopicId, device: &DeviceId) -> Vec<u8> {
    let mut k = subscriber_prefix(topic);
    k.extend_from_slice(&device.0);
    k
}

pub(crate) fn device_subscription(device: &DeviceId, topic: &TopicId) -> Vec<u8> {
    let mut k = key(DEVICE_SUBSCRIPTION);
    k.extend_from_slice(&device.0);
    topic_part(&mut k, topic);
    k
}

pub(crate) fn device_meta(device: &DeviceId) -> Vec<u8> {
    let mut k = key(DEVICE_META);
    k.extend_from_slice(&device.0);
    k
}

/// A device's quota usage ([`DeviceUsage`]). A record of its own rather than
/// more fields of [`DeviceMeta`], so that stores written before quotas
/// existed still decode: a missing record reads as zero usage.
pub(crate) fn device_usage(device: &DeviceId) -> Vec<u8> {
    let mut k = key(DEVICE_USAGE);
    k.extend_from_slice(&device.0);
    k
}

/// The key prefixes of every log frame and every mailbox frame.
#[cfg(test)]
pub(crate) fn frame_prefixes() -> [Vec<u8>; 2] {
    [key(LOG_FRAME), key(MAILBOX_FRAME)]
}

/// A subscription's cursor (a bare big-endian u64, not postcard): every
/// frame of the topic up to it was pushed to the device and acknowledged, or
/// passed over. Kept apart from the subscription record, because a device's
/// own mailbox has a cursor whether or not the device subscribed to it.
pub(crate) fn cursor(device: &DeviceId, topic: &TopicId) -> Vec<u8> {
    let mut k = key(CURSOR);
    k.extend_from_slice(&device.0);
    topic_part(&mut k, topic);
    k
}

/// A stored cursor's value.
pub(crate) fn cursor_value(seq: u64) -> Vec<u8> {
    seq.to_be_bytes().to_vec()
}

/// Read a stored cursor's value.
pub(crate) fn parse_cursor(key: &[u8], v: &[u8]) -> Result<u64, KvError> {
    <[u8; 8]>::try_from(v)
        .map(u64::from_be_bytes)
        .map_err(|_| KvError::Corrupt {
            key: hex::encode(key),
            reason: format!("a cursor is 8 bytes, not {}", v.len()),
        })
}

/// The key prefix of every subscription of `device` ([`device_subscription`]).
pub(crate) fn device_subscription_prefix(device: &DeviceId) -> Vec<u8> {
    let mut k = key(DEVICE_SUBSCRIPTION);
    k.extend_from_slice(&device.0);
    k
}

/// The topic of a [`device_subscription`] key.
pub(crate) fn parse_device_subscription(k: &[u8]) -> Option<TopicId> {
    let rest = k.get(33..)?;
    let len = u16::from_be_bytes([*rest.first()?, *rest.get(1)?]) as usize;
    (rest.len() == 2 + len).then(|| TopicId(rest[2..].to_vec()))
}

pub(crate) fn key_package_meta(device: &DeviceId) -> Vec<u8> {
    let mut k = key(KEY_PACKAGE_META);
    k.extend_from_slice(&device.0);
    k
}

pub(crate) fn key_package_prefix(device: &DeviceId) -> Vec<u8> {
    let mut k = key(KEY_PACKAGE);
    k.extend_from_slice(&device.0);
    k
}

pub(crate) fn key_package(device: &DeviceId, n: u64) -> Vec<u8> {
    let mut k = key_package_prefix(device);
    k.extend_from_slice(&n.to_be_bytes());
    k
}

pub(crate) fn expiry(at_ms: u64, kind: ExpiryKind, target: &[u8]) -> Vec<u8> {
    let mut k = key(EXPIRY);
    k.extend_from_slice(&at_ms.to_be_bytes());
    k.push(kind as u8);
    k.extend_from_slice(target);
    k
}

/// The first key past every expiry entry due at or before `now_ms`.
pub(crate) fn expiry_end(now_ms: u64) -> Vec<u8> {
    let mut k = key(EXPIRY);
    k.extend_from_slice(&now_ms.saturating_add(1).to_be_bytes());
    k
}

pub(crate) fn expiry_start() -> Vec<u8> {
    key(EXPIRY)
}

/// Split an expiry-index key into its kind and target key.
pub(crate) fn parse_expiry(k: &[u8]) -> Option<(ExpiryKind, &[u8])> {
    if k.len() < 10 || k[0] != EXPIRY {
        return None;
    }
    Some((ExpiryKind::from_byte(k[9])?, &k[10..]))
}

/// Split a log-frame or mailbox-frame key into (topic, seq).
pub(crate) fn parse_frame_key(k: &[u8]) -> Option<(TopicId, u64)> {
    if k.len() < 11 {
        return None;
    }
    let len = u16::from_be_bytes([k[1], k[2]]) as usize;
    if k.len() != 3 + len + 8 {
        return None;
    }
    let topic = TopicId(k[3..3 + len].to_vec());
    let seq = u64::from_be_bytes(k[3 + len..].try_into().ok()?);
    Some((topic, seq))
}

/// Per-topic state. The head is stored, never derived, so it survives trims.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TopicMeta {
    /// The last sequence number assigned (0: none yet).
    pub last_seq: u64,
    /// Sequence number of the last log publish.
    pub head: Option<u64>,
    /// Lowest log sequence number still held.
    pub oldest: Option<u64>,
    /// Every log frame with a sequence number up to this was trimmed.
    pub removed_through: u64,
    /// Log frames held.
    pub log_len: u64,
}

/// A stored frame (log or mailbox).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StoredFrame {
    pub sender: DeviceId,
    pub publish_id: PublishId,
    pub published_at_ms: u64,
    pub expires_at_ms: u64,
    #[serde(with = "serde_bytes")]
    pub payload: Vec<u8>,
    /// Mailbox only: recipients that still hold it.
    pub remaining: u32,
}

/// The idempotency record of a publish id.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PublishRecord {
    pub seq: u64,
    pub digest: [u8; 32],
}

/// A durable subscription.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Subscription {
    /// Frames published longer ago than this are not pushed to it.
    pub retention_secs: u64,
}

/// Per-device state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DeviceMeta {
    /// Unused since protocol version 4 (deliveries come from cursors); kept
    /// so that records written before it still decode.
    pub legacy_last_delivery: u64,
    pub subscriptions: u32,
}

/// What one device uses of its per-device quotas, kept in the same atomic
/// batch as the change that moves it.
///
/// A store written before quotas existed holds frames that no usage record
/// counts; releasing them saturates at zero, so usage there is an
/// undercount until those old records are gone. (A record written before
/// protocol version 4 has two more fields, which decoding ignores; its
/// `mailbox_frames` counted queued deliveries then.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceUsage {
    /// Frames the hub holds in this device's own mailbox
    /// (`Limits::max_mailbox_frames`).
    pub mailbox_frames: u64,
    /// Payload bytes of the log and mailbox frames this device published
    /// that the hub still holds (`Limits::max_stored_bytes`).
    pub stored_bytes: u64,
}

/// A device's key-package pool.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct KeyPackageMeta {
    pub next: u64,
    pub pool: u32,
    pub last_resort: Option<Vec<u8>>,
}

pub(crate) fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    match postcard::to_allocvec(v) {
        Ok(b) => b,
        Err(e) => unreachable!("postcard cannot fail on hub records: {e}"),
    }
}

pub(crate) fn decode<T: DeserializeOwned>(key: &[u8], bytes: &[u8]) -> Result<T, KvError> {
    postcard::from_bytes(bytes).map_err(|e| KvError::Corrupt {
        key: hex::encode(key),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_back() {
        let t = TopicId::from("topic");
        let d = DeviceId([7; 32]);
        assert_eq!(parse_frame_key(&log_frame(&t, 9)), Some((t.clone(), 9)));
        assert_eq!(parse_frame_key(&mailbox_frame(&t, 3)), Some((t.clone(), 3)));
        let sub = device_subscription(&d, &t);
        assert!(sub.starts_with(&device_subscription_prefix(&d)));
        assert_eq!(parse_device_subscription(&sub), Some(t.clone()));
        assert_eq!(parse_cursor(b"k", &cursor_value(77)).unwrap(), 77);
        assert!(parse_cursor(b"k", &[1, 2]).is_err());
        let target = log_frame(&t, 9);
        let e = expiry(1234, ExpiryKind::LogFrame, &target);
        assert_eq!(
            parse_expiry(&e),
            Some((ExpiryKind::LogFrame, target.as_slice()))
        );
        assert!(e < expiry_end(1234) && e >= expiry_start());
        assert!(e > expiry_end(1233));
    }

    #[test]
    fn topics_never_share_a_prefix() {
        // "ab" must not be a key prefix of topic "abc"'s frames.
        let a = log_prefix(&TopicId::from("ab"));
        let b = log_frame(&TopicId::from("abc"), 1);
        assert!(!b.starts_with(&a));
    }
}
