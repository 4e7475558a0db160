//! The ledger's state and the rules that decide whether an entry is
//! accepted.
//!
//! [`LedgerState`] is the fold of a ledger from its genesis. Every entry is
//! first *planned* against the current state (all checks, no mutation), and
//! only a plan that passed is *committed*; so [`LedgerState::check`] and
//! [`LedgerState::apply`] cannot disagree, and a refused entry changes
//! nothing.
//!
//! # Rules
//!
//! Authority is judged against the state of the earlier entries only.
//!
//! Every entry: its `group` is the ledger's ([`LedgerError::WrongGroup`]); its
//! signature verifies ([`LedgerError::BadSignature`]); it is within the
//! encoding's limits ([`LedgerError::Malformed`]); its id is not already held
//! ([`LedgerError::Duplicate`]); its type is known
//! ([`LedgerError::UnknownType`]); its `value` is empty unless it is a
//! `group.setting`, and its subject has its type's shape
//! ([`LedgerError::Malformed`]). Then, per type:
//!
//! | type | subject | who | refused when | effect |
//! |---|---|---|---|---|
//! | first entry | its author | anyone | not an `admin.grant` to its own author | author is the first admin and member |
//! | `member.invite` | device id | admin | already a member | joins members |
//! | `member.remove` | device id | admin | not a member; the last admin | leaves members and admins; its `self.*` settings go |
//! | `admin.grant` | device id, not the author | admin | not a member | joins admins (no-op if one already) |
//! | `admin.revoke` | device id | admin | not an admin; the last admin | leaves admins |
//! | `hub.bind` | hub URL | admin | — | appended to hubs (no-op if bound) |
//! | `hub.unbind` | hub URL | admin | it is the commit hub | removed from hubs (no-op if unbound) |
//! | `hub.commit` | hub URL | admin | not bound | becomes the commit hub |
//! | `group.setting` `self.*` | setting name | any member | — | the author's own setting |
//! | `group.setting` other | setting name | admin | — | the group-wide setting |
//!
//! A setting holds the value of the entry with the greatest `(ord, id)`: an
//! older entry is accepted into the ledger (it still advances the head) but
//! does not replace a newer value, so the result does not depend on the
//! order in which writers' entries were enacted.
//!
//! A device id subject is 32 bytes; a hub URL is 1..=1024 bytes of UTF-8; a
//! setting name is 1..=256 bytes of UTF-8.

use super::chain;
use super::entry::{Entry, EntryId, EntryType};
use super::hlc::Hlc;
use super::LedgerError;
use crate::device::records::GroupId;
use crate::wire::DeviceId;
use std::collections::{BTreeMap, BTreeSet, HashSet};

/// Prefix of a setting name that belongs to its author alone.
pub const SELF_SETTING_PREFIX: &str = "self.";
/// Longest setting name, in bytes.
pub const MAX_SETTING_NAME_LEN: usize = 256;
/// Longest hub URL, in bytes.
pub const MAX_HUB_URL_LEN: usize = 1024;

/// A setting's current value and the entry that set it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    /// The value bytes.
    pub value: Vec<u8>,
    /// The `ord` of the entry that set it.
    pub ord: Hlc,
    /// The author of that entry.
    pub author: DeviceId,
    /// The id of that entry (breaks ties between equal `ord`s).
    pub id: EntryId,
}

/// The fold of a group's ledger: who is in it, who administers it, which
/// hubs carry it, its settings, and the head the entries reach.
///
/// Built only by [`LedgerState::new`] and by applying entries, so it always
/// equals the full replay of the entries it has seen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LedgerState {
    /// The group whose ledger this is.
    pub group: GroupId,
    /// The head after the entries applied (the genesis when none).
    pub head: [u8; 32],
    /// How many entries were applied.
    pub len: u64,
    /// Current admins (always a subset of `members`; never empty once the
    /// first entry is in).
    pub admins: BTreeSet<DeviceId>,
    /// Current members.
    pub members: BTreeSet<DeviceId>,
    /// Bound hub URLs, in the order they were bound.
    pub hubs: Vec<String>,
    /// The commit hub, if one was named (always one of `hubs`).
    pub commit_hub: Option<String>,
    /// Group-wide settings, by name.
    pub settings: BTreeMap<String, Setting>,
    /// Members' own `self.*` settings, by (member, name).
    pub member_settings: BTreeMap<(DeviceId, String), Setting>,
    ids: HashSet<EntryId>,
}

/// What a checked entry will do to the state.
enum Effect {
    Genesis(DeviceId),
    Invite(DeviceId),
    Remove(DeviceId),
    Grant(DeviceId),
    Revoke(DeviceId),
    Bind(String),
    Unbind(String),
    Commit(String),
    GroupSetting(String, Setting),
    MemberSetting(DeviceId, String, Setting),
}

impl LedgerState {
    /// The empty ledger of `group`: no members, head = genesis.
    pub fn new(group: GroupId) -> Self {
        LedgerState {
            group,
            head: chain::genesis(&group),
            len: 0,
            admins: BTreeSet::new(),
            members: BTreeSet::new(),
            hubs: Vec::new(),
            commit_hub: None,
            settings: BTreeMap::new(),
            member_settings: BTreeMap::new(),
            ids: HashSet::new(),
        }
    }

    /// Whether `e` would be accepted as the next entry. Changes nothing.
    ///
    /// # Errors
    /// The reason it would be refused (see the module doc's rules).
    pub fn check(&self, e: &Entry) -> Result<(), LedgerError> {
        self.plan(e).map(|_| ())
    }

    /// Appends `e`: checks it, then applies its effect and advances `head`
    /// and `len`.
    ///
    /// # Errors
    /// As [`check`](Self::check); on error the state is unchanged.
    pub fn apply(&mut self, e: &Entry) -> Result<(), LedgerError> {
        let (id, effect) = self.plan(e)?;
        self.commit(id, effect);
        Ok(())
    }

    /// The state of `group`'s ledger holding `entries`, replayed in order
    /// from the genesis.
    ///
    /// # Errors
    /// The first refused entry's reason.
    pub fn fold(group: GroupId, entries: &[Entry]) -> Result<Self, LedgerError> {
        let mut state = LedgerState::new(group);
        for e in entries {
            state.apply(e)?;
        }
        Ok(state)
    }

    /// Like [`fold`](Self::fold), and the result must reach `expected_head`
    /// (the head authenticated in the group context): how a ledger handed
    /// over by someone else is accepted.
    ///
    /// # Errors
    /// The first refused entry's reason, or [`LedgerError::HeadMismatch`].
    pub fn fold_to(
        group: GroupId,
        entries: &[Entry],
        expected_head: &[u8; 32],
    ) -> Result<Self, LedgerError> {
        let state = Self::fold(group, entries)?;
        if &state.head != expected_head {
            return Err(LedgerError::HeadMismatch);
        }
        Ok(state)
    }

    /// Whether the entry with that id is in the ledger.
    pub fn contains(&self, id: &EntryId) -> bool {
        self.ids.contains(id)
    }

    /// Whether `d` is an admin.
    pub fn is_admin(&self, d: &DeviceId) -> bool {
        self.admins.contains(d)
    }

    /// Whether `d` is a member.
    pub fn is_member(&self, d: &DeviceId) -> bool {
        self.members.contains(d)
    }

    /// The head that applying `entries` in order would give. Changes nothing.
    ///
    /// # Errors
    /// The first entry that would be refused, and why.
    pub fn head_after(&self, entries: &[Entry]) -> Result<[u8; 32], LedgerError> {
        if entries.is_empty() {
            return Ok(self.head);
        }
        let mut scratch = self.clone();
        for e in entries {
            scratch.apply(e)?;
        }
        Ok(scratch.head)
    }

    /// Every check, in the documented order, and the effect to commit.
    fn plan(&self, e: &Entry) -> Result<(EntryId, Effect), LedgerError> {
        if e.group != self.group {
            return Err(LedgerError::WrongGroup);
        }
        e.verify()?;
        e.check_limits()?;
        let id = e.id();
        if self.ids.contains(&id) {
            return Err(LedgerError::Duplicate(id));
        }
        if let EntryType::Unknown(name) = &e.kind {
            return Err(LedgerError::UnknownType(name.clone()));
        }
        if e.kind != EntryType::GroupSetting && !e.value.is_empty() {
            return Err(LedgerError::Malformed(format!(
                "{} carries a value; only group.setting may",
                e.kind
            )));
        }
        let not_authorized = || LedgerError::NotAuthorized {
            kind: e.kind.as_str().to_owned(),
            author: e.author,
        };
        let admin = self.is_admin(&e.author);

        if self.len == 0 {
            // The creator makes itself the first admin (and member); nothing
            // else can open a ledger, or anyone could claim an empty group.
            return match (&e.kind, e.subject_device()) {
                (EntryType::AdminGrant, Some(d)) if d == e.author => Ok((id, Effect::Genesis(d))),
                _ => Err(not_authorized()),
            };
        }

        let effect = match &e.kind {
            EntryType::MemberInvite => {
                let d = device_subject(e)?;
                if !admin {
                    return Err(not_authorized());
                }
                if self.is_member(&d) {
                    return Err(LedgerError::AlreadyMember(d));
                }
                Effect::Invite(d)
            }
            EntryType::MemberRemove => {
                let d = device_subject(e)?;
                // An admin removes anyone; any member may remove itself
                // (leaving), which another member commits.
                if !admin && d != e.author {
                    return Err(not_authorized());
                }
                if !self.is_member(&d) {
                    return Err(LedgerError::NotAMember(d));
                }
                if self.is_last_admin(&d) {
                    return Err(LedgerError::LastAdmin);
                }
                Effect::Remove(d)
            }
            EntryType::AdminGrant => {
                let d = device_subject(e)?;
                // A later self-grant is refused even from an admin: only the
                // genesis entry may name its own author.
                if !admin || d == e.author {
                    return Err(not_authorized());
                }
                if !self.is_member(&d) {
                    return Err(LedgerError::NotAMember(d));
                }
                Effect::Grant(d)
            }
            EntryType::AdminRevoke => {
                let d = device_subject(e)?;
                if !admin {
                    return Err(not_authorized());
                }
                if !self.is_admin(&d) {
                    return Err(LedgerError::NotAnAdmin(d));
                }
                if self.is_last_admin(&d) {
                    return Err(LedgerError::LastAdmin);
                }
                Effect::Revoke(d)
            }
            EntryType::HubBind => {
                let url = hub_subject(e)?;
                if !admin {
                    return Err(not_authorized());
                }
                Effect::Bind(url)
            }
            EntryType::HubUnbind => {
                let url = hub_subject(e)?;
                if !admin {
                    return Err(not_authorized());
                }
                if self.commit_hub.as_deref() == Some(url.as_str()) {
                    return Err(LedgerError::CommitHubUnbind(url));
                }
                // With no hub left, each member would commit through its
                // own loopback hub: the group would fork. Only a group of
                // one may go back to its loopback hub.
                if self.hubs.len() == 1 && self.hubs[0] == url && self.members.len() > 1 {
                    return Err(LedgerError::CommitHubUnbind(url));
                }
                Effect::Unbind(url)
            }
            EntryType::HubCommit => {
                let url = hub_subject(e)?;
                if !admin {
                    return Err(not_authorized());
                }
                if !self.hubs.contains(&url) {
                    return Err(LedgerError::NotBound(url));
                }
                Effect::Commit(url)
            }
            EntryType::GroupSetting => {
                let name = setting_subject(e)?;
                let setting = Setting {
                    value: e.value.clone(),
                    ord: e.ord,
                    author: e.author,
                    id,
                };
                if name.starts_with(SELF_SETTING_PREFIX) {
                    if !self.is_member(&e.author) {
                        return Err(not_authorized());
                    }
                    Effect::MemberSetting(e.author, name, setting)
                } else {
                    if !admin {
                        return Err(not_authorized());
                    }
                    Effect::GroupSetting(name, setting)
                }
            }
            EntryType::Unknown(name) => return Err(LedgerError::UnknownType(name.clone())),
        };
        Ok((id, effect))
    }

    /// Applies a planned effect; cannot fail.
    fn commit(&mut self, id: EntryId, effect: Effect) {
        match effect {
            Effect::Genesis(d) => {
                self.members.insert(d);
                self.admins.insert(d);
            }
            Effect::Invite(d) => {
                self.members.insert(d);
            }
            Effect::Remove(d) => {
                self.members.remove(&d);
                self.admins.remove(&d);
                // A removed member's own settings leave with it, so a device
                // invited again starts clean and `member_settings` only ever
                // names members.
                self.member_settings.retain(|(owner, _), _| *owner != d);
            }
            Effect::Grant(d) => {
                self.admins.insert(d);
            }
            Effect::Revoke(d) => {
                self.admins.remove(&d);
            }
            Effect::Bind(url) => {
                if !self.hubs.contains(&url) {
                    self.hubs.push(url);
                }
            }
            Effect::Unbind(url) => self.hubs.retain(|h| *h != url),
            Effect::Commit(url) => self.commit_hub = Some(url),
            Effect::GroupSetting(name, setting) => {
                last_writer_wins(self.settings.entry(name), setting);
            }
            Effect::MemberSetting(owner, name, setting) => {
                last_writer_wins(self.member_settings.entry((owner, name)), setting);
            }
        }
        self.ids.insert(id);
        self.len += 1;
        self.head = chain::next(&self.head, self.len, &id);
    }

    fn is_last_admin(&self, d: &DeviceId) -> bool {
        self.admins.len() == 1 && self.admins.contains(d)
    }
}

/// Stores `new` unless the stored setting has a greater `(ord, id)`.
fn last_writer_wins<K: Ord>(
    slot: std::collections::btree_map::Entry<'_, K, Setting>,
    new: Setting,
) {
    use std::collections::btree_map::Entry as Slot;
    match slot {
        Slot::Vacant(v) => {
            v.insert(new);
        }
        Slot::Occupied(mut o) => {
            if (new.ord, new.id) > (o.get().ord, o.get().id) {
                o.insert(new);
            }
        }
    }
}

fn device_subject(e: &Entry) -> Result<DeviceId, LedgerError> {
    e.subject_device().ok_or_else(|| {
        LedgerError::Malformed(format!("{}: subject must be a 32-byte device id", e.kind))
    })
}

fn hub_subject(e: &Entry) -> Result<String, LedgerError> {
    match e.subject_str() {
        Some(s) if !s.is_empty() && s.len() <= MAX_HUB_URL_LEN => Ok(s.to_owned()),
        _ => Err(LedgerError::Malformed(format!(
            "{}: subject must be a hub URL of 1..=1024 bytes of UTF-8",
            e.kind
        ))),
    }
}

fn setting_subject(e: &Entry) -> Result<String, LedgerError> {
    match e.subject_str() {
        Some(s) if !s.is_empty() && s.len() <= MAX_SETTING_NAME_LEN => Ok(s.to_owned()),
        _ => Err(LedgerError::Malformed(
            "group.setting: subject must be a name of 1..=256 bytes of UTF-8".to_owned(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::SigningKey;

    const G: GroupId = GroupId([0x11; 32]);

    struct Dev {
        key: SigningKey,
        id: DeviceId,
    }

    fn dev(n: u8) -> Dev {
        let key = SigningKey::from_bytes(&[n; 32]);
        let id = DeviceId(key.verifying_key().to_bytes());
        Dev { key, id }
    }

    fn at(ms: u64) -> Hlc {
        Hlc {
            wall_ms: ms,
            counter: 0,
        }
    }

    fn entry(kind: EntryType, subject: &[u8], value: &[u8], ms: u64, by: &Dev) -> Entry {
        Entry::sign(kind, G, subject.to_vec(), value.to_vec(), at(ms), &by.key)
    }

    fn about(kind: EntryType, subject: &Dev, ms: u64, by: &Dev) -> Entry {
        entry(kind, &subject.id.0, b"", ms, by)
    }

    fn setting(name: &str, value: &[u8], ms: u64, by: &Dev) -> Entry {
        entry(EntryType::GroupSetting, name.as_bytes(), value, ms, by)
    }

    fn hub(kind: EntryType, url: &str, ms: u64, by: &Dev) -> Entry {
        entry(kind, url.as_bytes(), b"", ms, by)
    }

    /// Admin `a` (the creator), member `b`, and `c` who is not in the group.
    fn group() -> (LedgerState, Dev, Dev, Dev) {
        let (a, b, c) = (dev(1), dev(2), dev(3));
        let mut s = LedgerState::new(G);
        s.apply(&about(EntryType::AdminGrant, &a, 1, &a))
            .expect("genesis");
        s.apply(&about(EntryType::MemberInvite, &b, 2, &a))
            .expect("invite b");
        (s, a, b, c)
    }

    /// Asserts `e` is refused with `want`, by both check and apply, and that
    /// the state did not change.
    fn refuse(s: &mut LedgerState, e: &Entry, want: LedgerError) {
        let before = s.clone();
        assert_eq!(s.check(e), Err(want.clone()), "check");
        assert_eq!(s.apply(e), Err(want), "apply");
        assert_eq!(*s, before, "a refused entry changed the state");
    }

    fn not_authorized(kind: EntryType, author: &Dev) -> LedgerError {
        LedgerError::NotAuthorized {
            kind: kind.as_str().to_owned(),
            author: author.id,
        }
    }

    #[test]
    fn new_ledger_is_empty_at_genesis() {
        let s = LedgerState::new(G);
        assert_eq!(s.head, chain::genesis(&G));
        assert_eq!(s.len, 0);
        assert!(s.members.is_empty() && s.admins.is_empty());
    }

    #[test]
    fn genesis_self_grant_makes_the_creator_admin_and_member() {
        let (s, a, b, _) = group();
        assert!(s.is_admin(&a.id) && s.is_member(&a.id));
        assert!(!s.is_admin(&b.id) && s.is_member(&b.id));
        assert_eq!(s.len, 2);
    }

    #[test]
    fn first_entry_that_is_not_a_self_grant_is_refused() {
        let (a, b) = (dev(1), dev(2));
        let mut s = LedgerState::new(G);
        let grant_other = about(EntryType::AdminGrant, &b, 1, &a);
        refuse(
            &mut s,
            &grant_other,
            not_authorized(EntryType::AdminGrant, &a),
        );
        let invite = about(EntryType::MemberInvite, &a, 1, &a);
        refuse(&mut s, &invite, not_authorized(EntryType::MemberInvite, &a));
        let bind = hub(EntryType::HubBind, "wss://h", 1, &a);
        refuse(&mut s, &bind, not_authorized(EntryType::HubBind, &a));
    }

    #[test]
    fn self_grant_after_the_first_entry_is_refused() {
        let (mut s, a, b, _) = group();
        let again = about(EntryType::AdminGrant, &a, 10, &a);
        refuse(&mut s, &again, not_authorized(EntryType::AdminGrant, &a));
        let member_self = about(EntryType::AdminGrant, &b, 10, &b);
        refuse(
            &mut s,
            &member_self,
            not_authorized(EntryType::AdminGrant, &b),
        );
    }

    #[test]
    fn non_admin_cannot_invite() {
        let (mut s, _, b, c) = group();
        let e = about(EntryType::MemberInvite, &c, 10, &b);
        refuse(&mut s, &e, not_authorized(EntryType::MemberInvite, &b));
    }

    #[test]
    fn stranger_cannot_invite_itself() {
        let (mut s, _, _, c) = group();
        let e = about(EntryType::MemberInvite, &c, 10, &c);
        refuse(&mut s, &e, not_authorized(EntryType::MemberInvite, &c));
    }

    #[test]
    fn inviting_a_member_is_refused() {
        let (mut s, a, b, _) = group();
        let e = about(EntryType::MemberInvite, &b, 10, &a);
        refuse(&mut s, &e, LedgerError::AlreadyMember(b.id));
    }

    #[test]
    fn non_admin_cannot_grant() {
        let (mut s, a, b, c) = group();
        s.apply(&about(EntryType::MemberInvite, &c, 10, &a))
            .expect("invite c");
        let e = about(EntryType::AdminGrant, &c, 11, &b);
        refuse(&mut s, &e, not_authorized(EntryType::AdminGrant, &b));
    }

    #[test]
    fn grant_to_a_non_member_is_refused() {
        let (mut s, a, _, c) = group();
        let e = about(EntryType::AdminGrant, &c, 10, &a);
        refuse(&mut s, &e, LedgerError::NotAMember(c.id));
    }

    #[test]
    fn admin_grants_and_revokes() {
        let (mut s, a, b, _) = group();
        s.apply(&about(EntryType::AdminGrant, &b, 10, &a))
            .expect("grant");
        assert!(s.is_admin(&b.id));
        // The new admin may revoke the creator.
        s.apply(&about(EntryType::AdminRevoke, &a, 11, &b))
            .expect("revoke");
        assert!(!s.is_admin(&a.id) && s.is_member(&a.id));
        // And the creator, no longer an admin, may do nothing admin-only.
        let e = hub(EntryType::HubBind, "wss://h", 12, &a);
        refuse(&mut s, &e, not_authorized(EntryType::HubBind, &a));
    }

    #[test]
    fn granting_an_admin_again_is_a_recorded_no_op() {
        let (mut s, a, b, _) = group();
        s.apply(&about(EntryType::AdminGrant, &b, 10, &a))
            .expect("grant");
        let admins = s.admins.clone();
        s.apply(&about(EntryType::AdminGrant, &b, 11, &a))
            .expect("again");
        assert_eq!(s.admins, admins);
        assert_eq!(s.len, 4);
    }

    #[test]
    fn revoking_the_last_admin_is_refused() {
        let (mut s, a, _, _) = group();
        let e = about(EntryType::AdminRevoke, &a, 10, &a);
        refuse(&mut s, &e, LedgerError::LastAdmin);
    }

    #[test]
    fn revoking_a_non_admin_is_refused() {
        let (mut s, a, b, _) = group();
        let e = about(EntryType::AdminRevoke, &b, 10, &a);
        refuse(&mut s, &e, LedgerError::NotAnAdmin(b.id));
    }

    #[test]
    fn non_admin_cannot_revoke() {
        let (mut s, a, b, _) = group();
        let e = about(EntryType::AdminRevoke, &a, 10, &b);
        refuse(&mut s, &e, not_authorized(EntryType::AdminRevoke, &b));
    }

    #[test]
    fn removing_the_last_admin_is_refused() {
        let (mut s, a, _, _) = group();
        let e = about(EntryType::MemberRemove, &a, 10, &a);
        refuse(&mut s, &e, LedgerError::LastAdmin);
    }

    #[test]
    fn removing_an_admin_drops_it_from_admins_and_members() {
        let (mut s, a, b, _) = group();
        s.apply(&about(EntryType::AdminGrant, &b, 10, &a))
            .expect("grant");
        s.apply(&about(EntryType::MemberRemove, &a, 11, &b))
            .expect("remove");
        assert!(!s.is_member(&a.id) && !s.is_admin(&a.id));
        assert_eq!(s.admins, BTreeSet::from([b.id]));
    }

    #[test]
    fn non_admin_cannot_remove() {
        let (mut s, a, b, _) = group();
        let e = about(EntryType::MemberRemove, &a, 10, &b);
        refuse(&mut s, &e, not_authorized(EntryType::MemberRemove, &b));
    }

    #[test]
    fn a_member_may_remove_itself_but_not_as_the_last_admin() {
        let (mut s, a, b, _) = group();
        s.apply(&about(EntryType::MemberRemove, &b, 10, &b))
            .expect("a member leaves");
        assert!(!s.is_member(&b.id));
        refuse(
            &mut s,
            &about(EntryType::MemberRemove, &a, 11, &a),
            LedgerError::LastAdmin,
        );
    }

    #[test]
    fn removing_a_non_member_is_refused() {
        let (mut s, a, _, c) = group();
        let e = about(EntryType::MemberRemove, &c, 10, &a);
        refuse(&mut s, &e, LedgerError::NotAMember(c.id));
    }

    #[test]
    fn hub_bind_and_unbind_are_idempotent_but_recorded() {
        let (mut s, a, _, _) = group();
        s.apply(&hub(EntryType::HubBind, "wss://one", 10, &a))
            .expect("bind");
        s.apply(&hub(EntryType::HubBind, "wss://two", 11, &a))
            .expect("bind");
        let len = s.len;
        s.apply(&hub(EntryType::HubBind, "wss://one", 12, &a))
            .expect("rebind");
        assert_eq!(s.hubs, vec!["wss://one".to_owned(), "wss://two".to_owned()]);
        assert_eq!(s.len, len + 1, "a no-op entry is still recorded");
        s.apply(&hub(EntryType::HubUnbind, "wss://three", 13, &a))
            .expect("unbind unbound");
        s.apply(&hub(EntryType::HubUnbind, "wss://one", 14, &a))
            .expect("unbind");
        assert_eq!(s.hubs, vec!["wss://two".to_owned()]);
        assert_eq!(s.len, len + 3);
    }

    #[test]
    fn non_admin_cannot_touch_hubs() {
        let (mut s, a, b, _) = group();
        s.apply(&hub(EntryType::HubBind, "wss://one", 10, &a))
            .expect("bind");
        for kind in [
            EntryType::HubBind,
            EntryType::HubUnbind,
            EntryType::HubCommit,
        ] {
            let e = hub(kind.clone(), "wss://one", 11, &b);
            refuse(&mut s, &e, not_authorized(kind, &b));
        }
    }

    #[test]
    fn commit_hub_must_be_bound() {
        let (mut s, a, _, _) = group();
        let e = hub(EntryType::HubCommit, "wss://nowhere", 10, &a);
        refuse(&mut s, &e, LedgerError::NotBound("wss://nowhere".into()));
    }

    #[test]
    fn unbinding_the_commit_hub_is_refused() {
        let (mut s, a, _, _) = group();
        s.apply(&hub(EntryType::HubBind, "wss://one", 10, &a))
            .expect("bind");
        s.apply(&hub(EntryType::HubBind, "wss://two", 11, &a))
            .expect("bind");
        s.apply(&hub(EntryType::HubCommit, "wss://one", 12, &a))
            .expect("commit");
        assert_eq!(s.commit_hub.as_deref(), Some("wss://one"));
        let e = hub(EntryType::HubUnbind, "wss://one", 13, &a);
        refuse(&mut s, &e, LedgerError::CommitHubUnbind("wss://one".into()));
        // Moving the commit hub first makes the old one unbindable.
        s.apply(&hub(EntryType::HubCommit, "wss://two", 14, &a))
            .expect("move");
        s.apply(&hub(EntryType::HubUnbind, "wss://one", 15, &a))
            .expect("unbind");
        assert_eq!(s.hubs, vec!["wss://two".to_owned()]);
    }

    #[test]
    fn duplicate_entry_is_refused() {
        let (mut s, a, _, c) = group();
        let e = about(EntryType::MemberInvite, &c, 10, &a);
        s.apply(&e).expect("first time");
        // Even after the effect is undone, the same entry may not land again.
        s.apply(&about(EntryType::MemberRemove, &c, 11, &a))
            .expect("remove");
        refuse(&mut s, &e, LedgerError::Duplicate(e.id()));
        assert!(s.contains(&e.id()));
    }

    #[test]
    fn unknown_type_is_refused() {
        let (mut s, a, _, _) = group();
        let e = entry(
            EntryType::Unknown("member.promote".into()),
            b"x",
            b"",
            10,
            &a,
        );
        refuse(
            &mut s,
            &e,
            LedgerError::UnknownType("member.promote".into()),
        );
        // Also when it arrives by decoding.
        let decoded = Entry::decode(&e.encode()).expect("decodes");
        refuse(
            &mut s,
            &decoded,
            LedgerError::UnknownType("member.promote".into()),
        );
    }

    #[test]
    fn wrong_group_is_refused() {
        let (mut s, a, _, c) = group();
        let e = Entry::sign(
            EntryType::MemberInvite,
            GroupId([0x22; 32]),
            c.id.0.to_vec(),
            vec![],
            at(10),
            &a.key,
        );
        refuse(&mut s, &e, LedgerError::WrongGroup);
    }

    #[test]
    fn forged_entry_is_refused() {
        let (mut s, a, b, c) = group();
        // b signs an invite and claims a wrote it.
        let mut e = about(EntryType::MemberInvite, &c, 10, &b);
        e.author = a.id;
        refuse(&mut s, &e, LedgerError::BadSignature);
    }

    #[test]
    fn value_on_a_non_setting_entry_is_refused() {
        let (mut s, a, _, c) = group();
        let e = entry(EntryType::MemberInvite, &c.id.0, b"x", 10, &a);
        assert!(matches!(s.check(&e), Err(LedgerError::Malformed(_))));
        let before = s.clone();
        assert!(s.apply(&e).is_err());
        assert_eq!(s, before);
    }

    #[test]
    fn subjects_of_the_wrong_shape_are_refused() {
        let (mut s, a, _, _) = group();
        let long = "x".repeat(257);
        for e in [
            entry(EntryType::MemberInvite, &[1; 31], b"", 10, &a),
            entry(EntryType::HubBind, b"", b"", 10, &a),
            entry(EntryType::HubBind, &[0xff], b"", 10, &a),
            entry(EntryType::GroupSetting, b"", b"v", 10, &a),
            entry(EntryType::GroupSetting, long.as_bytes(), b"v", 10, &a),
        ] {
            let before = s.clone();
            assert!(
                matches!(s.apply(&e), Err(LedgerError::Malformed(_))),
                "{e:?}"
            );
            assert_eq!(s, before);
        }
    }

    #[test]
    fn non_member_cannot_set_a_self_setting() {
        let (mut s, _, _, c) = group();
        let e = setting("self.name", b"c", 10, &c);
        refuse(&mut s, &e, not_authorized(EntryType::GroupSetting, &c));
    }

    #[test]
    fn member_cannot_set_a_group_wide_setting() {
        let (mut s, _, b, _) = group();
        let e = setting("retention", b"7d", 10, &b);
        refuse(&mut s, &e, not_authorized(EntryType::GroupSetting, &b));
    }

    #[test]
    fn members_set_their_own_settings_and_admins_the_group_settings() {
        let (mut s, a, b, _) = group();
        s.apply(&setting("self.name", b"bob", 10, &b)).expect("own");
        s.apply(&setting("self.name", b"alice", 11, &a))
            .expect("own");
        s.apply(&setting("retention", b"7d", 12, &a))
            .expect("group-wide");
        assert_eq!(s.member_settings[&(b.id, "self.name".into())].value, b"bob");
        assert_eq!(
            s.member_settings[&(a.id, "self.name".into())].value,
            b"alice"
        );
        assert_eq!(s.settings["retention"].value, b"7d");
        assert_eq!(s.settings["retention"].author, a.id);
    }

    #[test]
    fn removing_a_member_drops_its_own_settings() {
        let (mut s, a, b, _) = group();
        s.apply(&setting("self.name", b"bob", 10, &b)).expect("own");
        s.apply(&about(EntryType::MemberRemove, &b, 11, &a))
            .expect("remove");
        assert!(s.member_settings.is_empty());
        let e = setting("self.name", b"bob again", 12, &b);
        refuse(&mut s, &e, not_authorized(EntryType::GroupSetting, &b));
    }

    #[test]
    fn settings_are_last_writer_wins_by_ord_regardless_of_order() {
        let (base, a, b, _) = group();
        let old = setting("retention", b"old", 100, &a);
        let new = setting("retention", b"new", 200, &a);
        let own_old = setting("self.x", b"old", 100, &b);
        let own_new = setting("self.x", b"new", 200, &b);
        for order in [
            [&old, &new, &own_old, &own_new],
            [&new, &old, &own_new, &own_old],
        ] {
            let mut s = base.clone();
            for e in order {
                s.apply(e).expect("accepted, even when older");
            }
            assert_eq!(s.settings["retention"].value, b"new");
            assert_eq!(s.settings["retention"].ord, at(200));
            assert_eq!(s.member_settings[&(b.id, "self.x".into())].value, b"new");
            assert_eq!(s.len, base.len + 4, "older entries are still recorded");
        }
    }

    #[test]
    fn equal_ords_are_broken_by_entry_id() {
        let (base, a, _, _) = group();
        let x = setting("k", b"x", 100, &a);
        let y = setting("k", b"y", 100, &a);
        let winner = if x.id() > y.id() { &x } else { &y };
        for order in [[&x, &y], [&y, &x]] {
            let mut s = base.clone();
            for e in order {
                s.apply(e).expect("accepted");
            }
            assert_eq!(s.settings["k"].value, winner.value);
            assert_eq!(s.settings["k"].id, winner.id());
        }
    }

    #[test]
    fn head_is_the_chain_over_applied_ids() {
        let (a, b) = (dev(1), dev(2));
        let entries = vec![
            about(EntryType::AdminGrant, &a, 1, &a),
            about(EntryType::MemberInvite, &b, 2, &a),
            hub(EntryType::HubBind, "wss://h", 3, &a),
        ];
        let s = LedgerState::fold(G, &entries).expect("folds");
        let ids: Vec<EntryId> = entries.iter().map(Entry::id).collect();
        assert_eq!(s.head, chain::head_of(&G, &ids));
        assert_eq!(s.len, 3);
        assert!(ids.iter().all(|id| s.contains(id)));
    }

    #[test]
    fn fold_stops_at_the_first_refused_entry() {
        let (a, b) = (dev(1), dev(2));
        let entries = vec![
            about(EntryType::AdminGrant, &a, 1, &a),
            about(EntryType::MemberInvite, &b, 2, &b),
        ];
        assert_eq!(
            LedgerState::fold(G, &entries),
            Err(not_authorized(EntryType::MemberInvite, &b))
        );
    }

    #[test]
    fn head_after_predicts_the_head_without_mutating() {
        let (s, a, _, c) = group();
        let more = vec![
            about(EntryType::MemberInvite, &c, 10, &a),
            hub(EntryType::HubBind, "wss://h", 11, &a),
        ];
        let before = s.clone();
        let predicted = s.head_after(&more).expect("valid");
        assert_eq!(s, before);
        let mut applied = s.clone();
        for e in &more {
            applied.apply(e).expect("valid");
        }
        assert_eq!(applied.head, predicted);
        assert_eq!(s.head_after(&[]), Ok(s.head));
        // A batch with a refused entry gives its error.
        let bad = vec![more[0].clone(), more[0].clone()];
        assert_eq!(
            s.head_after(&bad),
            Err(LedgerError::Duplicate(more[0].id()))
        );
    }

    #[test]
    fn fold_to_requires_the_expected_head() {
        let (a, b) = (dev(1), dev(2));
        let entries = vec![
            about(EntryType::AdminGrant, &a, 1, &a),
            about(EntryType::MemberInvite, &b, 2, &a),
        ];
        let head = LedgerState::fold(G, &entries).expect("folds").head;
        assert!(LedgerState::fold_to(G, &entries, &head).is_ok());
        // A rewound ledger (a hub dropping the last entry) is caught.
        assert_eq!(
            LedgerState::fold_to(G, &entries[..1], &head),
            Err(LedgerError::HeadMismatch)
        );
    }
}
