//! The control service's durable state: which hosts are draining, per-host
//! settings, and the event log. The agents stay the source of truth for where
//! VMs run and the storage nodes for disks and policies; what only the control
//! service knows lives here, so it survives a restart.
//!
//! Two back ends behind one API:
//! - **SQLite** (default; embedded, zero set-up), one control instance;
//! - **etcd** (`--store etcds://HOST:PORT`, TLS with a client certificate;
//!   `etcd://` in clear to loopback only), so several control instances
//!   share one state and any of them can be lost. Keys:
//!   `/ferry/hosts/NAME/draining`, `/ferry/hosts/NAME/settings` (JSON),
//!   `/ferry/cluster/KEY` (JSON, e.g. `bandwidth`),
//!   `/ferry/events/AT_MS-RANDOM` (JSON; the etcd revision is the event id).
//!
//! ```sql
//! CREATE TABLE hosts  (name TEXT PRIMARY KEY, draining INTEGER NOT NULL, settings TEXT);
//! CREATE TABLE cluster (key TEXT PRIMARY KEY, value TEXT NOT NULL);  -- e.g. bandwidth
//! CREATE TABLE events (id INTEGER PRIMARY KEY, at_ms INTEGER NOT NULL, kind TEXT NOT NULL,
//!                      subject TEXT NOT NULL, detail TEXT NOT NULL);
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Mutex;

use ferry_api::drain::HostSettings;
use ferry_api::{ApiError, Event};
use rusqlite::{params, Connection};

/// Events kept; older ones are dropped as new ones come.
pub const MAX_EVENTS: i64 = 10_000;

pub struct Store(Backend);

enum Backend {
    Sqlite(Mutex<Connection>),
    Etcd(Box<etcd_client::Client>),
}

fn db(e: rusqlite::Error) -> ApiError {
    ApiError::internal(format!("control state: {e}"))
}

fn etcd(e: etcd_client::Error) -> ApiError {
    ApiError::unavailable("etcd", e)
}

const HOSTS: &str = "/ferry/hosts/";
const EVENTS: &str = "/ferry/events/";
const CLUSTER: &str = "/ferry/cluster/";

use ferry_api::util::now_ms;

impl Store {
    /// Opens (creating if needed) the SQLite state database at `path`.
    pub fn open(path: &Path) -> Result<Store, ApiError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| ApiError::internal(format!("{}: {e}", dir.display())))?;
        }
        Self::init(Connection::open(path).map_err(db)?)
    }

    /// A state that lives as long as the process (tests, embedded use).
    pub fn in_memory() -> Store {
        match Connection::open_in_memory()
            .map_err(db)
            .and_then(Self::init)
        {
            Ok(s) => s,
            // SQLite without a file cannot fail to open short of no memory
            Err(e) => panic!("in-memory SQLite: {e}"),
        }
    }

    /// State in etcd at `url`:
    /// - `etcds://HOST:PORT[,HOST:PORT…]`: over TLS, the server checked
    ///   against `tls`'s `ca-cert.pem` and this service known to etcd by
    ///   `tls`'s `cert.pem` and `key.pem` (a certificate directory as
    ///   `ferry cluster issue-cert` writes one);
    /// - `etcd://HOST:PORT[,…]`: in clear, which token hashes and settings
    ///   must not cross a network in: loopback addresses only.
    pub async fn etcd(url: &str, tls: Option<&std::path::Path>) -> Result<Store, ApiError> {
        let bad = |why: String| ApiError::invalid("--store", format!("'{url}' {why}"));
        let (rest, secure) = match (url.strip_prefix("etcds://"), url.strip_prefix("etcd://")) {
            (Some(r), _) => (r, true),
            (None, Some(r)) => (r, false),
            _ => {
                return Err(bad(
                    "is neither etcds://HOST:PORT nor etcd://HOST:PORT".into()
                ))
            }
        };
        let hosts: Vec<&str> = rest.split(',').collect();
        for h in &hosts {
            let host = h.rsplit_once(':').map(|(h, _)| h).unwrap_or(h);
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let loopback = host == "localhost"
                || host
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|a| a.is_loopback());
            if !secure && !loopback {
                return Err(bad(format!(
                    "would send the cluster's state in clear to {h}: use etcds:// (TLS with a client certificate)"
                )));
            }
        }
        let scheme = if secure { "https" } else { "http" };
        let endpoints: Vec<String> = hosts.iter().map(|e| format!("{scheme}://{e}")).collect();
        let mut opts = etcd_client::ConnectOptions::new()
            .with_connect_timeout(std::time::Duration::from_secs(5))
            .with_timeout(std::time::Duration::from_secs(5));
        if secure {
            let dir = tls.ok_or_else(|| {
                bad(
                    "needs a certificate directory (--store-tls, or the control service's own)"
                        .into(),
                )
            })?;
            let read = |f: &str| {
                let p = dir.join(f);
                std::fs::read(&p)
                    .map_err(|e| ApiError::invalid("--store-tls", format!("{}: {e}", p.display())))
            };
            let (ca, cert, key) = (
                read(ferry_net::tls::CA_CERT)?,
                read(ferry_net::tls::CERT)?,
                read(ferry_net::tls::KEY)?,
            );
            opts = opts.with_tls(
                etcd_client::TlsOptions::new()
                    .ca_certificate(etcd_client::Certificate::from_pem(ca))
                    .identity(etcd_client::Identity::from_pem(cert, key)),
            );
        }
        let c = etcd_client::Client::connect(endpoints, Some(opts))
            .await
            .map_err(etcd)?;
        Ok(Store(Backend::Etcd(Box::new(c))))
    }

    fn init(conn: Connection) -> Result<Store, ApiError> {
        conn.execute_batch(
            "PRAGMA journal_mode=WAL;
             PRAGMA synchronous=NORMAL;
             CREATE TABLE IF NOT EXISTS hosts (
                 name TEXT PRIMARY KEY, draining INTEGER NOT NULL DEFAULT 0, settings TEXT);
             CREATE TABLE IF NOT EXISTS cluster (key TEXT PRIMARY KEY, value TEXT NOT NULL);
             CREATE TABLE IF NOT EXISTS events (
                 id INTEGER PRIMARY KEY, at_ms INTEGER NOT NULL, kind TEXT NOT NULL,
                 subject TEXT NOT NULL, detail TEXT NOT NULL);",
        )
        .map_err(db)?;
        Ok(Store(Backend::Sqlite(Mutex::new(conn))))
    }

    /// Whether other control instances may share this state (etcd).
    pub fn shared(&self) -> bool {
        matches!(self.0, Backend::Etcd(_))
    }

    fn sql(m: &Mutex<Connection>) -> std::sync::MutexGuard<'_, Connection> {
        ferry_api::util::lock(m)
    }

    /// Values of every key under `prefix`: (key, value, create revision).
    async fn etcd_prefix(
        c: &etcd_client::Client,
        prefix: &str,
        opts: etcd_client::GetOptions,
    ) -> Result<Vec<(String, String, i64)>, ApiError> {
        let mut c = c.clone();
        let r = c
            .get(prefix, Some(opts.with_prefix()))
            .await
            .map_err(etcd)?;
        Ok(r.kvs()
            .iter()
            .map(|kv| {
                (
                    kv.key_str().unwrap_or_default().to_string(),
                    kv.value_str().unwrap_or_default().to_string(),
                    kv.create_revision(),
                )
            })
            .collect())
    }

    pub async fn draining(&self) -> Result<BTreeSet<String>, ApiError> {
        match &self.0 {
            Backend::Sqlite(m) => {
                let c = Self::sql(m);
                let mut st = c
                    .prepare("SELECT name FROM hosts WHERE draining = 1")
                    .map_err(db)?;
                let rows = st.query_map([], |r| r.get::<_, String>(0)).map_err(db)?;
                rows.collect::<Result<_, _>>().map_err(db)
            }
            Backend::Etcd(c) => Ok(Self::etcd_prefix(c, HOSTS, etcd_client::GetOptions::new())
                .await?
                .into_iter()
                .filter_map(|(k, _, _)| {
                    k.strip_prefix(HOSTS)?
                        .strip_suffix("/draining")
                        .map(str::to_string)
                })
                .collect()),
        }
    }

    pub async fn set_draining(&self, host: &str, draining: bool) -> Result<(), ApiError> {
        match &self.0 {
            Backend::Sqlite(m) => Self::sql(m)
                .execute(
                    "INSERT INTO hosts (name, draining) VALUES (?1, ?2)
                     ON CONFLICT(name) DO UPDATE SET draining = excluded.draining",
                    params![host, draining as i64],
                )
                .map(|_| ())
                .map_err(db),
            Backend::Etcd(c) => {
                let mut c = c.clone();
                let key = format!("{HOSTS}{host}/draining");
                if draining {
                    c.put(key, "1", None).await.map(|_| ()).map_err(etcd)
                } else {
                    c.delete(key, None).await.map(|_| ()).map_err(etcd)
                }
            }
        }
    }

    /// A cluster-wide setting (e.g. `bandwidth`), JSON; `None` if never set.
    pub async fn cluster<T: serde::de::DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<T>, ApiError> {
        let json: Option<String> = match &self.0 {
            Backend::Sqlite(m) => {
                let c = Self::sql(m);
                let mut st = c
                    .prepare("SELECT value FROM cluster WHERE key = ?1")
                    .map_err(db)?;
                let mut rows = st
                    .query_map(params![key], |r| r.get::<_, String>(0))
                    .map_err(db)?;
                rows.next().transpose().map_err(db)?
            }
            Backend::Etcd(c) => {
                let r = c
                    .clone()
                    .get(format!("{CLUSTER}{key}"), None)
                    .await
                    .map_err(etcd)?;
                r.kvs()
                    .first()
                    .map(|kv| kv.value_str().unwrap_or_default().to_string())
            }
        };
        json.map(|j| {
            serde_json::from_str(&j).map_err(|e| ApiError::internal(format!("cluster {key}: {e}")))
        })
        .transpose()
    }

    pub async fn put_cluster<T: serde::Serialize>(&self, key: &str, v: &T) -> Result<(), ApiError> {
        let json = serde_json::to_string(v).map_err(ApiError::internal)?;
        match &self.0 {
            Backend::Sqlite(m) => Self::sql_put_cluster(&Self::sql(m), key, &json).map_err(db),
            Backend::Etcd(c) => c
                .clone()
                .put(format!("{CLUSTER}{key}"), json, None)
                .await
                .map(|_| ())
                .map_err(etcd),
        }
    }

    /// [`Store::put_cluster`] and [`Store::log`] as one write: the value and
    /// its event land together or not at all (a service killed between two
    /// writes would otherwise leave a change no event tells of).
    pub async fn put_cluster_logged<T: serde::Serialize>(
        &self,
        key: &str,
        v: &T,
        (kind, subject, detail): (&str, &str, serde_json::Value),
    ) -> Result<(), ApiError> {
        let json = serde_json::to_string(v).map_err(ApiError::internal)?;
        let at_ms = now_ms();
        match &self.0 {
            Backend::Sqlite(m) => {
                let mut c = Self::sql(m);
                let tx = c.transaction().map_err(db)?;
                Self::sql_put_cluster(&tx, key, &json).map_err(db)?;
                Self::sql_log(&tx, at_ms, kind, subject, &detail).map_err(db)?;
                tx.commit().map_err(db)
            }
            Backend::Etcd(c) => {
                use etcd_client::{Txn, TxnOp};
                let (event_key, event) = Self::etcd_event(at_ms, kind, subject, detail);
                let txn = Txn::new().and_then([
                    TxnOp::put(format!("{CLUSTER}{key}"), json, None),
                    TxnOp::put(event_key, event, None),
                ]);
                c.clone().txn(txn).await.map(|_| ()).map_err(etcd)
            }
        }
    }

    /// Every cluster key under `prefix` with its JSON value.
    pub async fn cluster_under(&self, prefix: &str) -> Result<Vec<(String, String)>, ApiError> {
        match &self.0 {
            Backend::Sqlite(m) => {
                let c = Self::sql(m);
                let mut st = c
                    .prepare("SELECT key, value FROM cluster WHERE substr(key, 1, length(?1)) = ?1")
                    .map_err(db)?;
                let rows = st
                    .query_map(params![prefix], |r| Ok((r.get(0)?, r.get(1)?)))
                    .map_err(db)?;
                rows.collect::<Result<_, _>>().map_err(db)
            }
            Backend::Etcd(c) => Ok(Self::etcd_prefix(
                c,
                &format!("{CLUSTER}{prefix}"),
                etcd_client::GetOptions::new(),
            )
            .await?
            .into_iter()
            .filter_map(|(k, v, _)| Some((k.strip_prefix(CLUSTER)?.to_string(), v)))
            .collect()),
        }
    }

    pub async fn delete_cluster(&self, key: &str) -> Result<(), ApiError> {
        match &self.0 {
            Backend::Sqlite(m) => Self::sql(m)
                .execute("DELETE FROM cluster WHERE key = ?1", params![key])
                .map(|_| ())
                .map_err(db),
            Backend::Etcd(c) => c
                .clone()
                .delete(format!("{CLUSTER}{key}"), None)
                .await
                .map(|_| ())
                .map_err(etcd),
        }
    }

    pub async fn settings(&self) -> Result<BTreeMap<String, HostSettings>, ApiError> {
        let rows: Vec<(String, String)> = match &self.0 {
            Backend::Sqlite(m) => {
                let c = Self::sql(m);
                let mut st = c
                    .prepare("SELECT name, settings FROM hosts WHERE settings IS NOT NULL")
                    .map_err(db)?;
                let rows = st
                    .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
                    .map_err(db)?;
                rows.collect::<Result<_, _>>().map_err(db)?
            }
            Backend::Etcd(c) => Self::etcd_prefix(c, HOSTS, etcd_client::GetOptions::new())
                .await?
                .into_iter()
                .filter_map(|(k, v, _)| {
                    let name = k.strip_prefix(HOSTS)?.strip_suffix("/settings")?;
                    Some((name.to_string(), v))
                })
                .collect(),
        };
        let mut out = BTreeMap::new();
        for (name, json) in rows {
            let s = serde_json::from_str(&json)
                .map_err(|e| ApiError::internal(format!("settings of {name}: {e}")))?;
            out.insert(name, s);
        }
        Ok(out)
    }

    pub async fn put_settings(&self, host: &str, s: &HostSettings) -> Result<(), ApiError> {
        let json = serde_json::to_string(s).map_err(ApiError::internal)?;
        match &self.0 {
            Backend::Sqlite(m) => Self::sql(m)
                .execute(
                    "INSERT INTO hosts (name, settings) VALUES (?1, ?2)
                     ON CONFLICT(name) DO UPDATE SET settings = excluded.settings",
                    params![host, json],
                )
                .map(|_| ())
                .map_err(db),
            Backend::Etcd(c) => c
                .clone()
                .put(format!("{HOSTS}{host}/settings"), json, None)
                .await
                .map(|_| ())
                .map_err(etcd),
        }
    }

    /// A cluster key's value written in SQLite (alone, or in a transaction).
    fn sql_put_cluster(c: &Connection, key: &str, json: &str) -> rusqlite::Result<()> {
        c.execute(
            "INSERT INTO cluster (key, value) VALUES (?1, ?2)
             ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            params![key, json],
        )
        .map(|_| ())
    }

    /// An event appended in SQLite, the oldest past [`MAX_EVENTS`] dropped.
    fn sql_log(
        c: &Connection,
        at_ms: u64,
        kind: &str,
        subject: &str,
        detail: &serde_json::Value,
    ) -> rusqlite::Result<()> {
        c.execute(
            "INSERT INTO events (at_ms, kind, subject, detail) VALUES (?1, ?2, ?3, ?4)",
            params![at_ms as i64, kind, subject, detail.to_string()],
        )?;
        c.execute(
            "DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?1",
            params![MAX_EVENTS],
        )
        .map(|_| ())
    }

    /// An event's key and value in etcd (keys sort by time).
    fn etcd_event(
        at_ms: u64,
        kind: &str,
        subject: &str,
        detail: serde_json::Value,
    ) -> (String, String) {
        let e = serde_json::json!({ "at_ms": at_ms, "kind": kind, "subject": subject, "detail": detail });
        (
            format!("{EVENTS}{at_ms:015}-{:08x}", rand_u32()),
            e.to_string(),
        )
    }

    /// Appends to the event log (SQLite keeps the newest [`MAX_EVENTS`]).
    pub async fn log(
        &self,
        kind: &str,
        subject: &str,
        detail: serde_json::Value,
    ) -> Result<(), ApiError> {
        let at_ms = now_ms();
        match &self.0 {
            Backend::Sqlite(m) => {
                Self::sql_log(&Self::sql(m), at_ms, kind, subject, &detail).map_err(db)
            }
            Backend::Etcd(c) => {
                let (key, event) = Self::etcd_event(at_ms, kind, subject, detail);
                c.clone()
                    .put(key, event, None)
                    .await
                    .map(|_| ())
                    .map_err(etcd)
            }
        }
    }

    /// The newest `limit` events, oldest first.
    pub async fn events(&self, limit: usize) -> Result<Vec<Event>, ApiError> {
        match &self.0 {
            Backend::Sqlite(m) => {
                let c = Self::sql(m);
                let mut st = c
                    .prepare(
                        "SELECT id, at_ms, kind, subject, detail FROM
                         (SELECT * FROM events ORDER BY id DESC LIMIT ?1) ORDER BY id",
                    )
                    .map_err(db)?;
                let rows = st
                    .query_map(params![limit as i64], |r| {
                        Ok(Event {
                            id: r.get::<_, i64>(0)? as u64,
                            at_ms: r.get::<_, i64>(1)? as u64,
                            kind: r.get(2)?,
                            subject: r.get(3)?,
                            detail: serde_json::from_str(&r.get::<_, String>(4)?)
                                .unwrap_or(serde_json::Value::Null),
                        })
                    })
                    .map_err(db)?;
                rows.collect::<Result<_, _>>().map_err(db)
            }
            Backend::Etcd(c) => {
                let opts = etcd_client::GetOptions::new()
                    .with_sort(
                        etcd_client::SortTarget::Key,
                        etcd_client::SortOrder::Descend,
                    )
                    .with_limit(limit as i64);
                let mut out: Vec<Event> = Self::etcd_prefix(c, EVENTS, opts)
                    .await?
                    .into_iter()
                    .filter_map(|(_, v, rev)| {
                        let e: serde_json::Value = serde_json::from_str(&v).ok()?;
                        Some(Event {
                            id: rev as u64,
                            at_ms: e["at_ms"].as_u64()?,
                            kind: e["kind"].as_str()?.to_string(),
                            subject: e["subject"].as_str()?.to_string(),
                            detail: e["detail"].clone(),
                        })
                    })
                    .collect();
                out.reverse();
                Ok(out)
            }
        }
    }
}

/// The key the leader of the control instances holds (etcd), under its lease.
const LEADER: &str = "/ferry/leader";

/// This instance's hold on leadership: its etcd lease, and the revision at
/// which it made the leader key (a later holder makes it anew).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    lease: i64,
    revision: i64,
}

/// Leadership among the control instances sharing a store. With SQLite
/// there is one instance, and it leads. With etcd, the leader key lives as
/// long as its holder's lease: a holder that dies, or cannot reach etcd,
/// loses it within the lease's time to live.
impl Store {
    /// Becomes the leader as `who` unless another instance is: `Ok(claim)`
    /// won, `Err(holder)` taken (the holder's `who`).
    pub async fn campaign(&self, who: &str, ttl_s: i64) -> Result<Result<Claim, String>, ApiError> {
        let Backend::Etcd(c) = &self.0 else {
            return Ok(Ok(Claim {
                lease: 0,
                revision: 0,
            }));
        };
        use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};
        let mut c = c.as_ref().clone();
        let lease = c.lease_grant(ttl_s, None).await.map_err(etcd)?.id();
        let txn = Txn::new()
            .when([Compare::create_revision(LEADER, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                LEADER,
                who,
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(LEADER, None)]);
        let r = c.txn(txn).await.map_err(etcd)?;
        if r.succeeded() {
            return Ok(Ok(Claim {
                lease,
                revision: r.header().map(|h| h.revision()).unwrap_or_default(),
            }));
        }
        let _ = c.lease_revoke(lease).await;
        let holder = r
            .op_responses()
            .into_iter()
            .find_map(|o| match o {
                TxnOpResponse::Get(g) => g
                    .kvs()
                    .first()
                    .map(|kv| kv.value_str().unwrap_or_default().to_string()),
                _ => None,
            })
            .unwrap_or_default();
        Ok(Err(holder))
    }

    /// Keeps `claim` alive for another time to live; `Ok(false)` when it is
    /// lost (its lease ended, or the key is another's).
    pub async fn keep_claim(&self, claim: Claim) -> Result<bool, ApiError> {
        let Backend::Etcd(c) = &self.0 else {
            return Ok(true);
        };
        let mut c = c.as_ref().clone();
        let (mut keeper, mut answers) = c.lease_keep_alive(claim.lease).await.map_err(etcd)?;
        keeper.keep_alive().await.map_err(etcd)?;
        let alive = answers
            .message()
            .await
            .map_err(etcd)?
            .is_some_and(|a| a.ttl() > 0);
        Ok(alive && self.holds(claim).await?)
    }

    /// Whether `claim` still holds the leader key (checked at etcd).
    pub async fn holds(&self, claim: Claim) -> Result<bool, ApiError> {
        let Backend::Etcd(c) = &self.0 else {
            return Ok(true);
        };
        let r = c.as_ref().clone().get(LEADER, None).await.map_err(etcd)?;
        Ok(r.kvs()
            .first()
            .is_some_and(|kv| kv.create_revision() == claim.revision && kv.lease() == claim.lease))
    }

    /// Gives leadership up at once (a clean stop).
    pub async fn resign(&self, claim: Claim) {
        if let Backend::Etcd(c) = &self.0 {
            let _ = c.as_ref().clone().lease_revoke(claim.lease).await;
        }
    }

    /// Who leads now (`None` with etcd when nobody does).
    pub async fn leader(&self) -> Result<Option<String>, ApiError> {
        let Backend::Etcd(c) = &self.0 else {
            return Ok(None);
        };
        let r = c.as_ref().clone().get(LEADER, None).await.map_err(etcd)?;
        Ok(r.kvs()
            .first()
            .map(|kv| kv.value_str().unwrap_or_default().to_string()))
    }
}

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(now_ms());
    h.finish() as u32
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use ferry_api::drain::MigrationLimit;

    #[tokio::test]
    async fn etcd_in_clear_is_for_loopback_only() {
        for (url, says) in [
            ("etcd://198.18.0.1:2379", "etcds://"),
            ("etcd://127.0.0.1:2379,etcd1:2379", "in clear to etcd1:2379"),
            ("etcds://127.0.0.1:2379", "certificate directory"),
            ("http://127.0.0.1:2379", "neither"),
        ] {
            match Store::etcd(url, None).await {
                Err(ApiError::InvalidArgument { field, reason }) => {
                    assert_eq!(field, "--store");
                    assert!(reason.contains(says), "{url}: {reason}");
                }
                Err(e) => panic!("{url}: {e}"),
                Ok(_) => panic!("{url} accepted"),
            }
        }
    }

    #[tokio::test]
    async fn state_survives_reopening() {
        let path = std::env::temp_dir().join(format!("ferry-state-{}.db", std::process::id()));
        let _ = std::fs::remove_file(&path);
        {
            let s = Store::open(&path).unwrap();
            s.set_draining("host1", true).await.unwrap();
            s.set_draining("host2", true).await.unwrap();
            s.set_draining("host2", false).await.unwrap();
            s.put_settings(
                "host3",
                &HostSettings {
                    max_migrations: Some(MigrationLimit::Fixed(3)),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
            s.put_cluster("bandwidth", &serde_json::json!({"classes": []}))
                .await
                .unwrap();
            s.log("resume", "host2", serde_json::json!({"was_draining": true}))
                .await
                .unwrap();
        }
        let s = Store::open(&path).unwrap();
        assert_eq!(
            s.draining().await.unwrap(),
            BTreeSet::from(["host1".to_string()])
        );
        assert_eq!(
            s.settings().await.unwrap()["host3"].max_migrations.unwrap(),
            MigrationLimit::Fixed(3)
        );
        assert_eq!(
            s.cluster::<serde_json::Value>("bandwidth").await.unwrap(),
            Some(serde_json::json!({"classes": []}))
        );
        assert_eq!(s.cluster::<serde_json::Value>("none").await.unwrap(), None);
        let ev = s.events(10).await.unwrap();
        assert_eq!(ev.len(), 1);
        assert_eq!(
            (ev[0].kind.as_str(), ev[0].subject.as_str()),
            ("resume", "host2")
        );
        assert_eq!(ev[0].detail["was_draining"], true);
        drop(s);
        let _ = std::fs::remove_file(&path);
    }

    #[tokio::test]
    async fn a_value_and_its_event_land_together_or_not_at_all() {
        let s = Store::in_memory();
        s.put_cluster_logged(
            "vms",
            &serde_json::json!({"a": "host1"}),
            ("ha_restart", "a", serde_json::json!({"to": "host1"})),
        )
        .await
        .unwrap();
        assert_eq!(
            s.cluster::<serde_json::Value>("vms").await.unwrap(),
            Some(serde_json::json!({"a": "host1"}))
        );
        let ev = s.events(10).await.unwrap();
        assert_eq!(ev.len(), 1);
        assert_eq!(
            (ev[0].kind.as_str(), ev[0].subject.as_str()),
            ("ha_restart", "a")
        );
        assert_eq!(ev[0].detail["to"], "host1");
        // the event cannot be written: the value is not either
        let Backend::Sqlite(m) = &s.0 else {
            unreachable!("an in-memory store is SQLite")
        };
        Store::sql(m).execute("DROP TABLE events", []).unwrap();
        let refused = s
            .put_cluster_logged(
                "vms",
                &serde_json::json!({"a": "host2"}),
                ("ha_restart", "a", serde_json::json!({"to": "host2"})),
            )
            .await;
        assert!(refused.is_err());
        assert_eq!(
            s.cluster::<serde_json::Value>("vms").await.unwrap(),
            Some(serde_json::json!({"a": "host1"})),
            "the value changed without its event"
        );
    }

    #[tokio::test]
    async fn the_log_keeps_the_newest_events_in_order() {
        let s = Store::in_memory();
        for i in 0..5 {
            s.log("k", &format!("s{i}"), serde_json::json!(i))
                .await
                .unwrap();
        }
        let ev = s.events(3).await.unwrap();
        let subjects: Vec<_> = ev.iter().map(|e| e.subject.as_str()).collect();
        assert_eq!(subjects, ["s2", "s3", "s4"]);
        assert!(ev.windows(2).all(|w| w[0].id < w[1].id));
    }
}
