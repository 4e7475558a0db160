//! Pair (g)'s baselines: NATS. JetStream's compare-and-set publishes
//! (`Nats-Expected-Last-Subject-Sequence`) against the hub's durable
//! compare-and-set publishes, and core NATS fan-out against the hub's.
//!
//! Why a client of our own: a NATS client crate would pull a second async
//! stack and its own buffering policy into the measurement; the bench needs
//! only a few verbs of the text protocol, so they are written here over
//! plain tokio TCP. Everything read from the socket is parsed defensively:
//! an answer that does not parse is a [`NatsError`], never a panic.
//!
//! The server is the `nats-server` binary, started by [`NatsServer::start`]
//! on a free loopback port over a temporary store and killed when the guard
//! is dropped, so a failing pair does not leave it running.

use super::load::Slice;
use serde::Deserialize;
use std::io::Write as _;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

/// The longest control line accepted from the server. INFO, the longest
/// one, is well under 1 KiB for a single server; anything past this is not
/// a NATS server talking.
const MAX_LINE: u64 = 64 * 1024;
/// The server's own default `max_payload`, used when INFO names none.
const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;
/// How long connecting, a request, or one publish's ack may take before the
/// bench calls the server stuck.
const ANSWER_LIMIT: Duration = Duration::from_secs(10);
/// How long a started server has to accept connections.
const START_LIMIT: Duration = Duration::from_secs(10);
/// The longest a fan-out slice waits for its subscribers to catch up.
const DRAIN_LIMIT: Duration = Duration::from_secs(20);
/// Core NATS publishes per write: real clients buffer their writes too, and
/// one syscall per 1 KiB message would measure the client, not the server.
const PUBLISH_BATCH: usize = 64;
/// How far (in messages) the fan-out publisher may run ahead of its slowest
/// subscriber. Core NATS has no flow control: a publisher that outruns a
/// subscriber by its `max_pending` (64 MiB by default) gets that subscriber
/// cut off as a slow consumer. Waiting instead keeps the baseline the same
/// kind of work as the hub's fan-out (nothing dropped), and 4,096 frames is
/// far below the limit at any payload the bench uses.
const MAX_LAG: u64 = 4096;
/// The subject of the fan-out pair.
const FANOUT_SUBJECT: &str = "bench.fanout";
/// The JetStream stream of the compare-and-set pair.
pub const STREAM: &str = "HUBSYNC_BENCH";
/// The subjects [`STREAM`] stores: each publisher's own subject is below.
const STREAM_SUBJECTS: &str = "cas.>";
/// JetStream's compare-and-set header: the publish is stored only if the
/// last message on its subject has this stream sequence (0: none yet).
const EXPECTED_LAST_SUBJECT_SEQ: &str = "Nats-Expected-Last-Subject-Sequence";

/// Why talking to (or starting) nats-server failed.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    /// The socket or the process failed.
    #[error("nats-server: {0}")]
    Io(#[from] std::io::Error),
    /// The server closed the connection.
    #[error("nats-server closed the connection")]
    Closed,
    /// The server sent something that is not the protocol: the text says
    /// what and where.
    #[error("malformed answer from nats-server: {0}")]
    Malformed(String),
    /// The server answered `-ERR`.
    #[error("nats-server answered -ERR {0}")]
    Refused(String),
    /// A request found nobody listening on its subject (status 503).
    #[error("no responders on {0}")]
    NoResponders(String),
    /// JetStream refused a request or a publish.
    #[error("JetStream refused ({code}, err_code {err_code}): {description}")]
    JetStream {
        /// The HTTP-like status code.
        code: u64,
        /// JetStream's own error code (10071: wrong last sequence).
        err_code: u64,
        /// JetStream's text.
        description: String,
    },
    /// Nothing came back in time.
    #[error("nats-server did not answer within {0:?}")]
    Timeout(Duration),
    /// The server process would not start or stopped early; the text holds
    /// what it printed.
    #[error("nats-server would not start: {0}")]
    Start(String),
    /// This nats-server cannot run the configuration asked for (an option
    /// it does not know); the text holds what it said.
    #[error("{0}")]
    Unsupported(String),
}

/// A message delivered to one of this connection's subscriptions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Msg {
    /// The subscription it was delivered to.
    pub sid: u64,
    /// The status code of its header line (`NATS/1.0 503` gives 503), when
    /// it came with headers that carry one.
    pub status: Option<u16>,
    /// Its payload, headers removed.
    pub payload: Vec<u8>,
}

/// One control line from the server, parsed.
#[derive(Debug, PartialEq, Eq)]
enum Control {
    /// `MSG` or `HMSG`: `total` bytes (of which `headers` are headers)
    /// follow, then CRLF.
    Msg {
        sid: u64,
        headers: usize,
        total: usize,
    },
    Ping,
    Pong,
    Ok,
    Err(String),
    Info(Vec<u8>),
}

fn malformed(what: &str, line: &[u8]) -> NatsError {
    NatsError::Malformed(format!("{what}: {:?}", String::from_utf8_lossy(line)))
}

fn number<T: std::str::FromStr>(tok: &str, line: &[u8]) -> Result<T, NatsError> {
    tok.parse()
        .map_err(|_| malformed(&format!("{tok:?} is not a number"), line))
}

/// Parse one control line (without its CRLF). Operation names are case
/// insensitive; fields are separated by any run of spaces or tabs (the
/// server writes `MSG subj 1  23` with an empty reply field).
fn parse_control(line: &[u8]) -> Result<Control, NatsError> {
    let text = std::str::from_utf8(line).map_err(|_| malformed("not UTF-8", line))?;
    let (op, rest) = match text.find([' ', '\t']) {
        Some(i) => (&text[..i], text[i..].trim()),
        None => (text, ""),
    };
    let args: Vec<&str> = rest.split_ascii_whitespace().collect();
    match op.to_ascii_uppercase().as_str() {
        // MSG <subject> <sid> [reply-to] <#bytes>
        "MSG" => match args.as_slice() {
            [_, sid, _, n] | [_, sid, n] => Ok(Control::Msg {
                sid: number(sid, line)?,
                headers: 0,
                total: number(n, line)?,
            }),
            _ => Err(malformed("MSG with the wrong number of fields", line)),
        },
        // HMSG <subject> <sid> [reply-to] <#header bytes> <#total bytes>
        "HMSG" => match args.as_slice() {
            [_, sid, _, h, n] | [_, sid, h, n] => {
                let (headers, total) = (number(h, line)?, number(n, line)?);
                if headers > total {
                    return Err(malformed("HMSG headers longer than the message", line));
                }
                Ok(Control::Msg {
                    sid: number(sid, line)?,
                    headers,
                    total,
                })
            }
            _ => Err(malformed("HMSG with the wrong number of fields", line)),
        },
        "PING" => Ok(Control::Ping),
        "PONG" => Ok(Control::Pong),
        "+OK" => Ok(Control::Ok),
        "-ERR" => Ok(Control::Err(rest.trim_matches('\'').to_string())),
        "INFO" => Ok(Control::Info(rest.as_bytes().to_vec())),
        _ => Err(malformed("unknown operation", line)),
    }
}

/// The status code of a header block (`NATS/1.0 503\r\n...\r\n\r\n`), if
/// its first line carries one.
fn header_status(block: &[u8]) -> Result<Option<u16>, NatsError> {
    let rest = block
        .strip_prefix(b"NATS/1.0")
        .ok_or_else(|| malformed("header block without NATS/1.0", block))?;
    if !rest.ends_with(b"\r\n\r\n") {
        return Err(malformed("header block not ended by an empty line", block));
    }
    let end = rest
        .windows(2)
        .position(|w| w == b"\r\n")
        .unwrap_or(rest.len());
    let first = std::str::from_utf8(&rest[..end])
        .map_err(|_| malformed("header line not UTF-8", block))?
        .trim();
    match first.split_ascii_whitespace().next() {
        None => Ok(None),
        Some(code) => Ok(Some(number(code, block)?)),
    }
}

/// A subject or reply token must be one non-empty field of the line.
fn check_token(what: &str, s: &str) -> Result<(), NatsError> {
    if s.is_empty()
        || s.bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
    {
        return Err(NatsError::Malformed(format!("bad {what} {s:?}")));
    }
    Ok(())
}

/// The part of INFO this client reads.
#[derive(Deserialize)]
struct Info {
    headers: Option<bool>,
    max_payload: Option<usize>,
}

/// One connection to nats-server, speaking the client text protocol.
/// Writes are buffered until [`NatsConn::flush`] (or a call that flushes),
/// so many publishes can share one syscall.
pub struct NatsConn {
    rd: BufReader<OwnedReadHalf>,
    wr: OwnedWriteHalf,
    out: Vec<u8>,
    line: Vec<u8>,
    max_payload: usize,
    next_sid: u64,
}

impl NatsConn {
    /// Connect, read INFO, send CONNECT (headers and no-responders on,
    /// `verbose` off) and wait for the PONG of a PING, so the server has
    /// taken the connection once this returns.
    ///
    /// # Errors
    /// When the socket fails, the server's answers do not parse, the server
    /// does not support headers, or it takes longer than 10 s.
    pub async fn connect(addr: SocketAddr) -> Result<Self, NatsError> {
        tokio::time::timeout(ANSWER_LIMIT, Self::handshake(addr))
            .await
            .map_err(|_| NatsError::Timeout(ANSWER_LIMIT))?
    }

    async fn handshake(addr: SocketAddr) -> Result<Self, NatsError> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (rd, wr) = stream.into_split();
        let mut c = NatsConn {
            rd: BufReader::with_capacity(64 * 1024, rd),
            wr,
            out: Vec::with_capacity(64 * 1024),
            line: Vec::with_capacity(256),
            max_payload: DEFAULT_MAX_PAYLOAD,
            next_sid: 1,
        };
        c.read_line().await?;
        let info = match parse_control(&c.line)? {
            Control::Info(json) => serde_json::from_slice::<Info>(&json)
                .map_err(|e| NatsError::Malformed(format!("INFO: {e}")))?,
            _ => return Err(malformed("first line is not INFO", &c.line)),
        };
        if info.headers != Some(true) {
            return Err(NatsError::Malformed(
                "the server does not support headers (HPUB)".into(),
            ));
        }
        if let Some(m) = info.max_payload.filter(|&m| m > 0) {
            c.max_payload = m;
        }
        c.out.extend_from_slice(
            b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"no_responders\":true}\r\n",
        );
        c.ping().await?;
        Ok(c)
    }

    /// Read one CRLF-ended line into `self.line`, CRLF removed.
    async fn read_line(&mut self) -> Result<(), NatsError> {
        self.line.clear();
        let n = (&mut self.rd)
            .take(MAX_LINE)
            .read_until(b'\n', &mut self.line)
            .await?;
        if n == 0 {
            return Err(NatsError::Closed);
        }
        if !self.line.ends_with(b"\r\n") {
            return Err(if n as u64 >= MAX_LINE {
                malformed("control line too long", &self.line[..64])
            } else if self.line.ends_with(b"\n") {
                malformed("line not ended by CRLF", &self.line)
            } else {
                NatsError::Closed
            });
        }
        self.line.truncate(self.line.len() - 2);
        Ok(())
    }

    /// The next message or PONG; answers the server's PINGs and skips
    /// `+OK` and INFO updates on the way.
    async fn next_event(&mut self) -> Result<Option<Msg>, NatsError> {
        loop {
            self.read_line().await?;
            match parse_control(&self.line)? {
                Control::Msg {
                    sid,
                    headers,
                    total,
                } => {
                    if total > self.max_payload {
                        return Err(malformed(
                            &format!("message larger than max_payload {}", self.max_payload),
                            &self.line,
                        ));
                    }
                    let mut body = vec![0u8; total + 2];
                    self.rd.read_exact(&mut body).await.map_err(|e| {
                        if e.kind() == std::io::ErrorKind::UnexpectedEof {
                            NatsError::Closed
                        } else {
                            NatsError::Io(e)
                        }
                    })?;
                    if !body.ends_with(b"\r\n") {
                        return Err(malformed("message not ended by CRLF", &self.line));
                    }
                    body.truncate(total);
                    let status = if headers > 0 {
                        header_status(&body[..headers])?
                    } else {
                        None
                    };
                    body.drain(..headers);
                    return Ok(Some(Msg {
                        sid,
                        status,
                        payload: body,
                    }));
                }
                Control::Pong => return Ok(None),
                Control::Ping => self.wr.write_all(b"PONG\r\n").await?,
                Control::Ok | Control::Info(_) => {}
                Control::Err(e) => return Err(NatsError::Refused(e)),
            }
        }
    }

    /// The next message delivered to any of this connection's
    /// subscriptions (stray PONGs are skipped).
    ///
    /// # Errors
    /// When the socket fails, the server sends `-ERR` or something that is
    /// not the protocol.
    pub async fn next_msg(&mut self) -> Result<Msg, NatsError> {
        loop {
            if let Some(m) = self.next_event().await? {
                return Ok(m);
            }
        }
    }

    /// Send what is buffered.
    ///
    /// # Errors
    /// When the socket fails.
    pub async fn flush(&mut self) -> Result<(), NatsError> {
        if !self.out.is_empty() {
            self.wr.write_all(&self.out).await?;
            self.out.clear();
        }
        Ok(())
    }

    /// Flush, send PING and wait for its PONG: the server has processed
    /// everything sent before it. Call it only when no message can arrive
    /// meanwhile: one that does is an error, not silently lost.
    ///
    /// # Errors
    /// As [`NatsConn::next_msg`], and a message arriving before the PONG.
    pub async fn ping(&mut self) -> Result<(), NatsError> {
        self.out.extend_from_slice(b"PING\r\n");
        self.flush().await?;
        match self.next_event().await? {
            None => Ok(()),
            Some(m) => Err(NatsError::Malformed(format!(
                "message on subscription {} while waiting for PONG",
                m.sid
            ))),
        }
    }

    /// Buffer a subscription to `subject` and return its id.
    ///
    /// # Errors
    /// When `subject` is not a single protocol token.
    pub fn subscribe(&mut self, subject: &str) -> Result<u64, NatsError> {
        check_token("subject", subject)?;
        let sid = self.next_sid;
        self.next_sid += 1;
        // Writing into a Vec cannot fail.
        let _ = write!(self.out, "SUB {subject} {sid}\r\n");
        Ok(sid)
    }

    /// Buffer the end of subscription `sid`.
    pub fn unsubscribe(&mut self, sid: u64) {
        let _ = write!(self.out, "UNSUB {sid}\r\n");
    }

    /// Buffer a publish of `payload` to `subject`, with replies to `reply`.
    ///
    /// # Errors
    /// When a subject is not a single protocol token or the payload is over
    /// the server's `max_payload`.
    pub fn publish(
        &mut self,
        subject: &str,
        reply: Option<&str>,
        payload: &[u8],
    ) -> Result<(), NatsError> {
        check_token("subject", subject)?;
        if payload.len() > self.max_payload {
            return Err(NatsError::Malformed(format!(
                "payload of {} B over max_payload {}",
                payload.len(),
                self.max_payload
            )));
        }
        match reply {
            Some(r) => {
                check_token("reply subject", r)?;
                let _ = write!(self.out, "PUB {subject} {r} {}\r\n", payload.len());
            }
            None => {
                let _ = write!(self.out, "PUB {subject} {}\r\n", payload.len());
            }
        }
        self.out.extend_from_slice(payload);
        self.out.extend_from_slice(b"\r\n");
        Ok(())
    }

    /// Buffer a publish with NATS/1.0 headers (HPUB).
    ///
    /// # Errors
    /// As [`NatsConn::publish`], and a header name or value that would break
    /// the header block.
    pub fn publish_with_headers(
        &mut self,
        subject: &str,
        reply: &str,
        headers: &[(&str, &str)],
        payload: &[u8],
    ) -> Result<(), NatsError> {
        check_token("subject", subject)?;
        check_token("reply subject", reply)?;
        let mut block = Vec::with_capacity(64);
        block.extend_from_slice(b"NATS/1.0\r\n");
        for (k, v) in headers {
            check_token("header name", k)?;
            if k.contains(':') || v.bytes().any(|b| b == b'\r' || b == b'\n') {
                return Err(NatsError::Malformed(format!("bad header {k}: {v:?}")));
            }
            let _ = write!(block, "{k}: {v}\r\n");
        }
        block.extend_from_slice(b"\r\n");
        let total = block.len() + payload.len();
        if total > self.max_payload {
            return Err(NatsError::Malformed(format!(
                "message of {total} B over max_payload {}",
                self.max_payload
            )));
        }
        let _ = write!(
            self.out,
            "HPUB {subject} {reply} {} {total}\r\n",
            block.len()
        );
        self.out.extend_from_slice(&block);
        self.out.extend_from_slice(payload);
        self.out.extend_from_slice(b"\r\n");
        Ok(())
    }

    /// Publish `payload` to `subject` and wait up to 10 s for one answer on
    /// a fresh inbox.
    ///
    /// # Errors
    /// As [`NatsConn::next_msg`]; [`NatsError::NoResponders`] when nobody
    /// listens on `subject`; [`NatsError::Timeout`].
    pub async fn request(&mut self, subject: &str, payload: &[u8]) -> Result<Msg, NatsError> {
        let inbox = format!("_INBOX.hubsync.{:016x}", rand::random::<u64>());
        let sid = self.subscribe(&inbox)?;
        self.publish(subject, Some(&inbox), payload)?;
        self.flush().await?;
        let answer = tokio::time::timeout(ANSWER_LIMIT, async {
            loop {
                let m = self.next_msg().await?;
                if m.sid == sid {
                    return Ok::<_, NatsError>(m);
                }
            }
        })
        .await
        .map_err(|_| NatsError::Timeout(ANSWER_LIMIT))??;
        self.unsubscribe(sid);
        self.flush().await?;
        if answer.status == Some(503) {
            return Err(NatsError::NoResponders(subject.to_string()));
        }
        Ok(answer)
    }
}

/// A JetStream API error object.
#[derive(Deserialize)]
struct ApiError {
    #[serde(default)]
    code: u64,
    #[serde(default)]
    err_code: u64,
    #[serde(default)]
    description: String,
}

impl From<ApiError> for NatsError {
    fn from(e: ApiError) -> Self {
        NatsError::JetStream {
            code: e.code,
            err_code: e.err_code,
            description: e.description,
        }
    }
}

#[derive(Deserialize)]
struct PubAck {
    error: Option<ApiError>,
    stream: Option<String>,
    seq: Option<u64>,
}

/// The stream sequence a JetStream publish was stored at, from its ack
/// (`{"stream":..,"seq":N}`).
///
/// # Errors
/// [`NatsError::NoResponders`] for a 503 (no stream takes the subject),
/// [`NatsError::JetStream`] for a refusal (10071: the compare-and-set
/// lost), [`NatsError::Malformed`] for anything else.
pub fn parse_pub_ack(msg: &Msg) -> Result<u64, NatsError> {
    if msg.status == Some(503) {
        return Err(NatsError::NoResponders("a JetStream subject".into()));
    }
    let ack: PubAck = serde_json::from_slice(&msg.payload)
        .map_err(|e| malformed(&format!("publish ack ({e})"), &msg.payload))?;
    if let Some(e) = ack.error {
        return Err(e.into());
    }
    match (ack.stream, ack.seq) {
        (Some(_), Some(seq)) if seq > 0 => Ok(seq),
        _ => Err(malformed(
            "publish ack without stream and seq",
            &msg.payload,
        )),
    }
}

#[derive(Deserialize)]
struct StreamCreated {
    error: Option<ApiError>,
    config: Option<StreamName>,
}

#[derive(Deserialize)]
struct StreamName {
    name: String,
}

/// Create the file-stored stream `name` over `subjects`. Retries while
/// JetStream does not answer yet (no responders), for at most 10 s.
///
/// # Errors
/// JetStream's refusal, or an answer that is not a stream's.
pub async fn create_stream(
    conn: &mut NatsConn,
    name: &str,
    subjects: &[&str],
) -> Result<(), NatsError> {
    check_token("stream name", name)?;
    let config = serde_json::json!({"name": name, "subjects": subjects, "storage": "file"});
    let body = serde_json::to_vec(&config)
        .map_err(|e| NatsError::Malformed(format!("stream config: {e}")))?;
    let subject = format!("$JS.API.STREAM.CREATE.{name}");
    let start = Instant::now();
    let answer = loop {
        match conn.request(&subject, &body).await {
            Err(NatsError::NoResponders(_)) if start.elapsed() < ANSWER_LIMIT => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => break other?,
        }
    };
    let created: StreamCreated = serde_json::from_slice(&answer.payload)
        .map_err(|e| malformed(&format!("stream create answer ({e})"), &answer.payload))?;
    if let Some(e) = created.error {
        return Err(e.into());
    }
    match created.config {
        Some(c) if c.name == name => Ok(()),
        _ => Err(malformed(
            "stream create answer names another stream",
            &answer.payload,
        )),
    }
}

/// How the JetStream server syncs its files, which decides what its ack
/// promises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// The server's default: it acks once the write is in the OS's page
    /// cache, and fsyncs on a timer (2 minutes by default).
    DefaultSync,
    /// `sync_interval: always`: every write is fsynced before its ack, as
    /// the hub flushes before each `Accepted`. Needs nats-server 2.10+.
    SyncAlways,
}

/// A nats-server process on a free loopback port with JetStream over a
/// temporary store; killed (and its store removed) when dropped.
pub struct NatsServer {
    child: Child,
    addr: SocketAddr,
    // Dropped after the child is killed (fields drop after `Drop::drop`).
    dir: tempfile::TempDir,
}

impl NatsServer {
    /// Start `binary` and wait until it accepts connections.
    ///
    /// # Errors
    /// [`NatsError::Unsupported`] when this server does not know an option
    /// `durability` needs (`sync_interval` before 2.10); [`NatsError::Start`]
    /// when it exits or does not accept within 10 s.
    pub async fn start(binary: &Path, durability: Durability) -> Result<Self, NatsError> {
        let dir = tempfile::tempdir()?;
        let store = dir.path().join("jetstream");
        let log = dir.path().join("server.log");
        // A port the OS just handed out and released: another process could
        // take it in between, which the accept wait below then reports.
        let port = StdListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut cmd = Command::new(binary);
        match durability {
            Durability::DefaultSync => {
                cmd.arg("-a")
                    .arg("127.0.0.1")
                    .arg("-p")
                    .arg(port.to_string());
                cmd.arg("-js").arg("-sd").arg(&store);
            }
            Durability::SyncAlways => {
                let store = store
                    .to_str()
                    .filter(|s| !s.contains(['"', '\\', '\n']))
                    .ok_or_else(|| {
                        NatsError::Start(format!("store path {} cannot be quoted", store.display()))
                    })?;
                let conf = dir.path().join("server.conf");
                std::fs::write(
                    &conf,
                    format!(
                        "listen: \"127.0.0.1:{port}\"\njetstream {{\n  store_dir: \"{store}\"\n  sync_interval: always\n}}\n"
                    ),
                )?;
                check_config(binary, &conf).await?;
                cmd.arg("-c").arg(&conf);
            }
        }
        let stderr = std::fs::File::create(&log)?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr));
        let child = cmd.spawn()?;
        let mut server = NatsServer { child, addr, dir };
        let start = Instant::now();
        loop {
            if let Some(status) = server.child.try_wait()? {
                return Err(NatsError::Start(format!(
                    "exited with {status}: {}",
                    server.log_tail()
                )));
            }
            if TcpStream::connect(addr).await.is_ok() {
                return Ok(server);
            }
            if start.elapsed() > START_LIMIT {
                return Err(NatsError::Start(format!(
                    "not accepting on {addr} after {START_LIMIT:?}: {}",
                    server.log_tail()
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The loopback address it accepts clients on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The last lines the server printed, for error messages.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().rev().take(5).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Run `binary -t -c conf`: nats-server checks the file and exits.
async fn check_config(binary: &Path, conf: &Path) -> Result<(), NatsError> {
    let out = tokio::process::Command::new(binary)
        .arg("-t")
        .arg("-c")
        .arg(conf)
        .stdin(Stdio::null())
        .output()
        .await?;
    if out.status.success() {
        return Ok(());
    }
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let said = said.trim().to_string();
    // Only the option this bench adds can be unknown: name it without the
    // temporary path nats-server prefixes it with.
    if let Some(i) = said.find("unknown field") {
        Err(NatsError::Unsupported(said[i..].to_string()))
    } else {
        Err(NatsError::Start(said))
    }
}

/// Where `name` is: itself when it names a path, else the first executable
/// file of that name on PATH; `None` when there is none.
pub fn locate(name: &Path) -> Option<PathBuf> {
    if name.components().count() > 1 {
        return is_executable(name).then(|| name.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    let Ok(meta) = std::fs::metadata(p) else {
        return false;
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        meta.is_file() && meta.permissions().mode() & 0o111 != 0
    }
    #[cfg(not(unix))]
    {
        meta.is_file()
    }
}

/// The version `binary --version` prints (`2.9.10`), or "unknown version".
pub async fn server_version(binary: &Path) -> String {
    let out = tokio::process::Command::new(binary)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .await;
    out.ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_ascii_whitespace()
                .find_map(|t| t.strip_prefix('v').map(str::to_string))
        })
        .unwrap_or_else(|| "unknown version".to_string())
}

/// One JetStream compare-and-set publisher: its own connection, its own
/// reply inbox, and in each slice its own subject of [`STREAM`].
struct CasPublisher {
    conn: NatsConn,
    inbox: String,
    sid: u64,
    index: usize,
}

/// The JetStream side of the compare-and-set pair: a stream and its
/// publishers, each on its own connection.
pub struct JetStreamCas {
    publishers: Vec<CasPublisher>,
    slices: u64,
}

impl JetStreamCas {
    /// Create [`STREAM`] on `server` and connect `n` publishers.
    ///
    /// # Errors
    /// When a connection or the stream cannot be made.
    pub async fn start(server: &NatsServer, n: usize) -> Result<Self, NatsError> {
        let mut admin = NatsConn::connect(server.addr()).await?;
        create_stream(&mut admin, STREAM, &[STREAM_SUBJECTS]).await?;
        let mut publishers = Vec::with_capacity(n);
        for index in 0..n {
            let mut conn = NatsConn::connect(server.addr()).await?;
            let inbox = format!("_INBOX.hubsync.cas.{index}");
            let sid = conn.subscribe(&inbox)?;
            conn.ping().await?;
            publishers.push(CasPublisher {
                conn,
                inbox,
                sid,
                index,
            });
        }
        Ok(Self {
            publishers,
            slices: 0,
        })
    }
}

/// JetStream compare-and-set publishes: each publisher appends to its own
/// fresh subject, one publish at a time, each naming (in
/// `Nats-Expected-Last-Subject-Sequence`) the sequence its previous ack
/// gave, for `len`. Latency is from the write to the ack.
///
/// # Errors
/// Any refusal or lost compare-and-set (nobody else writes these
/// subjects), a malformed ack, or one that takes over 10 s.
pub async fn jetstream_cas(
    js: &mut JetStreamCas,
    payload: usize,
    len: Duration,
) -> Result<Slice, String> {
    js.slices += 1;
    let slice_no = js.slices;
    let body = Arc::new(vec![0x5a; payload]);
    let start = Instant::now();
    let deadline = start + len;
    let mut tasks = JoinSet::new();
    // Each publisher runs on a task of its own, as the hub's publishers do,
    // and comes back with its latencies.
    for mut p in std::mem::take(&mut js.publishers) {
        let body = body.clone();
        tasks.spawn(async move {
            let subject = format!("cas.{slice_no}.{}", p.index);
            let mut last = 0u64;
            let mut lat = Vec::new();
            while Instant::now() < deadline {
                let t0 = Instant::now();
                let expected = last.to_string();
                let answer = async {
                    p.conn.publish_with_headers(
                        &subject,
                        &p.inbox,
                        &[(EXPECTED_LAST_SUBJECT_SEQ, &expected)],
                        &body,
                    )?;
                    p.conn.flush().await?;
                    loop {
                        let m = p.conn.next_msg().await?;
                        if m.sid == p.sid {
                            return parse_pub_ack(&m);
                        }
                    }
                };
                last = tokio::time::timeout(ANSWER_LIMIT, answer)
                    .await
                    .map_err(|_| NatsError::Timeout(ANSWER_LIMIT).to_string())?
                    .map_err(|e| format!("JetStream publish on {subject}: {e}"))?;
                lat.push(t0.elapsed().as_micros() as u64);
            }
            Ok::<_, String>((p, lat))
        });
    }
    let mut slice = Slice::default();
    let mut failure = None;
    while let Some(r) = tasks.join_next().await {
        match r.map_err(|e| e.to_string()).and_then(|r| r) {
            Ok((p, lat)) => {
                slice.ops += lat.len() as u64;
                slice.latencies_us.extend(lat);
                js.publishers.push(p);
            }
            Err(e) => failure = failure.or(Some(e)),
        }
    }
    slice.secs = start.elapsed().as_secs_f64();
    match failure {
        Some(e) => Err(e),
        None => Ok(slice),
    }
}

/// Core NATS subscribers of the fan-out subject, each on its own
/// connection and task, counting what they are delivered.
pub struct CoreSubscribers {
    counts: Vec<Arc<AtomicU64>>,
    failure: Arc<Mutex<Option<String>>>,
    tasks: JoinSet<()>,
}

impl CoreSubscribers {
    /// Connect `n` subscribers and wait until the server has registered
    /// each subscription.
    ///
    /// # Errors
    /// When a subscriber cannot connect or subscribe.
    pub async fn start(server: &NatsServer, n: usize) -> Result<Self, NatsError> {
        let failure = Arc::new(Mutex::new(None));
        let mut counts = Vec::with_capacity(n);
        let mut tasks = JoinSet::new();
        for _ in 0..n {
            let mut conn = NatsConn::connect(server.addr()).await?;
            let sid = conn.subscribe(FANOUT_SUBJECT)?;
            // The PONG says the SUB is in place before anything is sent.
            conn.ping().await?;
            let count = Arc::new(AtomicU64::new(0));
            counts.push(count.clone());
            let failure = failure.clone();
            tasks.spawn(async move {
                loop {
                    match conn.next_msg().await {
                        Ok(m) if m.sid == sid => {
                            count.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(_) => {}
                        Err(e) => {
                            failure
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .get_or_insert(e.to_string());
                            return;
                        }
                    }
                }
            });
        }
        Ok(Self {
            counts,
            failure,
            tasks,
        })
    }

    fn snapshot(&self) -> Vec<u64> {
        self.counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }

    fn failed(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for CoreSubscribers {
    fn drop(&mut self) {
        self.tasks.abort_all();
    }
}

/// Core NATS fan-out: `publisher` publishes `payload`-byte messages to the
/// subject every subscriber follows, in batches of [`PUBLISH_BATCH`] per
/// write and never more than [`MAX_LAG`] ahead of the slowest subscriber,
/// for `len`; counts deliveries the subscribers received inside the slice,
/// then waits for the rest so the next slice starts clean.
///
/// # Errors
/// When a socket fails, a subscriber's connection ends, or subscribers
/// never catch up.
pub async fn core_fanout(
    publisher: &mut NatsConn,
    subs: &CoreSubscribers,
    payload: usize,
    len: Duration,
) -> Result<Slice, String> {
    let body = vec![0x5a; payload];
    let bases = subs.snapshot();
    let behind = |sent: u64| -> bool {
        subs.counts.iter().zip(&bases).any(|(c, b)| {
            sent.saturating_sub(c.load(Ordering::Relaxed).saturating_sub(*b)) > MAX_LAG
        })
    };
    let start = Instant::now();
    let deadline = start + len;
    let mut sent = 0u64;
    while Instant::now() < deadline {
        for _ in 0..PUBLISH_BATCH {
            publisher
                .publish(FANOUT_SUBJECT, None, &body)
                .map_err(|e| e.to_string())?;
        }
        publisher.flush().await.map_err(|e| e.to_string())?;
        sent += PUBLISH_BATCH as u64;
        while behind(sent) && Instant::now() < deadline {
            if let Some(e) = subs.failed() {
                return Err(format!("a core NATS subscriber failed: {e}"));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let received = |now: &[u64]| -> u64 {
        now.iter()
            .zip(&bases)
            .map(|(n, b)| n.saturating_sub(*b))
            .sum()
    };
    let ops = received(&subs.snapshot());
    let secs = start.elapsed().as_secs_f64();
    let want = sent * subs.counts.len() as u64;
    let drained = Instant::now();
    while received(&subs.snapshot()) < want {
        if let Some(e) = subs.failed() {
            return Err(format!("a core NATS subscriber failed: {e}"));
        }
        if drained.elapsed() > DRAIN_LIMIT {
            return Err(format!(
                "core NATS subscribers received {} of {want} deliveries",
                received(&subs.snapshot())
            ));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Also answers any PING the server sent the publisher meanwhile.
    publisher.ping().await.map_err(|e| e.to_string())?;
    Ok(Slice {
        ops,
        secs,
        latencies_us: Vec::new(),
    })
}

/// Connect the fan-out publisher.
///
/// # Errors
/// When it cannot connect.
pub async fn fanout_publisher(server: &NatsServer) -> Result<NatsConn, NatsError> {
    NatsConn::connect(server.addr()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn msg_lines_parse_with_and_without_reply() {
        assert_eq!(
            parse_control(b"MSG _INBOX.x 1  23").ok(),
            Some(Control::Msg {
                sid: 1,
                headers: 0,
                total: 23
            })
        );
        assert_eq!(
            parse_control(b"msg foo.bar 9 GREETING.34 11").ok(),
            Some(Control::Msg {
                sid: 9,
                headers: 0,
                total: 11
            })
        );
        assert_eq!(
            parse_control(b"HMSG _INBOX.x 1 16 16").ok(),
            Some(Control::Msg {
                sid: 1,
                headers: 16,
                total: 16
            })
        );
        assert_eq!(
            parse_control(b"HMSG SUBJECT 1 REPLY 23 30").ok(),
            Some(Control::Msg {
                sid: 1,
                headers: 23,
                total: 30
            })
        );
        assert_eq!(parse_control(b"PING").ok(), Some(Control::Ping));
        assert_eq!(
            parse_control(b"-ERR 'Unknown Protocol Operation'").ok(),
            Some(Control::Err("Unknown Protocol Operation".into()))
        );
    }

    #[test]
    fn malformed_lines_are_errors_not_panics() {
        for line in [
            &b"MSG"[..],
            b"MSG a b 3",
            b"MSG a 1 -3",
            b"MSG a 1 r s 3",
            b"HMSG a 1 30 23",
            b"HMSG a 1 x 23",
            b"BOGUS 1",
            b"",
            b"\xff\xfe",
            b"MSG a 1 99999999999999999999999",
        ] {
            assert!(
                matches!(parse_control(line), Err(NatsError::Malformed(_))),
                "{line:?}"
            );
        }
    }

    #[test]
    fn header_blocks_give_their_status() {
        assert_eq!(header_status(b"NATS/1.0 503\r\n\r\n").ok(), Some(Some(503)));
        assert_eq!(header_status(b"NATS/1.0\r\nA: b\r\n\r\n").ok(), Some(None));
        assert!(header_status(b"HTTP/1.1 200\r\n\r\n").is_err());
        assert!(header_status(b"NATS/1.0 503\r\n").is_err());
        assert!(header_status(b"NATS/1.0 abc\r\n\r\n").is_err());
    }

    fn msg(payload: &[u8], status: Option<u16>) -> Msg {
        Msg {
            sid: 1,
            status,
            payload: payload.to_vec(),
        }
    }

    #[test]
    fn pub_acks_parse_or_name_the_refusal() {
        assert_eq!(
            parse_pub_ack(&msg(br#"{"stream":"B", "seq":7}"#, None)).ok(),
            Some(7)
        );
        let lost = parse_pub_ack(&msg(
            br#"{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 1"},"stream":"B","seq":0}"#,
            None,
        ));
        assert!(matches!(
            lost,
            Err(NatsError::JetStream {
                err_code: 10071,
                ..
            })
        ));
        assert!(matches!(
            parse_pub_ack(&msg(b"", Some(503))),
            Err(NatsError::NoResponders(_))
        ));
        for bad in [&b"not json"[..], b"{}", br#"{"stream":"B"}"#, b"[1]"] {
            assert!(
                matches!(parse_pub_ack(&msg(bad, None)), Err(NatsError::Malformed(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn tokens_with_spaces_are_refused() {
        assert!(check_token("subject", "a.b").is_ok());
        assert!(check_token("subject", "a b").is_err());
        assert!(check_token("subject", "a\r\n").is_err());
        assert!(check_token("subject", "").is_err());
    }

    /// Against a real server when one is installed: the compare-and-set
    /// holds (a stale expected sequence is refused) and core fan-out
    /// delivers every message to every subscriber.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn against_nats_server_when_installed() {
        let Some(binary) = locate(Path::new("nats-server")) else {
            eprintln!("nats-server not installed: skipped");
            return;
        };
        let server = NatsServer::start(&binary, Durability::DefaultSync)
            .await
            .expect("server starts");
        let mut c = NatsConn::connect(server.addr()).await.expect("connects");
        create_stream(&mut c, STREAM, &[STREAM_SUBJECTS])
            .await
            .expect("stream");
        let inbox = "_INBOX.test";
        let sid = c.subscribe(inbox).expect("sub");
        let mut publish = async |expected: u64| {
            c.publish_with_headers(
                "cas.t",
                inbox,
                &[(EXPECTED_LAST_SUBJECT_SEQ, &expected.to_string())],
                b"x",
            )?;
            c.flush().await?;
            let m = c.next_msg().await?;
            assert_eq!(m.sid, sid);
            parse_pub_ack(&m)
        };
        let first = publish(0).await.expect("first publish");
        assert!(matches!(
            publish(0).await,
            Err(NatsError::JetStream {
                err_code: 10071,
                ..
            })
        ));
        assert!(publish(first).await.expect("second publish") > first);

        let mut js = JetStreamCas {
            publishers: Vec::new(),
            slices: 0,
        };
        // The stream exists already: add publishers the way start() does.
        for index in 0..2 {
            let mut conn = NatsConn::connect(server.addr()).await.expect("connects");
            let inbox = format!("_INBOX.hubsync.cas.{index}");
            let sid = conn.subscribe(&inbox).expect("sub");
            conn.ping().await.expect("pong");
            js.publishers.push(CasPublisher {
                conn,
                inbox,
                sid,
                index,
            });
        }
        let s = jetstream_cas(&mut js, 64, Duration::from_millis(100))
            .await
            .expect("cas slice");
        assert!(s.ops > 0);
        assert_eq!(js.publishers.len(), 2);

        let subs = CoreSubscribers::start(&server, 3).await.expect("subs");
        let mut p = fanout_publisher(&server).await.expect("publisher");
        for _ in 0..2 {
            let s = core_fanout(&mut p, &subs, 128, Duration::from_millis(100))
                .await
                .expect("fan-out slice");
            assert!(s.ops > 0);
        }

        assert!(matches!(
            NatsServer::start(
                Path::new("/nonexistent/nats-server"),
                Durability::DefaultSync
            )
            .await,
            Err(NatsError::Io(_))
        ));
    }
}
