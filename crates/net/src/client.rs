//! The one HTTP client: JSON in, JSON or [`ApiError`] out, its credential
//! (a client certificate, a user's API token) on every request, and NDJSON
//! event streams for long operations.

use std::time::Duration;

use futures::{Stream, StreamExt};
use serde::{de::DeserializeOwned, Serialize};

use ferry_api::{auth::Credential, ApiError};

/// Largest single NDJSON event accepted from a peer.
const MAX_EVENT_LINE: usize = 1 << 20;

/// How a client proves who it is and knows its peer.
#[derive(Clone, Debug, Default)]
pub struct ClientAuth {
    /// Sent as `Authorization: Bearer`: a user's API token at the control
    /// service; the cluster credential between components under
    /// `--insecure-http`.
    pub bearer: Option<Credential>,
    /// TLS: the cluster CA, and this component's certificate when it has
    /// one. `None`: plain HTTP (`--insecure-http`).
    pub tls: Option<std::sync::Arc<rustls::ClientConfig>>,
}

impl ClientAuth {
    /// A component's: its certificate, or the cluster credential without TLS.
    pub fn component(
        pki: Option<&crate::tls::Pki>,
        cred: &Credential,
    ) -> Result<Self, crate::tls::TlsError> {
        Ok(match pki {
            Some(p) => ClientAuth {
                bearer: None,
                tls: Some(p.http_client_config()?),
            },
            None => ClientAuth {
                bearer: Some(cred.clone()),
                tls: None,
            },
        })
    }
}

#[derive(Clone, Debug)]
pub struct Client {
    base: String,
    auth: ClientAuth,
    http: reqwest::Client,
    /// Peer name used in errors ("agent host2", "control service").
    peer: String,
}

impl Client {
    pub fn new(peer: &str, base: &str, auth: ClientAuth) -> Self {
        let mut b = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(3))
            // an HTTP/2 connection kept to a peer that vanished (its host
            // cut off, no FIN) is found dead and dropped, so the next request
            // connects afresh rather than timing out on it
            .http2_keep_alive_interval(Duration::from_secs(10))
            .http2_keep_alive_timeout(Duration::from_secs(5))
            .http2_keep_alive_while_idle(true)
            .no_proxy();
        if let Some(tls) = &auth.tls {
            b = b.use_preconfigured_tls((**tls).clone()).https_only(true);
        }
        let http = b.build().unwrap_or_else(|e| {
            tracing::error!("HTTP client: {e}");
            reqwest::Client::new()
        });
        Client {
            base: base.trim_end_matches('/').to_string(),
            auth,
            http,
            peer: peer.into(),
        }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}{}", self.base, ferry_api::API_PREFIX, path)
    }

    fn unreachable(&self, e: reqwest::Error) -> ApiError {
        ApiError::unavailable(self.peer.clone(), e)
    }

    async fn send<T: DeserializeOwned>(&self, rb: reqwest::RequestBuilder) -> Result<T, ApiError> {
        let resp = rb
            .pipe_auth(&self.auth)
            .send()
            .await
            .map_err(|e| self.unreachable(e))?;
        let status = resp.status().as_u16();
        let text = resp.text().await.map_err(|e| self.unreachable(e))?;
        if !(200..300).contains(&status) {
            return Err(ApiError::from_body(status, &text));
        }
        serde_json::from_str(&text)
            .map_err(|e| ApiError::internal(format!("{} sent an unreadable reply: {e}", self.peer)))
    }

    pub async fn get<T: DeserializeOwned>(
        &self,
        path: &str,
        timeout: Duration,
    ) -> Result<T, ApiError> {
        self.send(self.http.get(self.url(path)).timeout(timeout))
            .await
    }

    pub async fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
        timeout: Duration,
    ) -> Result<T, ApiError> {
        self.send(self.http.post(self.url(path)).json(body).timeout(timeout))
            .await
    }

    pub async fn put<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
        timeout: Duration,
    ) -> Result<T, ApiError> {
        self.send(self.http.put(self.url(path)).json(body).timeout(timeout))
            .await
    }

    pub async fn delete<T: DeserializeOwned>(
        &self,
        path: &str,
        timeout: Duration,
    ) -> Result<T, ApiError> {
        self.send(self.http.delete(self.url(path)).timeout(timeout))
            .await
    }

    /// POSTs and reads the reply as a stream of NDJSON events.
    pub async fn post_events<B: Serialize, E: DeserializeOwned + Send + 'static>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<impl Stream<Item = Result<E, ApiError>> + Send + Unpin, ApiError> {
        let resp = self
            .http
            .post(self.url(path))
            .pipe_auth(&self.auth)
            .json(body)
            .send()
            .await
            .map_err(|e| self.unreachable(e))?;
        let status = resp.status().as_u16();
        if !(200..300).contains(&status) {
            let text = resp.text().await.unwrap_or_default();
            return Err(ApiError::from_body(status, &text));
        }
        let peer = self.peer.clone();
        let bytes = resp.bytes_stream();
        let lines = futures::stream::unfold(
            (bytes, Vec::<u8>::new(), false, peer),
            |(mut bytes, mut buf, mut done, peer)| async move {
                loop {
                    if let Some(pos) = buf.iter().position(|&b| b == b'\n') {
                        let line: Vec<u8> = buf.drain(..=pos).collect();
                        let line = &line[..line.len() - 1];
                        if line.is_empty() {
                            continue;
                        }
                        let item = serde_json::from_slice::<E>(line).map_err(|e| {
                            ApiError::internal(format!("{peer} sent an unreadable event: {e}"))
                        });
                        return Some((item, (bytes, buf, done, peer)));
                    }
                    if done {
                        return None;
                    }
                    if buf.len() > MAX_EVENT_LINE {
                        done = true;
                        buf.clear();
                        let e = ApiError::internal(format!("{peer} sent an event over 1 MiB"));
                        return Some((Err(e), (bytes, buf, done, peer)));
                    }
                    match bytes.next().await {
                        Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
                        Some(Err(e)) => {
                            done = true;
                            let e = ApiError::unavailable(peer.clone(), e);
                            return Some((Err(e), (bytes, buf, done, peer)));
                        }
                        None => done = true,
                    }
                }
            },
        );
        Ok(Box::pin(lines))
    }
}

trait WithAuth {
    fn pipe_auth(self, auth: &ClientAuth) -> Self;
}

impl WithAuth for reqwest::RequestBuilder {
    fn pipe_auth(self, auth: &ClientAuth) -> Self {
        match &auth.bearer {
            Some(c) => self.header("authorization", c.header_value()),
            None => self,
        }
    }
}
