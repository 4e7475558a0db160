//! The hub's half of the fuzzing targets ([`crate::fuzz`]): what needs the
//! hub's private modules.

use super::layout as l;
use crate::wire::{Auth, HubError};

/// The hub's checks of an answer to a challenge, as its connection runs
/// them (all but the replay check, which needs its record of nonces).
///
/// # Errors
/// The [`HubError`] the hub would answer.
pub fn check_answer(
    auth: &Auth,
    nonce: &[u8; 32],
    expires_at_ms: u64,
    now_ms: u64,
    hub_url: &str,
) -> Result<u16, HubError> {
    super::server::check_answer(auth, nonce, expires_at_ms, now_ms, hub_url)
}

/// A hub's stored record read back: the bytes as each record type's value,
/// as each key form the hub parses, and as the text of an announcement
/// between hub processes (PostgreSQL `NOTIFY`). Whatever decodes must
/// encode back to the same value.
pub fn hub_records(data: &[u8]) {
    fn round_trip<T>(data: &[u8])
    where
        T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
    {
        if let Ok(v) = l::decode::<T>(b"fuzz", data) {
            assert_eq!(
                l::decode::<T>(b"fuzz", &l::encode(&v)).ok().as_ref(),
                Some(&v),
                "a hub record does not round-trip"
            );
        }
    }
    round_trip::<l::TopicMeta>(data);
    round_trip::<l::StoredFrame>(data);
    round_trip::<l::PublishRecord>(data);
    round_trip::<l::Subscription>(data);
    round_trip::<l::DeviceMeta>(data);
    round_trip::<l::DeviceUsage>(data);
    round_trip::<l::KeyPackageMeta>(data);
    let _ = l::parse_cursor(b"fuzz", data);
    let _ = l::parse_device_subscription(data);
    let _ = l::parse_expiry(data);
    if let Some((topic, seq)) = l::parse_frame_key(data) {
        // Both frame key forms share the layout; the tag byte is not checked
        // by the parser (the caller's range read picked it).
        let mut key = l::log_frame(&topic, seq);
        key[0] = data[0];
        assert_eq!(key, data, "a frame key does not round-trip");
    }
    if let Ok(text) = std::str::from_utf8(data) {
        if let Some((
            origin,
            super::announce::Remote::Frame {
                topic,
                seq,
                recipients,
            },
        )) = super::announce::decode(text)
        {
            let again =
                super::announce::encode(origin, &topic, seq, recipients.as_deref().unwrap_or(&[]));
            let back = super::announce::decode(&again);
            // `*` (every follower) and more than MAX_NAMED recipients are
            // both encoded as `*`: only a named list comes back as it was.
            if recipients
                .as_ref()
                .is_some_and(|r| r.len() <= super::announce::MAX_NAMED)
            {
                assert_eq!(
                    back,
                    Some((
                        origin,
                        super::announce::Remote::Frame {
                            topic,
                            seq,
                            recipients
                        }
                    )),
                    "an announcement does not round-trip"
                );
            }
        }
    }
}

/// Seeds of `hub_records`: one record of each type, the key forms, an
/// announcement.
pub fn seeds(out: &mut Vec<crate::fuzz::Seed>) {
    use crate::wire::{DeviceId, PublishId, TopicId};
    let topic = TopicId::from("topic");
    let mut add = |name: &str, bytes: Vec<u8>| {
        out.push(crate::fuzz::Seed {
            target: "hub_records",
            name: name.to_string(),
            bytes,
        })
    };
    add(
        "topic-meta",
        l::encode(&l::TopicMeta {
            last_seq: 9,
            head: Some(9),
            oldest: Some(2),
            removed_through: 1,
            log_len: 8,
        }),
    );
    add(
        "frame",
        l::encode(&l::StoredFrame {
            sender: DeviceId([1; 32]),
            publish_id: PublishId([2; 32]),
            published_at_ms: 3,
            expires_at_ms: 4,
            payload: vec![5; 10],
            remaining: 1,
        }),
    );
    add(
        "key-packages",
        l::encode(&l::KeyPackageMeta {
            next: 3,
            pool: 2,
            last_resort: Some(vec![1; 30]),
        }),
    );
    add("frame-key", l::log_frame(&topic, 7));
    add(
        "subscription-key",
        l::device_subscription(&DeviceId([3; 32]), &topic),
    );
    add(
        "announcement",
        super::announce::encode(9, &topic, 4, &[DeviceId([4; 32])]).into_bytes(),
    );
}
