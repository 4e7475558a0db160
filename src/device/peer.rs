//! What a group peer does with what arrives: the commit topic handed to the
//! lane's pull, app frames decrypted and delivered once, Welcomes joined;
//! and the group operations that are not commits (create, send).

use super::error::DeviceError;
use super::events::Event;
use super::frames::{digest, AppMessage, WelcomeEnvelope};
use super::identity::{credential_matches_key, device_id_of};
use super::lane::select_commit_hub;
use super::ledger::{self, Entry, EntryType, GroupExt, LedgerState};
use super::link::HubLink;
use super::manager::{FutureFrames, GroupPeerManager, GroupTopics};
use super::mls;
use super::records::{AppCursor, GroupId, GroupRecord};
use super::registry::{GroupGuard, OpProvider};
use super::topics;
use crate::kv::WriteBatch;
use crate::wire::{DeviceId, TopicId};
use openmls::prelude::tls_codec::{Deserialize as _, Serialize as _};
use openmls::prelude::*;
use openmls_traits::OpenMlsProvider;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Kept sent messages are pruned once every this many sends in a group.
const SENDS_PER_PRUNE: usize = 64;
use std::sync::Arc;
use tokio::sync::{mpsc, watch, Notify};
use tokio_util::sync::CancellationToken;

/// Where an app frame came from: the hub, the topic, and the frame's
/// sequence number in that topic's log there.
#[derive(Clone, Copy, Debug)]
pub struct Via<'a> {
    /// The hub's URL.
    pub hub: &'a str,
    /// The app topic.
    pub topic: &'a TopicId,
    /// Its sequence number in that topic on that hub.
    pub seq: u64,
}

/// An app frame as it arrived: its bytes and, when it came from a hub,
/// where from (see [`GroupPeerManager::receive_app`]).
pub type AppFrame<'a> = (&'a [u8], Option<Via<'a>>);

/// At most how many frames a peer takes from its queue at once; app
/// frames among them are made durable in one flush.
const RECEIVE_BATCH: usize = 64;

/// How many epochs ahead a kept future frame may be.
const FUTURE_WINDOW: u64 = 8;

/// How often a peer on the commit hub pulls even without a push, so a pull
/// that failed (a flaky hub) is retried while the link stays up.
const PULL_INTERVAL: Duration = Duration::from_secs(5);

/// A message handed to the outbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sent {
    /// The message id receivers see.
    pub id: [u8; 16],
    /// The epoch it was encrypted in: the members of that epoch can read it.
    pub epoch: u64,
}

/// Serialized pool key packages and, when asked for, a last-resort one.
/// Pool key packages (encoded), their references, and a last resort.
type KeyPackages = (Vec<Vec<u8>>, Vec<KeyPackageRef>, Option<Vec<u8>>);

/// One frame for a peer to handle: pushed (with a delivery id to ack) or
/// fetched during catch-up (no id).
struct Item {
    topic: TopicId,
    payload: Vec<u8>,
    ack: Option<crate::wire::FrameRef>,
}

/// What a peer's log reads need: where to read, when to stop, and where
/// to say a read is done.
struct LogReads<'a> {
    group: GroupId,
    hub: &'a str,
    link: &'a HubLink,
    cancel: &'a CancellationToken,
    done: &'a mpsc::Sender<TopicId>,
}

/// At most how many pushed frames of one topic a peer holds while that
/// topic's log is read; past it, the newest are let go unacked and the log
/// is read once more before the held ones are handled (they are all in it).
const HELD_MAX: usize = 1024;

/// App frames pushed on a topic while its log is still being read from the
/// catch-up cursor. They wait for the read to end, so a sender's later
/// messages never reach the app before its earlier ones; the frames the read
/// already handled are then found to be duplicates.
#[derive(Default)]
struct Held {
    items: Vec<Item>,
    /// Read the log once more before handling them: some pushes were let
    /// go, or the log was asked for again while it was being read.
    again: bool,
}

impl GroupPeerManager {
    /// The peer task of one (group, hub): keep the hub subscriptions equal to
    /// the group's topics and handle each arriving frame. The peer on the
    /// commit hub pulls at start, on every push of the commit topic, and on
    /// a timer that pushes do not reset, so a pull that failed under steady
    /// traffic is still retried. App topics are read from their logs when
    /// subscribed, when the link comes back, and when `recatch` asks.
    pub(super) async fn run_peer(
        &self,
        group: GroupId,
        hub: String,
        link: HubLink,
        mut topics_rx: watch::Receiver<GroupTopics>,
        cancel: CancellationToken,
        recatch: Arc<Notify>,
    ) {
        let (tx, mut rx) = mpsc::channel::<Item>(256);
        // Catch-ups report here when they are done; until then that topic's
        // pushes are held.
        let (caught_tx, mut caught_rx) = mpsc::channel::<TopicId>(16);
        let mut catching: BTreeMap<TopicId, Held> = BTreeMap::new();
        let mut connections = link.connections();
        connections.borrow_and_update();
        let mut subs: BTreeMap<TopicId, tokio::task::JoinHandle<()>> = BTreeMap::new();
        let mut pulled_once = false;
        let mut tick = tokio::time::interval(PULL_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.reset();
        loop {
            let t = topics_rx.borrow_and_update().clone();
            let is_commit_hub = t.commit_hub == hub;
            let mut wanted: Vec<TopicId> = t.app.clone();
            if is_commit_hub {
                wanted.push(t.commit.clone());
            }
            // The rendezvous mailbox on every hub: a member left behind
            // asks on the hubs it knows, which may not be today's commit
            // hub.
            if let Some(r) = &t.rendezvous {
                wanted.push(r.clone());
            }
            let mut new_commit_topic = false;
            for topic in &wanted {
                if subs.contains_key(topic) {
                    continue;
                }
                new_commit_topic |= *topic == t.commit;
                let mut r = link.subscribe(topic.clone(), None);
                let fwd = tx.clone();
                let tp = topic.clone();
                subs.insert(
                    topic.clone(),
                    tokio::spawn(async move {
                        while let Some(d) = r.recv().await {
                            let item = Item {
                                topic: tp.clone(),
                                ack: Some(d.frame_ref()),
                                payload: d.payload,
                            };
                            if fwd.send(item).await.is_err() {
                                break;
                            }
                        }
                    }),
                );
                if Some(topic) == t.rendezvous.as_ref()
                    && hub != super::lane::LOOPBACK_HUB
                    && hub != self.shared.loopback_url
                {
                    self.ask_presence_in_background(group, &hub, &link, &cancel);
                }
                if *topic != t.commit && Some(topic) != t.rendezvous.as_ref() {
                    // Frames published before we subscribed are only in
                    // the log: read it from where catch-up last stopped.
                    let logs = LogReads {
                        group,
                        hub: &hub,
                        link: &link,
                        cancel: &cancel,
                        done: &caught_tx,
                    };
                    self.read_logs(&logs, std::slice::from_ref(topic), &mut catching);
                }
            }
            let stale: Vec<TopicId> = subs
                .keys()
                .filter(|k| !wanted.contains(k))
                .cloned()
                .collect();
            for topic in stale {
                if let Some(h) = subs.remove(&topic) {
                    h.abort();
                }
                link.unsubscribe(&topic).await;
            }
            if is_commit_hub && (!pulled_once || new_commit_topic) {
                pulled_once = true;
                // A commit topic new to this peer (the first, or the one a
                // roster change moved the log to): once the hub has the
                // subscription, a commit published there reaches us as a
                // push, and this pull reads what came before it.
                if let Err(e) = link.flush_subscriptions().await {
                    tracing::debug!(%group, error = %e, "subscriptions not yet at the hub; the pull below and the next tick cover it");
                }
                if let Err(e) = self.pull(group).await {
                    tracing::debug!(%group, error = %e, "initial pull failed; retried on the next tick");
                }
            }
            if !is_commit_hub {
                pulled_once = false;
            }
            tokio::select! {
                _ = cancel.cancelled() => break,
                r = topics_rx.changed() => if r.is_err() { break },
                _ = tick.tick(), if is_commit_hub => {
                    if let Err(e) = self.pull(group).await {
                        tracing::debug!(%group, error = %e, "periodic pull failed");
                    }
                }
                item = rx.recv() => {
                    let Some(item) = item else { break };
                    // Whatever else already waits is handled with it: app
                    // frames in a row share one flush (and one ack).
                    let mut items = vec![item];
                    while items.len() < RECEIVE_BATCH {
                        match rx.try_recv() {
                            Ok(more) => items.push(more),
                            Err(_) => break,
                        }
                    }
                    // A new connection counts before it pushes anything:
                    // some of these may be its pushes, which must wait for
                    // the log reads (below) like any after them.
                    if connections.has_changed().unwrap_or(false) {
                        connections.borrow_and_update();
                        let logs = LogReads { group, hub: &hub, link: &link, cancel: &cancel, done: &caught_tx };
                        self.read_logs(&logs, &t.app, &mut catching);
                    }
                    let (wait, items): (Vec<Item>, Vec<Item>) =
                        items.into_iter().partition(|i| catching.contains_key(&i.topic));
                    for item in wait {
                        if let Some(held) = catching.get_mut(&item.topic) {
                            if held.items.len() < HELD_MAX {
                                held.items.push(item);
                            } else {
                                held.again = true;
                            }
                        }
                    }
                    if !items.is_empty() {
                        let failed = self.handle_items(group, &hub, &link, &t, items).await;
                        let logs = LogReads { group, hub: &hub, link: &link, cancel: &cancel, done: &caught_tx };
                        self.read_logs(&logs, &Vec::from_iter(failed), &mut catching);
                    }
                }
                Some(topic) = caught_rx.recv() => {
                    let Some(held) = catching.remove(&topic) else { continue };
                    if held.again {
                        // Read the log again (it holds whatever was let
                        // go) before the kept ones are handled.
                        catching.insert(topic.clone(), Held { items: held.items, again: false });
                        self.spawn_catch_up(group, hub.clone(), link.clone(), topic, cancel.clone(), caught_tx.clone());
                    } else if !held.items.is_empty() {
                        let failed = self.handle_items(group, &hub, &link, &t, held.items).await;
                        let logs = LogReads { group, hub: &hub, link: &link, cancel: &cancel, done: &caught_tx };
                        self.read_logs(&logs, &Vec::from_iter(failed), &mut catching);
                    }
                }
                // The hub may have lost this peer's subscriptions (it came
                // back from an older copy of its store) or served another
                // store meanwhile: what was published before the link made
                // them again is only in the logs. Read each app topic from
                // its cursor, which the pushes handled since moved on.
                r = connections.changed() => {
                    if r.is_err() { break }
                    connections.borrow_and_update();
                    let logs = LogReads { group, hub: &hub, link: &link, cancel: &cancel, done: &caught_tx };
                    self.read_logs(&logs, &t.app, &mut catching);
                }
                _ = recatch.notified() => {
                    let logs = LogReads { group, hub: &hub, link: &link, cancel: &cancel, done: &caught_tx };
                    self.read_logs(&logs, &t.app, &mut catching);
                }
            }
        }
        // A peer removed while the device runs (left the group, unbound the
        // hub) drops its hub subscriptions, which are durable; a device
        // shutting down keeps them so nothing is missed while it is away.
        let removed = !self.shared.shutdown.is_cancelled();
        for (topic, h) in subs {
            h.abort();
            if removed {
                link.unsubscribe(&topic).await;
            }
        }
    }

    /// Handle frames a peer received, in order, and ack those handled (one
    /// not handled is delivered again later). Rendezvous frames go to their
    /// own tasks; a commit topic's frame means "pull"; each run of app
    /// frames is made durable in one flush. Answers the app topics a frame
    /// of which could not be handled: the caller has their logs read again.
    async fn handle_items(
        &self,
        group: GroupId,
        hub: &str,
        link: &HubLink,
        t: &GroupTopics,
        items: Vec<Item>,
    ) -> BTreeSet<TopicId> {
        let mut failed = BTreeSet::new();
        let mut acks = Vec::new();
        let mut run: Vec<Item> = Vec::new();
        let mut items = items.into_iter().peekable();
        while let Some(item) = items.next() {
            let handled = if Some(&item.topic) == t.rendezvous.as_ref() {
                // Judged and answered on tasks of their own: a stranger's
                // frames cost a decode at most.
                self.on_rendezvous(group, hub, &item.payload);
                true
            } else if item.topic == t.commit {
                match self.pull(group).await {
                    Ok(()) => true,
                    Err(e) if e.is_unknown_group() => true,
                    Err(e) => {
                        tracing::debug!(%group, hub, error = %e, "pull on push failed");
                        false
                    }
                }
            } else {
                run.push(item);
                let run_ends = items.peek().is_none_or(|next| {
                    Some(&next.topic) == t.rendezvous.as_ref() || next.topic == t.commit
                });
                if run_ends {
                    let done = std::mem::take(&mut run);
                    acks.extend(self.receive_run(group, hub, done, &mut failed).await);
                }
                continue;
            };
            if let (true, Some(id)) = (handled, item.ack) {
                acks.push(id);
            }
        }
        link.ack(acks).await;
        failed
    }

    /// Receive a run of app frames from `hub` under one flush; answers the
    /// delivery ids to ack. When the run fails as a whole (a store error,
    /// say), nothing of it was applied and each frame is tried alone. A
    /// frame that cannot be handled is counted and its topic added to
    /// `failed`; the topic's later frames are then left alone too (unacked),
    /// since handling one would move the topic's cursor past it: the log is
    /// read again for all of them.
    async fn receive_run(
        &self,
        group: GroupId,
        hub: &str,
        run: Vec<Item>,
        failed: &mut BTreeSet<TopicId>,
    ) -> Vec<crate::wire::FrameRef> {
        let run: Vec<Item> = run
            .into_iter()
            .filter(|i| !failed.contains(&i.topic))
            .collect();
        if run.is_empty() {
            return Vec::new();
        }
        let frames: Vec<AppFrame<'_>> = run
            .iter()
            .map(|i| {
                let via = i.ack.as_ref().map(|r| Via {
                    hub,
                    topic: &i.topic,
                    seq: r.seq,
                });
                (i.payload.as_slice(), via)
            })
            .collect();
        let all = self.receive_apps(group, &frames).await;
        let mut acks = Vec::new();
        for (item, frame) in run.iter().zip(&frames) {
            let handled = match &all {
                Ok(()) | Err(DeviceError::UnknownGroup(_)) => true,
                Err(_) if failed.contains(&item.topic) => continue,
                Err(_) if run.len() == 1 => false,
                Err(_) => matches!(
                    self.receive_apps(group, std::slice::from_ref(frame)).await,
                    Ok(()) | Err(DeviceError::UnknownGroup(_))
                ),
            };
            if let (Err(e), false) = (&all, handled) {
                tracing::warn!(%group, hub, error = %e, "frame not handled; its topic's log is read again");
                self.shared
                    .counters
                    .receive_failures
                    .fetch_add(1, Ordering::Relaxed);
                failed.insert(item.topic.clone());
            }
            if let (true, Some(id)) = (handled, item.ack.clone()) {
                acks.push(id);
            }
        }
        acks
    }

    /// Have each of `topics` read from its log on the peer's hub, holding
    /// its pushes meanwhile; one already being read is read once more when
    /// that read ends.
    fn read_logs(
        &self,
        logs: &LogReads<'_>,
        topics: &[TopicId],
        catching: &mut BTreeMap<TopicId, Held>,
    ) {
        for topic in topics {
            if let Some(held) = catching.get_mut(topic) {
                held.again = true;
                continue;
            }
            catching.insert(topic.clone(), Held::default());
            self.spawn_catch_up(
                logs.group,
                logs.hub.to_string(),
                logs.link.clone(),
                topic.clone(),
                logs.cancel.clone(),
                logs.done.clone(),
            );
        }
    }

    /// Read an app topic's log on this peer's hub from its catch-up cursor,
    /// once the subscription is in force (a frame published in between is
    /// then either in the log or pushed), retrying until it succeeds or the
    /// peer goes away; then say so on `done` (the peer's own), so the pushes the peer held
    /// meanwhile are handled after what the log gave.
    pub(super) fn spawn_catch_up(
        &self,
        group: GroupId,
        hub: String,
        link: HubLink,
        topic: TopicId,
        cancel: CancellationToken,
        done: mpsc::Sender<TopicId>,
    ) {
        let me = self.clone();
        self.shared.tasks.spawn(async move {
            loop {
                let r = tokio::select! {
                    _ = cancel.cancelled() => return,
                    r = link.flush_subscriptions() => r.map_err(|e| e.to_string()),
                };
                let r = match r {
                    Ok(()) => tokio::select! {
                        _ = cancel.cancelled() => return,
                        r = me.catch_up_app(group, &hub, &link, &topic) => r,
                    },
                    Err(e) => Err(crate::device::lane::PullError::Hub {
                        url: hub.clone(),
                        source: crate::device::link::LinkError::NotConnected { url: e },
                    }),
                };
                match r {
                    Ok(()) => break,
                    Err(e) if e.is_unknown_group() => break,
                    Err(e) => {
                        tracing::debug!(%group, hub = %hub, error = %e, "app catch-up failed; retrying");
                        me.shared
                            .counters
                            .receive_failures
                            .fetch_add(1, Ordering::Relaxed);
                        tokio::select! {
                            _ = cancel.cancelled() => return,
                            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        }
                    }
                }
            }
            // The peer handles what it held meanwhile (gone with the peer
            // if it went away: then those frames were never acked).
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = done.send(topic) => {}
            }
        });
    }

    pub(super) fn save_record(
        &self,
        guard: &mut GroupGuard,
        rec: &GroupRecord,
    ) -> Result<(), DeviceError> {
        let mut b = WriteBatch::new();
        self.shared.records.put_group(&mut b, rec);
        guard.finish(b)?;
        Ok(())
    }

    /// After a merge: rotate the app topic if the roster changed, persist the
    /// record with the MLS state, tell the app, and read any frames that
    /// waited for this epoch.
    pub(super) fn after_merge(
        &self,
        guard: &mut GroupGuard,
        rec: &mut GroupRecord,
        roster: bool,
        mut b: WriteBatch,
    ) -> Result<(), DeviceError> {
        if roster {
            let (app, commit) = self.roster_secrets(guard)?;
            rec.rotate_app_topic(app);
            rec.rotate_commit_seed(commit);
        }
        let epoch = guard.read(|g| g.epoch().as_u64())?;
        // The merge (staged in the guard), the record with its new cursor and
        // app topic, and the caller's own changes land as one batch.
        self.shared.records.put_group(&mut b, rec);
        // Frames of epochs older than the kept window can no longer be read
        // anyway: their inbox entries are dead weight.
        let keep_from = epoch.saturating_sub(mls::MAX_PAST_EPOCHS as u64 + 1);
        self.shared
            .records
            .prune_inbox(&mut b, &rec.id, keep_from)?;
        self.shared
            .records
            .prune_sent(&mut b, &rec.id, super::records::SENT_KEPT)?;
        guard.finish(b)?;
        self.publish_topics(rec);
        self.emit(Event::EpochChanged {
            group: rec.id,
            epoch,
        });
        if roster {
            let members = self.members_of(guard)?;
            self.emit(Event::MembersChanged {
                group: rec.id,
                members,
            });
        }
        self.retry_future_frames(guard, rec)?;
        Ok(())
    }

    /// The secrets the group's topics take at a roster change, drawn from
    /// the current epoch: the app topic's and the commit seed
    /// ([`topics`]).
    pub(super) fn roster_secrets(
        &self,
        guard: &mut GroupGuard,
    ) -> Result<([u8; 32], [u8; 32]), DeviceError> {
        let crypto = self.shared.registry.provider().crypto();
        let mut draw = |label: &str| -> Result<[u8; 32], DeviceError> {
            let v = guard
                .read(|g| g.export_secret(crypto, label, &[], 32))?
                .map_err(|e| DeviceError::Mls(e.to_string()))?;
            <[u8; 32]>::try_from(v.as_slice())
                .map_err(|_| DeviceError::Mls("exporter secret is not 32 bytes".into()))
        };
        Ok((
            draw(topics::APP_TOPIC_LABEL)?,
            draw(topics::COMMIT_SEED_LABEL)?,
        ))
    }

    pub(super) fn members_of(&self, guard: &mut GroupGuard) -> Result<Vec<DeviceId>, DeviceError> {
        Ok(guard.read(|g| {
            let mut m: Vec<DeviceId> = g
                .members()
                .filter_map(|m| device_id_of(&m.credential))
                .collect();
            m.sort();
            m
        })?)
    }

    /// Members of the group as a set (for membership tests).
    pub(super) fn member_set(
        &self,
        guard: &mut GroupGuard,
    ) -> Result<std::collections::BTreeSet<DeviceId>, DeviceError> {
        Ok(self.members_of(guard)?.into_iter().collect())
    }

    /// Forget a group on this device only: its MLS state (every secret of
    /// every epoch), records and peers go, and its hub subscriptions are
    /// dropped, as for a removal; [`Event::Forgotten`] says so. Nothing is
    /// sent: the other members still count this device as a member until
    /// an admin removes it, and they go on unaffected. The group's durable
    /// inbox stays readable. For a group that is gone, or one this device
    /// must drop at once.
    ///
    /// # Errors
    /// `UnknownGroup`, or the store's.
    pub async fn forget_group(&self, group: GroupId) -> Result<(), DeviceError> {
        let mut guard = self.shared.registry.lock(group).await;
        self.record(group)?;
        self.drop_group_state(&mut guard, group).await?;
        self.emit(Event::Forgotten { group });
        Ok(())
    }

    /// Forget a group this device was removed from: its MLS state (every
    /// secret of every epoch), records and peers.
    pub(super) async fn leave(
        &self,
        guard: &mut GroupGuard,
        group: GroupId,
    ) -> Result<(), DeviceError> {
        self.drop_group_state(guard, group).await?;
        self.emit(Event::Removed { group });
        Ok(())
    }

    /// Delete a group's MLS state, records and peers (never its inbox);
    /// then join a Welcome kept for after this, if there is one.
    async fn drop_group_state(
        &self,
        guard: &mut GroupGuard,
        group: GroupId,
    ) -> Result<(), DeviceError> {
        // Who may have invited us back, as the group stood when we left
        // it: an admin by the ledger up to our removal.
        let ledger = match self.shared.records.group(&group)? {
            Some(rec) if rec.ledger_complete => self.ledger_state(&rec).ok(),
            _ => None,
        };
        guard.discard();
        let purge = guard.with(|g, p| {
            let _ = g.delete(p.storage());
            p.storage().purge_group(&group.to_mls())
        })?;
        purge.map_err(|e| DeviceError::Store(e.to_string()))?;
        let mut b = WriteBatch::new();
        self.shared.records.delete_group(&mut b, &group)?;
        guard.finish(b)?;
        guard.discard();
        self.remove_group(group).await;
        // Welcomes that arrived while we still held the group (we were
        // removed and invited again before seeing the removal) can now be
        // joined: those of an admin, tried in turn until one joins.
        let kept = self.shared.records.pending_welcomes(&group)?;
        if !kept.is_empty() {
            let me = self.clone();
            self.shared.tasks.spawn(async move {
                me.join_kept_welcomes(group, kept, ledger).await;
            });
        }
        Ok(())
    }

    /// Join the first of `kept` (Welcomes kept aside while this device
    /// held `group`) whose inviter was an admin by `ledger`, the group's
    /// ledger up to this device's removal; every one not joined is
    /// reported as refused, and none stays kept.
    async fn join_kept_welcomes(
        &self,
        group: GroupId,
        kept: Vec<Vec<u8>>,
        ledger: Option<crate::device::ledger::LedgerState>,
    ) {
        let mut joined = false;
        for bytes in kept {
            let refused = if joined {
                None
            } else {
                match WelcomeEnvelope::open(&bytes) {
                    Ok(env) if !ledger.as_ref().is_some_and(|l| l.is_admin(&env.inviter)) => Some(
                        "a Welcome kept while this device held the group, from a device that was not its admin".to_string(),
                    ),
                    Ok(_) => match self.accept_welcome(&bytes).await {
                        Ok(()) => {
                            joined = self.shared.records.group(&group).ok().flatten().is_some();
                            None
                        }
                        Err(e) => Some(e.to_string()),
                    },
                    Err(e) => Some(e.to_string()),
                }
            };
            if let Some(reason) = refused {
                tracing::warn!(%group, %reason, "a Welcome kept for after our removal was refused");
                self.emit(Event::WelcomeRefused {
                    group: Some(group),
                    reason,
                });
            }
        }
        if !joined {
            let mut b = WriteBatch::new();
            let kv = self.shared.registry.provider().kv();
            let cleared = self
                .shared
                .records
                .clear_pending_welcomes(&mut b, &group)
                .and_then(|()| kv.apply(&b))
                .and_then(|()| kv.flush());
            if let Err(e) = cleared {
                self.shared
                    .counters
                    .control_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%group, error = %e, "kept Welcomes not cleared");
            }
        }
    }

    /// Handle one app frame: deduplicate, decrypt, deliver once. `via` names
    /// where it came from; with forwarding on, a frame delivered here for
    /// the first time is re-broadcast to the group's other hubs. Its `seq`
    /// moves the topic's catch-up cursor on that hub up to it: the caller
    /// promises that every earlier frame of the topic there was handled
    /// (as a peer's stream does once the topic's log was read).
    ///
    /// # Errors
    /// `UnknownGroup` when the group is gone, or the store's error.
    pub async fn receive_app(
        &self,
        group: GroupId,
        payload: &[u8],
        via: Option<Via<'_>>,
    ) -> Result<(), DeviceError> {
        self.receive_apps(group, &[(payload, via)]).await
    }

    /// Handle app frames in order as [`Self::receive_app`] does one, made
    /// durable together in one flush: all of them, or (on an error) none,
    /// and the app hears of them only after that flush. A frame or message
    /// id repeated within the run is a duplicate as it would be across
    /// runs. A peer hands each run of app frames already waiting in its
    /// queue here, so a burst costs one flush, not one per frame.
    ///
    /// # Errors
    /// `UnknownGroup` when the group is gone, or the store's error.
    pub async fn receive_apps(
        &self,
        group: GroupId,
        frames: &[AppFrame<'_>],
    ) -> Result<(), DeviceError> {
        if self.shared.faults.panic_on_receive.load(Ordering::Relaxed) {
            panic!("test fault: panic on receive");
        }
        let mut guard = self.shared.registry.lock(group).await;
        let Some(rec) = self.shared.records.group(&group)? else {
            return Err(DeviceError::UnknownGroup(group));
        };
        let mut b = WriteBatch::new();
        let mut events = Vec::new();
        let mut forwarded = false;
        let mut reached: BTreeMap<(&str, &TopicId), AppCursor> = BTreeMap::new();
        for (payload, via) in frames {
            let got = self.receive_locked(&mut guard, group, payload, &mut b)?;
            if let Some(v) = via {
                forwarded |= self.stage_forwards(&rec, &mut b, v.hub, v.topic, payload, &got)?;
                let r = reached.entry((v.hub, v.topic)).or_default();
                if v.seq > r.seq {
                    *r = AppCursor {
                        seq: v.seq,
                        digest: Some(digest(payload)),
                    };
                }
            }
            events.extend(got);
        }
        for ((hub, topic), cursor) in reached {
            if cursor.seq > self.shared.records.app_cursor(&group, hub, topic)?.seq {
                self.shared
                    .records
                    .put_app_cursor(&mut b, &group, hub, topic, cursor);
            }
        }
        guard.finish(b)?;
        drop(guard);
        if forwarded {
            self.shared.outbox.wake();
        }
        self.emit_received(events);
        Ok(())
    }

    /// With forwarding on, stage a frame this device just delivered for
    /// the first time (`events`) for the group's other hubs than `from`,
    /// on the app topic it came on, under its original publish id (so a hub
    /// that already has it answers `Duplicate`). Whether the frame came as
    /// a push or was read from the log, it is forwarded the same way. Only
    /// on an app topic the group still keeps: its writer key is what the
    /// other hubs ask for. Answers whether anything was staged.
    pub(super) fn stage_forwards(
        &self,
        rec: &GroupRecord,
        b: &mut WriteBatch,
        from: &str,
        topic: &TopicId,
        payload: &[u8],
        events: &[Event],
    ) -> Result<bool, DeviceError> {
        if !self.shared.config.forwarding {
            return Ok(false);
        }
        let Some(writer) = rec.app_writer(topic) else {
            return Ok(false);
        };
        let mut forwarded = false;
        for e in events {
            if let Event::MessageReceived { id, .. } = e {
                let mut publish = crate::wire::Publish {
                    topic: topic.clone(),
                    publish_id: super::frames::publish_id(id, topic),
                    class: crate::wire::RetentionClass::Log,
                    expected_head: crate::wire::ExpectedHead::Unconditional,
                    replay_only: false,
                    retention_secs: None,
                    payload: payload.to_vec(),
                    writer: None,
                };
                writer.sign(&mut publish);
                for hub in rec.routes().iter().filter(|h| h.as_str() != from) {
                    self.shared
                        .outbox
                        .stage(b, hub, &publish)
                        .map_err(|e| DeviceError::Store(e.to_string()))?;
                    forwarded = true;
                }
            }
        }
        Ok(forwarded)
    }

    /// Hand received messages to the app (twice under the test fault that
    /// shows the simulation catches a broken inbox).
    pub(super) fn emit_received(&self, events: Vec<Event>) {
        let twice = self.shared.faults.double_emit.load(Ordering::Relaxed);
        for e in events {
            if twice {
                self.emit(e.clone());
            }
            self.emit(e);
        }
    }

    pub(super) fn receive_locked(
        &self,
        guard: &mut GroupGuard,
        group: GroupId,
        payload: &[u8],
        b: &mut WriteBatch,
    ) -> Result<Vec<Event>, DeviceError> {
        let c = &self.shared.counters;
        let d = digest(payload);
        let skip_dedup = self.shared.faults.skip_dedup.load(Ordering::Relaxed);
        if !skip_dedup && self.shared.records.seen_frame(b, &group, &d)? {
            c.duplicates.fetch_add(1, Ordering::Relaxed);
            return Ok(vec![]);
        }
        let ours = guard.read(|g| g.epoch().as_u64())?;
        let pm = MlsMessageIn::tls_deserialize_exact(payload)
            .ok()
            .and_then(|m| m.try_into_protocol_message().ok())
            .filter(|pm| pm.group_id().as_slice() == group.0);
        let Some(pm) = pm else {
            c.dropped.fetch_add(1, Ordering::Relaxed);
            self.shared.records.mark_frame(b, &group, &d, ours);
            return Ok(vec![]);
        };
        // A frame claiming a far-future epoch is no message we could ever
        // be waiting for (a few commits at most race a message): keeping it
        // would let anyone fill the store.
        if pm.epoch().as_u64() > ours + FUTURE_WINDOW {
            c.dropped.fetch_add(1, Ordering::Relaxed);
            self.shared.records.mark_frame(b, &group, &d, ours);
            return Ok(vec![]);
        }
        if pm.epoch().as_u64() > ours {
            match self.shared.config.future_frames {
                FutureFrames::Persist => self.shared.records.keep_future(b, &group, &d, payload),
                FutureFrames::Drop => {
                    c.dropped.fetch_add(1, Ordering::Relaxed);
                    self.shared.records.mark_frame(b, &group, &d, ours);
                }
            }
            return Ok(vec![]);
        }
        self.shared.records.mark_frame(b, &group, &d, ours);
        let processed = guard.with(|g, p| g.process_message(p, pm))?;
        let processed = match processed {
            Ok(p) => p,
            Err(e) => {
                // Too old, or a secret already used: either way this frame
                // can never be read now.
                tracing::debug!(%group, error = %e, "app frame unreadable");
                c.dropped.fetch_add(1, Ordering::Relaxed);
                return Ok(vec![]);
            }
        };
        let sender = device_id_of(processed.credential());
        let control = processed.aad() == super::control_msg::CONTROL_AAD;
        let ProcessedMessageContent::ApplicationMessage(am) = processed.into_content() else {
            return Ok(vec![]);
        };
        let (Some(sender), Ok(msg)) =
            (sender, postcard::from_bytes::<AppMessage>(&am.into_bytes()))
        else {
            c.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(vec![]);
        };
        let body_digest = digest(&msg.body);
        match self.shared.records.message(b, &group, &msg.id)? {
            Some(known) if !skip_dedup => {
                if known == body_digest {
                    c.duplicates.fetch_add(1, Ordering::Relaxed);
                    Ok(vec![])
                } else {
                    Ok(vec![Event::Conflict { group, id: msg.id }])
                }
            }
            _ => {
                self.shared
                    .records
                    .mark_message(b, &group, &msg.id, &body_digest);
                if control {
                    // The engine's own, never the app's.
                    self.on_control(group, sender, &msg.body);
                    return Ok(vec![]);
                }
                // Into the app's inbox in the same batch: durable before
                // the hub delivery is acked.
                let staged = self
                    .shared
                    .inbox
                    .stage(b, &group, sender, msg.id, &msg.body)?;
                c.delivered.fetch_add(1, Ordering::Relaxed);
                let mut events = Vec::with_capacity(2);
                if let Some(position) = staged.trimmed {
                    c.inbox_trimmed.fetch_add(1, Ordering::Relaxed);
                    events.push(Event::InboxTrimmed { group, position });
                }
                events.push(Event::MessageReceived {
                    group,
                    position: staged.position,
                    sender,
                    id: msg.id,
                    body: msg.body,
                });
                Ok(events)
            }
        }
    }

    /// Read the frames that waited for an epoch we have now reached.
    fn retry_future_frames(
        &self,
        guard: &mut GroupGuard,
        rec: &GroupRecord,
    ) -> Result<(), DeviceError> {
        let kept = self.shared.records.future_frames(&rec.id)?;
        if kept.is_empty() {
            return Ok(());
        }
        let ours = guard.read(|g| g.epoch().as_u64())?;
        let mut b = WriteBatch::new();
        let mut events = Vec::new();
        for (k, frame) in kept {
            let epoch = MlsMessageIn::tls_deserialize_exact(&frame)
                .ok()
                .and_then(|m| m.try_into_protocol_message().ok())
                .map(|pm| pm.epoch().as_u64());
            if epoch.is_some_and(|e| e > ours) {
                continue;
            }
            b.delete(k);
            events.extend(self.receive_locked(guard, rec.id, &frame, &mut b)?);
        }
        guard.finish(b)?;
        // The app hears of a message only once it is durable, also when
        // this merge was one of a page's deferred ones.
        guard.flush()?;
        for e in events {
            self.emit(e);
        }
        Ok(())
    }

    /// Join the group of a Welcome envelope. Answers false when nothing was
    /// joined: a repeat, or a Welcome for a group this device still holds.
    ///
    /// A Welcome never takes a group away (DESIGN.md section 9): for a
    /// group id this device holds, from an admin or a member, it is kept
    /// aside (one per inviter, the latest) and tried only once the device
    /// has seen its own removal, if its inviter was an admin by then.
    /// Nothing about the group (lock slot, records, MLS state) is created
    /// before the Welcome and every leaf of its tree verify: the Welcome is
    /// processed in an overlay that is dropped whole on any refusal.
    pub(super) async fn join(&self, env: &WelcomeEnvelope) -> Result<bool, DeviceError> {
        if let Some(rec) = self.shared.records.group(&env.group)? {
            // Kept only from an admin or a member of the group we hold, one
            // per inviter: a stranger's envelope must not take the place
            // of a real re-invite, nor become the group we join once we
            // see our removal. A member not yet an admin here may be one
            // by commits this device has yet to read (the grant before
            // our removal and the re-invite): its Welcome is judged again
            // by the ledger as it stood at our removal.
            let admin = rec.ledger_complete
                && self
                    .ledger_state(&rec)
                    .is_ok_and(|l| l.is_admin(&env.inviter));
            let member = admin || {
                let mut guard = self.shared.registry.lock(env.group).await;
                self.member_set(&mut guard)
                    .is_ok_and(|m| m.contains(&env.inviter))
            };
            if !member || !rec.ledger_complete {
                return Err(DeviceError::Mls(
                    "a Welcome for a group this device holds, from a device that is not its admin"
                        .into(),
                ));
            }
            // A Welcome to an epoch this device is already at or past is
            // one it holds the group by already (an inviter posts its
            // Welcomes again after a hub rewind, and a device may have
            // come back by rejoining): kept, it would be joined once this
            // device sees a later removal, and hand it a state the group
            // left long ago (sim seed 896).
            let ours = {
                let mut guard = self.shared.registry.lock(env.group).await;
                guard.read(|g| g.epoch().as_u64())?
            };
            if let Some(epoch) = welcome_epoch(self, env)? {
                if epoch <= ours {
                    return Err(DeviceError::Mls(format!(
                        "a Welcome to epoch {epoch} of a group this device holds at epoch {ours}"
                    )));
                }
            }
            let mut b = WriteBatch::new();
            self.shared.records.put_pending_welcome(
                &mut b,
                &env.group,
                &env.inviter,
                &env.encode(),
            );
            let kv = self.shared.registry.provider().kv();
            kv.apply(&b)?;
            kv.flush()?;
            tracing::info!(group = %env.group, "Welcome for a group still held: kept until this device sees its removal");
            return Ok(false);
        }
        let welcome = welcome_of(env)?;
        let op = OpProvider::new(self.shared.registry.provider().clone());
        let staged = StagedWelcome::new_from_welcome(&op, &mls::join_config(), welcome, None)
            .map_err(|e| match e {
                WelcomeError::NoMatchingKeyPackage => DeviceError::KeyPackageGone {
                    group: env.group,
                    inviter: env.inviter,
                    welcome_digest: super::frames::digest(&env.welcome),
                    hubs: env.hubs.clone(),
                },
                e => DeviceError::Mls(e.to_string()),
            })?;
        // Every leaf is its device: credential identity and signature key
        // are the same ed25519 key.
        for m in staged.members() {
            if !credential_matches_key(&m.credential, &m.signature_key) {
                return Err(DeviceError::Mls(format!(
                    "the Welcome's tree has a leaf (index {}) that is not its device",
                    m.index.u32()
                )));
            }
        }
        let group = staged
            .into_group(&op)
            .map_err(|e| DeviceError::Mls(e.to_string()))?;
        if group.group_id().as_slice() != env.group.0 {
            return Err(DeviceError::Mls(
                "Welcome is for another group than its envelope says".into(),
            ));
        }
        if !group
            .members()
            .any(|m| device_id_of(&m.credential) == Some(env.inviter))
        {
            return Err(DeviceError::Mls(
                "the envelope's inviter is not a member".into(),
            ));
        }
        let ext = match GroupExt::from_extensions(group.extensions()) {
            Ok(Some(ext)) => ext,
            _ => {
                return Err(DeviceError::Mls(
                    "the group has no valid hubsync extension".into(),
                ))
            }
        };
        // The inviter sealed its whole ledger to our first epoch; it counts
        // only if it reproduces the head MLS authenticates.
        let crypto = self.shared.registry.provider().crypto();
        let key = group
            .export_secret(crypto, ledger::SNAPSHOT_KEY_LABEL, &[], 16)
            .map_err(|e| DeviceError::Mls(e.to_string()))?;
        let verified = ledger::open(crypto, &key, &env.group.0, &env.ledger)
            .and_then(|plain| super::gather::verify_ledger(env.group, &plain, &ext.ledger_head));
        let envelope_hubs: Vec<String> = env
            .hubs
            .iter()
            .map(|h| h.trim_end_matches('/').to_string())
            .collect();
        let (hubs, commit_hub, complete, entries) = match verified {
            Ok((entries, state)) => (state.hubs.clone(), select_commit_hub(&state), true, entries),
            Err(e) => {
                tracing::warn!(group = %env.group, error = %e, "the Welcome's ledger does not verify: ledger incomplete until gathered");
                (
                    envelope_hubs,
                    env.commit_hub.trim_end_matches('/').to_string(),
                    false,
                    Vec::new(),
                )
            }
        };
        // The joiner's commit topic is the one its own add moved the group
        // to: nothing was read there yet.
        let cursors = std::collections::BTreeMap::new();
        // Verified: only now does the group get state on this device.
        let mut guard = self.shared.registry.lock(env.group).await;
        if self.shared.records.group(&env.group)?.is_some() || guard.exists()? {
            // Another delivery of this Welcome won the race.
            return Ok(false);
        }
        guard.install(group);
        let (app, commit_seed) = self.roster_secrets(&mut guard)?;
        let rec = GroupRecord {
            id: env.group,
            hubs,
            commit_hub,
            cursors,
            app_topics: vec![topics::app_topic(&app)],
            app_secrets: vec![app],
            stranded: false,
            poison: 0,
            commit_seed,
            ledger_complete: complete,
            merged: Vec::new(),
            cursor_stores: std::collections::BTreeMap::new(),
            cursor_digests: std::collections::BTreeMap::new(),
            rendezvous_seed: Some(ext.topic_seed),
            lost_from: None,
            lost_seeds: Vec::new(),
            lost_to: None,
            caught_up_at_ms: 0,
            // The Welcome may be one posted again after a restore, on a
            // commit log the restore emptied: only the members can say
            // whether the group moved on.
            probe_owed: true,
        };
        let mut b = op.take_batch();
        self.shared.records.put_group(&mut b, &rec);
        let encoded: Vec<Vec<u8>> = entries.iter().map(Entry::encode).collect();
        self.shared
            .records
            .put_ledger(&mut b, &env.group, 0, &encoded);
        self.shared
            .records
            .clear_pending_welcomes(&mut b, &env.group)?;
        guard.finish(b)?;
        let epoch = guard.read(|g| g.epoch().as_u64())?;
        let members = self.members_of(&mut guard)?;
        drop(guard);
        self.emit(Event::GroupJoined {
            group: env.group,
            epoch,
        });
        self.emit(Event::MembersChanged {
            group: env.group,
            members,
        });
        Ok(true)
    }

    /// Create a group bound to `hubs` (the first is its commit hub), with
    /// this device its first member and first admin. With no hub, the
    /// group commits through this device's loopback hub until one is bound.
    ///
    /// # Errors
    /// MLS or store errors.
    pub async fn create_group(&self, hubs: &[String]) -> Result<GroupId, DeviceError> {
        let mut bound: Vec<String> = Vec::new();
        for h in hubs {
            let h = h.trim_end_matches('/').to_string();
            if !bound.contains(&h) {
                bound.push(h);
            }
        }
        let id = GroupId(self.shared.rng.bytes32());
        let topic_seed = self.shared.rng.bytes32();
        let me = &self.shared.identity;
        let mut entries =
            vec![self.sign_entry(EntryType::AdminGrant, id, me.id().0.to_vec(), Vec::new())];
        for h in &bound {
            entries.push(self.sign_entry(
                EntryType::HubBind,
                id,
                h.as_bytes().to_vec(),
                Vec::new(),
            ));
        }
        if let Some(first) = bound.first() {
            entries.push(self.sign_entry(
                EntryType::HubCommit,
                id,
                first.as_bytes().to_vec(),
                Vec::new(),
            ));
        }
        let state = LedgerState::fold(id, &entries).map_err(|e| DeviceError::Mls(e.to_string()))?;
        let ext = GroupExt {
            ledger_head: state.head,
            topic_seed,
        };
        let mut guard = self.shared.registry.lock(id).await;
        let group = {
            let p = guard.provider();
            MlsGroup::new_with_group_id(
                p,
                me.signature_key_pair(),
                &mls::create_config(ext, self.lifetime())
                    .map_err(|e| DeviceError::Mls(e.to_string()))?,
                id.to_mls(),
                me.credential_with_key(),
            )
            .map_err(|e| DeviceError::Mls(e.to_string()))?
        };
        guard.install(group);
        let (app, commit_seed) = self.roster_secrets(&mut guard)?;
        let rec = GroupRecord {
            id,
            hubs: state.hubs.clone(),
            commit_hub: select_commit_hub(&state),
            cursors: std::collections::BTreeMap::new(),
            app_topics: vec![topics::app_topic(&app)],
            app_secrets: vec![app],
            stranded: false,
            poison: 0,
            commit_seed,
            ledger_complete: true,
            merged: Vec::new(),
            cursor_stores: std::collections::BTreeMap::new(),
            cursor_digests: std::collections::BTreeMap::new(),
            rendezvous_seed: Some(topic_seed),
            lost_from: None,
            lost_seeds: Vec::new(),
            lost_to: None,
            caught_up_at_ms: 0,
            probe_owed: false,
        };
        let mut b = WriteBatch::new();
        self.shared.records.put_group(&mut b, &rec);
        let encoded: Vec<Vec<u8>> = entries.iter().map(Entry::encode).collect();
        self.shared.records.put_ledger(&mut b, &id, 0, &encoded);
        guard.finish(b)?;
        drop(guard);
        self.add_group(id).await?;
        self.emit(Event::GroupJoined {
            group: id,
            epoch: 0,
        });
        Ok(id)
    }

    /// Encrypt `body` for the group and queue it durably for every hub of
    /// the group. Answers the message id.
    ///
    /// With `wait`, first waits while the outbox is full
    /// ([`Outbox::wait_for_room`](super::outbox::Outbox::wait_for_room));
    /// without, answers [`DeviceError::OutboxFull`] at once. Either way a
    /// full outbox stops the message before it is encrypted, so nothing is
    /// half sent.
    ///
    /// A device left behind in the group (stranded) rejoins first, so the
    /// message is encrypted in an epoch the others can read; if it cannot,
    /// nothing is sent.
    ///
    /// # Errors
    /// `UnknownGroup`, `Stranded` (the rejoin did not help), `OutboxFull`
    /// (without `wait`), MLS or store errors. Hub outages are not errors:
    /// the outbox delivers once the hub is back.
    ///
    /// # Cancel safety
    /// Cancel safe while it waits for room.
    pub async fn broadcast(
        &self,
        group: GroupId,
        body: &[u8],
        wait: bool,
    ) -> Result<Sent, DeviceError> {
        // The others cannot read what this device would encrypt in an epoch
        // they left: rejoin first, then encrypt in theirs.
        self.rejoin_if_stranded(group).await?;
        self.broadcast_with(group, body, &[], wait, None).await
    }

    /// [`GroupPeerManager::broadcast`] with `aad` as the MLS message's
    /// authenticated data (empty for an app message,
    /// [`CONTROL_AAD`](super::control_msg::CONTROL_AAD) for a control message).
    /// App messages are kept (the newest [`super::records::SENT_KEPT`] per
    /// group) to be sent again if the branch they were encrypted on is
    /// lost; `again` is such a message, sent now under its own id in the
    /// current epoch (its kept copy of the lost epoch is forgotten).
    pub(super) async fn broadcast_with(
        &self,
        group: GroupId,
        body: &[u8],
        aad: &[u8],
        wait: bool,
        again: Option<&super::records::SentMessage>,
    ) -> Result<Sent, DeviceError> {
        let outbox = &self.shared.outbox;
        if wait {
            outbox.wait_for_room().await;
        } else if !outbox.has_room() {
            return Err(DeviceError::OutboxFull {
                owed: outbox.owed(),
                max: outbox.max_owed(),
            });
        }
        let mut guard = self.shared.registry.lock(group).await;
        let rec = self.record(group)?;
        let id = again.map_or_else(|| self.next_message_id(), |m| m.id);
        let plain = postcard::to_allocvec(&AppMessage {
            id,
            body: body.to_vec(),
        })
        .map_err(|e| DeviceError::Mls(e.to_string()))?;
        let signer = self.shared.identity.signature_key_pair();
        let out = guard
            .with(|g, p| {
                g.set_aad(aad.to_vec());
                g.create_message(p, signer, &plain)
            })?
            .map_err(|e| DeviceError::Mls(e.to_string()))?;
        let bytes = out
            .tls_serialize_detached()
            .map_err(|e| DeviceError::Mls(e.to_string()))?;
        let Some(writer) = rec.app_topics.first().and_then(|t| rec.app_writer(t)) else {
            return Err(DeviceError::Store("group record has no app topic".into()));
        };
        let topic = writer.topic().clone();
        let epoch = guard.read(|g| g.epoch().as_u64())?;
        let mut b = WriteBatch::new();
        // Our own frame may come back (forwarding); it is already handled.
        self.shared
            .records
            .mark_frame(&mut b, &group, &digest(&bytes), epoch);
        self.shared
            .records
            .mark_message(&mut b, &group, &id, &digest(body));
        if aad.is_empty() {
            let records = &self.shared.records;
            // Pruned every so many sends (and at every merge): a scan per
            // send would cost more than the send. Before the put, so the
            // prune's deletes cannot take it back.
            let unpruned = {
                let mut n = super::manager::lock(&self.shared.sends_unpruned);
                let n = n.entry(group).or_insert(0);
                *n = (*n + 1) % SENDS_PER_PRUNE;
                *n
            };
            if unpruned == 1 {
                records
                    .prune_sent(&mut b, &group, super::records::SENT_KEPT)
                    .map_err(|e| DeviceError::Store(e.to_string()))?;
            }
            if let Some(old) = again {
                records.forget_sent(&mut b, &group, old);
            }
            records.put_sent(
                &mut b,
                &group,
                &super::records::SentMessage {
                    epoch,
                    id,
                    body: body.to_vec(),
                    at_ms: self.shared.clock.now_ms(),
                },
            );
        }
        let mut publish = crate::wire::Publish {
            topic: topic.clone(),
            publish_id: super::frames::publish_id(&id, &topic),
            class: crate::wire::RetentionClass::Log,
            expected_head: crate::wire::ExpectedHead::Unconditional,
            replay_only: false,
            retention_secs: None,
            payload: bytes,
            writer: None,
        };
        writer.sign(&mut publish);
        for hub in &rec.routes() {
            self.shared
                .outbox
                .stage(&mut b, hub, &publish)
                .map_err(|e| DeviceError::Store(e.to_string()))?;
        }
        guard.finish(b)?;
        drop(guard);
        self.shared.outbox.wake();
        Ok(Sent { id, epoch })
    }

    /// The lifetime of a key package or leaf this device makes now.
    fn lifetime(&self) -> Lifetime {
        mls::lifetime(
            self.shared.clock.now_ms(),
            self.shared.config.key_package_lifetime,
        )
    }

    /// Make `n` pool key packages (and a last-resort one when asked), their
    /// private keys stored durably before they are returned.
    pub(super) fn make_key_packages(
        &self,
        n: usize,
        last_resort: bool,
    ) -> Result<KeyPackages, DeviceError> {
        let op = OpProvider::new(self.shared.registry.provider().clone());
        let me = &self.shared.identity;
        let build = |last: bool| -> Result<(Vec<u8>, KeyPackageRef), DeviceError> {
            let mut builder = KeyPackage::builder()
                .leaf_node_capabilities(mls::capabilities())
                .key_package_lifetime(self.lifetime());
            if last {
                builder = builder.mark_as_last_resort();
            }
            let bundle = builder
                .build(
                    mls::CIPHERSUITE,
                    &op,
                    me.signature_key_pair(),
                    me.credential_with_key(),
                )
                .map_err(|e| DeviceError::Mls(e.to_string()))?;
            let kp = bundle.key_package();
            let r = kp
                .hash_ref(op.crypto())
                .map_err(|e| DeviceError::Mls(e.to_string()))?;
            let bytes = kp
                .tls_serialize_detached()
                .map_err(|e| DeviceError::Mls(e.to_string()))?;
            Ok((bytes, r))
        };
        let mut pool = Vec::with_capacity(n);
        let mut refs = Vec::with_capacity(n);
        for _ in 0..n {
            let (bytes, r) = build(false)?;
            pool.push(bytes);
            refs.push(r);
        }
        let last = if last_resort {
            Some(build(true)?.0)
        } else {
            None
        };
        let kv = self.shared.registry.provider().kv();
        kv.apply(&op.take_batch())?;
        kv.flush()?;
        Ok((pool, refs, last))
    }

    /// Members of a group.
    ///
    /// # Errors
    /// `UnknownGroup`.
    pub async fn members(&self, group: GroupId) -> Result<Vec<DeviceId>, DeviceError> {
        let mut guard = self.shared.registry.lock(group).await;
        self.members_of(&mut guard)
    }

    /// A group's epoch and epoch authenticator.
    ///
    /// # Errors
    /// `UnknownGroup`.
    pub async fn epoch(&self, group: GroupId) -> Result<(u64, Vec<u8>), DeviceError> {
        let mut guard = self.shared.registry.lock(group).await;
        Ok(guard.read(|g| {
            (
                g.epoch().as_u64(),
                g.epoch_authenticator().as_slice().to_vec(),
            )
        })?)
    }

    /// The engine's record of a group.
    ///
    /// # Errors
    /// `UnknownGroup`.
    pub fn record(&self, group: GroupId) -> Result<GroupRecord, DeviceError> {
        self.shared
            .records
            .group(&group)?
            .ok_or(DeviceError::UnknownGroup(group))
    }
}

/// The epoch `env`'s Welcome would join this device at (as its GroupInfo
/// claims: the answer only ever refuses a Welcome), read in an overlay
/// that is dropped (nothing is kept, no key package is used up); `None`
/// when this device holds no key package it names.
fn welcome_epoch(
    manager: &GroupPeerManager,
    env: &WelcomeEnvelope,
) -> Result<Option<u64>, DeviceError> {
    let welcome = welcome_of(env)?;
    // Only processed (the group secrets opened, the GroupInfo decrypted):
    // staging would refuse a group id this device holds.
    let op = OpProvider::new(manager.shared.registry.provider().clone());
    match ProcessedWelcome::new_from_welcome(&op, &mls::join_config(), welcome) {
        Ok(processed) => Ok(Some(processed.unverified_group_info().epoch().as_u64())),
        Err(WelcomeError::NoMatchingKeyPackage) => Ok(None),
        Err(e) => Err(DeviceError::Mls(e.to_string())),
    }
}

/// The MLS Welcome an envelope carries.
pub(super) fn welcome_of(env: &WelcomeEnvelope) -> Result<Welcome, DeviceError> {
    let body = MlsMessageIn::tls_deserialize_exact(&env.welcome)
        .map_err(|e| DeviceError::Mls(e.to_string()))?
        .extract();
    match body {
        MlsMessageBodyIn::Welcome(welcome) => Ok(welcome),
        _ => Err(DeviceError::Mls("the envelope holds no Welcome".into())),
    }
}
