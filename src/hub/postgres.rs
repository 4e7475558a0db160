//! A [`HubStore`] on PostgreSQL, which several hub processes can share.
//!
//! The hub's data is the same ordered key-value space as on sled
//! ([`layout`](super::layout) says what lives under which key), kept in one
//! table, `hub_kv (k BYTEA PRIMARY KEY, v BYTEA NOT NULL)`; `BYTEA` compares
//! byte by byte, so a range over keys is the same range as sled's.
//!
//! What makes the promises of [`HubStore`] hold across processes:
//!
//! - **Isolated.** Every transaction runs at `SERIALIZABLE`: PostgreSQL
//!   commits a set of concurrent transactions only if some serial order
//!   would have given the same results, and fails the others with a
//!   serialization failure (SQLSTATE 40001) or a detected deadlock (40P01),
//!   which this store answers as [`StoreError::Conflict`] with nothing
//!   written. Two publishes that both read a topic's head 7, on the same
//!   process or on two, cannot both commit: that is the compare-and-set.
//! - **Atomic.** The staged writes are sent at commit, inside the
//!   transaction, followed by `COMMIT`.
//! - **Durable when `COMMIT` returns.** Each connection sets
//!   `synchronous_commit = on`, so `COMMIT` answers only after the commit's
//!   WAL record is flushed (on a replicated server, as its own settings
//!   say); [`HubStore::durable`] therefore never waits.
//!
//! Round trips: a transaction's `BEGIN` travels with its first read, and
//! its writes with its `COMMIT` (tokio-postgres pipelines requests made
//! together on one connection); statements are prepared once per
//! connection. A publish is two or three round trips; concurrent publishes
//! run on the pool's connections side by side, and the server's own group
//! commit shares WAL flushes between them.
//!
//! Several processes on one database push each other's frames: a publish
//! that has recipients sends, inside its transaction, a `NOTIFY` on the
//! channel `hubsync_frames` ([`announce`](super::announce) says what it
//! holds), which PostgreSQL delivers only if the transaction commits; each
//! store keeps one more connection that `LISTEN`s on it and hands what
//! arrives to its hub ([`HubStore::announcements`]), which wakes the
//! receive streams it holds. LISTEN/NOTIFY ([`Announce::Listen`], the
//! default) rather than polling a table: it costs nothing while idle, adds
//! one statement to the publish's pipeline, and delivers within a round
//! trip; what it does not promise (delivery while the listener is
//! reconnecting) is covered by the listener telling its hub that it may
//! have missed announcements, upon which every stream reads its topics'
//! heads again. Databases that speak PostgreSQL without LISTEN/NOTIFY get
//! [`Announce::Poll`]: the same announcement as a row of `hub_announce`,
//! which every process reads now and then (see [`poll`]).
//!
//! The SQL is plain: `BYTEA`, `INSERT … ON CONFLICT … DO UPDATE`, `UNNEST`
//! of arrays, `SERIALIZABLE`; with [`Announce::Poll`], nothing
//! PostgreSQL-specific beyond what CockroachDB and YugabyteDB also run
//! (docs/operations.md).

use super::announce::{self, Remote};
use super::layout as l;
use super::store::{Generation, HubStore, HubTxn, StoreError};
use crate::kv::{Entries, KvError};
use crate::rng::SharedRng;
use crate::wire::{DeviceId, StoreId, TopicId};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_postgres::error::SqlState;
use tokio_postgres::{AsyncMessage, Client, NoTls, Statement};

/// The schema, one step per version; a store records the versions it has.
/// Steps are only ever appended.
const MIGRATIONS: &[&str] = &[
    // 1: the key-value space.
    "CREATE TABLE IF NOT EXISTS hub_kv (k BYTEA PRIMARY KEY, v BYTEA NOT NULL)",
    // 2: announcements for processes that poll ([`Announce::Poll`]).
    "CREATE TABLE IF NOT EXISTS hub_announce (id BYTEA PRIMARY KEY, at BIGINT NOT NULL, \
     n TEXT NOT NULL); CREATE INDEX IF NOT EXISTS hub_announce_at ON hub_announce (at)",
];

/// Why a PostgreSQL store could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum PgOpenError {
    /// The connection string is not one tokio-postgres reads.
    #[error("not a PostgreSQL connection string: {0}")]
    Config(#[source] tokio_postgres::Error),
    /// The server could not be reached or refused the connection.
    #[error("cannot connect to PostgreSQL: {0}")]
    Connect(#[source] tokio_postgres::Error),
    /// A statement of the start (schema, identity) failed.
    #[error("PostgreSQL refused the hub's schema or identity: {0}")]
    Schema(#[source] tokio_postgres::Error),
    /// The database holds a schema newer than this hub knows: a newer hub
    /// version wrote it. Run that version (or newer) instead.
    #[error("the database's hub schema is version {found}; this hub knows up to {known}")]
    NewerSchema {
        /// The version found.
        found: i32,
        /// The newest this build knows.
        known: i32,
    },
    /// The stored identity is not 16 bytes.
    #[error("the stored hub identity is {0} bytes, not 16")]
    BadIdentity(usize),
}

/// How many connections a store keeps at most, when not told.
pub const DEFAULT_POOL_SIZE: usize = 16;

/// How the hub processes on one database tell each other which frames are
/// durable, so each pushes the others' frames at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Announce {
    /// A `NOTIFY` inside the publish's transaction, and one connection per
    /// process that `LISTEN`s: nothing runs while idle, and a push follows
    /// within a round trip. PostgreSQL only.
    Listen,
    /// A row in `hub_announce` inside the publish's transaction, which
    /// every process reads every `interval`, for databases that speak
    /// PostgreSQL's protocol without LISTEN/NOTIFY (CockroachDB,
    /// YugabyteDB). A push follows within `interval`; each process runs one
    /// small query per `interval`, and rows are deleted a minute after
    /// they were written.
    Poll {
        /// How often each process reads the table.
        interval: std::time::Duration,
    },
}

/// How a [`PgHubStore`] runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PgOptions {
    /// Connections kept at most (at least 1 is used).
    pub pool_size: usize,
    /// How processes announce durable frames to each other.
    pub announce: Announce,
}

impl Default for PgOptions {
    /// [`DEFAULT_POOL_SIZE`] connections, [`Announce::Listen`].
    fn default() -> Self {
        Self {
            pool_size: DEFAULT_POOL_SIZE,
            announce: Announce::Listen,
        }
    }
}

/// A [`HubStore`] on a PostgreSQL database (see the [module docs](self)).
pub struct PgHubStore {
    pool: Arc<Pool>,
    id: StoreId,
    /// Commits that wrote something; each was durable when it answered.
    commits: Arc<AtomicU64>,
    /// This process's name in its announcements (it ignores its own).
    origin: u64,
    announce: Announce,
    /// Announcement rows written by this process, for their ids.
    announced: Arc<AtomicU64>,
    /// Text on the announcement channel that was not an announcement.
    bad_announcements: Arc<AtomicU64>,
}

impl PgHubStore {
    /// Connect to the database named by `url` (a `postgres://` URL or a
    /// `key=value` string, as libpq reads them), bring its schema up to date
    /// (every hub process does this at start; concurrent starts are safe),
    /// and read the store's identity, drawing it from `rng` when the
    /// database has none yet (the first process to commit one wins, and
    /// every other reads that one).
    ///
    /// # Errors
    /// [`PgOpenError`], naming what failed.
    pub async fn open(
        url: &str,
        options: &PgOptions,
        rng: &SharedRng,
    ) -> Result<Arc<Self>, PgOpenError> {
        let config = tokio_postgres::Config::from_str(url).map_err(PgOpenError::Config)?;
        // The schema first, on a connection of its own: the pool's
        // connections prepare statements on the tables it creates.
        let (client, connection) = config.connect(NoTls).await.map_err(PgOpenError::Connect)?;
        let task = tokio::spawn(connection);
        let started = async {
            migrate(&client).await?;
            identity(&client, rng).await
        }
        .await;
        drop(client);
        let _ = task.await;
        let id = started?;
        let pool = Arc::new(Pool {
            config,
            idle: Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(options.pool_size.max(1))),
        });
        Ok(Arc::new(Self {
            pool,
            id,
            commits: Arc::new(AtomicU64::new(0)),
            origin: rng.next_u64(),
            announce: options.announce,
            announced: Arc::new(AtomicU64::new(0)),
            bad_announcements: Arc::new(AtomicU64::new(0)),
        }))
    }
}

/// Apply every migration the database lacks, in one serializable
/// transaction per attempt; a concurrent start that migrated first makes
/// this one conflict, and the retry finds the work done.
async fn migrate(client: &Client) -> Result<(), PgOpenError> {
    let known = MIGRATIONS.len() as i32;
    let mut attempts = 0;
    loop {
        attempts += 1;
        match migrate_once(client, known).await {
            // Another process created or migrated at the same moment: its
            // work is done or will be; look again.
            Err(MigrateError::Sql(e)) if attempts < 10 && (is_conflict(&e) || is_duplicate(&e)) => {
                let _ = client.batch_execute("ROLLBACK").await;
                tokio::time::sleep(std::time::Duration::from_millis(10 * attempts)).await;
            }
            Err(MigrateError::Sql(e)) => {
                let _ = client.batch_execute("ROLLBACK").await;
                return Err(PgOpenError::Schema(e));
            }
            Err(MigrateError::Newer(found)) => {
                let _ = client.batch_execute("ROLLBACK").await;
                return Err(PgOpenError::NewerSchema { found, known });
            }
            Ok(()) => return Ok(()),
        }
    }
}

enum MigrateError {
    Sql(tokio_postgres::Error),
    Newer(i32),
}

impl From<tokio_postgres::Error> for MigrateError {
    fn from(e: tokio_postgres::Error) -> Self {
        MigrateError::Sql(e)
    }
}

async fn migrate_once(client: &Client, known: i32) -> Result<(), MigrateError> {
    // Two processes creating the table at once can fail one with a
    // duplicate key in the catalog, even with IF NOT EXISTS: retried.
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS hubsync_schema (version INT PRIMARY KEY, \
             applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
        )
        .await?;
    client
        .batch_execute("BEGIN ISOLATION LEVEL SERIALIZABLE")
        .await?;
    let row = client
        .query_one("SELECT COALESCE(MAX(version), 0) FROM hubsync_schema", &[])
        .await?;
    let found: i32 = row.try_get(0)?;
    if found > known {
        return Err(MigrateError::Newer(found));
    }
    for (i, step) in MIGRATIONS.iter().enumerate().skip(found as usize) {
        client.batch_execute(step).await?;
        client
            .execute(
                "INSERT INTO hubsync_schema (version) VALUES ($1)",
                &[&(i as i32 + 1)],
            )
            .await?;
    }
    client.batch_execute("COMMIT").await?;
    Ok(())
}

/// The store's identity: the one committed, or a new one from `rng`.
async fn identity(client: &Client, rng: &SharedRng) -> Result<StoreId, PgOpenError> {
    let key = l::store_id();
    let mut fresh = [0u8; 16];
    rng.fill(&mut fresh);
    client
        .execute(
            "INSERT INTO hub_kv (k, v) VALUES ($1, $2) ON CONFLICT (k) DO NOTHING",
            &[&key, &fresh.as_slice()],
        )
        .await
        .map_err(PgOpenError::Schema)?;
    let row = client
        .query_one("SELECT v FROM hub_kv WHERE k = $1", &[&key])
        .await
        .map_err(PgOpenError::Schema)?;
    let stored: Vec<u8> = row.try_get(0).map_err(PgOpenError::Schema)?;
    let id: [u8; 16] = stored
        .as_slice()
        .try_into()
        .map_err(|_| PgOpenError::BadIdentity(stored.len()))?;
    if id == fresh {
        tracing::info!(store_id = %StoreId(id), "new hub store on PostgreSQL: identity created");
    }
    Ok(StoreId(id))
}

/// SQLSTATEs after which the transaction wrote nothing and may run again.
fn is_conflict(e: &tokio_postgres::Error) -> bool {
    matches!(
        e.code(),
        Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE || *c == SqlState::T_R_DEADLOCK_DETECTED
    )
}

/// SQLSTATEs of two processes creating the same table at once (even with
/// `IF NOT EXISTS`, the catalog can refuse the second): look again.
fn is_duplicate(e: &tokio_postgres::Error) -> bool {
    matches!(
        e.code(),
        Some(c) if *c == SqlState::UNIQUE_VIOLATION
            || *c == SqlState::DUPLICATE_TABLE
            || *c == SqlState::DUPLICATE_OBJECT
    )
}

fn engine(e: tokio_postgres::Error) -> StoreError {
    if is_conflict(&e) {
        StoreError::Conflict
    } else {
        StoreError::Engine(KvError::Engine(format!("postgres: {e}")))
    }
}

/// A `LIMIT` for at most `limit` rows.
fn sql_limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

fn rows_to_entries(rows: Vec<tokio_postgres::Row>) -> Result<Entries, StoreError> {
    rows.into_iter()
        .map(|r| Ok((r.try_get(0).map_err(engine)?, r.try_get(1).map_err(engine)?)))
        .collect()
}

/// The statements every connection prepares once.
struct Statements {
    get: Statement,
    get_many: Statement,
    range: Statement,
    range_open: Statement,
    upsert: Statement,
    delete: Statement,
    notify: Statement,
    announce_row: Statement,
}

struct Conn {
    client: Client,
    stmts: Statements,
    /// A transaction was begun and neither committed nor rolled back (its
    /// handle was dropped): roll it back before the next use.
    in_txn: bool,
}

impl Conn {
    /// The value under `key`; `BEGIN` goes first in the same pipeline when
    /// `begin`.
    async fn get(&self, key: &[u8], begin: bool) -> Result<Option<Vec<u8>>, StoreError> {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&key];
        let query = self.client.query_opt(&self.stmts.get, &params);
        let row = with_begin(&self.client, begin, query).await?;
        row.map(|r| r.try_get(0).map_err(engine)).transpose()
    }

    /// The values under each of `keys`, in their order, in one query;
    /// `BEGIN` goes first in the same pipeline when `begin`.
    async fn get_many(
        &self,
        keys: &[Vec<u8>],
        begin: bool,
    ) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&keys];
        let query = self.client.query(&self.stmts.get_many, &params);
        let found: std::collections::HashMap<Vec<u8>, Vec<u8>> =
            rows_to_entries(with_begin(&self.client, begin, query).await?)?
                .into_iter()
                .collect();
        Ok(keys.iter().map(|k| found.get(k).cloned()).collect())
    }

    /// Up to `limit` entries with `start <= key < end`; `BEGIN` goes first
    /// in the same pipeline when `begin`.
    async fn range(
        &self,
        start: &[u8],
        end: Option<&[u8]>,
        limit: usize,
        begin: bool,
    ) -> Result<Entries, StoreError> {
        let limit = sql_limit(limit);
        let (statement, params): (_, Vec<&(dyn tokio_postgres::types::ToSql + Sync)>) = match &end {
            Some(end) => (&self.stmts.range, vec![&start, end, &limit]),
            None => (&self.stmts.range_open, vec![&start, &limit]),
        };
        let query = self.client.query(statement, &params);
        rows_to_entries(with_begin(&self.client, begin, query).await?)
    }
}

/// Connections, opened on demand up to the pool's size and kept open.
struct Pool {
    config: tokio_postgres::Config,
    idle: Mutex<Vec<Conn>>,
    permits: Arc<Semaphore>,
}

enum PoolError {
    Connect(tokio_postgres::Error),
    Sql(tokio_postgres::Error),
}

impl From<PoolError> for StoreError {
    fn from(e: PoolError) -> Self {
        match e {
            PoolError::Connect(e) | PoolError::Sql(e) => engine(e),
        }
    }
}

impl Pool {
    async fn checkout(self: &Arc<Self>) -> Result<Pooled, PoolError> {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("the pool's semaphore is never closed");
        let conn = match self.take_idle().await {
            Some(conn) => conn,
            None => self.connect().await?,
        };
        Ok(Pooled {
            conn: Some(conn),
            pool: self.clone(),
            _permit: permit,
        })
    }

    /// An idle connection that still works, rolled back if a dropped
    /// transaction left it inside one.
    async fn take_idle(&self) -> Option<Conn> {
        loop {
            let mut conn = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop()?;
            if conn.client.is_closed() {
                continue;
            }
            if conn.in_txn {
                if conn.client.batch_execute("ROLLBACK").await.is_err() {
                    continue;
                }
                conn.in_txn = false;
            }
            return Some(conn);
        }
    }

    async fn connect(&self) -> Result<Conn, PoolError> {
        let (client, connection) = self
            .config
            .connect(NoTls)
            .await
            .map_err(PoolError::Connect)?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                // The client sees the same failure as an error on its next
                // request; this says why the connection ended.
                tracing::warn!(error = %e, "hub store: a PostgreSQL connection ended");
            }
        });
        client
            .batch_execute("SET synchronous_commit = on")
            .await
            .map_err(PoolError::Sql)?;
        let prepare = |sql: &'static str| {
            let client = &client;
            async move { client.prepare(sql).await.map_err(PoolError::Sql) }
        };
        let (get, get_many, range, range_open, upsert, delete, notify, announce_row) = futures::try_join!(
            prepare("SELECT v FROM hub_kv WHERE k = $1"),
            prepare("SELECT k, v FROM hub_kv WHERE k = ANY($1::BYTEA[])"),
            prepare("SELECT k, v FROM hub_kv WHERE k >= $1 AND k < $2 ORDER BY k LIMIT $3"),
            prepare("SELECT k, v FROM hub_kv WHERE k >= $1 ORDER BY k LIMIT $2"),
            prepare(
                "INSERT INTO hub_kv (k, v) SELECT * FROM UNNEST($1::BYTEA[], $2::BYTEA[]) \
                 ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v"
            ),
            prepare("DELETE FROM hub_kv WHERE k = ANY($1::BYTEA[])"),
            prepare("SELECT pg_notify('hubsync_frames', n) FROM UNNEST($1::TEXT[]) AS n"),
            prepare(
                "INSERT INTO hub_announce (id, at, n) \
                 SELECT i, (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::BIGINT, n \
                 FROM UNNEST($1::BYTEA[], $2::TEXT[]) AS a(i, n)"
            ),
        )?;
        Ok(Conn {
            client,
            stmts: Statements {
                get,
                get_many,
                range,
                range_open,
                upsert,
                delete,
                notify,
                announce_row,
            },
            in_txn: false,
        })
    }
}

/// A connection lent out by the pool; it goes back when dropped.
struct Pooled {
    conn: Option<Conn>,
    pool: Arc<Pool>,
    _permit: OwnedSemaphorePermit,
}

impl Pooled {
    fn conn(&mut self) -> &mut Conn {
        self.conn.as_mut().expect("present until dropped")
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            if !conn.client.is_closed() {
                self.pool
                    .idle
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(conn);
            }
        }
    }
}

struct PgTxn {
    conn: Pooled,
    /// Whether `BEGIN` was sent (it travels with the first request).
    begun: bool,
    writes: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    /// Announcements sent with the commit (a `NOTIFY` is delivered, and a
    /// row written, only if the transaction commits).
    announcements: Vec<String>,
    origin: u64,
    announce: Announce,
    announced: Arc<AtomicU64>,
    commits: Arc<AtomicU64>,
}

const BEGIN: &str = "BEGIN ISOLATION LEVEL SERIALIZABLE";

impl PgTxn {
    /// Mark the transaction begun, answering whether `BEGIN` must still be
    /// sent (together with the request about to be made).
    fn begin_now(&mut self) -> bool {
        let first = !self.begun;
        self.begun = true;
        // Until it commits, the connection is inside a transaction: if this
        // handle is dropped first, the pool rolls it back.
        self.conn.conn().in_txn = true;
        first
    }
}

/// Run `request` on `client`, preceded by `BEGIN` in the same pipeline when
/// `begin` (tokio-postgres sends requests in the order they are first
/// polled, and `try_join` polls in order).
async fn with_begin<T>(
    client: &Client,
    begin: bool,
    request: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, StoreError> {
    if !begin {
        return request.await.map_err(engine);
    }
    let (_, value) = futures::try_join!(client.batch_execute(BEGIN), request).map_err(engine)?;
    Ok(value)
}

impl HubTxn for PgTxn {
    fn get<'a>(&'a mut self, key: &'a [u8]) -> BoxFuture<'a, Result<Option<Vec<u8>>, StoreError>> {
        async move {
            let begin = self.begin_now();
            self.conn.conn().get(key, begin).await
        }
        .boxed()
    }

    fn get_many<'a>(
        &'a mut self,
        keys: &'a [Vec<u8>],
    ) -> BoxFuture<'a, Result<Vec<Option<Vec<u8>>>, StoreError>> {
        async move {
            let begin = self.begin_now();
            self.conn.conn().get_many(keys, begin).await
        }
        .boxed()
    }

    fn range<'a>(
        &'a mut self,
        start: &'a [u8],
        end: Option<&'a [u8]>,
        limit: usize,
    ) -> BoxFuture<'a, Result<Entries, StoreError>> {
        async move {
            let begin = self.begin_now();
            self.conn.conn().range(start, end, limit, begin).await
        }
        .boxed()
    }

    fn put(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.writes.insert(key, Some(value));
    }

    fn delete(&mut self, key: Vec<u8>) {
        self.writes.insert(key, None);
    }

    fn announce(&mut self, topic: &TopicId, seq: u64, recipients: &[DeviceId]) {
        self.announcements
            .push(announce::encode(self.origin, topic, seq, recipients));
    }

    fn commit(mut self: Box<Self>) -> BoxFuture<'static, Result<Generation, StoreError>> {
        async move {
            if self.writes.is_empty() && !self.begun {
                return Ok(self.commits.load(Ordering::Acquire));
            }
            let wrote = !self.writes.is_empty();
            let begin = self.begin_now();
            let mut put_keys = Vec::new();
            let mut put_values = Vec::new();
            let mut deletes = Vec::new();
            for (k, v) in std::mem::take(&mut self.writes) {
                match v {
                    Some(v) => {
                        put_keys.push(k);
                        put_values.push(v);
                    }
                    None => deletes.push(k),
                }
            }
            let c = self.conn.conn();
            let client = &c.client;
            // One pipeline: [BEGIN,] the upsert, the delete, COMMIT. A
            // failed statement aborts the transaction, and the COMMIT after
            // it then rolls back; the statement's own error is answered.
            let upsert = async {
                if put_keys.is_empty() {
                    Ok(0)
                } else {
                    client
                        .execute(&c.stmts.upsert, &[&put_keys, &put_values])
                        .await
                }
            };
            let delete = async {
                if deletes.is_empty() {
                    Ok(0)
                } else {
                    client.execute(&c.stmts.delete, &[&deletes]).await
                }
            };
            let announcements = std::mem::take(&mut self.announcements);
            // A row's id: this process, then its count of rows.
            let ids: Vec<Vec<u8>> = match self.announce {
                Announce::Listen => Vec::new(),
                Announce::Poll { .. } => announcements
                    .iter()
                    .map(|_| {
                        let n = self.announced.fetch_add(1, Ordering::Relaxed);
                        let mut id = self.origin.to_be_bytes().to_vec();
                        id.extend_from_slice(&n.to_be_bytes());
                        id
                    })
                    .collect(),
            };
            let notify = async {
                match self.announce {
                    _ if announcements.is_empty() => Ok(0),
                    Announce::Listen => client.execute(&c.stmts.notify, &[&announcements]).await,
                    Announce::Poll { .. } => {
                        client
                            .execute(&c.stmts.announce_row, &[&ids, &announcements])
                            .await
                    }
                }
            };
            let begin_req = async {
                if begin {
                    client.batch_execute(BEGIN).await
                } else {
                    Ok(())
                }
            };
            futures::try_join!(
                begin_req,
                upsert,
                delete,
                notify,
                client.batch_execute("COMMIT")
            )
            .map_err(engine)?;
            c.in_txn = false;
            if wrote {
                Ok(self.commits.fetch_add(1, Ordering::AcqRel) + 1)
            } else {
                Ok(self.commits.load(Ordering::Acquire))
            }
        }
        .boxed()
    }
}

impl HubStore for PgHubStore {
    fn store_id(&self) -> StoreId {
        self.id
    }

    fn begin(&self) -> BoxFuture<'_, Result<Box<dyn HubTxn>, StoreError>> {
        async move {
            let conn = self.pool.checkout().await?;
            let txn: Box<dyn HubTxn> = Box::new(PgTxn {
                conn,
                begun: false,
                writes: BTreeMap::new(),
                announcements: Vec::new(),
                origin: self.origin,
                announce: self.announce,
                announced: self.announced.clone(),
                commits: self.commits.clone(),
            });
            Ok(txn)
        }
        .boxed()
    }

    fn get<'a>(&'a self, key: &'a [u8]) -> BoxFuture<'a, Result<Option<Vec<u8>>, StoreError>> {
        async move { self.pool.checkout().await?.conn().get(key, false).await }.boxed()
    }

    fn range<'a>(
        &'a self,
        start: &'a [u8],
        end: Option<&'a [u8]>,
        limit: usize,
    ) -> BoxFuture<'a, Result<Entries, StoreError>> {
        async move {
            let mut conn = self.pool.checkout().await?;
            conn.conn().range(start, end, limit, false).await
        }
        .boxed()
    }

    fn durable(&self, _gen: Generation) -> BoxFuture<'_, Result<(), StoreError>> {
        // Every generation was durable when its COMMIT answered.
        futures::future::ready(Ok(())).boxed()
    }

    fn background(&self) -> BoxFuture<'static, ()> {
        // Nothing runs beside the transactions: PostgreSQL flushes its own
        // WAL (and shares flushes between concurrent commits).
        futures::future::pending().boxed()
    }

    fn close(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        futures::future::ready(Ok(())).boxed()
    }

    fn flushes(&self) -> u64 {
        self.commits.load(Ordering::Acquire)
    }

    fn size_bytes(&self) -> BoxFuture<'_, Result<Option<u64>, StoreError>> {
        async move {
            let mut conn = self.pool.checkout().await?;
            let row = match conn
                .conn()
                .client
                .query_one("SELECT pg_total_relation_size('hub_kv')::BIGINT", &[])
                .await
            {
                Ok(row) => row,
                // A database that speaks PostgreSQL's protocol without
                // PostgreSQL's size functions (CockroachDB) cannot say.
                Err(e) if e.code() == Some(&SqlState::UNDEFINED_FUNCTION) => return Ok(None),
                Err(e) => return Err(engine(e)),
            };
            let bytes: i64 = row.try_get(0).map_err(engine)?;
            Ok(u64::try_from(bytes).ok())
        }
        .boxed()
    }

    /// Text that arrived on the announcement channel (or in the
    /// announcement table) and was not an announcement: ignored, and
    /// counted here.
    fn bad_announcements(&self) -> u64 {
        self.bad_announcements.load(Ordering::Relaxed)
    }

    fn announcements(&self) -> Option<mpsc::Receiver<Remote>> {
        let (tx, rx) = mpsc::channel(ANNOUNCEMENT_QUEUE);
        let config = self.pool.config.clone();
        let origin = self.origin;
        let bad = self.bad_announcements.clone();
        let announce = self.announce;
        tokio::spawn(async move {
            loop {
                let ended = tokio::select! {
                    // The hub stopped reading.
                    _ = tx.closed() => return,
                    ended = async {
                        match announce {
                            Announce::Listen => listen(&config, &tx, origin, &bad).await,
                            Announce::Poll { interval } => {
                                poll(&config, &tx, origin, &bad, interval).await
                            }
                        }
                    } => ended,
                };
                if tx.is_closed() {
                    return;
                }
                if let Err(e) = ended {
                    tracing::warn!(
                        error = %e,
                        "hub store: the connection hearing other hub processes ended; \
                         reconnecting (streams read their topics again once it is back)"
                    );
                }
                tokio::time::sleep(LISTEN_RETRY).await;
            }
        });
        Some(rx)
    }
}

/// Announcements waiting for the hub; when it is full, the rest are
/// dropped and the hub is told [`Remote::Missed`] (it reads every followed
/// topic's head again), so the queue is bounded and nothing is lost.
const ANNOUNCEMENT_QUEUE: usize = 4096;

/// How long the listener waits before connecting again.
const LISTEN_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// Listen for other processes' announcements on one connection until it
/// ends, passing them to `tx`. Once listening, it first says
/// [`Remote::Missed`]: whatever was announced before (while no connection
/// listened) is unknown.
async fn listen(
    config: &tokio_postgres::Config,
    tx: &mpsc::Sender<Remote>,
    origin: u64,
    bad: &AtomicU64,
) -> Result<(), tokio_postgres::Error> {
    let (client, mut connection) = config.connect(NoTls).await?;
    // The connection's messages, notifications among them; polling them
    // also drives the client's requests.
    let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
    {
        let listening = client.batch_execute("LISTEN hubsync_frames");
        tokio::pin!(listening);
        loop {
            tokio::select! {
                r = &mut listening => {
                    r?;
                    break;
                }
                m = messages.next() => match m {
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(e),
                    None => return Ok(()),
                },
            }
        }
    }
    if tx.send(Remote::Missed).await.is_err() {
        return Ok(());
    }
    while let Some(m) = messages.next().await {
        let AsyncMessage::Notification(n) = m? else {
            continue;
        };
        if !hand_over(n.payload(), tx, origin, bad).await {
            return Ok(());
        }
    }
    drop(client);
    Ok(())
}

/// Pass the announcement `text` to the hub: decoded, unless it is this
/// process's own; when the queue is full, [`Remote::Missed`] instead.
/// Answers `false` once the hub stopped reading.
async fn hand_over(text: &str, tx: &mpsc::Sender<Remote>, origin: u64, bad: &AtomicU64) -> bool {
    match announce::decode(text) {
        Some((from, _)) if from == origin => true,
        Some((_, remote)) => match tx.try_send(remote) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => tx.send(Remote::Missed).await.is_ok(),
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        },
        None => {
            bad.fetch_add(1, Ordering::Relaxed);
            true
        }
    }
}

/// How far back each poll reads before the newest row it has seen, in µs:
/// a row is stamped just before its transaction commits, so a commit that
/// becomes visible later than this after its stamp (or a database node
/// whose clock is off by more) is missed by the polls and found by the
/// next sweep ([`POLL_SWEEP`]).
const POLL_OVERLAP_US: i64 = 5_000_000;

/// How long announcement rows are kept, in µs.
const POLL_KEEP_US: i64 = 60_000_000;

/// How often a polling process deletes rows older than [`POLL_KEEP_US`].
const POLL_PURGE: std::time::Duration = std::time::Duration::from_secs(10);

/// How often a polling process has every stream read its topics' heads
/// again, so that an announcement the polls missed makes a push late by
/// at most this, never lost.
const POLL_SWEEP: std::time::Duration = std::time::Duration::from_secs(30);

/// Read other processes' announcement rows every `interval` on one
/// connection until it fails, passing them to `tx` (each row once: rows
/// seen are remembered while they are within the overlap). Once reading,
/// it first says [`Remote::Missed`]: whatever was announced before is
/// unknown.
async fn poll(
    config: &tokio_postgres::Config,
    tx: &mpsc::Sender<Remote>,
    origin: u64,
    bad: &AtomicU64,
    interval: std::time::Duration,
) -> Result<(), tokio_postgres::Error> {
    let (client, connection) = config.connect(NoTls).await?;
    let driver = tokio::spawn(connection);
    // The connection's task ends with this function, whichever way.
    let _stop = AbortOnDrop(driver);
    let now: i64 = client
        .query_one(
            "SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::BIGINT",
            &[],
        )
        .await?
        .try_get(0)?;
    let read = client
        .prepare("SELECT id, at, n FROM hub_announce WHERE at > $1 ORDER BY at")
        .await?;
    let purge = client
        .prepare("DELETE FROM hub_announce WHERE at < $1")
        .await?;
    if tx.send(Remote::Missed).await.is_err() {
        return Ok(());
    }
    let mut newest = now;
    let mut seen: std::collections::HashMap<Vec<u8>, i64> = std::collections::HashMap::new();
    let mut purged = tokio::time::Instant::now();
    let mut swept = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(interval).await;
        for row in client.query(&read, &[&(newest - POLL_OVERLAP_US)]).await? {
            let id: Vec<u8> = row.try_get(0)?;
            let at: i64 = row.try_get(1)?;
            let text: &str = row.try_get(2)?;
            if seen.insert(id, at).is_some() {
                continue;
            }
            newest = newest.max(at);
            if !hand_over(text, tx, origin, bad).await {
                return Ok(());
            }
        }
        seen.retain(|_, at| *at > newest - POLL_OVERLAP_US);
        if purged.elapsed() >= POLL_PURGE {
            purged = tokio::time::Instant::now();
            client.execute(&purge, &[&(newest - POLL_KEEP_US)]).await?;
        }
        if swept.elapsed() >= POLL_SWEEP {
            swept = tokio::time::Instant::now();
            if tx.send(Remote::Missed).await.is_err() {
                return Ok(());
            }
        }
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<Result<(), tokio_postgres::Error>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::Clock;
    use crate::hub::{HubCore, Limits};
    use crate::testkit::TestPostgres;

    fn options(pool_size: usize) -> PgOptions {
        PgOptions {
            pool_size,
            ..PgOptions::default()
        }
    }

    async fn database() -> String {
        TestPostgres::shared()
            .expect("the test PostgreSQL starts")
            .database()
            .await
            .expect("a test database")
    }

    async fn open(url: &str, seed: u64) -> Arc<PgHubStore> {
        PgHubStore::open(url, &options(4), &SharedRng::seeded(seed))
            .await
            .expect("the store opens")
    }

    #[tokio::test]
    async fn stores_on_one_database_share_its_identity_and_a_newer_schema_is_refused() {
        let url = database().await;
        let (a, b) = futures::join!(open(&url, 1), open(&url, 2));
        assert_eq!(a.store_id(), b.store_id(), "the identity is the database's");
        let other = open(&database().await, 3).await;
        assert_ne!(other.store_id(), a.store_id());

        // A newer build migrated this database: this one refuses it.
        let (client, conn) = tokio_postgres::connect(&url, NoTls).await.unwrap();
        tokio::spawn(conn);
        client
            .batch_execute("INSERT INTO hubsync_schema (version) VALUES (99)")
            .await
            .unwrap();
        match PgHubStore::open(&url, &options(4), &SharedRng::seeded(4)).await {
            Err(PgOpenError::NewerSchema { found: 99, known }) => {
                assert_eq!(known, MIGRATIONS.len() as i32)
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("a newer schema was accepted"),
        }
    }

    #[tokio::test]
    async fn of_two_transactions_that_read_what_the_other_writes_one_conflicts_and_writes_nothing()
    {
        let url = database().await;
        let (a, b) = futures::join!(open(&url, 1), open(&url, 1));
        let mut t1 = a.begin().await.unwrap();
        let mut t2 = b.begin().await.unwrap();
        assert_eq!(t1.get(b"head").await.unwrap(), None);
        assert_eq!(t2.get(b"head").await.unwrap(), None);
        t1.put(b"head".to_vec(), b"one".to_vec());
        t1.put(b"frame/1".to_vec(), b"by one".to_vec());
        t2.put(b"head".to_vec(), b"two".to_vec());
        t2.put(b"frame/2".to_vec(), b"by two".to_vec());
        let gen = t1.commit().await.unwrap();
        a.durable(gen).await.unwrap();
        assert_eq!(t2.commit().await, Err(StoreError::Conflict));
        assert_eq!(b.get(b"head").await.unwrap(), Some(b"one".to_vec()));
        assert_eq!(
            b.get(b"frame/2").await.unwrap(),
            None,
            "nothing of the loser"
        );
        assert_eq!(a.flushes(), 1);
    }

    #[tokio::test]
    async fn a_dropped_transaction_writes_nothing_and_its_connection_serves_again() {
        let url = database().await;
        // One connection, so the next transaction gets the dropped one's.
        let store = PgHubStore::open(&url, &options(1), &SharedRng::seeded(1))
            .await
            .unwrap();
        let mut t = store.begin().await.unwrap();
        assert_eq!(t.get(b"k").await.unwrap(), None);
        t.put(b"k".to_vec(), b"v".to_vec());
        drop(t);
        let mut t = store.begin().await.unwrap();
        assert_eq!(t.get(b"k").await.unwrap(), None);
        for (k, v) in [(b"a1", b"1"), (b"a2", b"2"), (b"a3", b"3"), (b"b1", b"4")] {
            t.put(k.to_vec(), v.to_vec());
        }
        t.delete(b"a2".to_vec());
        t.commit().await.unwrap();
        let keys = |e: Entries| e.into_iter().map(|(k, _)| k).collect::<Vec<_>>();
        assert_eq!(
            keys(store.range(b"a", Some(b"b"), 10).await.unwrap()),
            vec![b"a1".to_vec(), b"a3".to_vec()]
        );
        assert_eq!(
            keys(store.range(b"a", None, 2).await.unwrap()),
            vec![b"a1".to_vec(), b"a3".to_vec()]
        );
        assert_eq!(
            keys(store.range(b"a3\0", None, 10).await.unwrap()),
            vec![b"b1".to_vec()]
        );
        assert!(
            store.size_bytes().await.unwrap().unwrap() > 0,
            "the table's size"
        );
    }

    /// Two hub processes over one database, in one test: cores over two
    /// stores race a compare-and-set on the same head, and exactly one wins.
    #[test]
    fn two_cores_on_two_stores_let_exactly_one_compare_and_set_win() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let url = database().await;
            let (a, b) = futures::join!(open(&url, 1), open(&url, 2));
            let cores: Vec<Arc<HubCore>> = [a, b]
                .into_iter()
                .map(|s| HubCore::open(s, Limits::unthrottled(), Clock::System))
                .collect();
            let accepted = crate::hub::model_tests::race_compare_and_set(&cores).await;
            assert_eq!(accepted, 1, "exactly one compare-and-set wins");
        });
    }
}
