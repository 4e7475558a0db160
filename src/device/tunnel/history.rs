//! History sync: a device that joined a group late asks a co-member, over
//! a tunnel, for the group's messages it was not there for
//! (docs/protocol.md section 28, "History").
//!
//! Off unless the group says otherwise: the group-wide setting
//! [`SETTING`] (written by an admin, so every member reads the same value)
//! names how many of the newest messages a member hands on. The serving
//! member sends at most that many of the newest messages of its durable
//! inbox, oldest first; the asking member takes at most that many (by its
//! own view of the setting), drops every one whose id it already holds,
//! and puts the rest in its own inbox, in that order.
//!
//! Who may do what: only a current member gets a tunnel at all, and a
//! member whose view of the group has history off serves none. What a
//! member hands on is that member's word: the message bodies come from
//! its inbox, not from MLS messages the joiner could verify (it holds no
//! keys of the epochs before its join).

use super::{Caller, GroupPeerManager, ResponseSink, TunnelError};
use crate::device::error::DeviceError;
use crate::device::events::Event;
use crate::device::frames::digest;
use crate::device::records::GroupId;
use crate::kv::WriteBatch;
use crate::wire::DeviceId;
use serde::{Deserialize, Serialize};
use std::sync::atomic::Ordering;

/// The procedure name the engine serves history under.
pub const PROCEDURE: &str = "hubsync/history";

/// The group setting that allows history sync: the decimal number of the
/// newest messages a member hands on. Absent, `0` or not a number: off.
pub const SETTING: &str = "history.share_last";

/// Most messages one history sync carries, whatever the setting says.
pub const MAX_HISTORY: u64 = 10_000;

/// Inbox messages read per page while serving.
const PAGE: usize = 100;

/// One message of a history stream.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Item {
    sender: DeviceId,
    id: [u8; 16],
    #[serde(with = "serde_bytes")]
    body: Vec<u8>,
}

/// What [`GroupPeerManager::sync_history`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HistorySummary {
    /// How many messages the group allows (0: history is off).
    pub allowed: u64,
    /// The member that answered, if one did.
    pub from: Option<DeviceId>,
    /// Messages put in this device's inbox.
    pub received: u64,
    /// Messages this device held already, dropped.
    pub duplicates: u64,
    /// Members asked that could not answer, with why.
    pub failed: Vec<(DeviceId, String)>,
}

impl GroupPeerManager {
    /// How many messages `group` allows a member to hand on (0: off).
    ///
    /// # Errors
    /// `UnknownGroup`, or the store's.
    pub fn history_allowed(&self, group: GroupId) -> Result<u64, DeviceError> {
        let settings = self.settings(group).map_err(|e| match e {
            crate::device::CommitError::UnknownGroup(g) => DeviceError::UnknownGroup(g),
            other => DeviceError::Store(other.to_string()),
        })?;
        Ok(settings
            .group
            .get(SETTING)
            .and_then(|s| {
                std::str::from_utf8(&s.value)
                    .ok()?
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or(0)
            .min(MAX_HISTORY))
    }

    /// Ask the other members in turn, over a tunnel, for the group's
    /// newest messages (as many as the group allows), until one answers;
    /// put those this device does not hold in its inbox, in order, and
    /// announce each as `Event::MessageReceived`.
    ///
    /// # Errors
    /// `UnknownGroup` and this device's own failures; members that cannot
    /// answer are listed in the summary, and when none could, the last
    /// one's error is returned.
    pub async fn sync_history(&self, group: GroupId) -> Result<HistorySummary, TunnelError> {
        let allowed = self.history_allowed(group)?;
        let mut summary = HistorySummary {
            allowed,
            ..HistorySummary::default()
        };
        if allowed == 0 {
            return Ok(summary);
        }
        // Live members first (presence), then the most recently seen: an
        // offline member costs a tunnel's whole open deadline.
        let others: Vec<DeviceId> = self
            .presence(group)
            .await?
            .into_iter()
            .map(|m| m.device)
            .collect();
        let mut last = TunnelError::NoAnswer;
        for member in others {
            match self
                .history_from(group, member, allowed, &mut summary)
                .await
            {
                Ok(()) => {
                    summary.from = Some(member);
                    return Ok(summary);
                }
                Err(e @ TunnelError::Device(_)) => return Err(e),
                Err(e) => {
                    summary.failed.push((member, e.to_string()));
                    last = e;
                }
            }
        }
        if summary.failed.is_empty() {
            // Nobody else in the group: nothing to sync.
            return Ok(summary);
        }
        Err(last)
    }

    async fn history_from(
        &self,
        group: GroupId,
        member: DeviceId,
        allowed: u64,
        summary: &mut HistorySummary,
    ) -> Result<(), TunnelError> {
        let tunnel = self.open_tunnel(group, member).await?;
        let mut stream = tunnel.call_stream(PROCEDURE, Vec::new()).await?;
        let mut taken = 0u64;
        while let Some(item) = stream.next().await {
            let item = item?;
            taken += 1;
            if taken > allowed {
                // More than the group allows: the rest is dropped.
                continue;
            }
            let Ok(item) = postcard::from_bytes::<Item>(&item) else {
                self.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            if self.take_history_item(group, item).await? {
                summary.received += 1;
            } else {
                summary.duplicates += 1;
            }
        }
        tunnel.close();
        Ok(())
    }

    /// Put one handed-on message in the inbox unless its id is known;
    /// answers whether it was new.
    async fn take_history_item(&self, group: GroupId, item: Item) -> Result<bool, DeviceError> {
        let mut guard = self.shared.registry.lock(group).await;
        let mut b = WriteBatch::new();
        if self.shared.records.message(&b, &group, &item.id)?.is_some() {
            return Ok(false);
        }
        self.shared
            .records
            .mark_message(&mut b, &group, &item.id, &digest(&item.body));
        let staged = self
            .shared
            .inbox
            .stage(&mut b, &group, item.sender, item.id, &item.body)?;
        guard.finish(b)?;
        drop(guard);
        if let Some(position) = staged.trimmed {
            self.shared
                .counters
                .inbox_trimmed
                .fetch_add(1, Ordering::Relaxed);
            self.emit(Event::InboxTrimmed { group, position });
        }
        self.emit(Event::MessageReceived {
            group,
            position: staged.position,
            sender: item.sender,
            id: item.id,
            body: item.body,
        });
        Ok(true)
    }

    /// Serve history to `caller`: the newest messages of this device's
    /// inbox of the group, as many as its view of the setting allows,
    /// oldest first.
    pub(super) async fn serve_history(
        &self,
        caller: Caller,
        sink: ResponseSink,
    ) -> Result<(), String> {
        let group = caller.group;
        let allowed = self.history_allowed(group).map_err(|e| e.to_string())?;
        if allowed == 0 {
            return Err("history sync is off in this group".into());
        }
        let head = self
            .shared
            .inbox
            .status(&group)
            .map_err(|e| e.to_string())?
            .head;
        let mut after = head.saturating_sub(allowed);
        while after < head {
            let page = self
                .shared
                .inbox
                .read(&group, after, PAGE)
                .map_err(|e| e.to_string())?;
            let Some(last) = page.last() else { break };
            after = last.position;
            for m in page {
                if m.position > head {
                    return Ok(());
                }
                let item = Item {
                    sender: m.sender,
                    id: m.id,
                    body: m.body,
                };
                let bytes = postcard::to_allocvec(&item).map_err(|e| e.to_string())?;
                sink.send(bytes).await.map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }
}
