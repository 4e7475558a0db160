//! Reading the commit topic: fetch pages with no lock held, then apply
//! each page under the group lock after checking that nobody else moved
//! the cursor meanwhile. Each frame is judged by [`classify`] on
//! authenticated evidence; a frame that could be applied goes through MLS
//! and the ledger checks; every skipped frame is an event with its reason.
//!
//! A local failure (the store, a merge that fails) is never a judgement on
//! the frame: the pull fails, the cursor stays before that frame, and the
//! next pull tries it again.

use super::build::{parse_enacted_aad, seal_key, CommitFrame};
use super::classify::{classify, trim_hides_commits, Facts, MergedThere, SkipReason, Verdict};
use super::{CommitError, JournalEntry};
use crate::device::events::Event;
use crate::device::frames::digest;
use crate::device::identity::{credential_matches_key, device_id_of};
use crate::device::ledger::{self, Entry, EntryType, GroupExt, LedgerState};
use crate::device::link::{HubLink, LinkError};
use crate::device::manager::GroupPeerManager;
use crate::device::records::{GroupId, GroupRecord, MergedCommit};
use crate::device::registry::{GroupGuard, RegistryError};
use crate::device::topics;
use crate::kv::{KvError, WriteBatch};
use crate::wire::{DeviceId, LogFrame, TopicId};
use openmls::prelude::tls_codec::Deserialize as _;
use openmls::prelude::*;
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;

/// How far ahead of our clock another member's entry may pull our hybrid
/// logical clock.
const HLC_MAX_AHEAD_MS: u64 = 60_000;

/// Frames fetched per page.
const PAGE: u32 = 100;

/// How often a caught-up pull checks the group's former commit logs
/// (`check_former_logs`).
const FORMER_CHECK_MS: u64 = 10_000;

/// How far the hub's clock and this device's may disagree when telling
/// whether a message was sent after a commit (see
/// `note_sends_left_behind`).
const SEND_CLOCK_SKEW_MS: u64 = 2_000;

/// How stale `GroupRecord::caught_up_at_ms` may be: it is written at most
/// once per this interval.
const CAUGHT_UP_GRANULARITY_MS: u64 = 60_000;

/// Where a pull ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pulled {
    /// Read to the end of the commit hub's topic.
    CaughtUp,
    /// Positive evidence that the group moved on without us.
    Stranded,
    /// A commit removed this device; its state there is gone.
    Removed,
}

/// Why a pull failed. Nothing past the failing frame was applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PullError {
    /// The device is not in that group.
    #[error("not a member of group {0}")]
    UnknownGroup(GroupId),
    /// The commit hub could not be read.
    #[error("hub {url}: {source}")]
    Hub {
        /// The hub.
        url: String,
        /// What the link said.
        #[source]
        source: LinkError,
    },
    /// The device's store failed, or a merge failed locally.
    #[error("device store: {0}")]
    Store(#[source] RegistryError),
    /// Settling an earlier run's journal failed.
    #[error(transparent)]
    Commit(#[from] CommitError),
}

impl PullError {
    /// Whether the group is gone.
    pub fn is_unknown_group(&self) -> bool {
        matches!(
            self,
            PullError::UnknownGroup(_) | PullError::Commit(CommitError::UnknownGroup(_))
        )
    }

    /// The same failure as a commit's.
    pub(crate) fn into_commit_error(self, group: GroupId) -> CommitError {
        match self {
            PullError::UnknownGroup(g) => CommitError::UnknownGroup(g),
            PullError::Hub { .. } => CommitError::TimedOut(group),
            PullError::Store(e) => CommitError::Store(e),
            PullError::Commit(c) => c,
        }
    }
}

impl From<RegistryError> for PullError {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::UnknownGroup(g) => PullError::UnknownGroup(g),
            other => PullError::Store(other),
        }
    }
}

impl From<KvError> for PullError {
    fn from(e: KvError) -> Self {
        PullError::Store(RegistryError::from(e))
    }
}

impl From<crate::device::DeviceError> for PullError {
    fn from(e: crate::device::DeviceError) -> Self {
        match e {
            crate::device::DeviceError::UnknownGroup(g) => PullError::UnknownGroup(g),
            other => PullError::Store(RegistryError::Store(other.to_string())),
        }
    }
}

/// What applying one frame did to the pull.
enum Applied {
    /// Go on with the next frame.
    Next,
    /// The commit hub changed: read the new one.
    HubChanged,
    /// Stop: stranded.
    Stranded,
    /// Stop: this device was removed.
    Removed,
}

/// The sentinel commit hub of a group with no hub bound: each device's own
/// in-process hub. Every member computes the same string; each reaches its
/// own loopback hub through it.
pub const LOOPBACK_HUB: &str = "loopback://local";

/// The group's canonical commit hub as its ledger names it: the
/// `hub.commit` hub; with none, the bound hub whose URL sorts first (with a
/// warning); with no hub bound, the loopback hub. A pure function of the
/// ledger, so every member computes the same answer.
pub fn select_commit_hub(ledger: &LedgerState) -> String {
    if let Some(h) = &ledger.commit_hub {
        return h.clone();
    }
    if let Some(first) = ledger.hubs.iter().min() {
        tracing::warn!(group = %ledger.group, hub = %first, "no hub.commit entry: committing through the first hub by URL");
        return first.clone();
    }
    LOOPBACK_HUB.to_string()
}

impl GroupPeerManager {
    /// Pull the group's commit topic to its end and apply it. Answers the
    /// hub's head as last read.
    ///
    /// # Errors
    /// `UnknownGroup`, the hub's failure, or the store's.
    ///
    /// Every failure but `UnknownGroup` is also counted in
    /// [`DeviceStats::pull_failures`](crate::device::DeviceStats): most
    /// pulls run in the background (after a reconnect, on a push, on the
    /// periodic tick), where the next one retries and nobody else sees
    /// the error.
    pub async fn pull(&self, group: GroupId) -> Result<(), PullError> {
        let result = self.pull_inner(group, false).await.map(|_| ());
        if let Err(e) = &result {
            if !e.is_unknown_group() {
                self.shared
                    .counters
                    .pull_failures
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        result
    }

    /// The ledger this device holds for a group, folded by full replay.
    ///
    /// # Errors
    /// The store's error; a stored ledger that does not fold is `Corrupt`.
    pub(crate) fn ledger_state(&self, rec: &GroupRecord) -> Result<LedgerState, KvError> {
        let entries = self.ledger_entries(rec.id)?;
        LedgerState::fold(rec.id, &entries).map_err(|e| KvError::Corrupt {
            key: format!("ledger of {}", rec.id),
            reason: e.to_string(),
        })
    }

    /// The stored ledger entries of a group, decoded, in enactment order.
    ///
    /// # Errors
    /// The store's error; an undecodable entry is `Corrupt`.
    pub(crate) fn ledger_entries(&self, group: GroupId) -> Result<Vec<Entry>, KvError> {
        self.shared
            .records
            .ledger(&group)?
            .iter()
            .map(|b| {
                Entry::decode(b).map_err(|e| KvError::Corrupt {
                    key: format!("ledger entry of {group}"),
                    reason: e.to_string(),
                })
            })
            .collect()
    }

    pub(crate) async fn pull_inner(
        &self,
        group: GroupId,
        from_lane: bool,
    ) -> Result<Pulled, PullError> {
        if self.shared.faults.no_pull.load(Ordering::Relaxed) {
            return Ok(Pulled::CaughtUp);
        }
        if !from_lane && !self.lane_busy(group) && self.shared.records.journal(&group)?.is_some() {
            // Step 0 is the lane's: a journal an earlier run left is
            // settled (adopted, or replayed and judged) before anything else.
            return match Box::pin(self.run_lane(group, None)).await {
                Ok(_) => Ok(Pulled::CaughtUp),
                Err(CommitError::RecoveryRequired(_)) => Ok(Pulled::Stranded),
                Err(CommitError::UnknownGroup(g)) => Err(PullError::UnknownGroup(g)),
                Err(e) => Err(PullError::Commit(e)),
            };
        }
        // Whether this pull gave a log of junk back its commits already: a
        // give-back the hub answers as a duplicate (the frame was there
        // once, and trimmed since) changes nothing on the log, so a second
        // try would only loop (sim seed 1145).
        let mut gave_back_after_junk = false;
        loop {
            let seen = self.record(group)?;
            if seen.stranded {
                return Ok(Pulled::Stranded);
            }
            let hub = seen.commit_hub.clone();
            let cursor = seen.cursor();
            let link = self.hub_link(&hub);
            let topic = topics::commit_topic(&seen.commit_seed);
            // Read from the frame at our cursor when we know its digest: the
            // hub must still hold that very frame there.
            let verify = match seen.cursor_digests.get(&hub) {
                Some(d) if cursor > 0 => Some(*d),
                _ => None,
            };
            let after = if verify.is_some() { cursor - 1 } else { cursor };
            let mut f = link
                .fetch(&topic, after, PAGE)
                .await
                .map_err(|source| PullError::Hub {
                    url: hub.clone(),
                    source,
                })?;
            // The fault holds for a pull already in flight when it was set:
            // nothing fetched after that is applied.
            if self.shared.faults.no_pull.load(Ordering::SeqCst) {
                return Ok(Pulled::CaughtUp);
            }
            // The store the answer came from: a cursor read on another
            // store of this hub says nothing about this one.
            let store = *link.store_id().borrow();
            if let Some(store) = store {
                match seen.cursor_stores.get(&hub) {
                    Some(known) if *known != store => {
                        self.rewound(group, &hub).await?;
                        self.note_cursor_store(group, &hub, store).await?;
                        continue;
                    }
                    Some(_) => {}
                    None => {
                        self.note_cursor_store(group, &hub, store).await?;
                        continue;
                    }
                }
            }
            if f.head.unwrap_or(0) < cursor {
                // The hub holds less than we already read: it lost or
                // restored its store. Never compare-and-set against it;
                // read it again from the start.
                self.rewound(group, &hub).await?;
                continue;
            }
            if let Some(d) = verify {
                match f.messages.first() {
                    Some(first) if first.seq == cursor => {
                        if digest(&first.payload) != d {
                            // Another frame where ours was: restored from
                            // an older copy, and written past us again.
                            self.rewound(group, &hub).await?;
                            continue;
                        }
                        f.messages.remove(0);
                        // The frame at the cursor was there: a trim that
                        // took only older frames is no gap for us.
                        f.gap = false;
                    }
                    _ if f.oldest.is_some_and(|o| o > cursor) => {
                        // Our frame was trimmed away: nothing to compare
                        // with; read on from the cursor as before.
                        let mut rec = self.record(group)?;
                        let mut guard = self.shared.registry.lock(group).await;
                        rec.cursor_digests.remove(&hub);
                        self.save_record(&mut guard, &rec)?;
                        continue;
                    }
                    _ => {
                        self.rewound(group, &hub).await?;
                        continue;
                    }
                }
            }
            if f.gap {
                // Only frames members published: a stranger (a removed
                // member, say) replaying a commit this device merged puts a
                // copy of it after the commits that were trimmed, and proves
                // nothing about them (sim seed 1282).
                let members = {
                    let mut guard = self.shared.registry.lock(group).await;
                    self.member_set(&mut guard).map_err(store_err)?
                };
                let held: Vec<[u8; 32]> = f
                    .messages
                    .iter()
                    .filter(|m| members.contains(&m.sender))
                    .map(|m| digest(&m.payload))
                    .collect();
                let merged: Vec<[u8; 32]> = seen.merged.iter().map(|k| k.digest).collect();
                f.gap = trim_hides_commits(held.iter(), &merged);
                // The window the hub kept holds nothing a member wrote
                // (frames of strangers or former members pushed the group's
                // commits out of a shallow log), and the hub lost commits
                // this device merged (a rewind): no member's frame says the
                // group moved on. Give the hub back what it lost, so the log
                // holds the group's place again, and read on. Stranding
                // here strands every member alike, and a stranded member
                // answers no rejoin (sim seed 1068). Should a commit this
                // device never read hide in the trim after all, its author
                // finds ours in its place and rejoins as a fork's loser.
                if f.gap && held.is_empty() && !gave_back_after_junk {
                    let lost_here = seen.merged.iter().any(|k| is_lost(k, &hub));
                    if lost_here && self.heal(group, &hub, &link, f.head).await? {
                        gave_back_after_junk = true;
                        continue;
                    }
                    if !lost_here {
                        // No rewind either: the hub trimmed past our cursor
                        // because others' frames filled its window, and
                        // what it trimmed is not known. Every member at our
                        // epoch finds the same and, stranding, would answer
                        // nobody's rejoin (sim seed 921). The members are
                        // asked their epoch instead (the probe strands this
                        // device if one is further on), and the pull reads
                        // on past the others' frames.
                        tracing::info!(%group, hub, cursor, "the hub trimmed past our cursor and kept only others' frames: asking the members their epoch");
                        let mut guard = self.shared.registry.lock(group).await;
                        let mut rec = self.record(group)?;
                        rec.probe_owed = true;
                        self.save_record(&mut guard, &rec)?;
                        drop(guard);
                        self.probe_in_background(group);
                        f.gap = false;
                    }
                }
            }
            if f.gap {
                let mut guard = self.shared.registry.lock(group).await;
                let mut rec = self.record(group)?;
                if rec.commit_hub == hub && rec.cursor() == cursor {
                    tracing::warn!(%group, hub, cursor, "stranded: the hub trimmed commits this device had not read");
                    self.strand(&mut guard, &mut rec)?;
                }
                return Ok(Pulled::Stranded);
            }
            if f.messages.is_empty() {
                let lost_here = seen.merged.iter().any(|k| is_lost(k, &hub));
                if lost_here && self.heal(group, &hub, &link, f.head).await? {
                    continue;
                }
                let now = self.shared.clock.now_ms();
                if now.saturating_sub(seen.caught_up_at_ms) >= CAUGHT_UP_GRANULARITY_MS {
                    let mut guard = self.shared.registry.lock(group).await;
                    let mut rec = self.record(group)?;
                    rec.caught_up_at_ms = now;
                    self.save_record(&mut guard, &rec)?;
                }
                if seen.lost_from.is_some() && !seen.stranded {
                    // Caught up: what this device sent on a lost branch, or
                    // too far behind, can now be sent in the group's epoch.
                    self.send_lost_again_in_background(group);
                }
                if !from_lane {
                    if let Err(e) = self.check_former_logs(group).await {
                        // Checked again at the next caught-up pull after
                        // the interval; the pull itself succeeded.
                        tracing::debug!(%group, error = %e, "checking former commit logs failed");
                    }
                }
                return Ok(Pulled::CaughtUp);
            }
            // Read the current epoch's messages before moving on: an epoch
            // left far behind can no longer be decrypted.
            if let Some(app) = seen.app_topics.first() {
                if let Err(e) = self.catch_up_app(group, &hub, &link, app).await {
                    tracing::debug!(%group, error = %e, "app catch-up before commits failed");
                }
            }
            let mut guard = self.shared.registry.lock(group).await;
            let mut rec = self.record(group)?;
            if rec.commit_hub != hub
                || rec.cursor() != cursor
                || rec.commit_seed != seen.commit_seed
            {
                continue;
            }
            let seed = rec.commit_seed;
            // The page's merges share one flush: none of them is heard of
            // outside the device before it (see `GroupGuard::defer_flush`),
            // and a crash before it reads them again from the log.
            guard.defer_flush();
            let ended = async {
                for m in &f.messages {
                    if rec.commit_seed != seed {
                        // A roster change moved the log to a new topic:
                        // what follows on the old one lost the race for
                        // that epoch or is a stranger's; the loop reads the
                        // new topic.
                        break;
                    }
                    match self.apply_frame(&mut guard, &mut rec, &hub, m).await? {
                        Applied::Next => {}
                        Applied::HubChanged => break,
                        Applied::Stranded => return Ok(Some(Pulled::Stranded)),
                        Applied::Removed => return Ok(Some(Pulled::Removed)),
                    }
                }
                Ok::<_, PullError>(None)
            }
            .await;
            guard.end_deferral()?;
            if let Some(p) = ended? {
                return Ok(p);
            }
        }
    }

    /// Mark the group stranded (once) and say so.
    /// Strand `group` here (see [`Self::strand`]).
    ///
    /// # Errors
    /// `UnknownGroup`, or the store's.
    pub(crate) async fn strand_group(
        &self,
        group: GroupId,
    ) -> Result<(), crate::device::DeviceError> {
        let mut guard = self.shared.registry.lock(group).await;
        let mut rec = self.record(group)?;
        self.strand(&mut guard, &mut rec)
            .map_err(|e| crate::device::DeviceError::Store(e.to_string()))
    }

    pub(crate) fn strand(
        &self,
        guard: &mut GroupGuard,
        rec: &mut GroupRecord,
    ) -> Result<(), PullError> {
        if !rec.stranded {
            rec.stranded = true;
            // What this device sent since it last knew itself at the log's
            // end may be in an epoch the group left too far behind to read
            // (it does not know how far): sent again after the rejoin,
            // receivers that did read it drop the copy by its id.
            let since = rec.caught_up_at_ms;
            if let Some(e) = self
                .shared
                .records
                .first_sent_behind(&rec.id, u64::MAX, since)?
            {
                rec.note_lost_from(e);
            }
            self.save_record(guard, rec)?;
            self.emit(Event::Stranded { group: rec.id });
            self.heal_in_background(rec.id);
        }
        Ok(())
    }

    /// Give a rewound hub back the commits this device merged that its log
    /// lost, in epoch order, each on the topic it was on, under the
    /// compare-and-set and the publish id its committer used, so members
    /// that had not read them before the rewind still can, and nobody
    /// builds another commit at their epoch. Several members healing at
    /// once is harmless: the same frame under the same id answers
    /// `duplicate`. A different commit already at one of those positions
    /// means the group went the other way: on the current topic the next
    /// pull judges it (a fork this device lost); on an older topic (one a
    /// roster change left) this device gives up on it. `head` is the
    /// current topic's. Answers whether anything was published.
    async fn heal(
        &self,
        group: GroupId,
        hub: &str,
        link: &HubLink,
        head: Option<u64>,
    ) -> Result<bool, PullError> {
        let rec = self.record(group)?;
        let mut seeds: Vec<[u8; 32]> = Vec::new();
        for k in rec.merged.iter().filter(|k| is_lost(k, hub)) {
            if let Some(s) = k.commit_seed {
                if !seeds.contains(&s) {
                    seeds.push(s);
                }
            }
        }
        let mut healed = false;
        // Positions learned on older topics (the pull never reads them
        // again) and frames given up there.
        let mut placed: Vec<(u64, Option<u64>)> = Vec::new();
        for seed in seeds {
            let writer = topics::commit_writer(&seed);
            let topic = writer.topic();
            // The log the pull reads: its head is the caller's.
            let current = hub == rec.commit_hub && seed == rec.commit_seed;
            let on_topic = |k: &&MergedCommit| k.hub == hub && k.commit_seed == Some(seed);
            // Only what comes after everything the log still holds of ours.
            let kept = rec
                .merged
                .iter()
                .filter(on_topic)
                .filter(|k| k.seq.is_some())
                .map(|k| k.epoch)
                .max();
            let mut lost: Vec<&MergedCommit> = rec
                .merged
                .iter()
                .filter(on_topic)
                .filter(|k| is_lost(k, hub) && kept.is_none_or(|e| k.epoch > e))
                .collect();
            lost.sort_by_key(|k| k.epoch);
            let mut head = if current {
                head
            } else {
                link.fetch(topic, 0, 1)
                    .await
                    .map_err(|source| PullError::Hub {
                        url: hub.to_string(),
                        source,
                    })?
                    .head
            };
            for k in lost {
                // On a log no pull reads, nobody has judged what was
                // written since the rewind: a member's other commit at this
                // epoch there won it (the log is what the group goes by),
                // and giving ours back after it would leave two commits of
                // one epoch on the log.
                if !current {
                    match self.place_on(group, link, topic, k, &rec).await? {
                        Place::Free => {}
                        Place::Taken { by } => {
                            self.strand_lost_fork(group, k, by).await?;
                            return Ok(healed);
                        }
                        // Ours of the epoch before is not there: after
                        // another member's commit of that epoch, ours would
                        // read as a commit from ahead to every reader there
                        // (sim seed 632). That loss is judged on its own.
                        Place::Behind | Place::Left => break,
                    }
                }
                let mut publish = crate::wire::Publish {
                    topic: topic.clone(),
                    publish_id: crate::device::frames::publish_id(&k.digest, topic),
                    class: crate::wire::RetentionClass::Log,
                    expected_head: match head {
                        Some(h) => crate::wire::ExpectedHead::Seq(h),
                        None => crate::wire::ExpectedHead::Empty,
                    },
                    replay_only: false,
                    retention_secs: None,
                    payload: k.payload.clone(),
                    writer: None,
                };
                writer.sign(&mut publish);
                let outcome = link
                    .publish(publish)
                    .await
                    .map_err(|source| PullError::Hub {
                        url: hub.to_string(),
                        source,
                    })?;
                match outcome {
                    crate::wire::PublishOutcome::Accepted { seq, .. }
                    | crate::wire::PublishOutcome::Duplicate { seq } => {
                        tracing::info!(%group, hub, epoch = k.epoch, seq, "gave a rewound hub back a commit it lost");
                        // A duplicate may sit below frames others wrote since.
                        head = head.max(Some(seq));
                        healed = true;
                        if !current {
                            placed.push((k.epoch, Some(seq)));
                        }
                    }
                    crate::wire::PublishOutcome::HeadMismatch { .. }
                    | crate::wire::PublishOutcome::HistoryMissing => {
                        if !current {
                            // No later pull reads this log to judge what
                            // took the place: judge it here.
                            if let Place::Taken { by } =
                                self.place_on(group, link, topic, k, &rec).await?
                            {
                                self.strand_lost_fork(group, k, by).await?;
                                return Ok(healed);
                            }
                            placed.push((k.epoch, None));
                        }
                        break;
                    }
                }
            }
        }
        if !placed.is_empty() {
            let mut guard = self.shared.registry.lock(group).await;
            let mut rec = self.record(group)?;
            for k in rec.merged.iter_mut().filter(|k| k.hub == hub) {
                match placed.iter().find(|(e, _)| *e == k.epoch) {
                    Some((_, Some(seq))) => k.seq = Some(*seq),
                    Some((_, None)) => k.payload = Vec::new(),
                    None => {}
                }
            }
            self.save_record(&mut guard, &rec)?;
        }
        Ok(healed)
    }

    /// This device's commit `lost` lost its place to a member's, written
    /// there by `by`: strand, and note that its branch from the next epoch
    /// on is lost (what it encrypted there, and the commit seeds it drew
    /// there, which its rejoin request names, with `by`, so the members
    /// still on that branch learn it).
    async fn strand_lost_fork(
        &self,
        group: GroupId,
        lost: &MergedCommit,
        by: DeviceId,
    ) -> Result<(), PullError> {
        tracing::warn!(%group, epoch = lost.epoch, by = %by, "stranded: a member's commit took the place of this device's on a former log");
        let mut guard = self.shared.registry.lock(group).await;
        let mut rec = self.record(group)?;
        rec.note_lost_branch(lost);
        rec.lost_to = Some(by);
        self.save_record(&mut guard, &rec)?;
        self.strand(&mut guard, &mut rec)
    }

    /// Where `ours` would go on `topic` (a log the pull no longer reads):
    /// [`Place::Taken`] when a member's different commit holds its epoch
    /// (the group went the other way there while the hub had lost ours, so
    /// ours lost that epoch), [`Place::Behind`] when the last member commit
    /// there is of the epoch before and not the one `rec` merged at that
    /// epoch (ours of that epoch lost its place), else [`Place::Free`].
    async fn place_on(
        &self,
        group: GroupId,
        link: &HubLink,
        topic: &TopicId,
        ours: &MergedCommit,
        rec: &GroupRecord,
    ) -> Result<Place, PullError> {
        let f = link
            .fetch(topic, 0, PAGE)
            .await
            .map_err(|source| PullError::Hub {
                url: ours.hub.clone(),
                source,
            })?;
        let members = {
            let mut guard = self.shared.registry.lock(group).await;
            self.member_set(&mut guard)?
        };
        let mut last: Option<(u64, [u8; 32])> = None;
        for m in &f.messages {
            let d = digest(&m.payload);
            if d == ours.digest {
                return Ok(Place::Free);
            }
            let Some(pm) = protocol_message(&m.payload) else {
                continue;
            };
            if pm.group_id().as_slice() != group.0 || !members.contains(&m.sender) {
                continue;
            }
            if pm.epoch().as_u64() == ours.epoch {
                if rec.came_over(&m.sender, ours.epoch) {
                    tracing::info!(%group, hub = ours.hub, epoch = ours.epoch, seq = m.seq, "a rewound log holds another member's commit where ours was, but its writer has since committed on our branch");
                    return Ok(Place::Left);
                }
                tracing::warn!(%group, hub = ours.hub, epoch = ours.epoch, seq = m.seq, "a rewound log holds another member's commit where ours was: ours lost");
                return Ok(Place::Taken { by: m.sender });
            }
            last = Some((pm.epoch().as_u64(), d));
        }
        match last {
            Some((e, d))
                if e + 1 == ours.epoch
                    && rec.merged.iter().any(|k| k.epoch == e && k.digest != d) =>
            {
                tracing::warn!(%group, hub = ours.hub, epoch = ours.epoch, "a rewound log holds another member's commit before where ours was: not given back");
                Ok(Place::Behind)
            }
            _ => Ok(Place::Free),
        }
    }

    /// The logs this device committed on before the current one: a former
    /// commit hub (the group moved its commits away) or a former commit
    /// topic (a roster change moved the log). A member that has not read
    /// the commit that moved the group still reads there and learns of the
    /// move from that log only, but the pull never reads it again, so a
    /// rewind there would go unnoticed. At most every
    /// [`FORMER_CHECK_MS`], check that each such log still holds the last
    /// commit this device merged on it (while its frame is kept); one that
    /// lost it is given back what it lost ([`Self::heal`]), or, if a
    /// member's other commit took that epoch there, this device lost it
    /// and is stranded. Only over links that are up.
    pub(crate) async fn check_former_logs(&self, group: GroupId) -> Result<(), PullError> {
        let now = self.shared.clock.now_ms();
        {
            let mut checked = crate::device::manager::lock(&self.shared.former_checked);
            match checked.get(&group) {
                Some(t) if now < t.saturating_add(FORMER_CHECK_MS) => return Ok(()),
                _ => {
                    checked.insert(group, now);
                }
            }
        }
        self.check_former_logs_now(group).await
    }

    /// Read `group`'s log to its end and check its former logs now, before
    /// telling another device where the group is (a rejoin answer, an
    /// epoch status): a member whose commit lost its place on a rewound
    /// former log is on a branch the group left, and would lead the asker
    /// onto it. Failures are only logged: the answer then goes by what
    /// this device knows, and the regular checks go on.
    pub(crate) async fn read_before_answering(&self, group: GroupId) {
        if let Err(e) = self.pull(group).await {
            tracing::debug!(%group, error = %e, "pull before an answer failed");
        }
        if let Err(e) = self.check_former_logs_now(group).await {
            tracing::debug!(%group, error = %e, "former-log check before an answer failed");
        }
    }

    /// [`Self::check_former_logs`] without its interval.
    async fn check_former_logs_now(&self, group: GroupId) -> Result<(), PullError> {
        let rec = self.record(group)?;
        if rec.stranded {
            return Ok(());
        }
        let mut last: Vec<&MergedCommit> = Vec::new();
        for k in rec.merged.iter().filter(|k| {
            k.hub != LOOPBACK_HUB
                && !k.payload.is_empty()
                && k.commit_seed.is_some()
                && !(k.hub == rec.commit_hub && k.commit_seed == Some(rec.commit_seed))
        }) {
            match last
                .iter_mut()
                .find(|f| f.hub == k.hub && f.commit_seed == k.commit_seed)
            {
                Some(f) if f.epoch >= k.epoch => {}
                Some(f) => *f = k,
                None => last.push(k),
            }
        }
        for k in last {
            let Some(seed) = k.commit_seed else {
                continue;
            };
            // Only over a link that exists and is up: checking must not
            // bring back a link to a hub the group no longer uses.
            let link = crate::device::manager::lock(&self.shared.links)
                .get(&k.hub)
                .cloned();
            let Some(link) = link.filter(HubLink::is_connected) else {
                continue;
            };
            let Some(seq) = k.seq else {
                // Known lost already (the hub's store changed under it):
                // give it back. A member that has not read the move still
                // reads there, and learns of it from this log only.
                self.heal(group, &k.hub, &link, None).await?;
                continue;
            };
            let topic = topics::commit_topic(&seed);
            let f = link
                .fetch(&topic, seq.saturating_sub(1), 1)
                .await
                .map_err(|source| PullError::Hub {
                    url: k.hub.clone(),
                    source,
                })?;
            let held = match f.messages.first() {
                Some(m) if m.seq == seq => digest(&m.payload) == k.digest,
                // Trimmed away: no evidence either way.
                _ => f.oldest.is_some_and(|o| o > seq),
            };
            if held {
                continue;
            }
            // That hub lost or restored its store: its app logs may have
            // lost what this device read there too, so it is read again
            // (the current commit log included, which costs a re-read).
            self.rewound(group, &k.hub).await?;
            self.heal(group, &k.hub, &link, None).await?;
        }
        Ok(())
    }

    /// Record which store of `hub` the group's cursor there is read from.
    async fn note_cursor_store(
        &self,
        group: GroupId,
        hub: &str,
        store: crate::wire::StoreId,
    ) -> Result<(), PullError> {
        let mut guard = self.shared.registry.lock(group).await;
        let mut rec = self.record(group)?;
        rec.cursor_stores.insert(hub.to_string(), store);
        self.save_record(&mut guard, &rec)?;
        Ok(())
    }

    /// `hub` holds less than this device read from it: it rewound.
    pub(crate) async fn rewound(&self, group: GroupId, hub: &str) -> Result<(), PullError> {
        let mut guard = self.shared.registry.lock(group).await;
        let mut rec = self.record(group)?;
        rec.rewind(hub);
        // The rewound log may have lost commits nobody can give back: the
        // group could be further on than anything this log will show. The
        // members are asked (`probe`), below and, if that is cut short,
        // when the device next starts.
        let probe = hub == rec.commit_hub && !rec.stranded;
        rec.probe_owed |= probe;
        let mut b = WriteBatch::new();
        self.shared.records.reset_app_cursors(&mut b, &group, hub)?;
        // Welcomes this device sent through that hub may be gone with the
        // store, and a joiner cut off from it until now never read them:
        // post again each one whose joiner is still a member, however many
        // commits ago it was invited (the same publish id; a joiner that
        // already joined ignores a repeat, and one that joins from an old
        // Welcome catches up or rejoins). Those of former members go.
        let kept = self
            .kept_welcomes(&mut guard, &mut b, group)
            .map_err(store_err)?;
        for w in kept {
            self.shared
                .outbox
                .stage(&mut b, hub, &w)
                .map_err(store_err)?;
        }
        self.shared.records.put_group(&mut b, &rec);
        guard.finish(b)?;
        self.shared.outbox.wake();
        // Subscriptions went with the store too: the link makes them again,
        // but what was published before that is only in the logs. The peer
        // there reads the group's app topics again from the start (holding
        // their pushes meanwhile, as when it subscribed).
        if let Some(peer) =
            crate::device::manager::lock(&self.shared.peers).get(&(group, hub.to_string()))
        {
            peer.recatch_app_logs();
        }
        tracing::warn!(%group, hub, "hub rewound: reading it again from the start");
        self.emit(Event::HubRewound {
            url: hub.to_string(),
        });
        // The hub may have lost commits of former logs there too, which a
        // member that joined on one of them (its cursor there is 0, so it
        // sees no rewind) would otherwise build on: check them at the next
        // caught-up pull, not 10 s later.
        crate::device::manager::lock(&self.shared.former_checked).remove(&group);
        if probe {
            self.probe_in_background(group);
        }
        // A rewind is the hub's, not the group's: every other group there
        // may have lost Welcomes this device sent, and a member that gives
        // a lost commit back first hides the rewind from the inviter's own
        // checks (sim seed 718). Post them again there too, and check those
        // groups' former logs at their next pull.
        let me = self.clone();
        let hub = hub.to_string();
        self.shared.tasks.spawn(async move {
            if let Err(e) = me.repost_welcomes_on(&hub, group).await {
                tracing::warn!(hub, error = %e, "posting kept Welcomes again after a rewind failed");
                me.shared.counters.control_failures.fetch_add(1, Ordering::Relaxed);
            }
        });
        Ok(())
    }

    /// Post again on `hub` the Welcomes this device keeps for the current
    /// members of each group bound there but `except` (a hub that still
    /// has one answers `Duplicate`), and have those groups' former logs
    /// checked at their next pull.
    async fn repost_welcomes_on(&self, hub: &str, except: GroupId) -> Result<(), PullError> {
        let groups = self.shared.records.groups().map_err(store_err)?;
        for rec in groups
            .iter()
            .filter(|r| r.id != except && r.routes().iter().any(|h| h == hub))
        {
            crate::device::manager::lock(&self.shared.former_checked).remove(&rec.id);
            let mut guard = self.shared.registry.lock(rec.id).await;
            let mut b = WriteBatch::new();
            let kept = self
                .kept_welcomes(&mut guard, &mut b, rec.id)
                .map_err(store_err)?;
            for w in &kept {
                self.shared
                    .outbox
                    .stage(&mut b, hub, w)
                    .map_err(store_err)?;
            }
            guard.finish(b)?;
        }
        self.shared.outbox.wake();
        Ok(())
    }

    /// Judge and apply one frame, with the group lock held.
    async fn apply_frame(
        &self,
        guard: &mut GroupGuard,
        rec: &mut GroupRecord,
        hub: &str,
        m: &LogFrame,
    ) -> Result<Applied, PullError> {
        let journal = self.shared.records.journal(&rec.id)?;
        let ours = guard.read(|g| g.epoch().as_u64())?;
        let members = self.member_set(guard)?;
        let frame = CommitFrame::parse(&m.payload);
        let pm = protocol_message(&m.payload);
        let d = digest(&m.payload);
        let epoch = pm.as_ref().map(|p| p.epoch().as_u64());
        let facts = Facts {
            epoch,
            other_group: pm
                .as_ref()
                .is_some_and(|p| p.group_id().as_slice() != rec.id.0),
            publisher_is_member: members.contains(&m.sender),
            publisher_is_me: m.sender == self.shared.identity.id(),
            is_journalled: journal.as_ref().is_some_and(|j| j.payload == m.payload),
            merged_here: epoch.and_then(|e| {
                rec.merged
                    .iter()
                    .find(|k| k.epoch == e)
                    .map(|k| MergedThere {
                        same_commit: k.digest == d,
                        // On the log we read, a different commit at an epoch we
                        // merged comes first when ours sits later, or is not
                        // there at all (the hub rewound and lost it: the log
                        // is what the group goes by).
                        frame_is_earlier: k.hub == hub && k.seq.is_none_or(|s| m.seq < s),
                    })
            }),
        };
        // Meeting a commit we merged again (a rewound log re-read): learn
        // where it sits on this store.
        if let Some(k) = rec
            .merged
            .iter_mut()
            .find(|k| k.digest == d && k.hub == hub && k.seq.is_none())
        {
            k.seq = Some(m.seq);
        }
        let verdict = classify(&facts, ours);
        match verdict {
            Verdict::Adopt => {
                let Some(j) = journal else {
                    return Ok(Applied::Next);
                };
                let before = rec.commit_hub.clone();
                self.adopt_locked(guard, rec, &j, m.seq)?;
                Ok(self.after_apply(rec, &before))
            }
            Verdict::Skip(reason) => {
                self.skip(guard, rec, hub, m, reason)?;
                Ok(Applied::Next)
            }
            Verdict::ForkLost | Verdict::Ahead | Verdict::OwnUnmerged => {
                tracing::warn!(group = %rec.id, seq = m.seq, ?verdict, "stranded");
                if let (Verdict::ForkLost, Some(e)) = (&verdict, facts.epoch) {
                    // The member's commit framed in `e` took the place of
                    // ours: what this device encrypted from `e + 1` on,
                    // the group cannot read.
                    rec.note_lost_from(e + 1);
                    self.save_record(guard, rec)?;
                }
                self.strand(guard, rec)?;
                Ok(Applied::Stranded)
            }
            Verdict::Process => {
                let Some(pm) = pm else {
                    return Ok(Applied::Next);
                };
                let sealed = frame.map(|f| f.sealed.to_vec()).unwrap_or_default();
                self.process_commit(guard, rec, hub, m, pm, &sealed, journal)
                    .await
            }
        }
    }

    /// Move past a frame without applying it, and say why.
    fn skip(
        &self,
        guard: &mut GroupGuard,
        rec: &mut GroupRecord,
        hub: &str,
        m: &LogFrame,
        reason: SkipReason,
    ) -> Result<(), PullError> {
        let seq = m.seq;
        guard.discard();
        rec.advance(hub, seq, digest(&m.payload));
        if reason != SkipReason::History {
            rec.poison += 1;
            self.shared.counters.poison.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(group = %rec.id, seq, %reason, "commit-topic frame skipped");
        }
        self.save_record(guard, rec)?;
        self.emit(Event::FrameSkipped {
            group: rec.id,
            hub: hub.to_string(),
            seq,
            reason,
        });
        Ok(())
    }

    fn after_apply(&self, rec: &GroupRecord, before: &str) -> Applied {
        if rec.commit_hub != before {
            Applied::HubChanged
        } else {
            Applied::Next
        }
    }

    /// A member's commit at our epoch: let MLS and the ledger judge it,
    /// then merge it.
    #[allow(clippy::too_many_arguments)]
    async fn process_commit(
        &self,
        guard: &mut GroupGuard,
        rec: &mut GroupRecord,
        hub: &str,
        m: &LogFrame,
        pm: ProtocolMessage,
        sealed: &[u8],
        journal: Option<JournalEntry>,
    ) -> Result<Applied, PullError> {
        let epoch = pm.epoch().as_u64();
        let processed = guard.with(|g, p| g.process_message(p, pm))?;
        let processed = match processed {
            Ok(p) => p,
            Err(ProcessMessageError::StorageError(e)) => {
                guard.discard();
                return Err(store_err(e));
            }
            Err(ProcessMessageError::LibraryError(e)) => {
                guard.discard();
                return Err(store_err(e));
            }
            Err(e) => {
                self.skip(guard, rec, hub, m, SkipReason::Refused(e.to_string()))?;
                return Ok(Applied::Next);
            }
        };
        let aad = processed.aad().to_vec();
        let sender = processed.sender().clone();
        let ProcessedMessageContent::StagedCommitMessage(staged) = processed.into_content() else {
            self.skip(
                guard,
                rec,
                hub,
                m,
                SkipReason::Refused("not a commit".into()),
            )?;
            return Ok(Applied::Next);
        };
        if let Err(reason) = check_leaves(guard, &staged, &sender) {
            self.skip(guard, rec, hub, m, SkipReason::ForeignLeaf(reason))?;
            return Ok(Applied::Next);
        }
        let (entries, folded) = match self.check_ledger(guard, rec, &staged, &sender, &aad, sealed)
        {
            Ok(e) => e,
            Err(reason) => {
                self.skip(guard, rec, hub, m, SkipReason::LedgerRefused(reason))?;
                return Ok(Applied::Next);
            }
        };
        let roster =
            staged.add_proposals().next().is_some() || staged.remove_proposals().next().is_some();
        if staged.self_removed() {
            self.leave(guard, rec.id).await?;
            return Ok(Applied::Removed);
        }
        let before = guard.read(|g| g.epoch_authenticator().as_slice().to_vec())?;
        match guard.with(|g, p| g.merge_staged_commit(p, *staged))? {
            Ok(()) => {}
            Err(e) => {
                guard.discard();
                return Err(store_err(e));
            }
        }
        let after = guard.read(|g| g.epoch_authenticator().as_slice().to_vec())?;
        if after == before {
            guard.discard();
            return Err(RegistryError::MergeDidNotAdvance(rec.id).into());
        }
        let mut b = WriteBatch::new();
        if let Some(j) = journal {
            // Another commit won our epoch; merging it dropped our pending
            // commit, and the journal goes in the same batch. A lane run in
            // flight learns it from the hub's answer; an earlier run's
            // commit is reported here.
            self.shared.records.clear_journal(&mut b, &rec.id);
            if !self.lane_busy(rec.id) {
                self.report_lost(rec.id, &j);
            }
        }
        self.note_sends_left_behind(rec, epoch, m.published_at_ms)?;
        let before_hub = rec.commit_hub.clone();
        self.land_merged(
            guard,
            rec,
            Landing {
                epoch,
                hub,
                seq: m.seq,
                digest: digest(&m.payload),
                payload: m.payload.clone(),
                writer: m.sender,
                entries: entries.iter().map(Entry::encode).collect(),
                folded,
                roster,
            },
            b,
        )?;
        Ok(self.after_apply(rec, &before_hub))
    }

    /// Merging a member's commit framed in `framed`, published at
    /// `published_at_ms`: an app message this device encrypted
    /// [`MAX_PAST_EPOCHS`](crate::device::mls::MAX_PAST_EPOCHS) or more epochs before it, and sent after
    /// that commit was already on the log (this device was behind and did
    /// not know it, offline, say), reached members that had moved past the
    /// epochs they keep: nobody could read it. Note its epoch as lost, so
    /// it is sent again once this device has caught up. The hub's clock
    /// and this device's may differ: a message sent within
    /// [`SEND_CLOCK_SKEW_MS`] before the commit counts as after it (at
    /// worst it is sent twice, and receivers drop the second by its id).
    fn note_sends_left_behind(
        &self,
        rec: &mut GroupRecord,
        framed: u64,
        published_at_ms: u64,
    ) -> Result<(), PullError> {
        let Some(through) = framed.checked_sub(crate::device::mls::MAX_PAST_EPOCHS as u64) else {
            return Ok(());
        };
        let after = published_at_ms.saturating_sub(SEND_CLOCK_SKEW_MS);
        if let Some(e) = self
            .shared
            .records
            .first_sent_behind(&rec.id, through, after)?
        {
            rec.note_lost_from(e);
        }
        Ok(())
    }

    /// Check what a staged commit does to the ledger: the ids its
    /// authenticated data names, the sealed bodies beside it, each entry's
    /// authority against the ledger before it, the head it installs, and
    /// that every member it adds or removes has its entry; an external
    /// commit only from a member taking the place of its own leaf (a
    /// rejoin). Answers the entries, or why the commit is refused.
    fn check_ledger(
        &self,
        guard: &mut GroupGuard,
        rec: &GroupRecord,
        staged: &StagedCommit,
        sender: &Sender,
        aad: &[u8],
        sealed: &[u8],
    ) -> Result<(Vec<Entry>, Option<LedgerState>), String> {
        let ids = parse_enacted_aad(aad).ok_or("authenticated data is not a ledger id list")?;
        let current = guard
            .read(|g| GroupExt::from_extensions(g.extensions()))
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?
            .ok_or("the group has no hubsync extension")?;
        let next = GroupExt::from_extensions(staged.group_context().extensions())
            .map_err(|e| e.to_string())?
            .ok_or("the commit drops the group's extension")?;
        if next.topic_seed != current.topic_seed {
            return Err("the commit changes the topic seed".into());
        }
        let mut folded = None;
        let entries = if ids.is_empty() {
            if !sealed.is_empty() {
                return Err("sealed entries without ids".into());
            }
            if next != current {
                return Err("the ledger head changes without entries".into());
            }
            Vec::new()
        } else {
            let crypto = self.shared.registry.provider().crypto();
            let key = guard
                .with(|g, p| seal_key(g, p))
                .map_err(|e| e.to_string())??;
            let plain = ledger::open(crypto, &key, aad, sealed).map_err(|e| e.to_string())?;
            let entries = ledger::decode_list(&plain).map_err(|e| e.to_string())?;
            let got: Vec<_> = entries.iter().map(Entry::id).collect();
            if got != ids {
                return Err("sealed entries do not match the enacted ids".into());
            }
            if rec.ledger_complete {
                let mut state = self.ledger_state(rec).map_err(|e| e.to_string())?;
                for e in &entries {
                    state.apply(e).map_err(|e| e.to_string())?;
                }
                if state.head != next.ledger_head {
                    return Err("the installed head is not the ledger's".into());
                }
                folded = Some(state);
            }
            entries
        };
        // Every add and remove is enacted by its own entry.
        let invited: BTreeSet<DeviceId> = entries
            .iter()
            .filter(|e| e.kind == EntryType::MemberInvite)
            .filter_map(Entry::subject_device)
            .collect();
        let removed: BTreeSet<DeviceId> = entries
            .iter()
            .filter(|e| e.kind == EntryType::MemberRemove)
            .filter_map(Entry::subject_device)
            .collect();
        let mut adds = BTreeSet::new();
        for a in staged.add_proposals() {
            let d = device_id_of(a.add_proposal().key_package().leaf_node().credential())
                .ok_or("an added leaf has no device identity")?;
            adds.insert(d);
        }
        let mut removes = BTreeSet::new();
        for r in staged.remove_proposals() {
            let leaf = r.remove_proposal().removed();
            let d = guard
                .read(|g| g.member(leaf).and_then(device_id_of))
                .map_err(|e| e.to_string())?
                .ok_or("a removed leaf has no device identity")?;
            removes.insert(d);
        }
        if matches!(sender, Sender::NewMemberCommit) {
            // A rejoin changes no one's membership: the joiner's new leaf
            // replaces its old one, so it needs no ledger entry. Anyone
            // else joining from outside (no old leaf, or another's) would
            // be a member the ledger never invited.
            let joiner = staged
                .update_path_leaf_node()
                .and_then(|l| device_id_of(l.credential()))
                .ok_or("an external commit without a leaf of a device")?;
            if !entries.is_empty()
                || !adds.is_empty()
                || removes.len() != 1
                || !removes.contains(&joiner)
            {
                return Err(format!(
                    "an external commit by {joiner} that is not a member re-adding its own leaf"
                ));
            }
            return Ok((entries, folded));
        }
        if adds != invited {
            return Err("members added without their member.invite entry (or the reverse)".into());
        }
        if removes != removed {
            return Err(
                "members removed without their member.remove entry (or the reverse)".into(),
            );
        }
        Ok((entries, folded))
    }

    /// Merge our own journalled commit, accepted at `seq` on the journal's
    /// hub: the MLS merge, the ledger entries, the record, the Welcome and
    /// the journal's end land as one batch.
    pub(crate) fn adopt_locked(
        &self,
        guard: &mut GroupGuard,
        rec: &mut GroupRecord,
        j: &JournalEntry,
        seq: u64,
    ) -> Result<(), PullError> {
        guard.merge_pending()?;
        let mut b = WriteBatch::new();
        self.shared.records.clear_journal(&mut b, &rec.id);
        if let Some((joiners, w)) = &j.welcome {
            let mut all = self.ledger_entries(rec.id)?;
            all.extend(j.entries.iter().filter_map(|e| Entry::decode(e).ok()));
            for joiner in joiners {
                self.stage_welcome(guard, &mut b, rec, seq, *joiner, w, &all)?;
            }
        }
        self.land_merged(
            guard,
            rec,
            Landing {
                epoch: j.epoch,
                hub: &j.hub,
                seq,
                digest: digest(&j.payload),
                payload: j.payload.clone(),
                writer: self.shared.identity.id(),
                entries: j.entries.clone(),
                folded: None,
                roster: j.roster,
            },
            b,
        )?;
        // What the commit staged (its Welcomes) leaves the device only
        // once durable, also in a page of deferred merges.
        guard.flush()?;
        self.shared.outbox.wake();
        Ok(())
    }

    /// The ledger grew by `landed` to `state`: our clock observes their
    /// `ord`s (bounded: one member's clock far ahead must not drag every
    /// later entry of ours with it), and the record follows the ledger's
    /// hubs and commit hub.
    pub(crate) fn follow_ledger(
        &self,
        rec: &mut GroupRecord,
        state: &LedgerState,
        landed: &[Entry],
    ) {
        for e in landed {
            self.shared
                .hlc
                .observe_bounded(e.ord, self.shared.clock.now_ms(), HLC_MAX_AHEAD_MS);
        }
        rec.hubs = state.hubs.clone();
        rec.commit_hub = select_commit_hub(state);
    }

    /// After a merge (ours or another's): the ledger grows, the record
    /// follows the ledger (hubs, commit hub), the cursor and the merged
    /// commit are remembered, all in one batch with the MLS state; then
    /// the peers follow the group's hubs.
    fn land_merged(
        &self,
        guard: &mut GroupGuard,
        rec: &mut GroupRecord,
        l: Landing<'_>,
        mut b: WriteBatch,
    ) -> Result<(), PullError> {
        rec.advance(l.hub, l.seq, l.digest);
        rec.remember(MergedCommit {
            epoch: l.epoch,
            digest: l.digest,
            hub: l.hub.to_string(),
            seq: Some(l.seq),
            payload: l.payload,
            commit_seed: Some(rec.commit_seed),
            writer: Some(l.writer),
        });
        let ledger_changed = !l.entries.is_empty() && rec.ledger_complete;
        if ledger_changed {
            let from = self.shared.records.ledger(&rec.id)?.len() as u64;
            self.shared
                .records
                .put_ledger(&mut b, &rec.id, from, &l.entries);
            let state = match l.folded {
                Some(state) => state,
                None => {
                    let mut all = self.ledger_entries(rec.id)?;
                    for e in &l.entries {
                        all.push(Entry::decode(e).map_err(|e| KvError::Corrupt {
                            key: "ledger entry".into(),
                            reason: e.to_string(),
                        })?);
                    }
                    LedgerState::fold(rec.id, &all).map_err(|e| KvError::Corrupt {
                        key: format!("ledger of {}", rec.id),
                        reason: e.to_string(),
                    })?
                }
            };
            let landed: Vec<Entry> = l
                .entries
                .iter()
                .filter_map(|e| Entry::decode(e).ok())
                .collect();
            self.follow_ledger(rec, &state, &landed);
        }
        self.after_merge(guard, rec, l.roster, b)?;
        if ledger_changed {
            self.emit(Event::LedgerChanged { group: rec.id });
            self.sync_peers(rec);
        }
        Ok(())
    }

    /// Read an app topic from its catch-up cursor through `link` and handle
    /// every frame. Each page lands as one batch with the new cursor; a
    /// frame that cannot be handled drops the page's batch whole and stops,
    /// so the next catch-up reads that page again.
    pub(crate) async fn catch_up_app(
        &self,
        group: GroupId,
        hub: &str,
        link: &HubLink,
        topic: &TopicId,
    ) -> Result<(), PullError> {
        loop {
            let cursor = self.shared.records.app_cursor(&group, hub, topic)?;
            let after = cursor.seq;
            // Knowing the frame at the cursor, read from the one before it:
            // the hub must still hold that same frame there.
            let from = match cursor.digest {
                Some(_) => after.saturating_sub(1),
                None => after,
            };
            let f = link
                .fetch(topic, from, 200 + u32::from(from < after))
                .await
                .map_err(|source| PullError::Hub {
                    url: hub.to_string(),
                    source,
                })?;
            if f.head.unwrap_or(0) < after {
                let mut b = WriteBatch::new();
                self.shared.records.put_app_cursor(
                    &mut b,
                    &group,
                    hub,
                    topic,
                    crate::device::records::AppCursor::default(),
                );
                self.shared.registry.provider().kv().apply(&b)?;
                continue;
            }
            let mut messages = f.messages;
            if from < after && messages.first().is_some_and(|m| m.seq == after) {
                let m = messages.remove(0);
                if cursor.digest != Some(digest(&m.payload)) {
                    // Another frame where this device read one: the hub
                    // came back from an older copy of its store and took
                    // new frames since, so the head alone does not show it
                    // (sim seed 1105). A rewind of the hub: read it again.
                    self.rewound(group, hub).await?;
                    continue;
                }
            }
            let done = messages.len() < 200;
            // Frames trimmed away before this device read them: gone for
            // good from this hub (another hub of the group may still
            // deliver them); said, never skipped silently.
            let missed = match (f.gap, f.oldest, f.head) {
                (false, _, _) => 0,
                (true, Some(oldest), _) => oldest.saturating_sub(after + 1),
                (true, None, head) => head.unwrap_or(after).saturating_sub(after),
            };
            let mut guard = self.shared.registry.lock(group).await;
            if self.shared.records.app_cursor(&group, hub, topic)? != cursor {
                // Another catch-up of the same topic moved on meanwhile.
                continue;
            }
            let Some(rec) = self.shared.records.group(&group)? else {
                return Err(PullError::UnknownGroup(group));
            };
            let mut b = WriteBatch::new();
            let mut events = Vec::new();
            let mut last = cursor;
            let mut forwarded = false;
            for m in messages {
                match self.receive_locked(&mut guard, group, &m.payload, &mut b) {
                    Ok(e) => {
                        forwarded |=
                            match self.stage_forwards(&rec, &mut b, hub, topic, &m.payload, &e) {
                                Ok(f) => f,
                                Err(e) => {
                                    guard.discard();
                                    return Err(e.into());
                                }
                            };
                        events.extend(e);
                    }
                    Err(e) => {
                        guard.discard();
                        return Err(e.into());
                    }
                }
                last = crate::device::records::AppCursor {
                    seq: m.seq,
                    digest: Some(digest(&m.payload)),
                };
            }
            if missed > 0 && after + missed > last.seq {
                last = crate::device::records::AppCursor {
                    seq: after + missed,
                    digest: None,
                };
            }
            self.shared
                .records
                .put_app_cursor(&mut b, &group, hub, topic, last);
            guard.finish(b)?;
            drop(guard);
            if missed > 0 {
                tracing::warn!(%group, hub, missed, "app frames trimmed before they were read");
                self.emit(Event::AppFramesMissed {
                    group,
                    hub: hub.to_string(),
                    missed,
                });
            }
            if forwarded {
                self.shared.outbox.wake();
            }
            self.emit_received(events);
            if done {
                return Ok(());
            }
        }
    }
}

/// A leaf is its device (DESIGN.md section 9, RFC 9420 section 5.3.1):
/// every leaf a commit installs carries a credential naming a device and
/// the signature key of that same device, and a member's new leaf (its
/// update path, or an Update proposal) keeps the identity it had.
fn check_leaves(
    guard: &mut GroupGuard,
    staged: &StagedCommit,
    sender: &Sender,
) -> Result<(), String> {
    let own_key = |leaf: &LeafNode| -> Result<DeviceId, String> {
        let d = device_id_of(leaf.credential()).ok_or("a leaf names no device")?;
        if !credential_matches_key(leaf.credential(), leaf.signature_key().as_slice()) {
            return Err(format!("leaf of {d} is signed by another key"));
        }
        Ok(d)
    };
    let identity_at =
        |guard: &mut GroupGuard, index: LeafNodeIndex| -> Result<Option<DeviceId>, String> {
            guard
                .read(|g| g.member(index).and_then(device_id_of))
                .map_err(|e| e.to_string())
        };
    for a in staged.add_proposals() {
        own_key(a.add_proposal().key_package().leaf_node())?;
    }
    for u in staged.update_proposals() {
        let new = own_key(u.update_proposal().leaf_node())?;
        if let Sender::Member(index) = u.sender() {
            if identity_at(guard, *index)? != Some(new) {
                return Err(format!("an update changes a member's identity to {new}"));
            }
        }
    }
    if let Some(leaf) = staged.update_path_leaf_node() {
        let new = own_key(leaf)?;
        if let Sender::Member(index) = sender {
            if identity_at(guard, *index)? != Some(new) {
                return Err(format!(
                    "the committer's update path changes its identity to {new}"
                ));
            }
        }
    }
    Ok(())
}

/// One merged commit, as [`GroupPeerManager::land_merged`] records it.
struct Landing<'a> {
    epoch: u64,
    hub: &'a str,
    seq: u64,
    digest: [u8; 32],
    payload: Vec<u8>,
    /// Who wrote the frame to the hub.
    writer: DeviceId,
    /// The ledger with these entries applied, when the checks already
    /// folded it (so it is not folded twice).
    folded: Option<LedgerState>,
    entries: Vec<Vec<u8>>,
    roster: bool,
}

/// The MLS protocol message a commit-topic frame carries, if it carries
/// one.
pub(crate) fn protocol_message(payload: &[u8]) -> Option<ProtocolMessage> {
    let frame = CommitFrame::parse(payload)?;
    MlsMessageIn::tls_deserialize_exact(frame.mls)
        .ok()?
        .try_into_protocol_message()
        .ok()
}

/// Where a commit given back to a rewound log would go
/// ([`GroupPeerManager::place_on`]).
#[derive(Debug, PartialEq, Eq)]
enum Place {
    /// Nothing there says the group went another way.
    Free,
    /// A member's other commit holds its epoch, written there by `by`:
    /// ours lost it.
    Taken {
        /// Who wrote the other commit there.
        by: DeviceId,
    },
    /// A member's other commit holds the epoch before: ours cannot follow.
    Behind,
    /// A member's other commit holds its epoch, but the member that wrote
    /// it there has since committed on this device's branch: it left the
    /// branch that commit began (sim seed 1337), so the commit says
    /// nothing about ours. Not given back either: a reader of that log
    /// would meet the other commit first.
    Left,
}

/// A commit this device merged that `hub` no longer holds, with its frame
/// still kept to give back.
fn is_lost(k: &MergedCommit, hub: &str) -> bool {
    k.hub == hub && k.seq.is_none() && !k.payload.is_empty() && k.commit_seed.is_some()
}

/// A store failure met on the way, as the pull's error.
fn store_err(e: impl std::fmt::Display) -> PullError {
    PullError::Store(RegistryError::Store(e.to_string()))
}
