//! A device's receive stream as a state machine, apart from I/O: for each
//! topic it follows, how far it looked, which pushed frames still wait for
//! an acknowledgement, and how far the subscription's stored cursor may
//! move.
//!
//! Deliveries come from the topics themselves (protocol version 4): a
//! publish writes its frame once, whoever follows the topic, and each
//! subscription keeps one cursor, the sequence number up to which every
//! frame was pushed and acknowledged (or passed over: the device's own
//! frames, frames too old for the subscription). The pump in
//! [`server`](super::server) reads the frames after the cursor, pushes them
//! and reports them here; acknowledgements come back here; the cursor moves
//! to just below the lowest frame still unacknowledged, and the pump saves
//! it. A cursor saved late only means frames pushed again after a
//! reconnect, which devices deduplicate; it never skips a frame the device
//! did not acknowledge.

use crate::wire::TopicId;
use std::collections::{BTreeMap, BTreeSet};

/// Where a stream starts on one topic: what the store holds for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopicStart {
    /// The topic.
    pub topic: TopicId,
    /// The subscription's stored cursor: every frame up to it is done.
    pub cursor: u64,
    /// Frames up to this sequence number are durable and may be pushed.
    pub durable_through: u64,
    /// Frames published longer ago than this (ms) are passed over: the
    /// subscription's retention.
    pub max_age_ms: u64,
}

/// One topic of a stream.
#[derive(Clone, Debug)]
struct TopicState {
    stored: u64,
    scanned: u64,
    durable: u64,
    max_age_ms: u64,
    unacked: BTreeSet<u64>,
}

impl TopicState {
    fn cursor(&self) -> u64 {
        match self.unacked.first() {
            Some(&lowest) => lowest - 1,
            None => self.scanned,
        }
    }
}

/// A range of a topic the pump should read next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadRange {
    /// The topic.
    pub topic: TopicId,
    /// Frames above this...
    pub after: u64,
    /// ...up to this one.
    pub through: u64,
    /// The subscription's retention (see [`TopicStart::max_age_ms`]).
    pub max_age_ms: u64,
}

/// The state of one receive stream.
#[derive(Debug, Default)]
pub struct StreamState {
    topics: BTreeMap<TopicId, TopicState>,
    /// Woken topics the stream does not know yet (a subscription made since
    /// it started, or the device's own mailbox): the pump loads them.
    unknown: BTreeMap<TopicId, u64>,
    unacked: usize,
}

impl StreamState {
    /// Follow a topic from where the store says.
    pub fn load(&mut self, start: TopicStart) {
        let woken = self.unknown.remove(&start.topic).unwrap_or(0);
        let old = self.topics.insert(
            start.topic,
            TopicState {
                stored: start.cursor,
                scanned: start.cursor,
                durable: start.durable_through.max(woken),
                max_age_ms: start.max_age_ms,
                unacked: BTreeSet::new(),
            },
        );
        if let Some(old) = old {
            self.unacked -= old.unacked.len();
        }
    }

    /// Whether the stream follows `topic`.
    pub fn follows(&self, topic: &TopicId) -> bool {
        self.topics.contains_key(topic)
    }

    /// The topics the stream follows.
    pub fn followed(&self) -> Vec<TopicId> {
        self.topics.keys().cloned().collect()
    }

    /// Stop following `topic` (it was unsubscribed); its unacknowledged
    /// frames are forgotten.
    pub fn forget(&mut self, topic: &TopicId) {
        self.unknown.remove(topic);
        if let Some(t) = self.topics.remove(topic) {
            self.unacked -= t.unacked.len();
        }
    }

    /// Frame `seq` of `topic` is durable: read up to it.
    pub fn woken(&mut self, topic: &TopicId, seq: u64) {
        match self.topics.get_mut(topic) {
            Some(t) => t.durable = t.durable.max(seq),
            None => {
                let w = self.unknown.entry(topic.clone()).or_default();
                *w = (*w).max(seq);
            }
        }
    }

    /// Woken topics to load first, taken out of the list.
    pub fn take_unknown(&mut self) -> Vec<TopicId> {
        std::mem::take(&mut self.unknown).into_keys().collect()
    }

    /// The first topic (in topic order, after `after` when given) with
    /// durable frames the stream has not looked at.
    pub fn next_read(&self, after: Option<&TopicId>) -> Option<ReadRange> {
        let range = match after {
            Some(a) => self
                .topics
                .range::<TopicId, _>((std::ops::Bound::Excluded(a), std::ops::Bound::Unbounded)),
            None => self.topics.range::<TopicId, _>(..),
        };
        range
            .filter(|(_, t)| t.durable > t.scanned)
            .map(|(topic, t)| ReadRange {
                topic: topic.clone(),
                after: t.scanned,
                through: t.durable,
                max_age_ms: t.max_age_ms,
            })
            .next()
    }

    /// Frame `seq` of `topic` was pushed.
    pub fn pushed(&mut self, topic: &TopicId, seq: u64) {
        if let Some(t) = self.topics.get_mut(topic) {
            if seq > t.scanned && t.unacked.insert(seq) {
                self.unacked += 1;
            }
            t.scanned = t.scanned.max(seq);
        }
    }

    /// Every frame of `topic` up to `seq` was looked at (pushed or passed
    /// over).
    pub fn scanned(&mut self, topic: &TopicId, seq: u64) {
        if let Some(t) = self.topics.get_mut(topic) {
            t.scanned = t.scanned.max(seq);
        }
    }

    /// The device acknowledged frame `seq` of `topic`: answers whether it
    /// was pushed on this stream and not acknowledged before.
    pub fn acked(&mut self, topic: &TopicId, seq: u64) -> bool {
        let Some(t) = self.topics.get_mut(topic) else {
            return false;
        };
        if t.unacked.remove(&seq) {
            self.unacked -= 1;
            true
        } else {
            false
        }
    }

    /// Frames pushed and not acknowledged, over every topic.
    pub fn unacked(&self) -> usize {
        self.unacked
    }

    /// Cursors that may move past what the store holds: `(topic, cursor)`.
    pub fn advances(&self) -> Vec<(TopicId, u64)> {
        self.topics
            .iter()
            .filter_map(|(topic, t)| {
                let c = t.cursor();
                (c > t.stored).then(|| (topic.clone(), c))
            })
            .collect()
    }

    /// The store now holds `cursor` for `topic`.
    pub fn saved(&mut self, topic: &TopicId, cursor: u64) {
        if let Some(t) = self.topics.get_mut(topic) {
            t.stored = t.stored.max(cursor);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(topic: &str, cursor: u64, durable: u64) -> TopicStart {
        TopicStart {
            topic: TopicId::from(topic),
            cursor,
            durable_through: durable,
            max_age_ms: u64::MAX,
        }
    }

    #[test]
    fn the_cursor_stops_below_the_lowest_unacknowledged_frame() {
        let t = TopicId::from("a");
        let mut s = StreamState::default();
        s.load(start("a", 3, 9));
        let r = s.next_read(None).unwrap();
        assert_eq!((r.after, r.through), (3, 9));
        for seq in [4, 5, 7] {
            s.pushed(&t, seq);
        }
        s.scanned(&t, 9);
        assert_eq!(s.unacked(), 3);
        assert!(s.next_read(None).is_none());
        // Nothing acknowledged: the cursor stays where the store has it.
        assert!(s.advances().is_empty());
        assert!(s.acked(&t, 5));
        assert!(!s.acked(&t, 5), "a second ack of one frame counts once");
        assert!(s.advances().is_empty(), "4 is still unacknowledged");
        assert!(s.acked(&t, 4));
        assert_eq!(s.advances(), vec![(t.clone(), 6)]);
        s.saved(&t, 6);
        assert!(s.advances().is_empty());
        assert!(s.acked(&t, 7));
        // 8 and 9 were passed over (the device's own frames, say).
        assert_eq!(s.advances(), vec![(t.clone(), 9)]);
        assert_eq!(s.unacked(), 0);
    }

    #[test]
    fn acks_of_frames_never_pushed_move_nothing() {
        let t = TopicId::from("a");
        let mut s = StreamState::default();
        s.load(start("a", 0, 2));
        assert!(!s.acked(&t, 1));
        assert!(!s.acked(&TopicId::from("b"), 1));
        assert!(s.advances().is_empty());
    }

    #[test]
    fn a_topic_woken_before_it_is_loaded_is_read_once_loaded() {
        let t = TopicId::from("new");
        let mut s = StreamState::default();
        s.woken(&t, 5);
        assert!(s.next_read(None).is_none());
        assert_eq!(s.take_unknown(), vec![t.clone()]);
        s.woken(&t, 6);
        s.load(start("new", 2, 4));
        let r = s.next_read(None).unwrap();
        assert_eq!((r.after, r.through), (2, 6));
    }

    #[test]
    fn reads_go_round_the_topics() {
        let mut s = StreamState::default();
        s.load(start("a", 0, 1));
        s.load(start("b", 0, 1));
        let first = s.next_read(None).unwrap();
        assert_eq!(first.topic, TopicId::from("a"));
        let second = s.next_read(Some(&first.topic)).unwrap();
        assert_eq!(second.topic, TopicId::from("b"));
        assert!(s.next_read(Some(&second.topic)).is_none());
    }

    #[test]
    fn forgetting_a_topic_drops_its_unacknowledged_frames() {
        let t = TopicId::from("a");
        let mut s = StreamState::default();
        s.load(start("a", 0, 3));
        s.pushed(&t, 1);
        s.pushed(&t, 2);
        s.forget(&t);
        assert_eq!(s.unacked(), 0);
        assert!(!s.follows(&t));
        assert!(s.advances().is_empty());
    }
}
