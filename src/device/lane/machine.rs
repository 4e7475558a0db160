//! The commit lane as a state machine with no I/O, in the way quinn-proto
//! is driven: the driver feeds it what happened (`on_*`), asks it what to do
//! next ([`Lane::poll`]) and when to wake ([`Lane::poll_timeout`]), and does
//! the I/O itself. Everything the lane decides (when to pull, build,
//! publish, settle, discard, retry or give up) is decided here and tested
//! with scripted outcomes, without hubs or MLS.
//!
//! One run of the machine is one `commit()` call. It starts with step 0:
//! a commit journalled by an earlier run (a crash, a timeout) is settled
//! first — adopted with no network call when the journal already records
//! the hub's acceptance, otherwise replayed `replay_only` under its
//! original publish id — and only then does the caller's own commit start.
//!
//! Transitions (the journal's states):
//!
//! ```text
//!  Idle ──Pull──► (pulled) ──Build──► Journalled ──Publish──► Published
//!   ▲                                                      │  │  │
//!   │        Lost ◄── head_mismatch / history_missing ─────┘  │  └─ transient error: Published again (same bytes)
//!   └──Discard─┘                                              ▼
//!                                   Accepted{seq} ──Settle──► done (or Idle after a replayed journal)
//!  any pull or build that finds positive evidence ──► Stranded (done: recovery required)
//! ```

use std::time::Duration;
use tokio::time::Instant;

/// Where one commit stands. The journal's states; only `Accepted` merges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaneState {
    /// Nothing in flight: the next step pulls the commit topic to its end
    /// and builds against what it reached.
    Idle,
    /// Built against the live handle; the pending commit and its journal
    /// entry are durable together; nothing has left the device.
    Journalled,
    /// Sent with the compare-and-set (or replayed `replay_only`); waiting
    /// for the hub's answer.
    Published,
    /// The hub accepted it at `seq`: mark the journal, merge, clear.
    Accepted {
        /// Its position on the commit topic.
        seq: u64,
    },
    /// It did not land (another commit won, or the hub never saw a
    /// replayed one): drop the pending commit and the journal together.
    Lost,
    /// The group moved on without this device: nothing more can be
    /// committed until a recovery lands.
    Stranded,
}

/// What the driver does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Re-publish the journalled commit `replay_only`, under its original
    /// publish id and head (step 0).
    Replay,
    /// Pull the commit topic to its end, applying what is there.
    Pull,
    /// Build against the live handle and journal it (under the group lock).
    Build,
    /// Publish the journalled bytes with the compare-and-set (no lock held).
    Publish,
    /// Mark the journal accepted at `seq`, then merge and clear it (under
    /// the group lock, after checking nothing moved).
    Settle {
        /// The accepted position.
        seq: u64,
    },
    /// Drop the pending commit and the journal (under the group lock).
    Discard,
    /// Nothing to do before this instant (a retry's backoff).
    Wait {
        /// When to poll again.
        until: Instant,
    },
    /// The run is over.
    Done(Finish),
}

/// How a run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The caller's commit landed at `seq` after `attempts` builds.
    Landed {
        /// Its position on the commit topic.
        seq: u64,
        /// Builds it took.
        attempts: u32,
    },
    /// Positive evidence that the group moved on without us.
    Stranded,
    /// The deadline passed. A commit still journalled stays so: the next
    /// pull or commit settles it.
    TimedOut,
    /// The hub refused the publish itself (not a lost race): the journal
    /// stays for the next pull to settle.
    Refused,
}

/// What a pull reported to the lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pulled {
    /// The topic is read to its end; nothing blocks a build.
    CaughtUp,
    /// The pull found positive evidence that we are stranded.
    Stranded,
    /// The pull failed (hub unreachable, a local store error): retry later.
    Failed,
}

/// The hub's answer to a publish or replay, as the lane sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Accepted, or a duplicate of an accepted publish, at `seq`.
    Accepted {
        /// The position.
        seq: u64,
    },
    /// Another commit holds the position (`head_mismatch`), or a replayed
    /// commit the hub never saw (`history_missing`).
    Lost,
    /// No answer, or an answer that a later attempt can change (the
    /// connection dropped, rate limited, shutting down).
    Transient {
        /// The hub's own retry hint, if any.
        after: Option<Duration>,
    },
    /// The hub refused the publish itself; retrying cannot help.
    Refused,
}

/// How long to wait before trying a failed pull or publish again.
pub const RETRY_BACKOFF: Duration = Duration::from_millis(200);

/// One commit run. See the module doc for the transitions.
#[derive(Debug)]
pub struct Lane {
    state: LaneState,
    deadline: Instant,
    attempts: u32,
    /// True while settling a commit journalled by an earlier run.
    replaying: bool,
    /// A replayed journal that turned out lost (the caller is told).
    lost_replay: bool,
    /// True once the commit topic is pulled to its end in `Idle`.
    pulled: bool,
    wait_until: Option<Instant>,
    finished: Option<Finish>,
    /// The commit topic's head the current build expects.
    built_at: Option<u64>,
    /// The head the last build that lost its race expected.
    lost_at: Option<u64>,
    /// Builds in a row against the head of a lost race: the pull after the
    /// loss brought nothing, although the hub said the head moved.
    stalls: u32,
}

/// The longest a stalled build waits before it is published.
pub const MAX_STALL_BACKOFF: Duration = Duration::from_millis(6_400);

/// How long a build waits after `stalls` losses in a row whose pulls
/// brought nothing: [`RETRY_BACKOFF`], doubling up to [`MAX_STALL_BACKOFF`].
fn stall_backoff(stalls: u32) -> Duration {
    RETRY_BACKOFF
        .saturating_mul(1 << stalls.saturating_sub(1).min(5))
        .min(MAX_STALL_BACKOFF)
}

/// What step 0 found in the journal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Journal {
    /// Nothing journalled.
    Empty,
    /// A commit journalled and maybe published, its fate unknown.
    Pending,
    /// A commit the hub accepted at `seq` but that was never merged.
    Accepted {
        /// The accepted position.
        seq: u64,
    },
}

impl Lane {
    /// A run that must finish by `deadline`, starting from what the journal
    /// holds.
    pub fn new(journal: Journal, deadline: Instant) -> Self {
        let (state, replaying) = match journal {
            Journal::Empty => (LaneState::Idle, false),
            Journal::Pending => (LaneState::Journalled, true),
            Journal::Accepted { seq } => (LaneState::Accepted { seq }, true),
        };
        Self {
            state,
            deadline,
            attempts: 0,
            replaying,
            lost_replay: false,
            pulled: false,
            wait_until: None,
            finished: None,
            built_at: None,
            lost_at: None,
            stalls: 0,
        }
    }

    /// The current state.
    pub fn state(&self) -> LaneState {
        self.state
    }

    /// Builds so far.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether step 0 found a journalled commit from an earlier run that
    /// never landed.
    pub fn lost_replay(&self) -> bool {
        self.lost_replay
    }

    /// Whether the commit being settled is one an earlier run journalled.
    pub fn replaying(&self) -> bool {
        self.replaying
    }

    /// The next deadline the driver must wake at, if any.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.finished.is_some() {
            return None;
        }
        Some(match self.wait_until {
            Some(w) => w.min(self.deadline),
            None => self.deadline,
        })
    }

    /// What to do now.
    pub fn poll(&mut self, now: Instant) -> Action {
        if let Some(f) = self.finished {
            return Action::Done(f);
        }
        if let Some(w) = self.wait_until {
            if now < w && now < self.deadline {
                return Action::Wait { until: w };
            }
            self.wait_until = None;
        }
        match self.state {
            // Settling and discarding are local and always finish, whatever
            // the deadline says: a decided outcome is never left half-done.
            LaneState::Accepted { seq } => Action::Settle { seq },
            LaneState::Lost => Action::Discard,
            LaneState::Stranded => self.finish(Finish::Stranded),
            _ if now >= self.deadline => self.finish(Finish::TimedOut),
            LaneState::Journalled if self.replaying => Action::Replay,
            LaneState::Journalled => Action::Publish,
            LaneState::Published if self.replaying => Action::Replay,
            LaneState::Published => Action::Publish,
            LaneState::Idle if !self.pulled => Action::Pull,
            LaneState::Idle => Action::Build,
        }
    }

    fn finish(&mut self, f: Finish) -> Action {
        self.finished = Some(f);
        Action::Done(f)
    }

    /// A pull finished.
    pub fn on_pulled(&mut self, now: Instant, r: Pulled) {
        match r {
            Pulled::CaughtUp => self.pulled = true,
            Pulled::Stranded => self.state = LaneState::Stranded,
            Pulled::Failed => self.wait_until = Some(now + RETRY_BACKOFF),
        }
    }

    /// The build, made against the commit topic's `head`, is journalled
    /// (durable); next it is published.
    ///
    /// A race lost against a head means the hub holds more than that, so
    /// the pull after it moves this device's cursor past it. A new build
    /// against the same head means the pull brought nothing: a hub that
    /// answers "lost" but does not serve what won, or a pull that cannot
    /// apply it.
    /// Publishing again at once would rebuild and lose in a loop as fast as
    /// the hub answers; instead the publish waits, longer each time
    /// ([`stall_backoff`]), until the deadline ends the run.
    pub fn on_journalled(&mut self, now: Instant, head: u64) {
        self.attempts += 1;
        self.state = LaneState::Journalled;
        self.built_at = Some(head);
        if self.lost_at == Some(head) {
            self.stalls += 1;
            self.wait_until = Some(now + stall_backoff(self.stalls));
        } else {
            self.stalls = 0;
        }
    }

    /// The build found that another commit landed since the pull (the
    /// handle's epoch or the cursor moved): pull again.
    pub fn on_moved(&mut self) {
        self.pulled = false;
    }

    /// The build found positive evidence that we are stranded.
    pub fn on_stranded(&mut self) {
        self.state = LaneState::Stranded;
    }

    /// The hub answered the publish or replay.
    pub fn on_answer(&mut self, now: Instant, a: Answer) {
        match a {
            Answer::Accepted { seq } => self.state = LaneState::Accepted { seq },
            Answer::Lost => {
                self.state = LaneState::Lost;
                self.lost_at = self.built_at;
            }
            Answer::Transient { after } => {
                // The same bytes go again: if an earlier send landed, the
                // hub answers with a duplicate and its position.
                self.state = LaneState::Published;
                self.wait_until = Some(now + after.unwrap_or(RETRY_BACKOFF));
            }
            Answer::Refused => {
                self.finished = Some(Finish::Refused);
            }
        }
    }

    /// The driver sent the publish (the answer comes with `on_answer`).
    pub fn on_sent(&mut self) {
        self.state = LaneState::Published;
    }

    /// The accepted commit is merged and its journal cleared (by this run
    /// or, meanwhile, by a pull that met it on the topic).
    pub fn on_settled(&mut self) {
        let LaneState::Accepted { seq } = self.state else {
            return;
        };
        if self.replaying {
            // An earlier run's commit landed; now the caller's own.
            self.replaying = false;
            self.state = LaneState::Idle;
            self.pulled = false;
        } else {
            self.finished = Some(Finish::Landed {
                seq,
                attempts: self.attempts,
            });
        }
    }

    /// The pending commit and the journal are dropped: build again.
    pub fn on_discarded(&mut self) {
        if self.replaying {
            self.replaying = false;
            self.lost_replay = true;
        }
        self.state = LaneState::Idle;
        self.pulled = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        // Instants relative to one base: the machine only compares them.
        static BASE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *BASE.get_or_init(Instant::now) + Duration::from_millis(ms)
    }

    fn lane(journal: Journal) -> Lane {
        Lane::new(journal, at(30_000))
    }

    #[test]
    fn a_clean_commit_pulls_builds_publishes_and_settles() {
        let mut l = lane(Journal::Empty);
        assert_eq!(l.poll(at(0)), Action::Pull);
        l.on_pulled(at(0), Pulled::CaughtUp);
        assert_eq!(l.poll(at(0)), Action::Build);
        l.on_journalled(at(0), 1);
        assert_eq!(l.state(), LaneState::Journalled);
        assert_eq!(l.poll(at(0)), Action::Publish);
        l.on_sent();
        l.on_answer(at(1), Answer::Accepted { seq: 7 });
        assert_eq!(l.poll(at(1)), Action::Settle { seq: 7 });
        l.on_settled();
        assert_eq!(
            l.poll(at(2)),
            Action::Done(Finish::Landed {
                seq: 7,
                attempts: 1
            })
        );
        assert_eq!(l.poll_timeout(), None);
    }

    #[test]
    fn a_lost_race_discards_pulls_and_builds_again() {
        let mut l = lane(Journal::Empty);
        l.poll(at(0));
        l.on_pulled(at(0), Pulled::CaughtUp);
        l.poll(at(0));
        l.on_journalled(at(0), 1);
        l.poll(at(0));
        l.on_sent();
        l.on_answer(at(1), Answer::Lost);
        assert_eq!(l.poll(at(1)), Action::Discard);
        l.on_discarded();
        assert!(
            !l.lost_replay(),
            "a race lost in this run is not a lost replay"
        );
        assert_eq!(l.poll(at(1)), Action::Pull);
        l.on_pulled(at(1), Pulled::CaughtUp);
        assert_eq!(l.poll(at(1)), Action::Build);
        l.on_journalled(at(0), 1);
        l.poll(at(1));
        l.on_sent();
        l.on_answer(at(2), Answer::Accepted { seq: 9 });
        l.poll(at(2));
        l.on_settled();
        assert_eq!(
            l.poll(at(2)),
            Action::Done(Finish::Landed {
                seq: 9,
                attempts: 2
            })
        );
    }

    #[test]
    fn a_journal_known_accepted_is_settled_without_the_network() {
        let mut l = lane(Journal::Accepted { seq: 4 });
        assert_eq!(l.poll(at(0)), Action::Settle { seq: 4 });
        l.on_settled();
        assert!(!l.replaying());
        // Then the caller's own commit starts from a pull.
        assert_eq!(l.poll(at(0)), Action::Pull);
    }

    #[test]
    fn a_pending_journal_is_replayed_and_a_lost_one_reported() {
        let mut l = lane(Journal::Pending);
        assert_eq!(l.poll(at(0)), Action::Replay);
        l.on_sent();
        l.on_answer(at(1), Answer::Lost);
        assert_eq!(l.poll(at(1)), Action::Discard);
        l.on_discarded();
        assert!(l.lost_replay());
        assert_eq!(l.poll(at(1)), Action::Pull);
    }

    #[test]
    fn a_replay_without_answer_is_replayed_again_not_republished() {
        let mut l = lane(Journal::Pending);
        l.poll(at(0));
        l.on_sent();
        l.on_answer(at(1), Answer::Transient { after: None });
        assert_eq!(
            l.poll(at(1)),
            Action::Wait {
                until: at(1) + RETRY_BACKOFF
            }
        );
        assert_eq!(l.poll(at(1) + RETRY_BACKOFF), Action::Replay);
    }

    #[test]
    fn transient_failures_resend_the_same_bytes_until_the_deadline() {
        let mut l = Lane::new(Journal::Empty, at(1_000));
        l.poll(at(0));
        l.on_pulled(at(0), Pulled::CaughtUp);
        l.poll(at(0));
        l.on_journalled(at(0), 1);
        l.poll(at(0));
        l.on_sent();
        l.on_answer(
            at(10),
            Answer::Transient {
                after: Some(Duration::from_millis(500)),
            },
        );
        assert_eq!(l.poll(at(10)), Action::Wait { until: at(510) });
        assert_eq!(l.poll_timeout(), Some(at(510)));
        assert_eq!(l.poll(at(510)), Action::Publish);
        l.on_sent();
        l.on_answer(at(900), Answer::Transient { after: None });
        // The backoff would end after the deadline: the deadline wins.
        assert_eq!(l.poll_timeout(), Some(at(1_000)));
        assert_eq!(l.poll(at(1_000)), Action::Done(Finish::TimedOut));
    }

    #[test]
    fn an_accepted_answer_after_the_deadline_is_still_settled() {
        let mut l = Lane::new(Journal::Empty, at(100));
        l.poll(at(0));
        l.on_pulled(at(0), Pulled::CaughtUp);
        l.poll(at(0));
        l.on_journalled(at(0), 1);
        l.poll(at(0));
        l.on_sent();
        l.on_answer(at(200), Answer::Accepted { seq: 3 });
        assert_eq!(l.poll(at(200)), Action::Settle { seq: 3 });
    }

    #[test]
    fn a_lost_answer_after_the_deadline_is_still_discarded_then_times_out() {
        let mut l = Lane::new(Journal::Empty, at(100));
        l.poll(at(0));
        l.on_pulled(at(0), Pulled::CaughtUp);
        l.poll(at(0));
        l.on_journalled(at(0), 1);
        l.poll(at(0));
        l.on_sent();
        l.on_answer(at(200), Answer::Lost);
        assert_eq!(l.poll(at(200)), Action::Discard);
        l.on_discarded();
        assert_eq!(l.poll(at(200)), Action::Done(Finish::TimedOut));
    }

    #[test]
    fn stranded_evidence_ends_the_run() {
        let mut l = lane(Journal::Empty);
        l.poll(at(0));
        l.on_pulled(at(0), Pulled::Stranded);
        assert_eq!(l.poll(at(0)), Action::Done(Finish::Stranded));
        let mut l = lane(Journal::Empty);
        l.poll(at(0));
        l.on_pulled(at(0), Pulled::CaughtUp);
        l.poll(at(0));
        l.on_stranded();
        assert_eq!(l.poll(at(0)), Action::Done(Finish::Stranded));
    }

    #[test]
    fn a_failed_pull_waits_then_pulls_again() {
        let mut l = lane(Journal::Empty);
        l.poll(at(0));
        l.on_pulled(at(0), Pulled::Failed);
        assert!(matches!(l.poll(at(0)), Action::Wait { .. }));
        assert_eq!(l.poll(at(0) + RETRY_BACKOFF), Action::Pull);
    }

    #[test]
    fn something_moved_before_the_build_pulls_again() {
        let mut l = lane(Journal::Empty);
        l.poll(at(0));
        l.on_pulled(at(0), Pulled::CaughtUp);
        assert_eq!(l.poll(at(0)), Action::Build);
        l.on_moved();
        assert_eq!(l.poll(at(0)), Action::Pull);
    }

    #[test]
    fn a_refusal_ends_the_run_and_keeps_the_journal() {
        let mut l = lane(Journal::Empty);
        l.poll(at(0));
        l.on_pulled(at(0), Pulled::CaughtUp);
        l.poll(at(0));
        l.on_journalled(at(0), 1);
        l.poll(at(0));
        l.on_sent();
        l.on_answer(at(1), Answer::Refused);
        assert_eq!(l.poll(at(1)), Action::Done(Finish::Refused));
        assert_eq!(l.state(), LaneState::Published);
    }

    /// Who may make a device spin: nobody. A hub that answers every
    /// publish "lost" while its log shows nothing new would have the device
    /// rebuild and publish as fast as the hub answers; the builds against
    /// the same head wait longer and longer instead.
    #[test]
    fn losses_whose_pulls_bring_nothing_back_off_until_the_deadline() {
        let mut l = lane(Journal::Empty);
        let mut now = at(0);
        let mut waits = Vec::new();
        let mut publishes = 0;
        loop {
            match l.poll(now) {
                Action::Pull => l.on_pulled(now, Pulled::CaughtUp),
                Action::Build => l.on_journalled(now, 5),
                Action::Publish => {
                    publishes += 1;
                    l.on_sent();
                    l.on_answer(now, Answer::Lost);
                }
                Action::Discard => l.on_discarded(),
                Action::Wait { until } => {
                    waits.push(until - now);
                    now = until;
                }
                Action::Done(f) => {
                    assert_eq!(f, Finish::TimedOut);
                    break;
                }
                other => panic!("unexpected {other:?}"),
            }
            assert!(publishes < 100, "the lane spins");
        }
        assert_eq!(waits[0], RETRY_BACKOFF);
        assert_eq!(waits[1], RETRY_BACKOFF * 2);
        assert!(waits.iter().all(|w| *w <= MAX_STALL_BACKOFF));
        assert!(waits.contains(&MAX_STALL_BACKOFF));
    }

    #[test]
    fn a_loss_whose_pull_moved_the_head_builds_again_at_once() {
        let mut l = lane(Journal::Empty);
        l.poll(at(0));
        l.on_pulled(at(0), Pulled::CaughtUp);
        l.poll(at(0));
        l.on_journalled(at(0), 5);
        l.poll(at(0));
        l.on_sent();
        l.on_answer(at(1), Answer::Lost);
        l.poll(at(1));
        l.on_discarded();
        l.poll(at(1));
        l.on_pulled(at(1), Pulled::CaughtUp);
        assert_eq!(l.poll(at(1)), Action::Build);
        l.on_journalled(at(1), 6);
        assert_eq!(l.poll(at(1)), Action::Publish);
    }
}
