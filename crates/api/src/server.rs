//! Server-side helpers shared by the control service and the agents, so both
//! serve the API the same way: errors as [`ApiError`] bodies with the one
//! status mapping, JSON bodies whose rejections name what was wrong, the
//! cluster-credential check, and NDJSON event streams.

use axum::{
    body::Body,
    extract::{FromRequest, Request, State},
    http::StatusCode,
    middleware::Next,
    response::{IntoResponse, Response},
};
use futures::StreamExt;
use serde::Serialize;

use crate::{auth::Credential, ApiError};

/// Largest request body accepted.
pub const MAX_BODY: usize = 1 << 20;

/// An [`ApiError`] as an HTTP response.
pub struct ErrorResponse(pub ApiError);

impl From<ApiError> for ErrorResponse {
    fn from(e: ApiError) -> Self {
        ErrorResponse(e)
    }
}

impl IntoResponse for ErrorResponse {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, axum::Json(self.0.to_body())).into_response()
    }
}

/// A JSON body; malformed JSON or unknown fields become `InvalidArgument`
/// naming the body and serde's description of the problem.
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ErrorResponse;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| ApiError::invalid("body", e.body_text()))?;
        if bytes.len() > MAX_BODY {
            return Err(ApiError::invalid("body", "larger than 1 MiB").into());
        }
        serde_json::from_slice(&bytes)
            .map(ApiJson)
            .map_err(|e| ApiError::invalid("body", e.to_string()).into())
    }
}

/// Middleware: refuse any request without the cluster credential.
pub async fn require_credential(
    State(cred): State<Credential>,
    req: Request,
    next: Next,
) -> Response {
    let header = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok());
    if !cred.verify_header(header) {
        return ErrorResponse(ApiError::Unauthorized).into_response();
    }
    next.run(req).await
}

/// A response streaming one JSON value per line.
pub fn ndjson<E, S>(events: S) -> Response
where
    E: Serialize + Send + 'static,
    S: futures::Stream<Item = E> + Send + 'static,
{
    let lines = events.map(|e| {
        let mut line = serde_json::to_vec(&e).unwrap_or_else(|_| b"{}".to_vec());
        line.push(b'\n');
        Ok::<_, std::convert::Infallible>(line)
    });
    Response::builder()
        .header("content-type", "application/x-ndjson")
        .body(Body::from_stream(lines))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// Route fallback: unknown paths get a `NotFound` naming the path.
pub async fn not_found(req: Request) -> ErrorResponse {
    ErrorResponse(ApiError::not_found("route", req.uri().path()))
}
