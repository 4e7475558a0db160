//! The remedies in order: what turns a `RecoveryRequired` into a retry, so
//! an app never has to call a remedy by hand.
//!
//! [`GroupPeerManager::commit_with_recovery`] runs a commit; on
//! [`CommitError::RecoveryRequired`] it tries the cheap remedy (a ledger
//! gather, [`GroupPeerManager::request_ledger_catchup`]) when the ledger is
//! what is missing, and retries once. Each remedy runs at most once per
//! call; when none helps, the original error is returned and every remedy
//! that failed was reported as [`Event::RecoveryFailed`]. The deep remedy
//! (rejoining by external commit) is not built yet: a device that is
//! stranded (not only missing its ledger) gets the original error.

use super::lane::{CommitError, LaneResult};
use super::manager::GroupPeerManager;
use super::records::GroupId;
use super::Event;
use std::future::Future;

/// A remedy [`GroupPeerManager::commit_with_recovery`] tried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Remedy {
    /// Ledger catch-up from the members.
    Gather,
}

impl GroupPeerManager {
    /// Run `op` (a commit in `group`); on `RecoveryRequired`, gather the
    /// ledger when it is incomplete and run `op` once more. Answers `op`'s
    /// last result, or the original error when no remedy helped.
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
        if !rec.ledger_complete {
            let deadline = self.shared.config.gather_deadline;
            let reason = match self.request_ledger_catchup(group, deadline).await {
                Ok(s) if s.installed_from.is_some() || s.already_complete => {
                    return match op().await {
                        // Still required: the device is stranded too, and
                        // the deep remedy is not built yet.
                        Err(CommitError::RecoveryRequired(_)) => Err(original),
                        other => other,
                    };
                }
                Ok(s) if s.answered.is_empty() => "no member answered".to_string(),
                Ok(s) => format!("every answer was refused: {:?}", s.refused),
                Err(e) => e.to_string(),
            };
            self.emit(Event::RecoveryFailed {
                group,
                remedy: Remedy::Gather,
                reason,
            });
        }
        Err(original)
    }
}
