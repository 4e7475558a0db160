//! The publish rules of DESIGN.md section 2, as a pure function over what
//! the store holds about one topic.
//!
//! [`decide`] answers what a publish does, given the topic's [`TopicView`]:
//! the idempotency record of its publish id and the topic's head. It reads
//! nothing and writes nothing, so every store (sled under the core's write
//! lock, a later SQL store inside one transaction) applies the same rules,
//! and the rules are tested apart from any store. What makes the outcome
//! hold is the store's part: the view must be read, and the outcome's
//! writes applied, with no other publish to the same topic in between.

use super::layout::{PublishRecord, TopicMeta};
use crate::wire::ExpectedHead;

/// What a publish's outcome depends on: read from the store in the same
/// atomic step that then applies the outcome.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TopicView<'a> {
    /// The idempotency record of the publish's id on this topic, if the
    /// hub still holds one.
    pub record: Option<&'a PublishRecord>,
    /// The topic's sequence and head state.
    pub meta: Option<&'a TopicMeta>,
}

/// The publish being decided, reduced to what the rules read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Attempt {
    /// SHA-256 of the retention class and payload.
    pub digest: [u8; 32],
    /// The compare-and-set condition.
    pub expected_head: ExpectedHead,
    /// A replay of a publish the sender made before: never stored anew.
    pub replay_only: bool,
}

/// What a publish does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// A repeat of a stored publish: answer its sequence number, store
    /// nothing, deliver to nobody.
    Duplicate {
        /// The original's sequence number.
        seq: u64,
    },
    /// The id is stored with other content: refuse, store nothing.
    Conflict {
        /// The stored publish's sequence number.
        seq: u64,
    },
    /// A replay of something the hub never saw: store nothing.
    HistoryMissing,
    /// The compare-and-set failed: store nothing, answer the head.
    HeadMismatch {
        /// The topic's head now.
        current: Option<u64>,
    },
    /// Store it under `seq`.
    Append {
        /// The sequence number it gets.
        seq: u64,
    },
}

impl Decision {
    /// Whether this publish is new work (anything but an answer from the
    /// idempotency record): what rate limits count, so a retry after an
    /// outage is never refused as rate limited.
    pub(crate) fn is_new_work(&self) -> bool {
        !matches!(self, Decision::Duplicate { .. } | Decision::Conflict { .. })
    }
}

/// The rules, in their order: idempotency first (a replay always carries a
/// stale head, so it must be recognised before the compare-and-set), then
/// `replay_only`, then the compare-and-set on the head, then the next
/// sequence number.
pub(crate) fn decide(view: TopicView<'_>, p: Attempt) -> Decision {
    if let Some(rec) = view.record {
        return if rec.digest == p.digest {
            Decision::Duplicate { seq: rec.seq }
        } else {
            Decision::Conflict { seq: rec.seq }
        };
    }
    if p.replay_only {
        return Decision::HistoryMissing;
    }
    let (head, last_seq) = view.meta.map_or((None, 0), |m| (m.head, m.last_seq));
    let cas_ok = match p.expected_head {
        ExpectedHead::Unconditional => true,
        ExpectedHead::Empty => head.is_none(),
        ExpectedHead::Seq(s) => head == Some(s),
    };
    if !cas_ok {
        return Decision::HeadMismatch { current: head };
    }
    Decision::Append { seq: last_seq + 1 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn meta(last_seq: u64, head: Option<u64>) -> TopicMeta {
        TopicMeta {
            last_seq,
            head,
            ..TopicMeta::default()
        }
    }

    fn attempt(expected_head: ExpectedHead) -> Attempt {
        Attempt {
            digest: [1; 32],
            expected_head,
            replay_only: false,
        }
    }

    #[test]
    fn idempotency_comes_before_the_compare_and_set() {
        let rec = PublishRecord {
            seq: 3,
            digest: [1; 32],
        };
        let m = meta(9, Some(9));
        let view = TopicView {
            record: Some(&rec),
            meta: Some(&m),
        };
        // A replay carries a stale head, and still answers duplicate.
        assert_eq!(
            decide(view, attempt(ExpectedHead::Seq(2))),
            Decision::Duplicate { seq: 3 }
        );
        let other = Attempt {
            digest: [2; 32],
            ..attempt(ExpectedHead::Unconditional)
        };
        assert_eq!(decide(view, other), Decision::Conflict { seq: 3 });
        assert!(!Decision::Conflict { seq: 3 }.is_new_work());
    }

    #[test]
    fn a_replay_the_hub_never_saw_is_history_missing() {
        let m = meta(4, Some(4));
        let view = TopicView {
            record: None,
            meta: Some(&m),
        };
        let replay = Attempt {
            replay_only: true,
            ..attempt(ExpectedHead::Seq(4))
        };
        assert_eq!(decide(view, replay), Decision::HistoryMissing);
    }

    #[test]
    fn the_compare_and_set_follows_the_head_not_the_sequence() {
        // A mailbox publish moved the sequence past the head.
        let m = meta(7, Some(5));
        let view = TopicView {
            record: None,
            meta: Some(&m),
        };
        assert_eq!(
            decide(view, attempt(ExpectedHead::Seq(5))),
            Decision::Append { seq: 8 }
        );
        assert_eq!(
            decide(view, attempt(ExpectedHead::Seq(7))),
            Decision::HeadMismatch { current: Some(5) }
        );
        assert_eq!(
            decide(view, attempt(ExpectedHead::Empty)),
            Decision::HeadMismatch { current: Some(5) }
        );
        let empty = TopicView::default();
        assert_eq!(
            decide(empty, attempt(ExpectedHead::Empty)),
            Decision::Append { seq: 1 }
        );
    }

    proptest! {
        /// Of any publishes that read the same view with conditions on the
        /// head, at most one kind of condition wins: exactly one epoch's
        /// commit can land.
        #[test]
        fn at_most_one_head_condition_wins(
            head in proptest::option::of(0u64..5),
            last in 0u64..5,
            wants in proptest::collection::vec(proptest::option::of(0u64..5), 1..6),
        ) {
            let m = meta(last.max(head.unwrap_or(0)), head);
            let view = TopicView { record: None, meta: Some(&m) };
            let mut winners: Vec<ExpectedHead> = wants
                .iter()
                .map(|w| match w {
                    None => ExpectedHead::Empty,
                    Some(s) => ExpectedHead::Seq(*s),
                })
                .filter(|e| matches!(decide(view, attempt(*e)), Decision::Append { .. }))
                .collect();
            winners.dedup();
            prop_assert!(winners.len() <= 1);
            for e in winners {
                let want = match head {
                    None => ExpectedHead::Empty,
                    Some(h) => ExpectedHead::Seq(h),
                };
                prop_assert_eq!(e, want);
            }
        }
    }
}
