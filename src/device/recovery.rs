//! The remedies in order: what turns a `RecoveryRequired` into a retry, so
//! an app never has to call a remedy by hand.
//!
//! [`GroupPeerManager::commit_with_recovery`] runs a commit; on
//! [`CommitError::RecoveryRequired`] it tries the cheap remedy first (a
//! ledger gather, [`GroupPeerManager::request_ledger_catchup`]) when the
//! ledger is what is missing and the device can still read the group, and
//! retries once; then, if the commit still needs recovery, the deep one
//! (a rejoin by external commit, [`GroupPeerManager::rejoin_group`]) and
//! one more retry. Each remedy runs at most once per call; when none
//! helps, the original error is returned, and every remedy that failed
//! was reported as [`Event::RecoveryFailed`].
//!
//! A stranded device skips the gather: members may still read its request
//! (sent in its old epoch), but their answers are sent in their current
//! epoch, which it cannot read, so the gather could only cost its
//! deadline. The rejoin gathers the ledger itself once the device is back.

use super::lane::{CommitError, LaneResult};
use super::manager::GroupPeerManager;
use super::records::GroupId;
use super::rejoin::RejoinResult;
use super::Event;
use std::future::Future;

/// A remedy [`GroupPeerManager::commit_with_recovery`] tried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Remedy {
    /// Ledger catch-up from the members.
    Gather,
    /// Rejoining by external commit.
    Rejoin,
}

impl GroupPeerManager {
    /// Run `op` (a commit in `group`); on `RecoveryRequired`, gather the
    /// ledger when it is incomplete and run `op` once more; if it still
    /// needs recovery, rejoin and run `op` once more. Answers `op`'s last
    /// result, or the original error when no remedy helped. A rejoin's
    /// re-enacted entries are in the result's `reenact`.
    ///
    /// # Errors
    /// `op`'s errors.
    pub async fn commit_with_recovery<F, Fut>(
        &self,
        group: GroupId,
        mut op: F,
    ) -> Result<LaneResult, CommitError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<LaneResult, CommitError>>,
    {
        let original = match op().await {
            Err(e @ CommitError::RecoveryRequired(_)) => e,
            other => return other,
        };
        let rec = self.record(group)?;
        if !rec.ledger_complete && !rec.stranded {
            let deadline = self.shared.config.gather_deadline;
            let failed = match self.request_ledger_catchup(group, deadline).await {
                Ok(s) => s.failure(),
                Err(e) => Some(e.to_string()),
            };
            match failed {
                None => match op().await {
                    Err(CommitError::RecoveryRequired(_)) => {}
                    other => return other,
                },
                Some(reason) => self.emit(Event::RecoveryFailed {
                    group,
                    remedy: Remedy::Gather,
                    reason,
                }),
            }
        }
        // `rejoin_group` reports its own failure.
        let reenact = match self.rejoin_group(group).await? {
            RejoinResult::Recovered { reenact, .. } => reenact,
            // Healed meanwhile (a background rejoin): just retry.
            RejoinResult::NotNeeded => Vec::new(),
            RejoinResult::NotAMember { .. } | RejoinResult::RecoveryFailed { .. } => {
                return Err(original)
            }
        };
        match op().await {
            Ok(mut r) => {
                r.reenact = reenact;
                Ok(r)
            }
            Err(CommitError::RecoveryRequired(_)) => Err(original),
            Err(e) => Err(e),
        }
    }
}
