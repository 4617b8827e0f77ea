//! The control service's durable state, in SQLite (embedded, zero set-up):
//! which hosts are draining, per-host settings, and the event log. The
//! agents stay the source of truth for where VMs run and the storage nodes
//! for disks and policies; what only the control service knows lives here,
//! so it survives a restart.
//!
//! ```sql
//! CREATE TABLE hosts  (name TEXT PRIMARY KEY, draining INTEGER NOT NULL, settings TEXT);
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

pub struct Store {
    conn: Mutex<Connection>,
}

fn db(e: rusqlite::Error) -> ApiError {
    ApiError::internal(format!("control state: {e}"))
}

impl Store {
    /// Opens (creating if needed) the state database at `path`.
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

    fn init(conn: Connection) -> Result<Store, ApiError> {
        conn.execute_batch(
            "PRAGMA journal_mode=WAL;
             PRAGMA synchronous=NORMAL;
             CREATE TABLE IF NOT EXISTS hosts (
                 name TEXT PRIMARY KEY, draining INTEGER NOT NULL DEFAULT 0, settings TEXT);
             CREATE TABLE IF NOT EXISTS events (
                 id INTEGER PRIMARY KEY, at_ms INTEGER NOT NULL, kind TEXT NOT NULL,
                 subject TEXT NOT NULL, detail TEXT NOT NULL);",
        )
        .map_err(db)?;
        Ok(Store {
            conn: Mutex::new(conn),
        })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn draining(&self) -> Result<BTreeSet<String>, ApiError> {
        let c = self.conn();
        let mut st = c
            .prepare("SELECT name FROM hosts WHERE draining = 1")
            .map_err(db)?;
        let rows = st.query_map([], |r| r.get::<_, String>(0)).map_err(db)?;
        rows.collect::<Result<_, _>>().map_err(db)
    }

    pub fn set_draining(&self, host: &str, draining: bool) -> Result<(), ApiError> {
        self.conn()
            .execute(
                "INSERT INTO hosts (name, draining) VALUES (?1, ?2)
                 ON CONFLICT(name) DO UPDATE SET draining = excluded.draining",
                params![host, draining as i64],
            )
            .map(|_| ())
            .map_err(db)
    }

    pub fn settings(&self) -> Result<BTreeMap<String, HostSettings>, ApiError> {
        let c = self.conn();
        let mut st = c
            .prepare("SELECT name, settings FROM hosts WHERE settings IS NOT NULL")
            .map_err(db)?;
        let rows = st
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
            .map_err(db)?;
        let mut out = BTreeMap::new();
        for row in rows {
            let (name, json) = row.map_err(db)?;
            let s = serde_json::from_str(&json)
                .map_err(|e| ApiError::internal(format!("settings of {name}: {e}")))?;
            out.insert(name, s);
        }
        Ok(out)
    }

    pub fn put_settings(&self, host: &str, s: &HostSettings) -> Result<(), ApiError> {
        let json = serde_json::to_string(s).map_err(ApiError::internal)?;
        self.conn()
            .execute(
                "INSERT INTO hosts (name, settings) VALUES (?1, ?2)
                 ON CONFLICT(name) DO UPDATE SET settings = excluded.settings",
                params![host, json],
            )
            .map(|_| ())
            .map_err(db)
    }

    /// Appends to the event log (trimmed to [`MAX_EVENTS`]).
    pub fn log(
        &self,
        kind: &str,
        subject: &str,
        detail: serde_json::Value,
    ) -> Result<(), ApiError> {
        let at_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        let c = self.conn();
        c.execute(
            "INSERT INTO events (at_ms, kind, subject, detail) VALUES (?1, ?2, ?3, ?4)",
            params![at_ms, kind, subject, detail.to_string()],
        )
        .map_err(db)?;
        c.execute(
            "DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?1",
            params![MAX_EVENTS],
        )
        .map(|_| ())
        .map_err(db)
    }

    /// The newest `limit` events, oldest first.
    pub fn events(&self, limit: usize) -> Result<Vec<Event>, ApiError> {
        let c = self.conn();
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
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use ferry_api::drain::MigrationLimit;

    #[test]
    fn state_survives_reopening() {
        let path = std::env::temp_dir().join(format!("ferry-state-{}.db", std::process::id()));
        let _ = std::fs::remove_file(&path);
        {
            let s = Store::open(&path).unwrap();
            s.set_draining("host1", true).unwrap();
            s.set_draining("host2", true).unwrap();
            s.set_draining("host2", false).unwrap();
            s.put_settings(
                "host3",
                &HostSettings {
                    max_migrations: MigrationLimit::Fixed(3),
                },
            )
            .unwrap();
            s.log("resume", "host2", serde_json::json!({"was_draining": true}))
                .unwrap();
        }
        let s = Store::open(&path).unwrap();
        assert_eq!(s.draining().unwrap(), BTreeSet::from(["host1".to_string()]));
        assert_eq!(
            s.settings().unwrap()["host3"].max_migrations,
            MigrationLimit::Fixed(3)
        );
        let ev = s.events(10).unwrap();
        assert_eq!(ev.len(), 1);
        assert_eq!(
            (ev[0].kind.as_str(), ev[0].subject.as_str()),
            ("resume", "host2")
        );
        assert_eq!(ev[0].detail["was_draining"], true);
        drop(s);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn the_log_keeps_the_newest_events_in_order() {
        let s = Store::in_memory();
        for i in 0..5 {
            s.log("k", &format!("s{i}"), serde_json::json!(i)).unwrap();
        }
        let ev = s.events(3).unwrap();
        let subjects: Vec<_> = ev.iter().map(|e| e.subject.as_str()).collect();
        assert_eq!(subjects, ["s2", "s3", "s4"]);
        assert!(ev.windows(2).all(|w| w[0].id < w[1].id));
    }
}
