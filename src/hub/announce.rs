//! Announcements between hub processes that share one store: "frame `seq`
//! of `topic` is durable, for these devices", so that a process holding a
//! recipient's receive stream pushes the frame at once, whichever process
//! accepted it.
//!
//! An announcement only wakes a stream; the frame itself is always read
//! from the store. So a lost announcement delays a push, never loses it,
//! and a forged one (from anything that can write to the channel) costs a
//! store read and pushes nothing the device was not owed. When
//! announcements may have been missed (the channel was interrupted or a
//! queue was full), the store says so with [`Remote::Missed`], and every
//! stream reads its topics' heads again.
//!
//! The text form (PostgreSQL's `NOTIFY` payloads are text of at most 8,000
//! bytes): `v1 <origin> <topic hex> <seq> <recipients>`, where `origin`
//! names the process that sent it (16 hex digits; a process ignores its
//! own) and `recipients` is the devices' ids in hex separated by commas, or
//! `*` when there are more than [`MAX_NAMED`] (then every stream following
//! the topic is woken).

use crate::wire::{DeviceId, TopicId};

/// The most recipients an announcement names; more are announced as `*`.
pub const MAX_NAMED: usize = 100;

/// What another process on the store made durable, or that the store may
/// have missed some of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Remote {
    /// Frame `seq` of `topic` is durable.
    Frame {
        /// The topic.
        topic: TopicId,
        /// The frame's sequence number.
        seq: u64,
        /// The devices it is for; `None`: every follower of the topic.
        recipients: Option<Vec<DeviceId>>,
    },
    /// Announcements may have been lost: read every followed topic's head.
    Missed,
}

/// Encode an announcement of frame `seq` of `topic` for `recipients`, sent
/// by the process `origin`.
pub fn encode(origin: u64, topic: &TopicId, seq: u64, recipients: &[DeviceId]) -> String {
    let named = if recipients.len() > MAX_NAMED {
        "*".to_string()
    } else {
        recipients
            .iter()
            .map(|d| hex::encode(d.0))
            .collect::<Vec<_>>()
            .join(",")
    };
    format!(
        "v1 {origin:016x} {} {seq} {named}",
        hex::encode(topic.as_bytes())
    )
}

/// Decode an announcement: its origin and what it says; `None` for text
/// that is not one (counted by the caller, never trusted).
pub fn decode(text: &str) -> Option<(u64, Remote)> {
    let mut parts = text.split(' ');
    if parts.next()? != "v1" {
        return None;
    }
    let origin = u64::from_str_radix(parts.next()?, 16).ok()?;
    let topic = TopicId(hex::decode(parts.next()?).ok()?);
    let seq = parts.next()?.parse().ok()?;
    let named = parts.next()?;
    if parts.next().is_some() {
        return None;
    }
    let recipients = match named {
        "*" => None,
        "" => Some(Vec::new()),
        list => Some(
            list.split(',')
                .map(|h| {
                    let bytes = hex::decode(h).ok()?;
                    Some(DeviceId(<[u8; 32]>::try_from(bytes).ok()?))
                })
                .collect::<Option<Vec<_>>>()?,
        ),
    };
    Some((
        origin,
        Remote::Frame {
            topic,
            seq,
            recipients,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_announcement_reads_back_as_written() {
        let topic = TopicId::from("t");
        let devices: Vec<DeviceId> = (0..3u8).map(|i| DeviceId([i; 32])).collect();
        let text = encode(7, &topic, 42, &devices);
        assert_eq!(
            decode(&text),
            Some((
                7,
                Remote::Frame {
                    topic: topic.clone(),
                    seq: 42,
                    recipients: Some(devices)
                }
            ))
        );
        let many: Vec<DeviceId> = (0..=MAX_NAMED as u8).map(|i| DeviceId([i; 32])).collect();
        let text = encode(u64::MAX, &topic, 1, &many);
        assert!(text.len() < 8000, "fits a NOTIFY payload");
        assert_eq!(
            decode(&text),
            Some((
                u64::MAX,
                Remote::Frame {
                    topic,
                    seq: 1,
                    recipients: None
                }
            ))
        );
    }

    #[test]
    fn the_longest_announcement_fits_a_notify_payload() {
        let topic = TopicId(vec![0xff; 256]);
        let devices: Vec<DeviceId> = (0..MAX_NAMED as u8).map(|i| DeviceId([i; 32])).collect();
        assert!(encode(u64::MAX, &topic, u64::MAX, &devices).len() < 8000);
    }

    #[test]
    fn anything_else_is_not_an_announcement() {
        for text in [
            "",
            "v1",
            "v2 0 00 1 *",
            "v1 zz 00 1 *",
            "v1 0 0g 1 *",
            "v1 0 00 -1 *",
            "v1 0 00 1 abc",
            "v1 0 00 1 * extra",
            &format!("v1 0 00 1 {}", hex::encode([1u8; 31])),
        ] {
            assert_eq!(decode(text), None, "{text:?}");
        }
    }
}
