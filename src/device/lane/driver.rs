//! The lane's driver: runs [`Lane`](super::machine::Lane) against the
//! group's handle, its journal and its commit hub. It takes the group lock
//! only to build and journal, and again to settle or discard; the publish
//! waits on the hub with no lock held, so sends, receives and other
//! groups' commits go on meanwhile.

use super::build::{self, Plan, REDRIVE};
use super::machine::{Action, Answer, Finish, Journal, Lane, Pulled as LanePulled};
use super::pull::Pulled;
use super::{CommitError, CommitKind, CommitReport, JournalEntry, LaneResult, LostCommit};
use crate::device::events::Event;
use crate::device::frames::{digest, publish_id};
use crate::device::ledger::Entry;
use crate::device::manager::{send_failure, GroupPeerManager};
use crate::device::outbox::SendFailure;
use crate::device::records::GroupId;
use crate::device::topics;
use crate::kv::WriteBatch;
use crate::wire::{ExpectedHead, Publish, PublishOutcome, RetentionClass};
use openmls_traits::OpenMlsProvider;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::Mutex as AsyncMutex;
use tokio::time::Instant;

/// What the build step did.
enum Step {
    /// Built against this head of the commit topic, and journalled.
    Journalled(u64),
    Stranded,
}

impl GroupPeerManager {
    /// The lock that lets one commit run at a time per group.
    pub(crate) fn lane_lock(&self, group: GroupId) -> Arc<AsyncMutex<()>> {
        let mut lanes = self.shared.lanes.lock().unwrap_or_else(|p| p.into_inner());
        lanes.entry(group).or_default().clone()
    }

    /// Whether a commit run of this group is in progress on this device.
    pub(crate) fn lane_busy(&self, group: GroupId) -> bool {
        self.lane_lock(group).try_lock().is_err()
    }

    /// Drive one commit through the group's canonical commit hub: settle
    /// what an earlier run journalled (step 0), then pull, build, journal,
    /// publish under the compare-and-set, and merge only once accepted; a
    /// lost race builds again, until the configured deadline. With no
    /// plan, only step 0 runs (a pull's way to settle a crash's journal).
    ///
    /// # Errors
    /// [`CommitError`]: `RecoveryRequired` on positive evidence that the
    /// group moved on, `TimedOut` at the deadline (a journalled commit
    /// stays for the next pull), the ledger's or MLS's refusal of the plan,
    /// the hub's refusal of the publish, the store's failure.
    ///
    /// # Cancel safety
    /// Not cancel safe in effect, though nothing is lost: a run abandoned
    /// after its journal is durable is settled by the next pull or commit.
    pub(crate) async fn run_lane(
        &self,
        group: GroupId,
        plan: Option<Plan>,
    ) -> Result<Option<LaneResult>, CommitError> {
        let lock = self.lane_lock(group);
        let _running = lock.lock().await;
        let deadline = Instant::now() + self.shared.config.commit_deadline;
        let start = match self.shared.records.journal(&group)? {
            None => Journal::Empty,
            Some(j) => match j.accepted {
                Some(seq) => Journal::Accepted { seq },
                None => Journal::Pending,
            },
        };
        let mut lane = Lane::new(start, deadline);
        let mut lost = None;
        let mut refusal = None;
        // The epoch the caller's commit was built at: it lands at the next
        // one, whatever other commits merged by the time we report.
        let mut built_epoch = None;
        // The digest of the last journalled commit this run sent.
        let mut sent: Option<[u8; 32]> = None;
        loop {
            if self.shared.shutdown.is_cancelled() {
                return Err(CommitError::Stopped);
            }
            let now = Instant::now();
            let action = lane.poll(now);
            match action {
                Action::Wait { until } => {
                    tokio::select! {
                        _ = self.shared.shutdown.cancelled() => return Err(CommitError::Stopped),
                        _ = tokio::time::sleep_until(until) => {}
                    }
                }
                Action::Pull => {
                    let r = match self.pull_inner(group, true).await {
                        Ok(Pulled::CaughtUp) => LanePulled::CaughtUp,
                        Ok(Pulled::Stranded) => LanePulled::Stranded,
                        Ok(Pulled::Removed) => return Err(CommitError::UnknownGroup(group)),
                        Err(e) if e.is_unknown_group() => {
                            return Err(CommitError::UnknownGroup(group))
                        }
                        Err(e) => {
                            tracing::debug!(%group, error = %e, "pull before a commit failed; retrying");
                            LanePulled::Failed
                        }
                    };
                    lane.on_pulled(Instant::now(), r);
                }
                Action::Build => {
                    let Some(plan) = &plan else {
                        return Ok(None);
                    };
                    match self.build_and_journal(group, plan).await? {
                        Step::Journalled(head) => lane.on_journalled(Instant::now(), head),
                        Step::Stranded => lane.on_stranded(),
                    }
                    if self.shared.faults.halt_after_journal.load(Ordering::SeqCst) {
                        return Err(CommitError::Stopped);
                    }
                }
                Action::Publish | Action::Replay => {
                    let replay = action == Action::Replay;
                    let Some(entry) = self.shared.records.journal(&group)? else {
                        // A pull cleared the journal meanwhile: it met our
                        // commit on the topic and merged it (an earlier send
                        // landed though its answer never came), or met
                        // another commit at our epoch and dropped ours.
                        lane.on_sent();
                        let answer = match sent.and_then(|d| self.merged_at(group, &d)) {
                            Some(seq) => Answer::Accepted { seq },
                            None => Answer::Lost,
                        };
                        lane.on_answer(Instant::now(), answer);
                        continue;
                    };
                    sent = Some(digest(&entry.payload));
                    if !replay {
                        built_epoch = Some(entry.epoch);
                    }
                    lane.on_sent();
                    let (answer, refused) = self.publish_journalled(group, &entry, replay).await?;
                    if refused.is_some() {
                        refusal = refused;
                    }
                    lane.on_answer(Instant::now(), answer);
                }
                Action::Settle { seq } => {
                    self.settle(group, seq).await?;
                    lane.on_settled();
                }
                Action::Discard => {
                    let dropped = self.discard(group).await?;
                    if lane.replaying() {
                        if let Some(j) = dropped {
                            lost = Some(self.report_lost(group, &j));
                        }
                    } else {
                        self.shared
                            .counters
                            .lost_races
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    lane.on_discarded();
                }
                Action::Done(f) => {
                    return match f {
                        Finish::Landed { seq, attempts } => {
                            let epoch = match built_epoch {
                                Some(e) => e + 1,
                                None => {
                                    let mut guard = self.shared.registry.lock(group).await;
                                    guard.read(|g| g.epoch().as_u64())?
                                }
                            };
                            self.shared.counters.commits.fetch_add(1, Ordering::Relaxed);
                            Ok(Some(LaneResult {
                                outcome: CommitReport {
                                    epoch,
                                    seq,
                                    attempts,
                                },
                                lost,
                                reenact: Vec::new(),
                            }))
                        }
                        Finish::Stranded => Err(CommitError::RecoveryRequired(group)),
                        Finish::TimedOut => Err(CommitError::TimedOut(group)),
                        Finish::Refused => {
                            let url = self
                                .shared
                                .records
                                .journal(&group)?
                                .map(|j| j.hub)
                                .unwrap_or_default();
                            Err(CommitError::HubRefused {
                                url,
                                source: refusal
                                    .take()
                                    .unwrap_or(crate::device::link::LinkError::Stopped),
                            })
                        }
                    };
                }
            }
        }
    }

    /// Build `plan` against the live handle and journal it with the pending
    /// commit in one durable batch, all under the group lock.
    async fn build_and_journal(&self, group: GroupId, plan: &Plan) -> Result<Step, CommitError> {
        let mut guard = self.shared.registry.lock(group).await;
        let rec = self.record(group)?;
        if rec.stranded || !rec.ledger_complete {
            return Ok(Step::Stranded);
        }
        let ledger = self.ledger_state(&rec)?;
        let me = &self.shared.identity;
        let epoch = guard.read(|g| g.epoch().as_u64())?;
        let built = guard.with(|g, p| build::build(g, p, me, &ledger, plan))?;
        let built = match built {
            Ok(b) => b,
            Err(e) => {
                guard.discard();
                return Err(e);
            }
        };
        let topic = topics::commit_topic(&rec.commit_seed);
        let cursor = rec.cursor();
        let entry = JournalEntry {
            op: plan.op,
            kind: plan.kind,
            hub: rec.commit_hub.clone(),
            epoch,
            publish_id: publish_id(&digest(&built.payload), &topic),
            // The pull read the topic to its end, so the cursor is the
            // head: a position, never the epoch.
            expected_head: if cursor == 0 {
                ExpectedHead::Empty
            } else {
                ExpectedHead::Seq(cursor)
            },
            payload: built.payload,
            roster: built.roster,
            subject: plan.add.first().map(|(d, _)| *d).or(plan.remove),
            welcome: built.welcome,
            entries: built.entries,
            accepted: None,
            redriven: plan.redriven,
            commit_seed: Some(rec.commit_seed),
        };
        let mut b = WriteBatch::new();
        self.shared.records.put_journal(&mut b, &group, &entry);
        guard.finish(b)?;
        Ok(Step::Journalled(cursor))
    }

    /// Send the journalled commit (or replay it) and map the hub's answer.
    async fn publish_journalled(
        &self,
        group: GroupId,
        entry: &JournalEntry,
        replay: bool,
    ) -> Result<(Answer, Option<crate::device::link::LinkError>), CommitError> {
        let rec = self.record(group)?;
        let writer = topics::commit_writer(&entry.commit_seed.unwrap_or(rec.commit_seed));
        let mut publish = Publish {
            topic: writer.topic().clone(),
            publish_id: entry.publish_id,
            class: RetentionClass::Log,
            expected_head: entry.expected_head,
            replay_only: replay,
            retention_secs: None,
            payload: entry.payload.clone(),
            writer: None,
        };
        writer.sign(&mut publish);
        let link = self.hub_link(&entry.hub);
        Ok(match link.publish(publish).await {
            Ok(PublishOutcome::Accepted { .. } | PublishOutcome::Duplicate { .. })
                if take_one(&self.shared.faults.lose_commit_answers) =>
            {
                // Test fault: the answer never came.
                (
                    Answer::Transient {
                        after: Some(crate::device::manager::LOST_ANSWER_RETRY),
                    },
                    None,
                )
            }
            Ok(PublishOutcome::Accepted { seq, .. } | PublishOutcome::Duplicate { seq }) => {
                (Answer::Accepted { seq }, None)
            }
            Ok(PublishOutcome::HeadMismatch { current })
                if self.shared.faults.merge_on_mismatch.load(Ordering::Relaxed) =>
            {
                // Test fault: adopt our commit though another won.
                (
                    Answer::Accepted {
                        seq: current.unwrap_or(0),
                    },
                    None,
                )
            }
            Ok(PublishOutcome::HeadMismatch { .. } | PublishOutcome::HistoryMissing) => {
                (Answer::Lost, None)
            }
            Err(e) => match send_failure(e.clone()) {
                SendFailure::Retry { after, .. } => (Answer::Transient { after }, None),
                SendFailure::Refused(_) => (Answer::Refused, Some(e)),
            },
        })
    }

    /// The hub accepted the journalled commit at `seq`: mark the journal
    /// accepted (durably), then merge, queue the Welcome and clear the
    /// journal in one batch. A pull that met the commit on the topic may
    /// have done so already.
    async fn settle(&self, group: GroupId, seq: u64) -> Result<(), CommitError> {
        let mut guard = self.shared.registry.lock(group).await;
        let Some(mut j) = self.shared.records.journal(&group)? else {
            return Ok(());
        };
        if j.accepted.is_none() {
            j.accepted = Some(seq);
            let mut b = WriteBatch::new();
            self.shared.records.put_journal(&mut b, &group, &j);
            guard.finish(b)?;
        }
        if self.shared.faults.halt_after_accept.load(Ordering::SeqCst) {
            return Err(CommitError::Stopped);
        }
        let mut rec = self.record(group)?;
        self.adopt_locked(&mut guard, &mut rec, &j, seq)
            .map_err(|e| e.into_commit_error(group))?;
        Ok(())
    }

    /// Where the commit with this digest landed, if this device merged it
    /// (`0` when the hub rewound since and its position is unknown).
    fn merged_at(&self, group: GroupId, commit: &[u8; 32]) -> Option<u64> {
        let rec = self.record(group).ok()?;
        let k = rec.merged.iter().find(|k| k.digest == *commit)?;
        Some(k.seq.unwrap_or(0))
    }

    /// Drop the pending commit and the journal together; answers what was
    /// dropped (nothing when a pull already did).
    async fn discard(&self, group: GroupId) -> Result<Option<JournalEntry>, CommitError> {
        let mut guard = self.shared.registry.lock(group).await;
        let Some(j) = self.shared.records.journal(&group)? else {
            return Ok(None);
        };
        guard
            .with(|g, p| g.clear_pending_commit(p.storage()))?
            .map_err(|e| {
                CommitError::Store(crate::device::registry::RegistryError::Store(e.to_string()))
            })?;
        let mut b = WriteBatch::new();
        self.shared.records.clear_journal(&mut b, &group);
        guard.finish(b)?;
        Ok(Some(j))
    }

    /// A commit journalled by an earlier run never landed: tell the app,
    /// and re-drive a lost ledger commit's entries once (those the ledger
    /// does not already hold: an entry is never appended twice).
    pub(crate) fn report_lost(&self, group: GroupId, j: &JournalEntry) -> LostCommit {
        let entries: Vec<Entry> = j
            .entries
            .iter()
            .filter_map(|e| Entry::decode(e).ok())
            .collect();
        let mut redriven = false;
        if j.kind == CommitKind::Ledger && !j.redriven {
            let held = self
                .record(group)
                .ok()
                .and_then(|rec| self.ledger_state(&rec).ok());
            let surviving: Vec<Entry> = entries
                .iter()
                .filter(|e| held.as_ref().is_none_or(|l| !l.contains(&e.id())))
                .cloned()
                .collect();
            if !surviving.is_empty() {
                redriven = true;
                let me = self.clone();
                let plan = REDRIVE(surviving, j.op);
                self.shared.tasks.spawn(async move {
                    if let Err(e) = me.run_lane(group, Some(plan)).await {
                        tracing::warn!(%group, error = %e, "re-driving a lost ledger commit failed");
                        me.emit(Event::CommitFailed {
                            group,
                            kind: CommitKind::Ledger,
                            error: e,
                        });
                    }
                });
            }
        }
        let lost = LostCommit {
            kind: j.kind,
            subject: j.subject,
            entries,
            redriven,
        };
        tracing::warn!(%group, kind = ?j.kind, redriven, "a journalled commit never landed");
        self.emit(Event::CommitLost {
            group,
            kind: j.kind,
            subject: j.subject,
            redriven,
        });
        lost
    }
}

/// Take one from a fault's countdown: true when it was above zero.
fn take_one(n: &std::sync::atomic::AtomicU64) -> bool {
    n.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_sub(1))
        .is_ok()
}
