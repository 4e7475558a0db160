//! Server processes of this binary, and what Linux says about a process:
//! its resident memory and its open files, both read from `/proc`.
//!
//! Shared by the bench's memory pair (a hub or a raw server measured alone)
//! and by `hubsync soak` (a hub killed and restarted under load, sampled
//! all along). Reading another process's `/proc/<pid>` entries needs the
//! same user, which a child always has.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// How long a server may take to say where it listens.
const LISTEN_WAIT: Duration = Duration::from_secs(30);

/// A server process, killed when dropped.
pub(crate) struct ChildServer {
    child: Child,
    /// The address it said it listens on (`host:port`).
    pub(crate) addr: String,
}

impl ChildServer {
    /// Start `exe args…` with its stderr discarded, and read its address
    /// from the first stdout line that says `listening on ADDR`.
    pub(crate) async fn start(exe: &Path, args: &[&str]) -> Result<ChildServer, String> {
        Self::start_with(exe, args, Stdio::null(), &[]).await
    }

    /// As [`ChildServer::start`], with the child's stderr going to
    /// `stderr` and `env` added to its environment.
    pub(crate) async fn start_with(
        exe: &Path,
        args: &[&str],
        stderr: Stdio,
        env: &[(&str, &str)],
    ) -> Result<ChildServer, String> {
        let mut child = Command::new(exe)
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", exe.display()))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| "no stdout from the server".to_string())?;
        let mut lines = BufReader::new(stdout).lines();
        let read = async {
            while let Some(line) = lines.next_line().await.map_err(|e| e.to_string())? {
                if let Some(rest) = line.split("listening on ").nth(1) {
                    let addr = rest.split_whitespace().next().unwrap_or_default();
                    return Ok(addr.to_string());
                }
            }
            Err("the server exited before it listened".to_string())
        };
        let addr = tokio::time::timeout(LISTEN_WAIT, read)
            .await
            .map_err(|_| "the server did not say where it listens".to_string())??;
        Ok(ChildServer { child, addr })
    }

    fn pid(&self) -> Result<u32, String> {
        self.child
            .id()
            .ok_or_else(|| "the server exited".to_string())
    }

    /// The resident set of the process, in bytes.
    pub(crate) fn rss(&self) -> Result<u64, String> {
        rss_bytes(&self.pid()?.to_string())
    }

    /// The process's open file descriptors (sockets, files, pipes).
    pub(crate) fn open_files(&self) -> Result<u64, String> {
        open_files(&self.pid()?.to_string())
    }

    /// Whether the process is still running (it did not exit on its own).
    pub(crate) fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Kill the process with SIGKILL (no flush, no goodbye: a crash) and
    /// reap it, so its port and its store's lock are free when this
    /// returns.
    pub(crate) async fn kill(mut self) -> Result<(), String> {
        self.child
            .kill()
            .await
            .map_err(|e| format!("cannot kill the server: {e}"))
    }
}

/// This binary, when it is `hubsync` (a test or an embedding program is
/// not, and cannot serve as the hub process).
pub(crate) fn hubsync_exe() -> Option<std::path::PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let name = exe.file_stem()?.to_str()?;
    (name == "hubsync").then_some(exe)
}

/// The resident set (`VmRSS`) of process `pid` (a number, or `self`), in
/// bytes.
///
/// # Errors
/// When `/proc/<pid>/status` cannot be read (the process is gone) or has
/// no `VmRSS` line.
pub fn rss_bytes(pid: &str) -> Result<u64, String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("cannot read the memory of process {pid}: {e}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| format!("no VmRSS in the status of process {pid}"))
}

/// The open file descriptors of process `pid` (a number, or `self`): the
/// entries of `/proc/<pid>/fd`. For `self` the count includes the one
/// descriptor the listing itself holds open, every time alike.
///
/// # Errors
/// When `/proc/<pid>/fd` cannot be listed (the process is gone).
pub fn open_files(pid: &str) -> Result<u64, String> {
    let dir = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map_err(|e| format!("cannot list the open files of process {pid}: {e}"))?;
    Ok(dir.filter(|e| e.is_ok()).count() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_memory_and_open_files() {
        let rss = rss_bytes("self").unwrap();
        assert!(
            rss > 1 << 20,
            "a Rust test process holds more than 1 MiB: {rss}"
        );
        // Other tests of this process open and close files meanwhile, so
        // only a floor is certain: stdin, stdout, stderr and the listing.
        let n = open_files("self").unwrap();
        assert!(n >= 4, "{n}");
    }

    #[test]
    fn a_process_that_does_not_exist_is_an_error() {
        assert!(rss_bytes("0").is_err());
        assert!(open_files("0").is_err());
    }
}
