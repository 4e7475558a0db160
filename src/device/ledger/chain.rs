//! The ledger's head: a hash chain over entry ids.
//!
//! `genesis = SHA-256("hubsync/ledger/genesis/v1" ‖ group id)` and, for the
//! n-th entry (n counted from 1), `head_n = SHA-256(head_{n-1} ‖ n as u64 BE ‖
//! id_n)`. Folding the length in means two ledgers with the same head have
//! the same length as well as the same entries in the same order; deriving
//! the genesis from the group id means heads of different groups never
//! coincide.

use super::entry::EntryId;
use crate::device::records::GroupId;
use sha2::{Digest, Sha256};

/// Domain of the genesis head.
pub const GENESIS_DOMAIN: &[u8] = b"hubsync/ledger/genesis/v1";

/// The head of the group's empty ledger.
pub fn genesis(group: &GroupId) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(GENESIS_DOMAIN);
    h.update(group.0);
    h.finalize().into()
}

/// The head after appending `id` to a ledger whose head was `head`; `len` is
/// the ledger's length including this entry (1 for the first).
pub fn next(head: &[u8; 32], len: u64, id: &EntryId) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(head);
    h.update(len.to_be_bytes());
    h.update(id.0);
    h.finalize().into()
}

/// The head of a ledger holding `ids` in this order.
pub fn head_of<'a>(group: &GroupId, ids: impl IntoIterator<Item = &'a EntryId>) -> [u8; 32] {
    let mut head = genesis(group);
    let mut len = 0u64;
    for id in ids {
        len += 1;
        head = next(&head, len, id);
    }
    head
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u8) -> Vec<EntryId> {
        (0..n).map(|i| EntryId([i; 32])).collect()
    }

    #[test]
    fn genesis_is_the_domain_hash_of_the_group() {
        let g = GroupId([3; 32]);
        let mut input = b"hubsync/ledger/genesis/v1".to_vec();
        input.extend_from_slice(&[3; 32]);
        let want: [u8; 32] = Sha256::digest(&input).into();
        assert_eq!(genesis(&g), want);
        assert_ne!(genesis(&g), genesis(&GroupId([4; 32])));
    }

    #[test]
    fn head_of_equals_folding_next() {
        let g = GroupId([1; 32]);
        let ids = ids(5);
        let mut head = genesis(&g);
        for (i, id) in ids.iter().enumerate() {
            head = next(&head, i as u64 + 1, id);
        }
        assert_eq!(head_of(&g, &ids), head);
        assert_eq!(head_of(&g, &[]), genesis(&g));
    }

    #[test]
    fn next_hashes_head_length_and_id() {
        let head = [9u8; 32];
        let id = EntryId([8; 32]);
        let mut input = head.to_vec();
        input.extend_from_slice(&1u64.to_be_bytes());
        input.extend_from_slice(&id.0);
        let want: [u8; 32] = Sha256::digest(&input).into();
        assert_eq!(next(&head, 1, &id), want);
        assert_ne!(next(&head, 2, &id), want);
    }

    #[test]
    fn order_matters() {
        let g = GroupId([1; 32]);
        let mut ids = ids(3);
        let before = head_of(&g, &ids);
        ids.swap(0, 2);
        assert_ne!(head_of(&g, &ids), before);
    }
}
