//! Credentials: the cluster credential, and users' API tokens with roles.
//!
//! Made once when a lab or cluster is created ([`Credential::generate`]) and
//! stored in a root-only file. Every request to an agent or to the control
//! service carries it as `Authorization: Bearer <hex>`; servers compare it in
//! constant time and refuse anything else with [`crate::ApiError::Unauthorized`].

use std::path::Path;

#[derive(Clone)]
pub struct Credential(String);

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Credential(<redacted>)")
    }
}

impl Credential {
    /// 256 random bits, hex encoded.
    pub fn generate() -> Self {
        let bytes: [u8; 32] = rand::random();
        Credential(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    pub fn from_secret(s: &str) -> Self {
        Credential(s.trim().to_string())
    }

    pub fn load(path: &Path) -> std::io::Result<Self> {
        let s = std::fs::read_to_string(path)?;
        if s.trim().len() < 32 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{} does not hold a cluster credential", path.display()),
            ));
        }
        Ok(Self::from_secret(&s))
    }

    /// Writes the credential readable by its owner only.
    pub fn store(&self, path: &Path) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)?;
        f.write_all(self.0.as_bytes())
    }

    /// The secret itself, as key material (transport handshakes).
    pub fn secret(&self) -> &[u8] {
        self.0.as_bytes()
    }

    pub fn header_value(&self) -> String {
        format!("Bearer {}", self.0)
    }

    /// Checks an `Authorization` header value in constant time.
    pub fn verify_header(&self, header: Option<&str>) -> bool {
        let Some(got) = header.and_then(|h| h.strip_prefix("Bearer ")) else {
            return false;
        };
        let (a, b) = (got.as_bytes(), self.0.as_bytes());
        if a.len() != b.len() {
            return false;
        }
        a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

/// What a user's API token may do at the control service; each role can do
/// everything the one before it can.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum TokenRole {
    /// Sees everything, changes nothing.
    ReadOnly,
    /// Also creates, moves and removes VMs, drains hosts, runs validation,
    /// manages disks and storage QoS.
    Operator,
    /// Also manages tokens, host settings and cluster settings (bandwidth
    /// classes, carrier encryption).
    Admin,
}

impl TokenRole {
    pub fn as_str(self) -> &'static str {
        match self {
            TokenRole::ReadOnly => "read-only",
            TokenRole::Operator => "operator",
            TokenRole::Admin => "admin",
        }
    }
}

impl std::fmt::Display for TokenRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for TokenRole {
    type Err = crate::ApiError;
    fn from_str(s: &str) -> Result<Self, crate::ApiError> {
        match s {
            "read-only" => Ok(TokenRole::ReadOnly),
            "operator" => Ok(TokenRole::Operator),
            "admin" => Ok(TokenRole::Admin),
            _ => Err(crate::ApiError::invalid(
                "role",
                format!("'{s}' is not one of admin, operator, read-only"),
            )),
        }
    }
}

/// `POST /tokens`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenCreateRequest {
    pub name: String,
    pub role: TokenRole,
}

/// A token as listed: never its secret.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TokenInfo {
    pub name: String,
    pub role: TokenRole,
    pub created_ms: u64,
    /// When it was revoked; a revoked token is refused and its name stays taken.
    pub revoked_ms: Option<u64>,
}

/// The answer to `POST /tokens`: the secret, shown this once.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct TokenCreated {
    #[serde(flatten)]
    pub info: TokenInfo,
    pub token: String,
}

/// The SHA-256 of a token's secret, hex: what the control service stores.
/// (Tokens are 256 random bits, so a fast hash suffices.)
pub fn token_hash(secret: &str) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(secret.trim().as_bytes());
    d.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_only_the_exact_bearer() {
        let c = Credential::generate();
        assert!(c.verify_header(Some(&c.header_value())));
        assert!(!c.verify_header(None));
        assert!(!c.verify_header(Some("Bearer ")));
        assert!(!c.verify_header(Some(&Credential::generate().header_value())));
        let mut almost = c.header_value();
        almost.pop();
        assert!(!c.verify_header(Some(&almost)));
        assert!(!c.verify_header(Some(c.header_value().trim_start_matches("Bearer "))));
    }

    #[test]
    fn store_is_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("ferry-cred-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("token");
        let c = Credential::generate();
        c.store(&p).unwrap();
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert!(Credential::load(&p)
            .unwrap()
            .verify_header(Some(&c.header_value())));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
