//! The one HTTP client: JSON in, JSON or [`ApiError`] out, the cluster
//! credential on every request, and NDJSON event streams for long operations.

use std::time::Duration;

use futures::{Stream, StreamExt};
use serde::{de::DeserializeOwned, Serialize};

use crate::{auth::Credential, ApiError};

/// Largest single NDJSON event accepted from a peer.
const MAX_EVENT_LINE: usize = 1 << 20;

#[derive(Clone, Debug)]
pub struct Client {
    base: String,
    cred: Credential,
    http: reqwest::Client,
    /// Peer name used in errors ("agent host2", "control service").
    peer: String,
}

impl Client {
    pub fn new(peer: &str, base: &str, cred: Credential) -> Self {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(3))
            .no_proxy()
            .build()
            .unwrap_or_default();
        Client {
            base: base.trim_end_matches('/').to_string(),
            cred,
            http,
            peer: peer.into(),
        }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}{}", self.base, crate::API_PREFIX, path)
    }

    fn unreachable(&self, e: reqwest::Error) -> ApiError {
        ApiError::unavailable(self.peer.clone(), e)
    }

    async fn send<T: DeserializeOwned>(&self, rb: reqwest::RequestBuilder) -> Result<T, ApiError> {
        let resp = rb
            .header("authorization", self.cred.header_value())
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
            .header("authorization", self.cred.header_value())
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
