//! Browser sessions of the web console: a user signs in once with an API
//! token (`POST /api/v1/session`, the token in the body, never in a URL)
//! and the browser keeps a session cookie instead of the token.
//!
//! ```text
//! POST   /api/v1/session {"token": T}  → 200 {name, role, csrf}
//!        Set-Cookie: ferry_session=ID; HttpOnly; Secure; SameSite=Strict; Path=/; Max-Age=28800
//! GET    /api/v1/session               → 200 {name, role, csrf} for the cookie's session, else 401
//! DELETE /api/v1/session               → 200 {}, the cookie cleared (needs X-Ferry-CSRF)
//! ```
//!
//! ID and CSRF are 128 random bits each (32 hex digits). A request with the
//! cookie and no `Authorization` header is the session's token's request:
//! the token is checked again on every request, so revoking it ends its
//! sessions at once. Every request but GET and HEAD must also carry the
//! session's CSRF token in `X-Ferry-CSRF` (a page of another site can make
//! a browser send the cookie — `SameSite=Strict` already stops that — but
//! never read or set that header); without it the request is refused
//! (403), as is one whose role may not do what it asks. A session ends
//! after [`IDLE`] unused, or at sign-out.
//!
//! Sessions live in the control state (cluster keys `session/H`, H the
//! SHA-256 of the ID; the value holds the token's SHA-256, never the token,
//! the CSRF token and when it was last used), so with several control
//! instances a browser signed in to one is signed in to all, and a control
//! restart signs nobody out. Each instance caches what it read, and reads
//! again at most [`RECHECK`] later, so a sign-out on one instance ends the
//! session on the others within that.
//! `Secure` is left out only under `--insecure-http`, where there is no
//! TLS for the browser to require.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ferry_api::auth::token_hash;
use ferry_api::util::now_ms;
use ferry_api::ApiError;
use serde::{Deserialize, Serialize};

use crate::store::Store;

/// The cookie's name.
pub const COOKIE: &str = "ferry_session";
/// The header a session's changing requests carry.
pub const CSRF_HEADER: &str = "x-ferry-csrf";
/// A session unused this long ends.
pub const IDLE: Duration = Duration::from_secs(8 * 3600);
/// A cached session is read from the store again after this.
pub const RECHECK: Duration = Duration::from_secs(1);
/// Its last use is written to the store at most this often.
const TOUCH_EVERY: Duration = Duration::from_secs(60);
/// At most this many sessions are cached; the least recently used go first.
const MAX: usize = 4096;
/// The store's keys of sessions start so.
const PREFIX: &str = "session/";

/// One session as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Stored {
    /// SHA-256 of the API token it was opened with.
    token: String,
    csrf: String,
    used_ms: u64,
}

struct Cached {
    s: Stored,
    /// When the store was last read (or written) for it.
    checked: Instant,
}

/// The sessions this instance has seen, by ID.
#[derive(Default)]
pub struct Sessions(std::sync::Mutex<HashMap<String, Cached>>);

fn random_hex() -> String {
    rand::random::<[u8; 16]>()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn key(id: &str) -> String {
    format!("{PREFIX}{}", token_hash(id))
}

fn idle(used_ms: u64) -> bool {
    now_ms().saturating_sub(used_ms) >= IDLE.as_millis() as u64
}

impl Sessions {
    /// Opens a session for the token of SHA-256 `token` (already checked);
    /// returns (ID, CSRF). Sessions idle too long are dropped from the store.
    pub async fn open(&self, store: &Store, token: &str) -> Result<(String, String), ApiError> {
        let (id, csrf) = (random_hex(), random_hex());
        let s = Stored {
            token: token.to_string(),
            csrf: csrf.clone(),
            used_ms: now_ms(),
        };
        store.put_cluster(&key(&id), &s).await?;
        for (k, v) in store.cluster_under(PREFIX).await? {
            let old = serde_json::from_str::<Stored>(&v).map_or(true, |o| idle(o.used_ms));
            if old {
                store.delete_cluster(&k).await?;
            }
        }
        let mut m = ferry_api::util::lock(&self.0);
        while m.len() >= MAX {
            let oldest = m
                .iter()
                .min_by_key(|(_, c)| c.s.used_ms)
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => m.remove(&k),
                None => break,
            };
        }
        m.insert(
            id.clone(),
            Cached {
                s,
                checked: Instant::now(),
            },
        );
        Ok((id, csrf))
    }

    /// The session `id`'s (token SHA-256, CSRF), if it is open; marks it used.
    pub async fn get(&self, store: &Store, id: &str) -> Option<(String, String)> {
        let cached = {
            let m = ferry_api::util::lock(&self.0);
            m.get(id)
                .filter(|c| c.checked.elapsed() < RECHECK)
                .map(|c| (c.s.clone(), c.checked))
        };
        let fresh = cached.as_ref().map(|c| c.1);
        let mut s = match cached {
            Some((s, _)) => s,
            // not seen here, or seen a while ago: the store says
            _ => match store.cluster::<Stored>(&key(id)).await {
                Ok(Some(s)) => s,
                Ok(None) | Err(_) => {
                    ferry_api::util::lock(&self.0).remove(id);
                    return None;
                }
            },
        };
        if idle(s.used_ms) {
            self.close(store, id).await;
            return None;
        }
        let now = now_ms();
        if now.saturating_sub(s.used_ms) >= TOUCH_EVERY.as_millis() as u64 {
            s.used_ms = now;
            if let Err(e) = store.put_cluster(&key(id), &s).await {
                tracing::warn!("session: {e}");
            }
        }
        let out = (s.token.clone(), s.csrf.clone());
        let mut m = ferry_api::util::lock(&self.0);
        let checked = fresh.unwrap_or_else(Instant::now);
        m.insert(id.to_string(), Cached { s, checked });
        Some(out)
    }

    pub async fn close(&self, store: &Store, id: &str) {
        ferry_api::util::lock(&self.0).remove(id);
        if let Err(e) = store.delete_cluster(&key(id)).await {
            tracing::warn!("session: {e}");
        }
    }
}

/// The session ID in a request's `Cookie` headers, if any.
pub fn cookie_id(headers: &axum::http::HeaderMap) -> Option<String> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.to_string())
        .filter(|v| v.len() == 32 && v.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The `Set-Cookie` value opening (`Some(id)`) or clearing a session.
pub fn set_cookie(id: Option<&str>, secure: bool) -> String {
    let secure = if secure { " Secure;" } else { "" };
    match id {
        Some(id) => format!(
            "{COOKIE}={id}; HttpOnly;{secure} SameSite=Strict; Path=/; Max-Age={}",
            IDLE.as_secs()
        ),
        None => format!("{COOKIE}=; HttpOnly;{secure} SameSite=Strict; Path=/; Max-Age=0"),
    }
}

/// Is a request of this method one that changes something (and so needs
/// the CSRF header)?
pub fn changes(method: &axum::http::Method) -> bool {
    !matches!(*method, axum::http::Method::GET | axum::http::Method::HEAD)
}

/// Does `given` (the request's CSRF header) match the session's, in
/// constant time?
pub fn csrf_ok(given: Option<&str>, want: &str) -> bool {
    let Some(g) = given else {
        return false;
    };
    g.len() == want.len()
        && g.bytes()
            .zip(want.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_session_keeps_its_token_and_csrf_until_closed_on_any_instance() {
        let store = Store::in_memory();
        let (one, two) = (Sessions::default(), Sessions::default());
        let (id, csrf) = one.open(&store, "hash-of-the-token").await.unwrap();
        assert_eq!(id.len(), 32);
        assert_ne!(id, csrf);
        let want = Some(("hash-of-the-token".to_string(), csrf.clone()));
        assert_eq!(one.get(&store, &id).await, want);
        // another instance on the same store knows it
        assert_eq!(two.get(&store, &id).await, want);
        assert_eq!(
            one.get(&store, "0123456789abcdef0123456789abcdef").await,
            None
        );
        // the store holds neither the ID nor a token
        let kept = store.cluster_under(PREFIX).await.unwrap();
        assert_eq!(kept.len(), 1);
        assert!(!kept[0].0.contains(&id) && !kept[0].1.contains(&id));
        // signed out on one: ended on the other once it reads again
        one.close(&store, &id).await;
        assert_eq!(one.get(&store, &id).await, None);
        tokio::time::sleep(RECHECK).await;
        assert_eq!(two.get(&store, &id).await, None);
    }

    #[tokio::test]
    async fn an_idle_session_ends_and_is_dropped_from_the_store() {
        let store = Store::in_memory();
        let s = Sessions::default();
        let (id, _) = s.open(&store, "t").await.unwrap();
        let old = Stored {
            token: "t".into(),
            csrf: "c".into(),
            used_ms: now_ms() - IDLE.as_millis() as u64 - 1,
        };
        store.put_cluster(&key(&id), &old).await.unwrap();
        assert_eq!(Sessions::default().get(&store, &id).await, None);
        assert!(store.cluster_under(PREFIX).await.unwrap().is_empty());
    }

    #[test]
    fn the_cookie_is_found_among_others_and_checked_for_shape() {
        let mut h = axum::http::HeaderMap::new();
        let id = "0123456789abcdef0123456789abcdef";
        h.append(
            "cookie",
            format!("a=1; {COOKIE}={id}; b=2").parse().unwrap(),
        );
        assert_eq!(cookie_id(&h).as_deref(), Some(id));
        let mut bad = axum::http::HeaderMap::new();
        bad.append("cookie", format!("{COOKIE}=../../etc").parse().unwrap());
        assert_eq!(cookie_id(&bad), None);
        assert_eq!(cookie_id(&axum::http::HeaderMap::new()), None);
    }

    #[test]
    fn the_cookie_is_http_only_strict_and_secure_over_tls() {
        let c = set_cookie(Some("ab"), true);
        for part in [
            "ferry_session=ab",
            "HttpOnly",
            "Secure",
            "SameSite=Strict",
            "Path=/",
        ] {
            assert!(c.contains(part), "{c}");
        }
        assert!(!set_cookie(Some("ab"), false).contains("Secure"));
        assert!(set_cookie(None, true).contains("Max-Age=0"));
    }

    #[test]
    fn csrf_must_match_exactly_and_only_changing_requests_need_it() {
        assert!(csrf_ok(Some("abcd"), "abcd"));
        assert!(!csrf_ok(Some("abce"), "abcd"));
        assert!(!csrf_ok(Some("abc"), "abcd"));
        assert!(!csrf_ok(None, "abcd"));
        assert!(changes(&axum::http::Method::POST));
        assert!(changes(&axum::http::Method::DELETE));
        assert!(!changes(&axum::http::Method::GET));
    }
}
