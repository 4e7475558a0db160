//! Pairs (a), (e) and (h): group changes through the hub against the raw
//! OpenMLS work of the same change, on the same cores.
//!
//! - (a) a commit: `rotate_keys` on one member until every member merged
//!   it, against one member's self-update commit and merge plus every
//!   other member's processing and merge;
//! - (h) forming a group of N: `create_group` and one `invite_many` of the
//!   other N-1 devices until every one has joined, against creating the
//!   group, adding N-1 key packages in one commit and every joiner's
//!   processing of the Welcome;
//! - (e) a device far behind: reopened after the group moved `epochs`
//!   commits on, until it merged the last, against processing and merging
//!   the same number of commits in raw OpenMLS.
//!
//! Both count only the time of the measured operations (a slice's `secs`
//! is the sum of their latencies), because the raw side makes fresh key
//! packages between operations, off the clock, as the hub side's devices
//! upload theirs ahead of any invite.

use super::app::{HubGroup, RawGroup, RawInvitees};
use super::load::Slice;
use std::time::{Duration, Instant};

/// Run `op` until `len` of its own time has passed, timing each.
async fn timed<F>(len: Duration, mut op: F) -> Result<Slice, String>
where
    F: AsyncFnMut() -> Result<Duration, String>,
{
    let mut slice = Slice::default();
    let mut spent = Duration::ZERO;
    // At least one operation, however long it takes: a group of 1000 can
    // take longer than a short slice.
    while slice.ops == 0 || spent < len {
        let took = op().await?;
        spent += took;
        slice.ops += 1;
        slice.latencies_us.push(took.as_micros() as u64);
    }
    slice.secs = spent.as_secs_f64();
    Ok(slice)
}

/// Commits through the hub, one at a time, each until every member merged.
///
/// # Errors
/// A refused commit, or a member that never merged one.
pub async fn hub_commits(g: &HubGroup, len: Duration) -> Result<Slice, String> {
    timed(len, async || {
        let t0 = Instant::now();
        g.rotate().await?;
        Ok(t0.elapsed())
    })
    .await
}

/// The raw work of [`hub_commits`], one commit at a time.
///
/// # Errors
/// When OpenMLS fails.
pub async fn raw_commits(g: &mut RawGroup, len: Duration) -> Result<Slice, String> {
    timed(len, async || {
        let t0 = Instant::now();
        g.rotate()?;
        Ok(t0.elapsed())
    })
    .await
}

/// Groups formed through the hub by the first of `g`'s devices, with every
/// other device invited in one commit, each until all have joined.
///
/// # Errors
/// A refused create or invite, or a device that never joined.
pub async fn hub_forming(g: &HubGroup, len: Duration) -> Result<Slice, String> {
    timed(len, async || {
        let t0 = Instant::now();
        g.form_group().await?;
        Ok(t0.elapsed())
    })
    .await
}

/// The raw work of [`hub_forming`] for groups of `n`, fresh identities and
/// key packages made off the clock for each.
///
/// # Errors
/// When OpenMLS fails.
pub async fn raw_forming(n: usize, len: Duration) -> Result<Slice, String> {
    timed(len, async || {
        let invitees = RawInvitees::new(n)?;
        let t0 = Instant::now();
        let members = invitees.form()?;
        let took = t0.elapsed();
        drop(members);
        // Keeps the bench responsive (progress bar, timers) between
        // operations that do not otherwise yield.
        tokio::task::yield_now().await;
        Ok(took)
    })
    .await
}

/// Pair (e): device 1 of `g` closed while the first device commits
/// `epochs` times (off the clock), then timed from its reopening until it
/// merged the last of them, one catch-up per operation.
///
/// # Errors
/// A refused commit, or a device that never caught up.
pub async fn hub_catch_up(g: &mut HubGroup, epochs: usize, len: Duration) -> Result<Slice, String> {
    timed(len, async || {
        let target = g.leave_behind(1, epochs).await?;
        let t0 = Instant::now();
        g.catch_up(1, target).await?;
        Ok(t0.elapsed())
    })
    .await
}

/// The raw work of [`hub_catch_up`]: the first member makes `epochs`
/// commits (off the clock), then the second processes and merges them all.
///
/// # Errors
/// When OpenMLS fails.
pub async fn raw_catch_up(g: &mut RawGroup, epochs: usize, len: Duration) -> Result<Slice, String> {
    timed(len, async || {
        let mut commits = Vec::with_capacity(epochs);
        for _ in 0..epochs {
            commits.push(g.commit()?);
        }
        let t0 = Instant::now();
        g.merge_all(1, &commits)?;
        let took = t0.elapsed();
        tokio::task::yield_now().await;
        Ok(took)
    })
    .await
}
