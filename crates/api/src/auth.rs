//! The cluster credential.
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
