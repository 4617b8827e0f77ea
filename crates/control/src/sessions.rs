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
//! after [`IDLE`] unused, at sign-out, or when the control service
//! restarts (sessions live in its memory only: with several control
//! instances a browser signs in to the one it talks to).
//! `Secure` is left out only under `--insecure-http`, where there is no
//! TLS for the browser to require.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The cookie's name.
pub const COOKIE: &str = "ferry_session";
/// The header a session's changing requests carry.
pub const CSRF_HEADER: &str = "x-ferry-csrf";
/// A session unused this long ends.
pub const IDLE: Duration = Duration::from_secs(8 * 3600);
/// At most this many sessions are kept; the least recently used go first.
const MAX: usize = 4096;

struct Session {
    /// The `Authorization` value of the token it was opened with.
    bearer: String,
    csrf: String,
    used: Instant,
}

/// The open sessions, by ID.
#[derive(Default)]
pub struct Sessions(std::sync::Mutex<HashMap<String, Session>>);

fn random_hex() -> String {
    rand::random::<[u8; 16]>()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl Sessions {
    /// Opens a session for `token` (already checked); returns (ID, CSRF).
    pub fn open(&self, token: &str) -> (String, String) {
        let (id, csrf) = (random_hex(), random_hex());
        let mut m = ferry_api::util::lock(&self.0);
        m.retain(|_, s| s.used.elapsed() < IDLE);
        while m.len() >= MAX {
            let oldest = m.iter().min_by_key(|(_, s)| s.used).map(|(k, _)| k.clone());
            match oldest {
                Some(k) => m.remove(&k),
                None => break,
            };
        }
        m.insert(
            id.clone(),
            Session {
                bearer: format!("Bearer {token}"),
                csrf: csrf.clone(),
                used: Instant::now(),
            },
        );
        (id, csrf)
    }

    /// The session `id`'s (bearer, CSRF), if it is open; marks it used.
    pub fn get(&self, id: &str) -> Option<(String, String)> {
        let mut m = ferry_api::util::lock(&self.0);
        let s = m.get_mut(id)?;
        if s.used.elapsed() >= IDLE {
            m.remove(id);
            return None;
        }
        s.used = Instant::now();
        Some((s.bearer.clone(), s.csrf.clone()))
    }

    pub fn close(&self, id: &str) {
        ferry_api::util::lock(&self.0).remove(id);
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

    #[test]
    fn a_session_keeps_its_token_and_csrf_until_closed() {
        let s = Sessions::default();
        let (id, csrf) = s.open("ferry_abc");
        assert_eq!(id.len(), 32);
        assert_ne!(id, csrf);
        assert_eq!(s.get(&id), Some(("Bearer ferry_abc".into(), csrf.clone())));
        assert_eq!(s.get("0123456789abcdef0123456789abcdef"), None);
        s.close(&id);
        assert_eq!(s.get(&id), None);
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
