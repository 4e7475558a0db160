//! What a commit changes ([`Plan`]) and how it becomes bytes on the commit
//! topic: an MLS commit whose authenticated data names the ledger entries
//! it enacts, whose GroupContextExtensions proposal installs the new ledger
//! head, and beside it the entry bodies sealed under the epoch's exporter.
//!
//! Frame layout on the commit topic (docs/protocol.md has worked bytes):
//! a commit with no ledger entries is a bare MLSMessage, so a standard MLS
//! client's commit is a valid frame; one with entries is
//! `f1 01 ‖ u32 len ‖ MLSMessage ‖ u32 len ‖ sealed entries`, where the
//! two magic bytes can never start an MLSMessage (its first two bytes are
//! the protocol version, `00 01`).

use super::{CommitError, CommitKind};
use crate::device::identity::{device_id_of, DeviceIdentity};
use crate::device::ledger::{self, Entry, EntryId, GroupExt, LedgerState};
use crate::device::registry::OpProvider;
use crate::wire::DeviceId;
use openmls::prelude::tls_codec::Serialize as _;
use openmls::prelude::*;
use openmls_traits::random::OpenMlsRand;
use openmls_traits::OpenMlsProvider;

/// The two bytes that start a hubsync commit frame carrying ledger entries.
pub const COMMIT_FRAME_MAGIC: [u8; 2] = [0xf1, 0x01];

/// The domain that starts a commit's authenticated data when it enacts
/// ledger entries.
pub const ENACTED_AAD_DOMAIN: &[u8; 4] = b"HSL1";

/// What a commit changes. Data, not a closure: after a lost race the lane
/// builds the same plan again against the new epoch.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    /// What it is.
    pub kind: CommitKind,
    /// The operation id (stable across rebuilds and the one re-drive).
    pub op: [u8; 16],
    /// Ledger entries it enacts, signed by their author.
    pub entries: Vec<Entry>,
    /// The validated key packages of the devices an invite adds (several
    /// in one commit for `invite_many`).
    pub add: Vec<(DeviceId, KeyPackage)>,
    /// The device a remove removes.
    pub remove: Option<DeviceId>,
    /// This plan is the one re-drive of a lost ledger commit.
    pub redriven: bool,
}

/// Rebuilds a lost `ledger` commit's surviving entries into a fresh plan
/// under the original operation id, for the lane to re-drive once. A narrow
/// capability: the lane may ask for exactly this and nothing else of the
/// ledger's write path.
pub(crate) type BuildLedgerRedrive = fn(Vec<Entry>, [u8; 16]) -> Plan;

impl Plan {
    /// The plan of a re-drive: the entries the ledger still lacks, under
    /// the lost commit's operation id.
    pub(crate) fn redrive(entries: Vec<Entry>, op: [u8; 16]) -> Plan {
        Plan {
            kind: CommitKind::Ledger,
            op,
            entries,
            add: Vec::new(),
            remove: None,
            redriven: true,
        }
    }
}

/// The lane's one way to re-drive a lost ledger commit.
pub(crate) const REDRIVE: BuildLedgerRedrive = Plan::redrive;

/// A built commit, ready to journal.
pub(crate) struct Built {
    /// The frame published on the commit topic.
    pub payload: Vec<u8>,
    /// The Welcome for an invite's joiners (one Welcome for all of them).
    pub welcome: Option<(Vec<DeviceId>, Vec<u8>)>,
    /// Whether the roster changes.
    pub roster: bool,
    /// The entries, encoded.
    pub entries: Vec<Vec<u8>>,
}

/// The authenticated data of a commit enacting `ids` (empty for none).
pub fn enacted_aad(ids: &[EntryId]) -> Vec<u8> {
    if ids.is_empty() {
        return Vec::new();
    }
    let mut out = ENACTED_AAD_DOMAIN.to_vec();
    out.extend_from_slice(&(ids.len() as u16).to_be_bytes());
    for id in ids {
        out.extend_from_slice(&id.0);
    }
    out
}

/// The entry ids a commit's authenticated data names. `None` when the
/// data is not ours (a standard client's own AAD is allowed only empty).
pub fn parse_enacted_aad(aad: &[u8]) -> Option<Vec<EntryId>> {
    if aad.is_empty() {
        return Some(Vec::new());
    }
    let rest = aad.strip_prefix(ENACTED_AAD_DOMAIN.as_slice())?;
    let (count, rest) = rest.split_first_chunk::<2>()?;
    let count = u16::from_be_bytes(*count) as usize;
    if count == 0 || rest.len() != count * 32 {
        return None;
    }
    Some(
        rest.chunks_exact(32)
            .map(|c| {
                let mut id = [0u8; 32];
                id.copy_from_slice(c);
                EntryId(id)
            })
            .collect(),
    )
}

/// A commit-topic frame split into its MLS message and sealed entries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommitFrame<'a> {
    /// The MLSMessage bytes.
    pub mls: &'a [u8],
    /// The sealed ledger entries (empty when none).
    pub sealed: &'a [u8],
}

impl<'a> CommitFrame<'a> {
    /// Split a payload. `None` when it starts with the magic but is not a
    /// well-formed frame.
    pub fn parse(payload: &'a [u8]) -> Option<Self> {
        let Some(rest) = payload.strip_prefix(COMMIT_FRAME_MAGIC.as_slice()) else {
            return Some(CommitFrame {
                mls: payload,
                sealed: &[],
            });
        };
        let (mls, rest) = take_u32_prefixed(rest)?;
        let (sealed, rest) = take_u32_prefixed(rest)?;
        if !rest.is_empty() || sealed.is_empty() {
            return None;
        }
        Some(CommitFrame { mls, sealed })
    }

    /// Encode (a bare MLSMessage when nothing is sealed).
    pub fn encode(mls: &[u8], sealed: &[u8]) -> Vec<u8> {
        if sealed.is_empty() {
            return mls.to_vec();
        }
        let mut out = Vec::with_capacity(10 + mls.len() + sealed.len());
        out.extend_from_slice(&COMMIT_FRAME_MAGIC);
        out.extend_from_slice(&(mls.len() as u32).to_be_bytes());
        out.extend_from_slice(mls);
        out.extend_from_slice(&(sealed.len() as u32).to_be_bytes());
        out.extend_from_slice(sealed);
        out
    }
}

fn take_u32_prefixed(b: &[u8]) -> Option<(&[u8], &[u8])> {
    let (len, rest) = b.split_first_chunk::<4>()?;
    let len = u32::from_be_bytes(*len) as usize;
    if rest.len() < len {
        return None;
    }
    Some(rest.split_at(len))
}

/// The exporter key entry bodies of a commit framed at the group's current
/// epoch are sealed under.
pub(crate) fn seal_key(g: &MlsGroup, p: &OpProvider) -> Result<Vec<u8>, String> {
    g.export_secret(p.crypto(), ledger::SEAL_KEY_LABEL, &[], 16)
        .map_err(|e| e.to_string())
}

/// The group's extensions with ours replaced by `ext`.
pub(crate) fn with_ext(
    current: &Extensions<GroupContext>,
    ext: GroupExt,
) -> Result<Extensions<GroupContext>, String> {
    let mut out = current.clone();
    out.add_or_replace(ext.to_extension())
        .map_err(|e| e.to_string())?;
    Ok(out)
}

/// Build `plan` against the live handle (staged: nothing is merged). The
/// ledger must accept every entry in order, else nothing is built.
pub(crate) fn build(
    g: &mut MlsGroup,
    p: &OpProvider,
    me: &DeviceIdentity,
    ledger: &LedgerState,
    plan: &Plan,
) -> Result<Built, CommitError> {
    let group = ledger.group;
    let mut next = ledger.clone();
    for e in &plan.entries {
        next.apply(e).map_err(CommitError::Ledger)?;
    }
    let ext = GroupExt::from_extensions(g.extensions())
        .map_err(CommitError::Ledger)?
        .ok_or_else(|| CommitError::Mls("the group has no hubsync extension".into()))?;
    let remove = match plan.remove {
        Some(device) => Some(
            g.members()
                .find(|m| device_id_of(&m.credential) == Some(device))
                .map(|m| m.index)
                .ok_or(CommitError::NotAMember { group, device })?,
        ),
        None => None,
    };
    for (device, _) in &plan.add {
        if g.members()
            .any(|m| device_id_of(&m.credential) == Some(*device))
        {
            return Err(CommitError::AlreadyMember {
                group,
                device: *device,
            });
        }
    }
    let ids: Vec<EntryId> = plan.entries.iter().map(Entry::id).collect();
    let encoded: Vec<Vec<u8>> = plan.entries.iter().map(Entry::encode).collect();
    let sealed = if plan.entries.is_empty() {
        Vec::new()
    } else {
        let key = seal_key(g, p).map_err(CommitError::Mls)?;
        let nonce: [u8; 12] = p
            .rand()
            .random_array()
            .map_err(|e| CommitError::Mls(format!("{e:?}")))?;
        ledger::seal(
            p.crypto(),
            &key,
            nonce,
            &enacted_aad(&ids),
            &ledger::encode_list(&plan.entries),
        )
        .map_err(CommitError::Ledger)?
    };
    let new_ext = if plan.entries.is_empty() {
        None
    } else {
        Some(with_ext(g.extensions(), ext.with_head(next.head)).map_err(CommitError::Mls)?)
    };
    g.set_aad(enacted_aad(&ids));
    let mut cb = g.commit_builder();
    if !plan.add.is_empty() {
        cb = cb.propose_adds(plan.add.iter().map(|(_, kp)| kp.clone()));
    }
    if let Some(leaf) = remove {
        cb = cb.propose_removals([leaf]);
    }
    if plan.kind == CommitKind::Rotate {
        cb = cb.force_self_update(true);
    }
    if let Some(exts) = new_ext {
        cb = cb
            .propose_group_context_extensions(exts)
            .map_err(|e| CommitError::Mls(e.to_string()))?;
    }
    let bundle = cb
        .load_psks(p.storage())
        .map_err(|e| CommitError::Mls(e.to_string()))?
        .build(p.rand(), p.crypto(), me.signature_key_pair(), |_| true)
        .map_err(|e| CommitError::Mls(e.to_string()))?
        .stage_commit(p)
        .map_err(|e| CommitError::Mls(e.to_string()))?;
    let (commit, welcome, _info) = bundle.into_messages();
    let mls = commit
        .tls_serialize_detached()
        .map_err(|e| CommitError::Mls(e.to_string()))?;
    let welcome = match welcome {
        Some(w) if !plan.add.is_empty() => Some((
            plan.add.iter().map(|(d, _)| *d).collect(),
            w.tls_serialize_detached()
                .map_err(|e| CommitError::Mls(e.to_string()))?,
        )),
        _ => None,
    };
    Ok(Built {
        payload: CommitFrame::encode(&mls, &sealed),
        welcome,
        roster: !plan.add.is_empty() || plan.remove.is_some(),
        entries: encoded,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enacted_aad_round_trips_and_is_strict() {
        let ids = vec![EntryId([1; 32]), EntryId([2; 32])];
        let aad = enacted_aad(&ids);
        assert_eq!(parse_enacted_aad(&aad), Some(ids));
        assert_eq!(parse_enacted_aad(&[]), Some(vec![]));
        assert_eq!(parse_enacted_aad(&aad[..aad.len() - 1]), None);
        assert_eq!(parse_enacted_aad(b"other app data"), None);
        let mut zero = ENACTED_AAD_DOMAIN.to_vec();
        zero.extend_from_slice(&[0, 0]);
        assert_eq!(parse_enacted_aad(&zero), None);
    }

    #[test]
    fn commit_frames_round_trip_and_bare_mls_passes_through() {
        let f = CommitFrame::encode(b"\x00\x01mls", b"sealed");
        assert_eq!(
            CommitFrame::parse(&f),
            Some(CommitFrame {
                mls: b"\x00\x01mls",
                sealed: b"sealed"
            })
        );
        assert_eq!(CommitFrame::encode(b"\x00\x01mls", b""), b"\x00\x01mls");
        assert_eq!(
            CommitFrame::parse(b"\x00\x01mls"),
            Some(CommitFrame {
                mls: b"\x00\x01mls",
                sealed: b""
            })
        );
        for cut in 2..f.len() {
            assert_eq!(CommitFrame::parse(&f[..cut]), None, "cut at {cut}");
        }
        let mut trailing = f.clone();
        trailing.push(0);
        assert_eq!(CommitFrame::parse(&trailing), None);
    }
}
