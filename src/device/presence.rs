//! Presence: which co-members are live, on which hubs, and when each was
//! last seen (docs/protocol.md section 27, "Presence").
//!
//! A device says where it is with a signed [`PresenceBeacon`] on the
//! group's rendezvous mailbox of a hub, which every member subscribes to on
//! every hub bound to the group:
//!
//! - `Live`, asking, when its peer of the group on that hub starts (the
//!   device started, joined the group, or the group was bound to the hub)
//!   and its subscriptions are at the hub; members that hear an ask answer
//!   with a `Live` beacon of their own after a random 0-250 ms, unless
//!   they said `Live` there since the ask arrived (several asks at once get
//!   one answer), so a device that just came learns who is there without
//!   waiting for them to speak;
//! - `Live` when its link to that hub connects again (at most once per
//!   [`RESAY_INTERVAL`] per group and hub);
//! - `Away` on every hub it is live on when it stops.
//!
//! What a device learned lives in memory ([`PresenceBook`]); a restarted
//! device asks again. A device that crashed said no `Away`: it looks live
//! until it comes back and says so again, and `last_seen_ms` tells how old
//! that news is. Nothing is sent periodically, so presence costs one small
//! frame per group and hub at a connect, a join or a stop, plus the
//! answers to an ask.
//!
//! Co-members use it to choose whom to ask first: `sync_history` asks live
//! members before the others, and an app can do the same before
//! [`open_tunnel`](super::GroupPeerManager::open_tunnel).
//!
//! Who may do what: a beacon counts only if its signature verifies by the
//! device it names and that device is in this device's tree now; a
//! stranger's or a removed member's is dropped and counted
//! ([`DeviceStats::dropped`](super::DeviceStats)). A hub can withhold or
//! delay beacons (presence is advice, never a reason to trust), and it
//! cannot replay an old one over a newer: each device's beacons carry its
//! clock, and only a later one changes anything.

use super::error::DeviceError;
use super::identity::verify_by;
use super::manager::{lock, GroupPeerManager};
use super::records::GroupId;
use super::rejoin::{RendezvousFrame, ANSWER_JITTER_MS};
use super::topics;
use crate::wire::DeviceId;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Signature domain of a [`PresenceBeacon`].
const BEACON_DOMAIN: &[u8] = b"hubsync presence v1";

/// A device says `Live` on a hub again after a reconnect only if it did
/// not within this long.
pub const RESAY_INTERVAL: Duration = Duration::from_secs(5);

/// Hubs remembered per member (the most recently seen).
const HUBS_PER_MEMBER: usize = 16;

/// How long a stopping device spends saying `Away`, in all.
const AWAY_BUDGET: Duration = Duration::from_secs(1);

/// What a beacon says of its device on the hub it was posted to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PresenceState {
    /// Connected there, and reading the group.
    Live,
    /// Stopping: gone from there.
    Away,
}

/// "I am `device`, `state` on this hub in `group`, at `at_ms` of my clock."
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PresenceBeacon {
    /// The group.
    pub group: GroupId,
    /// The device it is about, which signed it.
    pub device: DeviceId,
    /// The device's clock (ms since the Unix epoch): only a beacon later
    /// than the last one taken from a device changes anything.
    pub at_ms: u64,
    /// Live or away.
    pub state: PresenceState,
    /// Members that hear it answer with a beacon of their own.
    pub ask: bool,
    /// ed25519 by `device` over [`PresenceBeacon::signed_bytes`].
    #[serde(with = "serde_bytes")]
    pub signature: Vec<u8>,
}

impl PresenceBeacon {
    /// What the signature covers: the domain, `group ‖ device`, `at_ms`
    /// (8 bytes big-endian), the state (0 live, 1 away) and `ask` (0, 1).
    pub fn signed_bytes(&self) -> Vec<u8> {
        let mut m = BEACON_DOMAIN.to_vec();
        m.extend_from_slice(&self.group.0);
        m.extend_from_slice(&self.device.0);
        m.extend_from_slice(&self.at_ms.to_be_bytes());
        m.push(match self.state {
            PresenceState::Live => 0,
            PresenceState::Away => 1,
        });
        m.push(u8::from(self.ask));
        m
    }

    /// Whether `device` signed it.
    pub fn verify(&self) -> bool {
        verify_by(&self.device, &self.signed_bytes(), &self.signature)
    }
}

/// Where and when one co-member was last seen, as [`presence`] answers.
///
/// [`presence`]: GroupPeerManager::presence
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberPresence {
    /// The member.
    pub device: DeviceId,
    /// The hubs it is live on as far as this device knows (it said so and
    /// did not say it went away since), most recently seen first, with
    /// when (ms on this device's clock).
    pub hubs: Vec<(String, u64)>,
    /// When it last said anything of itself, live or away (ms on this
    /// device's clock; `None`: not since this device started).
    pub last_seen_ms: Option<u64>,
    /// Live now as far as this device knows: seen live on a hub this
    /// device is connected to, and not away from it since.
    pub live: bool,
}

/// What one device learned of another.
#[derive(Debug, Default)]
struct Seen {
    /// Per hub it is live on: when it was last seen live there (this
    /// device's clock).
    hubs: BTreeMap<String, u64>,
    /// When a beacon of its last arrived (a goodbye counts: it was there).
    last_seen: Option<u64>,
    /// The newest beacon's `at_ms` taken from it.
    beacon_at: u64,
}

/// Presence learned per group, in memory.
#[derive(Debug, Default)]
pub struct PresenceBook {
    groups: HashMap<GroupId, BTreeMap<DeviceId, Seen>>,
}

impl PresenceBook {
    /// Take a verified beacon of a member heard on `hub` at `now`.
    /// Answers whether it changed anything (an older one changes nothing).
    pub fn beacon(&mut self, b: &PresenceBeacon, hub: &str, now: u64) -> bool {
        let s = self
            .groups
            .entry(b.group)
            .or_default()
            .entry(b.device)
            .or_default();
        if b.at_ms <= s.beacon_at {
            return false;
        }
        s.beacon_at = b.at_ms;
        s.last_seen = Some(now);
        match b.state {
            PresenceState::Live => {
                s.hubs.insert(hub.to_string(), now);
                bound_hubs(&mut s.hubs);
            }
            PresenceState::Away => {
                s.hubs.remove(hub);
            }
        }
        true
    }

    /// Forget everyone of `group` not in `members`.
    pub fn retain_members(&mut self, group: GroupId, members: &BTreeSet<DeviceId>) {
        if let Some(g) = self.groups.get_mut(&group) {
            g.retain(|d, _| members.contains(d));
        }
    }

    /// Forget `group`.
    pub fn forget(&mut self, group: GroupId) {
        self.groups.remove(&group);
    }

    /// The presence of each of `members`: live first, then the most
    /// recently seen, then those never seen (in id order).
    pub fn view(
        &self,
        group: GroupId,
        members: impl IntoIterator<Item = DeviceId>,
        connected: impl Fn(&str) -> bool,
    ) -> Vec<MemberPresence> {
        let known = self.groups.get(&group);
        let mut out: Vec<MemberPresence> = members
            .into_iter()
            .map(|device| {
                let seen = known.and_then(|g| g.get(&device));
                let mut hubs: Vec<(String, u64)> = seen
                    .map(|s| s.hubs.iter().map(|(h, t)| (h.clone(), *t)).collect())
                    .unwrap_or_default();
                hubs.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
                let last_seen_ms = seen.and_then(|s| s.last_seen);
                let live = hubs.iter().any(|(h, _)| connected(h));
                MemberPresence {
                    device,
                    hubs,
                    last_seen_ms,
                    live,
                }
            })
            .collect();
        out.sort_by(|a, b| {
            b.live
                .cmp(&a.live)
                .then_with(|| b.last_seen_ms.cmp(&a.last_seen_ms))
                .then_with(|| a.device.cmp(&b.device))
        });
        out
    }
}

/// Keep the most recently seen [`HUBS_PER_MEMBER`] hubs.
fn bound_hubs(hubs: &mut BTreeMap<String, u64>) {
    while hubs.len() > HUBS_PER_MEMBER {
        let Some(oldest) = hubs.iter().min_by_key(|(_, t)| **t).map(|(h, _)| h.clone()) else {
            return;
        };
        hubs.remove(&oldest);
    }
}

impl GroupPeerManager {
    /// Where and when each co-member in `group` was last seen: live
    /// members first, then the most recently seen, then those not seen
    /// since this device started. This device is not in it.
    ///
    /// # Errors
    /// `UnknownGroup`, or reading the group's MLS state failing.
    pub async fn presence(&self, group: GroupId) -> Result<Vec<MemberPresence>, DeviceError> {
        let me = self.shared.identity.id();
        let members: BTreeSet<DeviceId> = {
            let mut guard = self.shared.registry.lock(group).await;
            self.member_set(&mut guard)?.into_iter().collect()
        };
        let links: BTreeSet<String> = lock(&self.shared.links)
            .iter()
            .filter(|(_, l)| l.is_connected())
            .map(|(u, _)| u.clone())
            .collect();
        let mut book = lock(&self.shared.presence);
        book.retain_members(group, &members);
        Ok(
            book.view(group, members.into_iter().filter(|d| *d != me), |h| {
                links.contains(h)
            }),
        )
    }

    /// When this device last said `Live` on `hub` in `group` (ms), if it
    /// did since it started.
    fn last_live(&self, group: GroupId, hub: &str) -> Option<u64> {
        lock(&self.shared.presence_sent)
            .get(&(group, hub.to_string()))
            .copied()
    }

    /// Say `Live` on `hub` in `group` unless it was said there within
    /// [`RESAY_INTERVAL`] (a link that connects again and again costs one
    /// beacon per interval).
    pub(crate) async fn announce_live(&self, group: GroupId, hub: &str) -> Result<(), DeviceError> {
        let now = self.shared.clock.now_ms();
        if self
            .last_live(group, hub)
            .is_some_and(|t| now < t.saturating_add(RESAY_INTERVAL.as_millis() as u64))
        {
            return Ok(());
        }
        self.announce(group, hub, PresenceState::Live, false).await
    }

    /// Say on `hub` that this device is `state` in `group`; `ask` has the
    /// members there answer.
    pub(crate) async fn announce(
        &self,
        group: GroupId,
        hub: &str,
        state: PresenceState,
        ask: bool,
    ) -> Result<(), DeviceError> {
        let now = self.shared.clock.now_ms();
        if state == PresenceState::Live {
            if self.shared.shutdown.is_cancelled() {
                // Stopping: an answer still on its way would undo the
                // `Away`.
                return Ok(());
            }
            lock(&self.shared.presence_sent).insert((group, hub.to_string()), now);
        }
        let Some(seed) = self.record(group)?.rendezvous_seed else {
            return Ok(());
        };
        let me = &self.shared.identity;
        let mut b = PresenceBeacon {
            group,
            device: me.id(),
            at_ms: now,
            state,
            ask,
            signature: Vec::new(),
        };
        b.signature = me.signature_over(&b.signed_bytes());
        let bytes = postcard::to_allocvec(&RendezvousFrame::Presence(b))
            .map_err(|e| DeviceError::Mls(e.to_string()))?;
        self.post_rendezvous(hub, &topics::rendezvous_topic(&seed), &bytes)
            .await
            .map_err(|e| DeviceError::Hub {
                url: hub.to_string(),
                reason: format!("posting a presence beacon: {e}"),
            })
    }

    /// Once the peer of `group` on `hub` has its subscriptions at the hub
    /// (so the answers reach it), say `Live` there, asking who else is.
    /// Tried again each second until `cancel`: the link may not be up yet.
    pub(crate) fn ask_presence_in_background(
        &self,
        group: GroupId,
        hub: &str,
        link: &super::link::HubLink,
        cancel: &tokio_util::sync::CancellationToken,
    ) {
        let (me, hub, link, cancel) = (self.clone(), hub.to_string(), link.clone(), cancel.clone());
        self.shared.tasks.spawn(async move {
            loop {
                let asked = async {
                    link.flush_subscriptions()
                        .await
                        .map_err(|e| DeviceError::Hub {
                            url: hub.clone(),
                            reason: e.to_string(),
                        })?;
                    me.announce(group, &hub, PresenceState::Live, true).await
                };
                let r = tokio::select! {
                    _ = cancel.cancelled() => return,
                    r = asked => r,
                };
                match r {
                    Ok(()) => return,
                    Err(DeviceError::UnknownGroup(_)) => return,
                    Err(e) => {
                        tracing::debug!(%group, hub, error = %e, "presence ask not posted yet")
                    }
                }
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        });
    }

    /// Say `Away` on every connected hub of every group, within
    /// [`AWAY_BUDGET`] in all: the device is stopping. Best effort: the
    /// others keep when it was last seen. A beacon that could not be posted
    /// is counted in `control_failures` (one still out at the budget is
    /// dropped with the stop).
    pub(crate) async fn announce_away(&self) {
        let groups = match self.shared.records.groups() {
            Ok(g) => g,
            Err(e) => {
                self.shared
                    .counters
                    .control_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, "no Away beacons: the groups could not be read");
                return;
            }
        };
        let links: BTreeSet<String> = lock(&self.shared.links)
            .iter()
            .filter(|(_, l)| l.is_connected())
            .map(|(u, _)| u.clone())
            .collect();
        let mut sends = tokio::task::JoinSet::new();
        for rec in groups {
            for hub in rec.routes().into_iter().filter(|h| links.contains(h)) {
                let me = self.clone();
                let group = rec.id;
                sends.spawn(async move {
                    // The device is stopping: nobody is left to return this
                    // to, so it is counted where an operator sees it (a
                    // missed Away only leaves the device listed as last
                    // seen live until the others' presence ages it out).
                    if let Err(e) = me.announce(group, &hub, PresenceState::Away, false).await {
                        me.shared
                            .counters
                            .control_failures
                            .fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(%group, hub, error = %e, "Away beacon not posted");
                    }
                });
            }
        }
        let _ = tokio::time::timeout(AWAY_BUDGET, async {
            while sends.join_next().await.is_some() {}
        })
        .await;
    }

    /// A beacon arrived on `group`'s rendezvous mailbox at `hub` (its
    /// signature verified): take it if its device is a member, and answer
    /// an `ask`.
    pub(crate) fn on_beacon(&self, group: GroupId, hub: &str, b: PresenceBeacon) {
        let hub = hub.to_string();
        let who = b.device;
        self.handle_request(group, who, "presence beacon", move |this| async move {
            let member = {
                let mut guard = this.shared.registry.lock(group).await;
                this.member_set(&mut guard)?.contains(&b.device)
            };
            if !member {
                this.shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            let now = this.shared.clock.now_ms();
            let taken = lock(&this.shared.presence).beacon(&b, &hub, now);
            if taken && b.ask && b.state == PresenceState::Live {
                // The asker was subscribed when it asked: a beacon of ours
                // posted after its ask reached it, so several asks at
                // once get one answer.
                let jitter = this.shared.rng.next_u64() % (ANSWER_JITTER_MS + 1);
                tokio::time::sleep(Duration::from_millis(jitter)).await;
                if this.last_live(group, &hub).is_some_and(|t| t >= now) {
                    return Ok(());
                }
                this.announce(group, &hub, PresenceState::Live, false)
                    .await?;
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::{Signer as _, SigningKey};

    fn beacon(k: &SigningKey, at_ms: u64, state: PresenceState) -> PresenceBeacon {
        let mut b = PresenceBeacon {
            group: GroupId([1; 32]),
            device: DeviceId(k.verifying_key().to_bytes()),
            at_ms,
            state,
            ask: false,
            signature: Vec::new(),
        };
        b.signature = k.sign(&b.signed_bytes()).to_bytes().to_vec();
        b
    }

    #[test]
    fn a_beacon_verifies_only_as_signed_with_every_field() {
        let k = SigningKey::from_bytes(&[3; 32]);
        let b = beacon(&k, 10, PresenceState::Live);
        assert!(b.verify());
        let mut later = b.clone();
        later.at_ms = 11;
        assert!(!later.verify());
        let mut away = b.clone();
        away.state = PresenceState::Away;
        assert!(!away.verify());
        let mut asking = b.clone();
        asking.ask = true;
        assert!(!asking.verify());
        let mut other = b.clone();
        other.device = DeviceId([4; 32]);
        assert!(!other.verify());
    }

    #[test]
    fn an_older_beacon_changes_nothing_and_away_ends_liveness_on_its_hub() {
        let k = SigningKey::from_bytes(&[3; 32]);
        let d = DeviceId(k.verifying_key().to_bytes());
        let g = GroupId([1; 32]);
        let mut book = PresenceBook::default();
        assert!(book.beacon(&beacon(&k, 10, PresenceState::Live), "h0", 100));
        assert!(book.beacon(&beacon(&k, 11, PresenceState::Live), "h1", 110));
        let v = book.view(g, [d], |_| true);
        assert!(v[0].live);
        assert_eq!(v[0].last_seen_ms, Some(110));
        assert_eq!(v[0].hubs[0].0, "h1");
        // Away from h1; a replay of the older live beacon there is ignored.
        assert!(book.beacon(&beacon(&k, 12, PresenceState::Away), "h1", 120));
        assert!(!book.beacon(&beacon(&k, 11, PresenceState::Live), "h1", 130));
        let v = book.view(g, [d], |h| h == "h1");
        assert!(!v[0].live, "away from the only hub this device reaches");
        assert_eq!(v[0].hubs, vec![("h0".to_string(), 100)]);
        // Back on h1.
        assert!(book.beacon(&beacon(&k, 13, PresenceState::Live), "h1", 140));
        assert!(book.view(g, [d], |h| h == "h1")[0].live);
    }

    #[test]
    fn the_view_puts_live_members_first_then_the_most_recently_seen() {
        let g = GroupId([1; 32]);
        let keys: Vec<SigningKey> = (1..=4u8)
            .map(|i| SigningKey::from_bytes(&[i; 32]))
            .collect();
        let [a, b, c, d] = [0, 1, 2, 3].map(|i| DeviceId(keys[i].verifying_key().to_bytes()));
        let mut book = PresenceBook::default();
        book.beacon(&beacon(&keys[0], 1, PresenceState::Live), "down", 500);
        book.beacon(&beacon(&keys[1], 1, PresenceState::Live), "up", 100);
        book.beacon(&beacon(&keys[2], 1, PresenceState::Live), "up", 200);
        let v = book.view(g, [a, b, c, d], |h| h == "up");
        let order: Vec<DeviceId> = v.iter().map(|m| m.device).collect();
        assert_eq!(order, vec![c, b, a, d]);
        assert_eq!(v[3].last_seen_ms, None);
        book.retain_members(g, &[c].into_iter().collect());
        assert_eq!(book.view(g, [a], |_| true)[0].last_seen_ms, None);
    }

    #[test]
    fn a_member_keeps_its_most_recent_hubs_only() {
        let g = GroupId([1; 32]);
        let k = SigningKey::from_bytes(&[3; 32]);
        let d = DeviceId(k.verifying_key().to_bytes());
        let mut book = PresenceBook::default();
        for i in 0..(HUBS_PER_MEMBER as u64 + 5) {
            book.beacon(&beacon(&k, i + 1, PresenceState::Live), &format!("h{i}"), i);
        }
        let v = book.view(g, [d], |_| false);
        assert_eq!(v[0].hubs.len(), HUBS_PER_MEMBER);
        assert_eq!(v[0].hubs.last().map(|h| h.1), Some(5));
    }
}
