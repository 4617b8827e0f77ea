//! Users' API tokens: named, with a role, stored hashed in the control
//! state (cluster key `tokens`, so SQLite and etcd alike), checked on every
//! request to the control service.
//!
//! A token is `ferry_` followed by 64 hex digits (256 random bits); only
//! its SHA-256 is kept. Revoking keeps the record (the name stays taken and
//! the event log can still name it). Every control instance sharing a store
//! takes up new and revoked tokens at its next heartbeat (≤ 1 s); the one
//! that made the change at once.
//!
//! The first admin token comes from a file (`admin_token` in
//! `control.toml`, written by `ferry cluster init`): at start, a token named
//! `admin` is made from it unless a token of that name was ever made.

use std::collections::BTreeMap;

use ferry_api::auth::{token_hash, TokenCreated, TokenInfo, TokenRole};
use ferry_api::ApiError;
use serde::{Deserialize, Serialize};

use crate::store::Store;

/// The cluster key the tokens live under.
const KEY: &str = "tokens";
/// The name of the token made from the bootstrap file.
pub const BOOTSTRAP_NAME: &str = "admin";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct Record {
    #[serde(flatten)]
    info: TokenInfo,
    /// SHA-256 of the secret, hex.
    hash: String,
}

/// Who made a request: a token's name and role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub name: String,
    pub role: TokenRole,
}

impl Caller {
    /// The control service itself (heartbeats, the policy manager, tests).
    pub fn system() -> Caller {
        Caller {
            name: "control".into(),
            role: TokenRole::Admin,
        }
    }
}

/// The tokens, as last read from the store.
#[derive(Default)]
pub struct Tokens {
    by_name: std::sync::Mutex<BTreeMap<String, Record>>,
}

use ferry_api::util::now_ms;

/// A new secret: `ferry_` and 64 hex digits.
pub fn new_secret() -> String {
    let b: [u8; 32] = rand::random();
    format!(
        "ferry_{}",
        b.iter().map(|x| format!("{x:02x}")).collect::<String>()
    )
}

impl Tokens {
    /// Takes up what the store holds.
    pub async fn reload(&self, store: &Store) -> Result<(), ApiError> {
        let list: Vec<Record> = store.cluster(KEY).await?.unwrap_or_default();
        *ferry_api::util::lock(&self.by_name) =
            list.into_iter().map(|r| (r.info.name.clone(), r)).collect();
        Ok(())
    }

    async fn save(&self, store: &Store) -> Result<(), ApiError> {
        let list: Vec<Record> = ferry_api::util::lock(&self.by_name)
            .values()
            .cloned()
            .collect();
        store.put_cluster(KEY, &list).await
    }

    /// Who `secret` belongs to, or why it is refused.
    pub fn authenticate(&self, header: Option<&str>) -> Result<Caller, ApiError> {
        let secret = header
            .and_then(|h| h.strip_prefix("Bearer "))
            .ok_or_else(|| ApiError::unauthorized("no API token (Authorization: Bearer)"))?;
        self.by_hash(&token_hash(secret))
    }

    /// Who the token of SHA-256 `hash` belongs to (a browser session's),
    /// or why it is refused.
    pub fn by_hash(&self, hash: &str) -> Result<Caller, ApiError> {
        let tokens = ferry_api::util::lock(&self.by_name);
        let rec = tokens
            .values()
            .find(|r| r.hash == hash)
            .ok_or_else(|| ApiError::unauthorized("unknown API token"))?;
        if rec.info.revoked_ms.is_some() {
            return Err(ApiError::unauthorized(format!(
                "API token '{}' was revoked",
                rec.info.name
            )));
        }
        Ok(Caller {
            name: rec.info.name.clone(),
            role: rec.info.role,
        })
    }

    pub fn list(&self) -> Vec<TokenInfo> {
        ferry_api::util::lock(&self.by_name)
            .values()
            .map(|r| r.info.clone())
            .collect()
    }

    /// A new token; its secret is returned this once.
    pub async fn create(
        &self,
        store: &Store,
        name: &str,
        role: TokenRole,
        secret: Option<String>,
    ) -> Result<TokenCreated, ApiError> {
        ferry_api::validate_name("token name", name)?;
        self.reload(store).await?;
        let secret = secret.unwrap_or_else(new_secret);
        let info = TokenInfo {
            name: name.into(),
            role,
            created_ms: now_ms(),
            revoked_ms: None,
        };
        {
            let mut m = ferry_api::util::lock(&self.by_name);
            if m.contains_key(name) {
                return Err(ApiError::AlreadyExists {
                    kind: "token".into(),
                    name: name.into(),
                });
            }
            m.insert(
                name.into(),
                Record {
                    info: info.clone(),
                    hash: token_hash(&secret),
                },
            );
        }
        self.save(store).await?;
        Ok(TokenCreated {
            info,
            token: secret,
        })
    }

    pub async fn revoke(&self, store: &Store, name: &str) -> Result<TokenInfo, ApiError> {
        self.reload(store).await?;
        let info = {
            let mut m = ferry_api::util::lock(&self.by_name);
            let r = m
                .get_mut(name)
                .ok_or_else(|| ApiError::not_found("token", name))?;
            if r.info.revoked_ms.is_none() {
                r.info.revoked_ms = Some(now_ms());
            }
            r.info.clone()
        };
        self.save(store).await?;
        Ok(info)
    }

    /// Makes the bootstrap admin token from `secret` unless a token named
    /// [`BOOTSTRAP_NAME`] was ever made. Returns whether it made it.
    pub async fn bootstrap(&self, store: &Store, secret: &str) -> Result<bool, ApiError> {
        // an empty or short file would be an admin token anyone can guess
        if secret.trim().len() < MIN_SECRET {
            return Err(ApiError::invalid(
                "admin_token",
                format!(
                    "the file holds {} characters; an admin token has at least {MIN_SECRET} (ferry cluster init writes one)",
                    secret.trim().len()
                ),
            ));
        }
        self.reload(store).await?;
        if ferry_api::util::lock(&self.by_name).contains_key(BOOTSTRAP_NAME) {
            return Ok(false);
        }
        let made = self
            .create(
                store,
                BOOTSTRAP_NAME,
                TokenRole::Admin,
                Some(secret.trim().into()),
            )
            .await;
        match made {
            Ok(_) => Ok(true),
            // another instance sharing the store made it meanwhile
            Err(e) => {
                self.reload(store).await?;
                if ferry_api::util::lock(&self.by_name).contains_key(BOOTSTRAP_NAME) {
                    Ok(false)
                } else {
                    Err(e)
                }
            }
        }
    }
}

/// The shortest secret taken as a token (128 bits, hex).
pub const MIN_SECRET: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_empty_or_short_admin_token_file_is_refused() {
        let store = Store::in_memory();
        let t = Tokens::default();
        for s in ["", "  \n", "0123456789abcdef"] {
            let e = t.bootstrap(&store, s).await.unwrap_err().to_string();
            assert!(e.contains("admin_token"), "{e}");
        }
        assert!(t.list().is_empty() || !t.list().iter().any(|i| i.name == BOOTSTRAP_NAME));
        assert!(t.bootstrap(&store, &new_secret()).await.unwrap());
    }

    fn bearer(s: &str) -> String {
        format!("Bearer {s}")
    }

    #[tokio::test]
    async fn tokens_authenticate_by_hash_and_revocation_refuses() {
        let store = Store::in_memory();
        let t = Tokens::default();
        let c = t
            .create(&store, "ci", TokenRole::ReadOnly, None)
            .await
            .unwrap();
        assert!(c.token.starts_with("ferry_") && c.token.len() == 70);
        // only the hash is stored
        let raw: serde_json::Value = store.cluster(KEY).await.unwrap().unwrap();
        assert!(!raw.to_string().contains(&c.token[6..]));
        assert_eq!(
            t.authenticate(Some(&bearer(&c.token))).unwrap(),
            Caller {
                name: "ci".into(),
                role: TokenRole::ReadOnly
            }
        );
        for (h, why) in [
            (None, "no API token"),
            (Some("Basic abc".to_string()), "no API token"),
            (Some(bearer("ferry_00")), "unknown API token"),
        ] {
            let e = t.authenticate(h.as_deref()).unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
            assert_eq!(e.http_status(), 401);
        }
        // a second instance sharing the store sees the revocation after reload
        let other = Tokens::default();
        other.reload(&store).await.unwrap();
        assert!(other.authenticate(Some(&bearer(&c.token))).is_ok());
        t.revoke(&store, "ci").await.unwrap();
        other.reload(&store).await.unwrap();
        let e = other.authenticate(Some(&bearer(&c.token))).unwrap_err();
        assert!(e.to_string().contains("'ci' was revoked"), "{e}");
        // the name stays taken
        assert!(matches!(
            t.create(&store, "ci", TokenRole::Admin, None).await,
            Err(ApiError::AlreadyExists { .. })
        ));
        assert!(t
            .create(&store, "bad name", TokenRole::Admin, None)
            .await
            .is_err());
    }

    #[tokio::test]
    async fn bootstrap_happens_once_even_after_revocation() {
        let store = Store::in_memory();
        let t = Tokens::default();
        let first = "ferry_first_0123456789abcdef0123456789";
        assert!(t.bootstrap(&store, &format!("{first}\n")).await.unwrap());
        assert_eq!(
            t.authenticate(Some(&format!("Bearer {first}")))
                .unwrap()
                .role,
            TokenRole::Admin
        );
        t.revoke(&store, BOOTSTRAP_NAME).await.unwrap();
        assert!(!t.bootstrap(&store, first).await.unwrap());
        assert!(t.authenticate(Some(&format!("Bearer {first}"))).is_err());
    }
}
