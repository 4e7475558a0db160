//! What a device tells its app.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use futures::Stream;
use tokio::sync::broadcast;
use tokio_util::sync::ReusableBoxFuture;

use super::lane::{CommitError, CommitKind, SkipReason};
use super::records::GroupId;
use crate::wire::DeviceId;

/// The status of one hub connection, as events report it.
pub use super::link::LinkStatus;

/// Something that happened on a device. Every [`EventStream`] gets every
/// event from the moment it subscribed; one that falls more than the
/// channel's capacity behind misses the oldest and is told how many
/// ([`EventsLagged`]). The device's state (and, for messages, its durable
/// inbox) is always the source of truth.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// This device joined a group (created it or accepted a Welcome).
    GroupJoined {
        /// The group.
        group: GroupId,
        /// Its epoch at joining.
        epoch: u64,
    },
    /// An app message arrived, once, however many hubs carried it. It is
    /// in the group's durable inbox at `position` (see
    /// [`Device::messages`](super::Device::messages)) before this is sent.
    MessageReceived {
        /// The group.
        group: GroupId,
        /// Its position in the group's inbox.
        position: u64,
        /// The sending member.
        sender: DeviceId,
        /// The sender's message id.
        id: [u8; 16],
        /// The message.
        body: Vec<u8>,
    },
    /// The group's inbox was full ([`InboxConfig::max_unprocessed`]
    /// unprocessed messages): the unprocessed message at `position` was
    /// deleted to make room for a new one.
    ///
    /// [`InboxConfig::max_unprocessed`]: super::InboxConfig::max_unprocessed
    InboxTrimmed {
        /// The group.
        group: GroupId,
        /// The position deleted.
        position: u64,
    },
    /// The group's members changed.
    MembersChanged {
        /// The group.
        group: GroupId,
        /// Members now.
        members: Vec<DeviceId>,
    },
    /// The group moved to a new epoch.
    EpochChanged {
        /// The group.
        group: GroupId,
        /// The new epoch.
        epoch: u64,
    },
    /// This device was removed from the group; its state there is gone.
    Removed {
        /// The group.
        group: GroupId,
    },
    /// A message id arrived again with different content: reported, not
    /// delivered.
    Conflict {
        /// The group.
        group: GroupId,
        /// The message id.
        id: [u8; 16],
    },
    /// The group moved on without this device (a gap or a later epoch in the
    /// commit log); it needs recovery.
    Stranded {
        /// The group.
        group: GroupId,
    },
    /// A commit-topic frame was skipped without being applied, and why.
    FrameSkipped {
        /// The group.
        group: GroupId,
        /// The hub it was read from.
        hub: String,
        /// Its position there.
        seq: u64,
        /// Why.
        reason: SkipReason,
    },
    /// A hub holds less than this device already read from it (it lost or
    /// restored its store): its logs are read again from the start and it
    /// is never compared-and-set against a head below what we read.
    HubRewound {
        /// The hub.
        url: String,
    },
    /// The group's ledger grew (admins, hubs, commit hub or settings may
    /// have changed).
    LedgerChanged {
        /// The group.
        group: GroupId,
    },
    /// A hub trimmed `missed` frames of one of the group's app logs before
    /// this device read them (it was away longer than the hub keeps): the
    /// messages among them that no other hub of the group delivers are
    /// lost to this device.
    AppFramesMissed {
        /// The group.
        group: GroupId,
        /// The hub.
        hub: String,
        /// How many frames.
        missed: u64,
    },
    /// The group's whole ledger was gathered from a member
    /// ([`request_ledger_catchup`]) and installed: it reproduced the
    /// group's authenticated ledger head.
    ///
    /// [`request_ledger_catchup`]: super::GroupPeerManager::request_ledger_catchup
    LedgerGathered {
        /// The group.
        group: GroupId,
        /// The member whose answer was installed.
        from: DeviceId,
        /// Entries in the installed ledger.
        entries: usize,
    },
    /// A commit journalled before a crash or a timeout never landed. A lost
    /// ledger commit is re-driven once (`redriven`); a lost invite or
    /// remove must be issued again by the app.
    CommitLost {
        /// The group.
        group: GroupId,
        /// What it was.
        kind: CommitKind,
        /// The device it added or removed.
        subject: Option<DeviceId>,
        /// Whether its ledger entries were issued again.
        redriven: bool,
    },
    /// A commit the engine started on its own (a re-drive) failed.
    CommitFailed {
        /// The group.
        group: GroupId,
        /// What it was.
        kind: CommitKind,
        /// Why.
        error: CommitError,
    },
    /// This device forgot the group on its own
    /// ([`Device::forget_group`](super::Device::forget_group)): its state
    /// there is gone; the other members were not told.
    Forgotten {
        /// The group.
        group: GroupId,
    },
    /// A Welcome addressed to this device was refused: it does not verify,
    /// or it names a group this device holds and its inviter is neither an
    /// admin nor a member of that group, or it was kept aside while this
    /// device held the group and its inviter was not an admin when this
    /// device saw its removal. Nothing was joined or changed.
    WelcomeRefused {
        /// The group the envelope names, when it could be read.
        group: Option<GroupId>,
        /// Why.
        reason: String,
    },
    /// This device rejoined a group that had left it behind, by external
    /// commit ([`rejoin_group`]); it is at `epoch` and can commit again.
    ///
    /// [`rejoin_group`]: super::GroupPeerManager::rejoin_group
    Rejoined {
        /// The group.
        group: GroupId,
        /// The group's epoch after the rejoin.
        epoch: u64,
    },
    /// After a rejoin, the app messages this device had encrypted on a
    /// branch of the group it lost (a fork) were sent again in the group's
    /// epoch, under their own ids (so members that read them the first
    /// time drop them).
    MessagesSentAgain {
        /// The group.
        group: GroupId,
        /// Their ids, as `send` answered them.
        ids: Vec<[u8; 16]>,
        /// Whether older messages of that branch had already been
        /// forgotten (more than the kept number were sent since), so they
        /// never reach the members who did not read them.
        older_forgotten: bool,
    },
    /// A remedy did not help (tried by [`commit_with_recovery`], whose
    /// commit then answered its original error, or called by the app).
    ///
    /// [`commit_with_recovery`]: super::GroupPeerManager::commit_with_recovery
    RecoveryFailed {
        /// The group.
        group: GroupId,
        /// The remedy.
        remedy: super::Remedy,
        /// Why it did not help.
        reason: String,
    },
    /// A claimed key package of `device` was refused (it is not valid MLS,
    /// or its leaf is not `device`'s own): someone planted it on `hub`.
    KeyPackageRefused {
        /// The device it claims to be.
        device: DeviceId,
        /// The hub that handed it out.
        hub: String,
        /// Why.
        reason: String,
    },
    /// A hub refused to subscribe this device to a topic (too many
    /// subscriptions on that hub, say): frames on it are not pushed from
    /// that hub until a later subscribe succeeds. Counted in
    /// `DeviceStats::subscriptions_refused`.
    SubscriptionRefused {
        /// The hub.
        hub: String,
        /// The group the topic belongs to, when it is one of a group's.
        group: Option<GroupId>,
        /// The topic.
        topic: crate::wire::TopicId,
        /// The hub's answer.
        error: crate::wire::HubError,
    },
    /// A hub connection changed status.
    HubStatus {
        /// The hub.
        url: String,
        /// Its new status.
        status: LinkStatus,
    },
}

/// A subscription to a device's events, from
/// [`Device::events`](super::Device::events): a [`Stream`] of every event
/// emitted after it was made, in order. Every subscription behaves the same;
/// none holds events from before it was made (an app that needs those sets
/// [`ManagerConfig::observer`](super::ManagerConfig::observer) before it opens
/// the device; messages wait in the durable inbox anyway). The stream ends
/// when the device closes.
pub struct EventStream {
    next: ReusableBoxFuture<'static, Received>,
}

/// One receive and the receiver it came from, so the next one reuses it.
type Received = (
    Result<Event, broadcast::error::RecvError>,
    broadcast::Receiver<Event>,
);

async fn receive(mut rx: broadcast::Receiver<Event>) -> Received {
    let got = rx.recv().await;
    (got, rx)
}

/// A subscriber fell more than the channel's capacity behind: `missed`
/// events (the oldest) are gone for it. What they said is in the device's
/// state and inbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("event subscriber fell behind: {missed} events missed")]
pub struct EventsLagged {
    /// How many events this subscriber missed.
    pub missed: u64,
}

impl EventStream {
    pub(super) fn new(rx: broadcast::Receiver<Event>) -> Self {
        Self {
            next: ReusableBoxFuture::new(receive(rx)),
        }
    }

    /// The next event, `Err` when some were missed, `None` once the device
    /// closed. Cancel-safe: dropping the future loses nothing.
    pub async fn recv(&mut self) -> Option<Result<Event, EventsLagged>> {
        futures::StreamExt::next(self).await
    }

    /// The next event if one is waiting now, without waiting; `None` when
    /// none is (or the device closed).
    pub fn try_recv(&mut self) -> Option<Result<Event, EventsLagged>> {
        futures::FutureExt::now_or_never(self.recv()).flatten()
    }
}

impl Stream for EventStream {
    type Item = Result<Event, EventsLagged>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let (got, rx) = ready!(self.next.poll(cx));
        self.next.set(receive(rx));
        Poll::Ready(match got {
            Ok(e) => Some(Ok(e)),
            Err(broadcast::error::RecvError::Lagged(missed)) => Some(Err(EventsLagged { missed })),
            Err(broadcast::error::RecvError::Closed) => None,
        })
    }
}

impl std::fmt::Debug for EventStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EventStream")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn joined(epoch: u64) -> Event {
        Event::GroupJoined {
            group: GroupId([7; 32]),
            epoch,
        }
    }

    /// A subscriber that falls behind is told how many it missed, then
    /// goes on with what is left; the stream ends when the sender goes.
    #[tokio::test]
    async fn a_lagging_subscriber_is_told_how_many_it_missed() {
        let (tx, _) = broadcast::channel(2);
        let mut s = EventStream::new(tx.subscribe());
        for epoch in 0..5 {
            tx.send(joined(epoch)).unwrap();
        }
        assert_eq!(s.recv().await, Some(Err(EventsLagged { missed: 3 })));
        assert_eq!(s.recv().await, Some(Ok(joined(3))));
        assert_eq!(s.try_recv(), Some(Ok(joined(4))));
        assert_eq!(s.try_recv(), None);
        drop(tx);
        assert_eq!(s.recv().await, None);
    }
}
