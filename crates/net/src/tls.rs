//! Transport security for every HTTP endpoint Ferry serves, and for NBD.
//!
//! ## The cluster's certificates
//! `ferry cluster init` makes a cluster CA (ECDSA P-256, ten years); `ferry
//! cluster issue-cert` signs one certificate per component with it. A
//! certificate says who its holder is in its subject:
//!
//! ```text
//! O  = ferry
//! OU = control | agent | storage | admin     (the role, see [`Role`])
//! CN = the component's name (host1, storage1, control)
//! ```
//!
//! and carries the DNS names and IP addresses peers reach it at as subject
//! alternative names, with both TLS server and client usage, so one
//! certificate serves a component's API and authenticates it to its peers.
//!
//! A component's directory ([`Pki::load`]) holds `ca-cert.pem`, `cert.pem`
//! and `key.pem` (mode 0600), and links named as GnuTLS tools expect them
//! (`client-cert.pem`, `client-key.pem`, `server-cert.pem`,
//! `server-key.pem`), so the same directory is QEMU's `tls-creds-x509` dir,
//! libnbd's `tls-certificates` and nbdkit's `--tls-certificates`.
//!
//! ## Who may call whom
//! The control service's API takes users' API tokens (see `tokens`); its
//! TLS asks for no client certificate. Agents and storage nodes require a
//! client certificate signed by the cluster CA and then check its role
//! ([`require_peer`]): agents serve the control service and peer agents,
//! storage nodes the control service and agents. A user's token is never
//! accepted there.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
pub use rustls::{ClientConfig, ServerConfig};

/// File names in a component's certificate directory.
pub const CA_CERT: &str = "ca-cert.pem";
pub const CA_KEY: &str = "ca-key.pem";
pub const CERT: &str = "cert.pem";
pub const KEY: &str = "key.pem";
/// The names GnuTLS-based peers (QEMU, libnbd, nbdkit) look for.
const LINKS: [(&str, &str); 4] = [
    ("client-cert.pem", CERT),
    ("client-key.pem", KEY),
    ("server-cert.pem", CERT),
    ("server-key.pem", KEY),
];

/// How long a TLS handshake may take before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {why}")]
    Pem { path: PathBuf, why: String },
    #[error("certificate: {0}")]
    Generate(String),
    #[error("TLS configuration: {0}")]
    Config(String),
    #[error("{0}")]
    Name(String),
    #[error("invalid {what} '{value}': {why}")]
    Invalid {
        what: &'static str,
        value: String,
        why: &'static str,
    },
}

/// What a certificate's holder is to the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// The control service.
    Control,
    /// A host's agent (and the QEMUs it starts, for NBD).
    Agent,
    /// A storage node.
    Storage,
    /// An administrator's tools (`ferry disk import`, `nbdinfo`, `fio`).
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Control => "control",
            Role::Agent => "agent",
            Role::Storage => "storage",
            Role::Admin => "admin",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = TlsError;
    fn from_str(s: &str) -> Result<Self, TlsError> {
        Ok(match s {
            "control" => Role::Control,
            "agent" => Role::Agent,
            "storage" => Role::Storage,
            "admin" => Role::Admin,
            _ => {
                return Err(TlsError::Invalid {
                    what: "certificate role",
                    value: s.into(),
                    why: "not one of control, agent, storage, admin",
                })
            }
        })
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who a verified peer certificate says its holder is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub role: Role,
    pub name: String,
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.role, self.name)
    }
}

/// When `cert` stops being valid (Unix ms).
pub fn expires_ms(cert: &CertificateDer<'_>) -> Option<u64> {
    let (_, x) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    u64::try_from(x.validity().not_after.timestamp())
        .ok()
        .map(|s| s * 1000)
}

/// The identity in a certificate Ferry issued (its subject's OU and CN);
/// `None` for a certificate without them. Only call on a certificate the
/// TLS handshake verified against the cluster CA.
pub fn identity_of(cert: &CertificateDer<'_>) -> Option<Identity> {
    let (_, x) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let subject = x.subject();
    let ou = subject.iter_organizational_unit().next()?.as_str().ok()?;
    let cn = subject.iter_common_name().next()?.as_str().ok()?;
    let org = subject.iter_organization().next()?.as_str().ok()?;
    if org != "ferry" {
        return None;
    }
    Some(Identity {
        role: ou.parse().ok()?,
        name: cn.to_string(),
    })
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TlsError + '_ {
    move |source| TlsError::Io {
        path: path.into(),
        source,
    }
}

fn write_private(path: &Path, text: &str) -> Result<(), TlsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(io(path))?;
    f.write_all(text.as_bytes()).map_err(io(path))
}

fn write_public(path: &Path, text: &str) -> Result<(), TlsError> {
    std::fs::write(path, text).map_err(io(path))
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let text = std::fs::read(path).map_err(io(path))?;
    let certs: Vec<_> = rustls_pemfile_certs(&text).map_err(|why| TlsError::Pem {
        path: path.into(),
        why,
    })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            path: path.into(),
            why: "no CERTIFICATE in it".into(),
        });
    }
    Ok(certs)
}

/// PEM blocks labelled CERTIFICATE, decoded.
fn rustls_pemfile_certs(text: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    use rustls::pki_types::pem::PemObject;
    CertificateDer::pem_slice_iter(text)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not PEM certificates: {e:?}"))
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    use rustls::pki_types::pem::PemObject;
    let text = std::fs::read(path).map_err(io(path))?;
    PrivateKeyDer::from_pem_slice(&text).map_err(|e| TlsError::Pem {
        path: path.into(),
        why: format!("no private key in it: {e:?}"),
    })
}

/// The cluster CA: makes and signs certificates.
pub struct Authority {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
    pem: String,
}

/// How long a service's certificate lasts by default: a year, so a key
/// that leaked stops working within one (rotate before; see `ferry
/// cluster issue-cert`).
pub const CERT_DAYS: u32 = 365;

/// What a new certificate is for.
#[derive(Debug, Clone)]
pub struct CertRequest {
    pub role: Role,
    pub name: String,
    /// DNS names and IP addresses peers reach the holder at.
    pub san: Vec<String>,
    pub days: u32,
}

fn rc(e: rcgen::Error) -> TlsError {
    TlsError::Generate(e.to_string())
}

impl Authority {
    /// A new CA written to `dir` (`ca-cert.pem`, `ca-key.pem` 0600). Refuses
    /// to overwrite an existing one.
    pub fn create(dir: &Path, cluster: &str) -> Result<Authority, TlsError> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let (cert_path, key_path) = (dir.join(CA_CERT), dir.join(CA_KEY));
        if key_path.exists() {
            return Err(TlsError::Io {
                path: key_path,
                source: std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "a cluster CA is already there (remove it to start a new cluster)",
                ),
            });
        }
        let key = rcgen::KeyPair::generate().map_err(rc)?;
        let mut p = rcgen::CertificateParams::default();
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name
            .push(rcgen::DnType::OrganizationName, "ferry");
        p.distinguished_name.push(
            rcgen::DnType::CommonName,
            format!("ferry cluster CA {cluster}"),
        );
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let now = time::OffsetDateTime::now_utc();
        p.not_before = now - time::Duration::hours(1);
        p.not_after = now + time::Duration::days(3650);
        let cert = p.self_signed(&key).map_err(rc)?;
        let pem = cert.pem();
        write_private(&key_path, &key.serialize_pem())?;
        write_public(&cert_path, &pem)?;
        Ok(Authority { cert, key, pem })
    }

    /// The CA in `dir`.
    pub fn load(dir: &Path) -> Result<Authority, TlsError> {
        let (cert_path, key_path) = (dir.join(CA_CERT), dir.join(CA_KEY));
        let pem = std::fs::read_to_string(&cert_path).map_err(io(&cert_path))?;
        let key_pem = std::fs::read_to_string(&key_path).map_err(io(&key_path))?;
        let key = rcgen::KeyPair::from_pem(&key_pem).map_err(|e| TlsError::Pem {
            path: key_path.clone(),
            why: e.to_string(),
        })?;
        let params =
            rcgen::CertificateParams::from_ca_cert_pem(&pem).map_err(|e| TlsError::Pem {
                path: cert_path.clone(),
                why: e.to_string(),
            })?;
        let cert = params.self_signed(&key).map_err(rc)?;
        Ok(Authority { cert, key, pem })
    }

    /// Signs a certificate for `req` and writes the component's directory
    /// `out` (see the module documentation).
    pub fn issue(&self, req: &CertRequest, out: &Path) -> Result<(), TlsError> {
        // the names hosts and nodes have in the cluster
        ferry_api::validate_name("certificate name", &req.name)
            .map_err(|e| TlsError::Name(e.to_string()))?;
        let mut san = vec![req.name.clone()];
        san.extend(req.san.iter().cloned());
        san.dedup();
        let mut p = rcgen::CertificateParams::new(san).map_err(rc)?;
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name
            .push(rcgen::DnType::OrganizationName, "ferry");
        p.distinguished_name
            .push(rcgen::DnType::OrganizationalUnitName, req.role.as_str());
        p.distinguished_name
            .push(rcgen::DnType::CommonName, req.name.clone());
        p.is_ca = rcgen::IsCa::ExplicitNoCa;
        // QEMU's TLS credentials insist on key encipherment too, whatever the key
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::DigitalSignature,
            rcgen::KeyUsagePurpose::KeyEncipherment,
        ];
        p.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let now = time::OffsetDateTime::now_utc();
        p.not_before = now - time::Duration::hours(1);
        p.not_after = now + time::Duration::days(i64::from(req.days.max(1)));
        let key = rcgen::KeyPair::generate().map_err(rc)?;
        let cert = p.signed_by(&key, &self.cert, &self.key).map_err(rc)?;
        std::fs::create_dir_all(out).map_err(io(out))?;
        write_private(&out.join(KEY), &key.serialize_pem())?;
        write_public(&out.join(CERT), &cert.pem())?;
        write_public(&out.join(CA_CERT), &self.pem)?;
        for (link, target) in LINKS {
            let l = out.join(link);
            let _ = std::fs::remove_file(&l);
            std::os::unix::fs::symlink(target, &l).map_err(io(&l))?;
        }
        Ok(())
    }
}

/// A component's certificate directory, loaded.
#[derive(Clone)]
pub struct Pki {
    pub dir: PathBuf,
    roots: Arc<RootCertStore>,
    pub(crate) chain: Vec<CertificateDer<'static>>,
    pub(crate) key: Arc<PrivateKeyDer<'static>>,
    /// Who this certificate says we are.
    pub identity: Identity,
}

impl Pki {
    /// When this component's own certificate stops being valid (Unix ms).
    pub fn expires_ms(&self) -> Option<u64> {
        expires_ms(self.chain.first()?)
    }
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pki({}, {})", self.dir.display(), self.identity)
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The cluster CA from `ca-cert.pem`, as trust roots.
pub fn load_roots(ca: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in read_certs(ca)? {
        roots.add(c).map_err(|e| TlsError::Pem {
            path: ca.into(),
            why: e.to_string(),
        })?;
    }
    Ok(Arc::new(roots))
}

impl Pki {
    pub fn load(dir: &Path) -> Result<Pki, TlsError> {
        let roots = load_roots(&dir.join(CA_CERT))?;
        let chain = read_certs(&dir.join(CERT))?;
        let key = read_key(&dir.join(KEY))?;
        let identity = identity_of(&chain[0]).ok_or_else(|| TlsError::Pem {
            path: dir.join(CERT),
            why: "not a certificate issued by `ferry cluster issue-cert` (no ferry role in its subject)"
                .into(),
        })?;
        Ok(Pki {
            dir: dir.into(),
            roots,
            chain,
            key: Arc::new(key),
            identity,
        })
    }

    /// TLS for a server; `require_client_cert`: refuse clients without a
    /// certificate of this cluster (agents, storage nodes); otherwise one is
    /// verified when offered (the control service, whose users bring tokens).
    pub fn server_config(&self, require_client_cert: bool) -> Result<Arc<ServerConfig>, TlsError> {
        let b = WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider());
        let verifier = if require_client_cert {
            b.build()
        } else {
            b.allow_unauthenticated().build()
        }
        .map_err(|e| TlsError::Config(e.to_string()))?;
        let mut c = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| TlsError::Config(e.to_string()))?;
        c.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(c))
    }

    /// The cluster CA as trust roots.
    pub fn roots(&self) -> Arc<RootCertStore> {
        self.roots.clone()
    }

    /// TLS for a client that presents this certificate.
    pub fn client_config(&self) -> Result<Arc<ClientConfig>, TlsError> {
        ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_root_certificates(self.roots.clone())
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map(Arc::new)
            .map_err(|e| TlsError::Config(e.to_string()))
    }
}

/// TLS for a client without a certificate of its own (the CLI): trusts the
/// cluster CA in `ca` only.
pub fn anonymous_client_config(ca: &Path) -> Result<Arc<ClientConfig>, TlsError> {
    let roots = load_roots(ca)?;
    let c = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(c))
}
