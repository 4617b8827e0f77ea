//! The web console's files, served like a real front end's: each compressed
//! once (gzip, for the browsers that take it), named in the page with a hash
//! of its content (`/ui/app.js?v=…`) so browsers keep it for a year and
//! fetch it again only when it changes, and the page itself revalidated on
//! every load (its ETag answered with 304 Not Modified). Static, no cluster
//! data in them: served without a credential (the page signs in).

use std::io::Write;
use std::sync::LazyLock;

use axum::body::Bytes;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

/// One file of the console.
pub struct Asset {
    pub path: &'static str,
    ctype: &'static str,
    /// Shared with every response (a clone is a reference, not a copy).
    body: Bytes,
    gzip: Bytes,
    /// The first 16 hex digits of the content's SHA-256.
    pub hash: String,
}

impl Asset {
    fn new(path: &'static str, ctype: &'static str, body: Vec<u8>) -> Asset {
        let hash: String = Sha256::digest(&body)
            .iter()
            .take(8)
            .map(|b| format!("{b:02x}"))
            .collect();
        let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        // writing into a Vec cannot fail
        let gzip = z
            .write_all(&body)
            .and_then(|_| z.finish())
            .unwrap_or_default();
        Asset {
            path,
            ctype,
            body: body.into(),
            gzip: gzip.into(),
            hash,
        }
    }

    /// Bytes as stored and as sent to a browser that takes gzip.
    pub fn sizes(&self) -> (usize, usize) {
        (self.body.len(), self.gzip.len())
    }
}

const PAGE: &str = "/";

/// The console's files; the page names the others with their hashes.
pub static ASSETS: LazyLock<Vec<Asset>> = LazyLock::new(|| {
    let files = vec![
        Asset::new(
            "/ui/app.js",
            "text/javascript",
            include_bytes!("../web/app.js").to_vec(),
        ),
        Asset::new(
            "/ui/uPlot.iife.min.js",
            "text/javascript",
            include_bytes!("../web/vendor/uPlot.iife.min.js").to_vec(),
        ),
        Asset::new(
            "/ui/uPlot.min.css",
            "text/css",
            include_bytes!("../web/vendor/uPlot.min.css").to_vec(),
        ),
    ];
    let mut page = include_str!("../web/index.html").to_string();
    for f in &files {
        page = page.replace(
            &format!("\"{}\"", f.path),
            &format!("\"{}?v={}\"", f.path, f.hash),
        );
    }
    let mut all = vec![Asset::new(
        PAGE,
        "text/html; charset=utf-8",
        page.into_bytes(),
    )];
    all.extend(files);
    all
});

/// Whether `accept` (an Accept-Encoding value) takes gzip: listed, and not
/// with q=0.
fn takes_gzip(accept: &str) -> bool {
    accept.split(',').any(|part| {
        let mut it = part.split(';').map(str::trim);
        let coding = it.next().unwrap_or_default();
        let refused = it.any(|p| {
            p.strip_prefix("q=")
                .and_then(|q| q.parse::<f32>().ok())
                .is_some_and(|q| q == 0.0)
        });
        (coding.eq_ignore_ascii_case("gzip") || coding == "*") && !refused
    })
}

/// Answers a GET for one of [`ASSETS`].
pub async fn serve(uri: Uri, headers: HeaderMap) -> Response {
    let Some(a) = ASSETS.iter().find(|a| a.path == uri.path()) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let etag = format!("\"{}\"", a.hash);
    // the page: revalidated every time; a file named with its hash: a year
    let versioned = a.path != PAGE && uri.query() == Some(&format!("v={}", a.hash));
    let cache = if versioned {
        "public, max-age=31536000, immutable"
    } else {
        "no-cache"
    };
    let mut h = HeaderMap::new();
    let value = |s: &str| HeaderValue::from_str(s).unwrap_or(HeaderValue::from_static(""));
    h.insert(header::ETAG, value(&etag));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static(cache));
    h.insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    let unchanged = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag || t.trim() == "*"));
    if unchanged {
        return (StatusCode::NOT_MODIFIED, h).into_response();
    }
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(a.ctype));
    let gzip = headers
        .get(header::ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(takes_gzip);
    if gzip {
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        (h, a.gzip.clone()).into_response()
    } else {
        (h, a.body.clone()).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gzip_is_taken_when_listed_and_not_refused() {
        assert!(takes_gzip("gzip, deflate, br, zstd"));
        assert!(takes_gzip("br;q=1.0, gzip;q=0.8"));
        assert!(takes_gzip("*"));
        assert!(!takes_gzip("gzip;q=0, br"));
        assert!(!takes_gzip("identity"));
        assert!(!takes_gzip(""));
    }

    #[test]
    fn the_page_names_every_file_with_its_hash_and_each_shrinks() {
        let page = String::from_utf8(ASSETS[0].body.to_vec()).unwrap();
        for a in &ASSETS[1..] {
            assert!(
                page.contains(&format!("\"{}?v={}\"", a.path, a.hash)),
                "{} not named with its hash",
                a.path
            );
            let (raw, gz) = a.sizes();
            assert!(gz * 2 < raw, "{}: {raw} → {gz}", a.path);
        }
    }
}
