//! A private PostgreSQL server for tests, started from the machine's own
//! PostgreSQL binaries (Debian's `postgresql` package), never a mock.
//!
//! One server per test process, made on first use in a temporary directory
//! (`initdb`, then `postgres` on a free loopback port), and a fresh
//! database per [`TestPostgres::database`] call, so tests running side by
//! side never see each other's data. The server stops when the test
//! process ends, however it ends: it runs under a small shell that waits on
//! a pipe from this process and stops the server when the pipe closes.
//!
//! Where the binaries are: `HUBSYNC_PG_BIN` if set, else the newest
//! `/usr/lib/postgresql/<version>/bin`, else `initdb` and `postgres` on the
//! `PATH`. PostgreSQL refuses to run as root; run as root, the server runs
//! as the `postgres` user the package creates.
//!
//! The shared server runs with `fsync = off`: tests are about what the
//! store's transactions decide, not about the disk; what the hub's ack
//! promises on a real server is in docs/operations.md. Measurements start
//! a server of their own with `fsync = on` ([`TestPostgres::start_durable`]).

use std::io;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// A running test server (see the [module docs](self)).
pub struct TestPostgres {
    port: u16,
    dir: PathBuf,
    next_db: AtomicU64,
    // Kept so that the pipe to the shell stays open while the process runs.
    _child: Mutex<Child>,
}

static SERVER: OnceLock<Result<TestPostgres, String>> = OnceLock::new();

impl TestPostgres {
    /// This process's server, started on first use (a blocking start of a
    /// second or two).
    ///
    /// # Errors
    /// When the binaries are missing or the server does not start; the
    /// error says which, with the server's log.
    pub fn shared() -> io::Result<&'static TestPostgres> {
        SERVER
            .get_or_init(|| Self::start(false).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| io::Error::other(e.clone()))
    }

    /// A server of its own with `fsync = on` (every commit flushed to disk,
    /// as in production), for measurements; it stops, and its directory
    /// goes, when the value is dropped.
    ///
    /// # Errors
    /// As [`TestPostgres::shared`].
    pub fn start_durable() -> io::Result<TestPostgres> {
        Self::start(true)
    }

    fn start(durable: bool) -> io::Result<TestPostgres> {
        let bin = bin_dir()?;
        // Removed by the shell below when the tests end.
        let dir = tempfile::Builder::new()
            .prefix("hubsync-pg")
            .tempdir()?
            .keep();
        let owner = server_user()?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid))?;
        }
        let data = dir.join("data");
        let mut initdb = Command::new(bin.join("initdb"));
        initdb
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        as_user(&mut initdb, owner);
        let out = initdb.output()?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "initdb failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let log = dir.join("server.log");
        // The shell starts the server, then waits for its stdin (a pipe
        // from this process) to close, stops the server with a fast
        // shutdown and removes its directory: neither outlives the tests
        // (a static is never dropped, so no destructor could).
        let script = format!(
            "{postgres} -D {data} -p {port} -k {dir} -c listen_addresses=127.0.0.1 \
             -c fsync={fsync} -c full_page_writes={fsync} -c max_connections=400 \
             -c shared_buffers=32MB >{log} 2>&1 & pid=$!; cat >/dev/null; \
             kill -INT $pid; wait $pid; rm -rf {dir}",
            fsync = if durable { "on" } else { "off" },
            postgres = quote(&bin.join("postgres")),
            data = quote(&data),
            dir = quote(&dir),
            log = quote(&log),
        );
        let mut sh = Command::new("sh");
        sh.arg("-c")
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        as_user(&mut sh, owner);
        let child = sh.spawn()?;
        let server = TestPostgres {
            port,
            dir,
            next_db: AtomicU64::new(1),
            _child: Mutex::new(child),
        };
        server.wait_ready()?;
        Ok(server)
    }

    /// Wait until the server answers on its port.
    fn wait_ready(&self) -> io::Result<()> {
        for _ in 0..300 {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
        Err(io::Error::other(format!(
            "PostgreSQL did not start on port {}: {log}",
            self.port
        )))
    }

    /// A URL of the server's `database` (for a hub: `--store URL`).
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Create a new, empty database and answer its URL.
    ///
    /// # Errors
    /// When the server refuses.
    pub async fn database(&self) -> io::Result<String> {
        let name = format!(
            "t_{}_{}",
            std::process::id(),
            self.next_db.fetch_add(1, Ordering::Relaxed)
        );
        let mut last = None;
        // The server may still be starting its last steps after the port
        // opened: try for a few seconds.
        for _ in 0..100 {
            match tokio_postgres::connect(&self.url("postgres"), tokio_postgres::NoTls).await {
                Ok((client, conn)) => {
                    let task = tokio::spawn(conn);
                    let made = client
                        .batch_execute(&format!("CREATE DATABASE {name}"))
                        .await
                        .map_err(io::Error::other);
                    drop(client);
                    let _ = task.await;
                    made?;
                    return Ok(self.url(&name));
                }
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(io::Error::other(format!(
            "cannot connect to the test PostgreSQL: {}",
            last.map(|e| e.to_string()).unwrap_or_default()
        )))
    }
}

/// Quote `path` for `sh`.
fn quote(path: &Path) -> String {
    format!("'{}'", path.display().to_string().replace('\'', r"'\''"))
}

/// Where `initdb` and `postgres` are.
fn bin_dir() -> io::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("HUBSYNC_PG_BIN") {
        return Ok(PathBuf::from(dir));
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Ok(bin);
    }
    for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
        if dir.join("initdb").exists() && dir.join("postgres").exists() {
            return Ok(dir);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        "no PostgreSQL binaries: install Debian's postgresql package, or set HUBSYNC_PG_BIN \
         to the directory holding initdb and postgres",
    ))
}

/// The (uid, gid) the server must run as: `postgres` when this process is
/// root (the server refuses root), else this process's own (`None`).
fn server_user() -> io::Result<Option<(u32, u32)>> {
    use std::os::unix::fs::MetadataExt;
    // /proc/self belongs to the process's effective user.
    if std::fs::metadata("/proc/self")?.uid() != 0 {
        return Ok(None);
    }
    let passwd = std::fs::read_to_string("/etc/passwd")?;
    passwd
        .lines()
        .find_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            (f.first() == Some(&"postgres") && f.len() > 3)
                .then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))
                .flatten()
        })
        .map(Some)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "running as root, and no postgres user to run PostgreSQL as",
            )
        })
}

fn as_user(cmd: &mut Command, owner: Option<(u32, u32)>) {
    use std::os::unix::process::CommandExt;
    if let Some((uid, gid)) = owner {
        cmd.uid(uid).gid(gid);
    }
}
