//! [`ApiError`]: the errors that cross Ferry's API, on the control service and
//! on agents alike. Each variant names what was wrong; [`ApiError::http_status`]
//! is the one mapping from error to HTTP status. On the wire an error is the
//! JSON form of this enum (tagged by `code`) plus a human `message`.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "code", rename_all = "snake_case")]
pub enum ApiError {
    #[error("No {kind} named '{name}'")]
    NotFound { kind: String, name: String },
    #[error("A {kind} named '{name}' already exists")]
    AlreadyExists { kind: String, name: String },
    #[error("Invalid {field}: {reason}")]
    InvalidArgument { field: String, reason: String },
    #[error("Host {host} has {available} bytes of memory free, {needed} needed")]
    InsufficientMemory {
        host: String,
        needed: u64,
        available: u64,
    },
    #[error("Request refused: {reason}")]
    Unauthorized { reason: String },
    #[error("Forbidden: {caller} has role {role}; {action} needs role {needed}")]
    Forbidden {
        caller: String,
        role: String,
        action: String,
        needed: String,
    },
    /// Refused whatever the caller's role: a browser session's changing
    /// request without its CSRF token.
    #[error("Refused: {reason}")]
    Refused { reason: String },
    #[error("Conflict: {reason}")]
    Conflict { reason: String },
    #[error("{what} is unavailable: {reason}")]
    Unavailable { what: String, reason: String },
    #[error(
        "Migration of {vm} failed at step '{step}': {reason}; the VM keeps running on {running_on}"
    )]
    MigrationFailed {
        vm: String,
        step: String,
        reason: String,
        running_on: String,
    },
    /// The source committed (only the target may run the guest now) and the
    /// target's answer to RUN was lost: both stay paused until one agent can
    /// ask the other (`ferry vm resolve`).
    #[error(
        "Migration of {vm} from {source_host} to {target} is in doubt: {reason}; the guest is paused \
         and runs on neither until {target} answers (ferry vm resolve {vm})"
    )]
    MigrationInDoubt {
        vm: String,
        source_host: String,
        target: String,
        reason: String,
    },
    /// After the commit (post-copy): the guest's state is on the target and the
    /// migration broke; the source is never resumed.
    #[error("Migration of {vm} to {target} failed after its commit point: {reason}")]
    MigrationLost {
        vm: String,
        target: String,
        reason: String,
    },
    /// A host lacks what a VM needs (a bridge, a disk path, a firmware
    /// file, a CPU model): refused before anything starts there.
    #[error("Host {host} cannot run VM {vm}: {}", missing.join("; "))]
    HostCannotRun {
        host: String,
        vm: String,
        missing: Vec<String>,
    },
    /// A VM names a host resource (a drive path, a kernel, a bridge, a
    /// machine type) the host's administrator does not grant guests: refused
    /// before anything starts, naming the field, the key in `agent.toml`
    /// that grants it and what is granted.
    #[error(
        "Host {host} does not grant {field} = '{value}' to guests; it grants {} (agent.toml `{key}`)",
        if allowed.is_empty() { "none".to_string() } else { allowed.join(", ") }
    )]
    NotGranted {
        host: String,
        field: String,
        value: String,
        key: String,
        allowed: Vec<String>,
    },
    /// A limit the caller reached (streams, connections): refused until
    /// it gives some back; `setting` names the limit.
    #[error("Too many {what}: the limit is {limit} ({setting})")]
    TooMany {
        what: String,
        limit: u64,
        setting: String,
    },
    /// An incoming migration without a good ticket from the control
    /// service (see `ferry_net::ticket`); `reason` says which check failed.
    #[error("Move refused: {reason}")]
    BadTicket { reason: String },
    #[error("Internal error: {reason}")]
    Internal { reason: String },
}

impl ApiError {
    /// The HTTP status each error is served with.
    pub fn http_status(&self) -> u16 {
        match self {
            ApiError::NotFound { .. } => 404,
            ApiError::AlreadyExists { .. } | ApiError::Conflict { .. } => 409,
            ApiError::InvalidArgument { .. } => 400,
            ApiError::InsufficientMemory { .. } => 507,
            ApiError::HostCannotRun { .. } => 412,
            ApiError::Unauthorized { .. } => 401,
            ApiError::Forbidden { .. }
            | ApiError::Refused { .. }
            | ApiError::NotGranted { .. }
            | ApiError::BadTicket { .. } => 403,
            ApiError::Unavailable { .. } => 503,
            ApiError::MigrationFailed { .. }
            | ApiError::MigrationInDoubt { .. }
            | ApiError::MigrationLost { .. } => 502,
            ApiError::TooMany { .. } => 429,
            ApiError::Internal { .. } => 500,
        }
    }

    pub fn not_found(kind: &str, name: &str) -> Self {
        ApiError::NotFound {
            kind: kind.into(),
            name: name.into(),
        }
    }

    pub fn invalid(field: &str, reason: impl Into<String>) -> Self {
        ApiError::InvalidArgument {
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub fn unauthorized(reason: impl Into<String>) -> Self {
        ApiError::Unauthorized {
            reason: reason.into(),
        }
    }

    pub fn internal(reason: impl std::fmt::Display) -> Self {
        ApiError::Internal {
            reason: reason.to_string(),
        }
    }

    pub fn unavailable(what: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        ApiError::Unavailable {
            what: what.into(),
            reason: reason.to_string(),
        }
    }

    /// The JSON body an error is served as: the tagged enum plus `message`.
    pub fn to_body(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap_or_else(|_| serde_json::json!({}));
        if let Some(o) = v.as_object_mut() {
            o.insert("message".into(), self.to_string().into());
        }
        v
    }

    /// Reads an error body back; anything unreadable becomes `Internal` with
    /// the status and the raw text, so no error is silently lost.
    pub fn from_body(status: u16, body: &str) -> Self {
        let parsed = serde_json::from_str::<serde_json::Value>(body)
            .ok()
            .and_then(|mut v| {
                v.as_object_mut().map(|o| o.remove("message"));
                serde_json::from_value::<ApiError>(v).ok()
            });
        parsed.unwrap_or_else(|| ApiError::Internal {
            reason: format!(
                "HTTP {status}: {}",
                body.chars().take(300).collect::<String>()
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_round_trips_through_its_body() {
        let all = [
            ApiError::not_found("vm", "a"),
            ApiError::AlreadyExists {
                kind: "vm".into(),
                name: "a".into(),
            },
            ApiError::invalid("--memory", "too small"),
            ApiError::InsufficientMemory {
                host: "host2".into(),
                needed: 2,
                available: 1,
            },
            ApiError::unauthorized("no credential"),
            ApiError::Forbidden {
                caller: "token ci".into(),
                role: "read-only".into(),
                action: "move vm".into(),
                needed: "operator".into(),
            },
            ApiError::Refused {
                reason: "no CSRF token".into(),
            },
            ApiError::Conflict {
                reason: "busy".into(),
            },
            ApiError::unavailable("agent host1", "refused"),
            ApiError::MigrationFailed {
                vm: "a".into(),
                step: "transfer".into(),
                reason: "link".into(),
                running_on: "host1".into(),
            },
            ApiError::HostCannotRun {
                host: "host3".into(),
                vm: "deb1".into(),
                missing: vec!["bridge br-guest".into()],
            },
            ApiError::NotGranted {
                host: "host1".into(),
                field: "drives[0].path".into(),
                value: "/etc/shadow".into(),
                key: "drive_dirs".into(),
                allowed: vec!["/srv/vm".into()],
            },
            ApiError::TooMany {
                what: "event streams of token ci".into(),
                limit: 16,
                setting: "max_streams_per_token".into(),
            },
            ApiError::BadTicket {
                reason: "ticket expired 3 ms ago".into(),
            },
            ApiError::internal("x"),
        ];
        for e in all {
            let body = e.to_body().to_string();
            assert_eq!(ApiError::from_body(e.http_status(), &body), e);
            assert!(body.contains(&e.to_string()));
        }
    }

    #[test]
    fn statuses_are_distinct_per_class() {
        assert_eq!(ApiError::unauthorized("x").http_status(), 401);
        assert_eq!(ApiError::not_found("vm", "x").http_status(), 404);
        assert_eq!(ApiError::invalid("f", "r").http_status(), 400);
    }

    #[test]
    fn unreadable_bodies_keep_status_and_text() {
        let e = ApiError::from_body(502, "<html>bad gateway</html>");
        assert!(e.to_string().contains("502") && e.to_string().contains("bad gateway"));
    }
}
