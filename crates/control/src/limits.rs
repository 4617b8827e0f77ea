//! What one caller may take of the control service, beyond what
//! [`ferry_net::server::Limits`] caps per connection:
//!
//! - **Event streams per token** (`GET /watch`, `/watch/operations/{id}`):
//!   each holds a connection and a task polling the cluster every second,
//!   so a token may keep at most [`MAX_STREAMS_PER_TOKEN`] open; the next
//!   is refused with `too_many` until one closes.
//! - **Refusals in the event log**: every refused request is an event, so a
//!   flood of them could push the real audit trail out of the bounded log.
//!   Per source (a token's name, or a client's address when it has none),
//!   the first [`REFUSALS_SHOWN`] refusals of each [`REFUSAL_WINDOW`] are
//!   logged one by one; the rest are counted and logged as one `refused`
//!   event with `count` when the window ends.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_api::util::lock;
use ferry_api::ApiError;

/// Event streams one API token may hold open at once.
pub const MAX_STREAMS_PER_TOKEN: usize = 16;
/// Refusals from one source logged one by one per window.
pub const REFUSALS_SHOWN: u64 = 10;
pub const REFUSAL_WINDOW: Duration = Duration::from_secs(60);
/// Sources tracked at once; past it, new sources share one entry.
const MAX_SOURCES: usize = 4096;

/// Open event streams per token.
#[derive(Default)]
pub struct Streams(Arc<Mutex<BTreeMap<String, usize>>>);

/// One open stream; dropping it (the client went away) gives it back.
pub struct StreamSlot {
    table: Arc<Mutex<BTreeMap<String, usize>>>,
    token: String,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut t = lock(&self.table);
        if let Some(n) = t.get_mut(&self.token) {
            *n -= 1;
            if *n == 0 {
                t.remove(&self.token);
            }
        }
    }
}

impl Streams {
    /// A slot for one more stream of `token`, or `too_many`.
    pub fn open(&self, token: &str, max: usize) -> Result<StreamSlot, ApiError> {
        let mut t = lock(&self.0);
        let n = t.entry(token.to_string()).or_default();
        if *n >= max {
            return Err(ApiError::TooMany {
                what: format!("event streams of token {token}"),
                limit: max as u64,
                setting: "max_streams_per_token".into(),
            });
        }
        *n += 1;
        Ok(StreamSlot {
            table: self.0.clone(),
            token: token.to_string(),
        })
    }
}

struct Window {
    since: Instant,
    seen: u64,
    last: serde_json::Value,
}

/// Refusals per source, for the event log (see the module's text).
#[derive(Default)]
pub struct Refusals(Mutex<BTreeMap<String, Window>>);

/// What to write for one refusal: the event's detail, and a summary of the
/// window it closed, if that window held refusals not logged one by one.
pub type ToLog = (Option<serde_json::Value>, Option<serde_json::Value>);

fn summary(source: &str, w: &Window, window: Duration) -> Option<serde_json::Value> {
    let more = w.seen.saturating_sub(REFUSALS_SHOWN);
    (more > 0).then(|| {
        serde_json::json!({
            "source": source, "summary": true, "count": more,
            "window_s": window.as_secs(), "last": w.last,
        })
    })
}

impl Refusals {
    /// Counts one refusal from `source` at `now`.
    pub fn note(
        &self,
        source: &str,
        detail: serde_json::Value,
        now: Instant,
        window: Duration,
    ) -> ToLog {
        let mut t = lock(&self.0);
        let source = if t.len() >= MAX_SOURCES && !t.contains_key(source) {
            "(other sources)"
        } else {
            source
        };
        let mut closed = None;
        if let Some(w) = t.get(source) {
            if now.duration_since(w.since) >= window {
                closed = summary(source, w, window);
                t.remove(source);
            }
        }
        let w = t.entry(source.to_string()).or_insert(Window {
            since: now,
            seen: 0,
            last: serde_json::Value::Null,
        });
        w.seen += 1;
        w.last = detail.clone();
        let mut detail = detail;
        if let Some(o) = detail.as_object_mut() {
            o.insert("source".into(), source.into());
        }
        ((w.seen <= REFUSALS_SHOWN).then_some(detail), closed)
    }

    /// Summaries of the windows that have ended by `now` (each source's
    /// uncounted refusals, once), dropping those windows.
    pub fn flush(&self, now: Instant, window: Duration) -> Vec<serde_json::Value> {
        let mut t = lock(&self.0);
        let ended: Vec<String> = t
            .iter()
            .filter(|(_, w)| now.duration_since(w.since) >= window)
            .map(|(s, _)| s.clone())
            .collect();
        ended
            .into_iter()
            .filter_map(|s| {
                let w = t.remove(&s)?;
                summary(&s, &w, window)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_of_refusals_is_counted_not_logged() {
        let r = Refusals::default();
        let t0 = Instant::now();
        let w = Duration::from_secs(60);
        let mut logged = 0;
        for i in 0..1000 {
            let (one, closed) = r.note(
                "198.18.0.9",
                serde_json::json!({"status": 401, "i": i}),
                t0,
                w,
            );
            logged += one.is_some() as u64;
            assert!(closed.is_none());
        }
        assert_eq!(logged, REFUSALS_SHOWN);
        // another source is not held back by the first
        assert!(r.note("token ci", serde_json::json!({}), t0, w).0.is_some());
        assert!(r.flush(t0 + Duration::from_secs(1), w).is_empty());
        let s = r.flush(t0 + w, w);
        assert_eq!(s.len(), 1, "{s:?}");
        assert_eq!(s[0]["count"], 1000 - REFUSALS_SHOWN);
        assert_eq!(s[0]["source"], "198.18.0.9");
        assert_eq!(s[0]["last"]["i"], 999);
        // a new window logs again, and closing one by a new refusal summarises it
        for _ in 0..REFUSALS_SHOWN + 5 {
            r.note("x", serde_json::json!({}), t0 + w, w);
        }
        let (one, closed) = r.note("x", serde_json::json!({}), t0 + w + w, w);
        assert!(one.is_some());
        assert_eq!(closed.unwrap()["count"], 5);
    }

    #[test]
    fn streams_per_token_are_capped_and_given_back() {
        let s = Streams::default();
        let a = s.open("ro", 2).unwrap();
        let _b = s.open("ro", 2).unwrap();
        let e = s.open("ro", 2).err().unwrap();
        assert_eq!(e.http_status(), 429);
        assert!(e.to_string().contains("max_streams_per_token"), "{e}");
        assert!(s.open("admin", 2).is_ok());
        drop(a);
        assert!(s.open("ro", 2).is_ok());
    }
}
