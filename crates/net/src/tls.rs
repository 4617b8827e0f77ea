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
//! (`require_peer`): agents serve the control service and peer agents,
//! storage nodes the control service and agents. A user's token is never
//! accepted there.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ferry_api::util::hex;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::pki_types::{CertificateRevocationListDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
pub use rustls::{ClientConfig, ServerConfig};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

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
    /// A certificate or revocation list sent to a component, refused.
    #[error("invalid {what} '{value}': {why}")]
    Refused {
        what: &'static str,
        value: String,
        why: String,
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
    /// One VM's QEMU, for NBD only: a certificate its host's agent signed
    /// with the agent's own key ([`Pki::vm_credentials`]), which no server
    /// but a storage node's NBD takes ([`Pki::nbd_server_config`]).
    Vm,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Control => "control",
            Role::Agent => "agent",
            Role::Storage => "storage",
            Role::Admin => "admin",
            Role::Vm => "vm",
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
            "vm" => Role::Vm,
            _ => {
                return Err(TlsError::Invalid {
                    what: "certificate role",
                    value: s.into(),
                    why: "not one of control, agent, storage, admin, vm",
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
        let p = leaf_params(req.role, &req.name, san, req.days)?;
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

/// The revocation list's file in a component's directory, when the
/// cluster has revoked anything (see [`Pki::install_crl`]).
pub const CRL: &str = "crl.pem";

impl Authority {
    /// Renews a component's certificate: the holder, its role and the names
    /// it is reached at come from `current` (which this CA must have
    /// signed), the key from `csr_pem` (whose signature must verify).
    /// Returns the new certificate, PEM, valid `days`.
    pub fn renew(&self, current: &str, csr_pem: &str, days: u32) -> Result<String, TlsError> {
        let bad = |why: String| TlsError::Generate(why);
        let chain = rustls_pemfile_certs(current.as_bytes()).map_err(bad)?;
        let cert = chain
            .first()
            .ok_or_else(|| bad("no current certificate given".into()))?;
        let (_, x) = x509_parser::parse_x509_certificate(cert.as_ref())
            .map_err(|e| bad(format!("current certificate: {e}")))?;
        let (_, ca) = x509_parser::parse_x509_certificate(self.cert.der().as_ref())
            .map_err(|e| bad(format!("CA certificate: {e}")))?;
        x.verify_signature(Some(ca.public_key()))
            .map_err(|_| bad("the current certificate is not this CA's".into()))?;
        let id = identity_of(cert)
            .ok_or_else(|| bad("the current certificate names no Ferry role".into()))?;
        let mut san = vec![];
        if let Ok(Some(ext)) = x.subject_alternative_name() {
            for n in &ext.value.general_names {
                match n {
                    x509_parser::extensions::GeneralName::DNSName(d) => san.push(d.to_string()),
                    x509_parser::extensions::GeneralName::IPAddress(ip) => {
                        let ip = match ip.len() {
                            4 => {
                                std::net::IpAddr::from(<[u8; 4]>::try_from(*ip).unwrap_or_default())
                            }
                            16 => std::net::IpAddr::from(
                                <[u8; 16]>::try_from(*ip).unwrap_or_default(),
                            ),
                            _ => continue,
                        };
                        san.push(ip.to_string());
                    }
                    _ => {}
                }
            }
        }
        let csr = rcgen::CertificateSigningRequestParams::from_pem(csr_pem)
            .map_err(|e| bad(format!("signing request of {id}: {e}")))?;
        let csr = rcgen::CertificateSigningRequestParams {
            params: leaf_params(id.role, &id.name, san, days)?,
            public_key: csr.public_key,
        };
        Ok(csr.signed_by(&self.cert, &self.key).map_err(rc)?.pem())
    }

    /// A revocation list numbered `number` naming `serials` (big-endian
    /// bytes), PEM.
    pub fn revocation_list(&self, number: u64, serials: &[Vec<u8>]) -> Result<String, TlsError> {
        let now = time::OffsetDateTime::now_utc();
        let p = rcgen::CertificateRevocationListParams {
            this_update: now,
            next_update: now + time::Duration::days(3650),
            crl_number: rcgen::SerialNumber::from(number.to_be_bytes().to_vec()),
            issuing_distribution_point: None,
            revoked_certs: serials
                .iter()
                .map(|s| rcgen::RevokedCertParams {
                    serial_number: rcgen::SerialNumber::from(s.clone()),
                    revocation_time: now,
                    reason_code: None,
                    invalidity_date: None,
                })
                .collect(),
            key_identifier_method: rcgen::KeyIdMethod::Sha256,
        };
        p.signed_by(&self.cert, &self.key)
            .map_err(rc)?
            .pem()
            .map_err(rc)
    }
}

/// What every certificate the CA signs says (see the module documentation).
fn leaf_params(
    role: Role,
    name: &str,
    san: Vec<String>,
    days: u32,
) -> Result<rcgen::CertificateParams, TlsError> {
    let mut p = rcgen::CertificateParams::new(san).map_err(rc)?;
    p.distinguished_name = subject(role, name);
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
    p.not_after = now + time::Duration::days(i64::from(days.max(1)));
    Ok(p)
}

/// What Ferry's HTTPS servers and its components' clients offer: HTTP/2
/// first. A browser's web console then shares one connection between its
/// event streams and requests (over HTTP/1.1 it opens at most six to a
/// server, and each stream holds one); the control service's heartbeats,
/// leases and a move's event stream to an agent, and an agent's questions
/// to its peer, share one per pair, where HTTP/1.1 paid a TLS handshake
/// (~1.3 ms of the server's CPU here) for each request that found the last
/// connection busy.
pub fn component_alpn() -> Vec<Vec<u8>> {
    vec![b"h2".to_vec(), b"http/1.1".to_vec()]
}

/// No TLS session resumption on Ferry's servers: a resumed session skips
/// the client certificate's verification, so a certificate revoked after
/// its first handshake would get in again on every resumption. Every
/// connection is a full handshake against the revocation list in force;
/// components keep theirs open ([`component_alpn`]), so there are few.
fn no_resumption(c: &mut ServerConfig) {
    c.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    c.send_tls13_tickets = 0;
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The cluster CA from `ca-cert.pem`, as trust roots.
pub fn load_roots(ca: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    roots_of(ca, &read_certs(ca)?)
}

/// A TLS client configuration from a credentials directory laid out as
/// QEMU's `tls-creds-x509` reads it, the one [`Pki::vm_credentials`]
/// writes: `ca-cert.pem`, `client-cert.pem` (the chain after the leaf),
/// `client-key.pem`. What a VM presents, for tools and tests that speak
/// as one.
pub fn client_config_from_dir(dir: &Path) -> Result<Arc<ClientConfig>, TlsError> {
    let roots = load_roots(&dir.join("ca-cert.pem"))?;
    let chain = read_certs(&dir.join("client-cert.pem"))?;
    let key = read_key(&dir.join("client-key.pem"))?;
    let c = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(config_err)?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(config_err)?;
    Ok(Arc::new(c))
}

fn roots_of(ca: &Path, certs: &[CertificateDer<'static>]) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in certs {
        roots.add(c.clone()).map_err(|e| TlsError::Pem {
            path: ca.into(),
            why: e.to_string(),
        })?;
    }
    Ok(Arc::new(roots))
}

/// A component's certificate directory, loaded and kept current.
///
/// The TLS configurations a `Pki` makes ([`Pki::server_config`],
/// [`Pki::client_config`]) read its current certificate, trust roots and
/// revocation list at every handshake, so [`Pki::reload`] (files changed on
/// disk), [`Pki::install`] (a renewed certificate) and
/// [`Pki::install_crl`] take effect for the next connection of every
/// server and client made from it; connections already open keep going.
/// Clones share one state.
#[derive(Clone)]
pub struct Pki {
    pub dir: PathBuf,
    /// Who this certificate says we are; a reload never changes it.
    pub identity: Identity,
    live: Arc<Live>,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pki({}, {})", self.dir.display(), self.identity)
    }
}

struct Live {
    current: std::sync::RwLock<Arc<Loaded>>,
    /// The key of a signing request not yet answered ([`Pki::signing_request`]).
    pending: std::sync::Mutex<Option<String>>,
    generation: std::sync::atomic::AtomicU64,
    /// The generation, told to servers ([`Pki::changes`]).
    changed: tokio::sync::watch::Sender<u64>,
}

/// One reading of the directory.
struct Loaded {
    roots: Arc<RootCertStore>,
    /// The CA certificates the roots are made of.
    cas: Vec<CertificateDer<'static>>,
    chain: Vec<CertificateDer<'static>>,
    key: Arc<PrivateKeyDer<'static>>,
    certified: Arc<rustls::sign::CertifiedKey>,
    /// Clients must present a certificate of the cluster, not revoked.
    strict: Arc<dyn ClientCertVerifier>,
    /// Clients may present none; one presented is checked as above.
    lenient: Arc<dyn ClientCertVerifier>,
    server: Arc<dyn ServerCertVerifier>,
    crl_number: Option<u64>,
    /// The certificate's expiry and serial, read once (each heartbeat's
    /// answer reports them).
    expires_ms: Option<u64>,
    serial: Option<String>,
    stamp: Stamp,
}

/// Sizes and modification times of the directory's files: a reload reads
/// them again only when this changed.
type Stamp = Vec<Option<(u64, std::time::SystemTime)>>;

fn stamp(dir: &Path) -> Stamp {
    [CERT, KEY, CA_CERT, CRL]
        .iter()
        .map(|f| {
            std::fs::metadata(dir.join(f))
                .ok()
                .and_then(|m| Some((m.len(), m.modified().ok()?)))
        })
        .collect()
}

fn config_err(e: impl std::fmt::Display) -> TlsError {
    TlsError::Config(e.to_string())
}

fn read_crls(path: &Path) -> Result<Vec<CertificateRevocationListDer<'static>>, TlsError> {
    use rustls::pki_types::pem::PemObject;
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(io(path)(e)),
    };
    CertificateRevocationListDer::pem_slice_iter(&text)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            path: path.into(),
            why: format!("not a PEM revocation list: {e:?}"),
        })
}

impl Loaded {
    fn read(dir: &Path) -> Result<(Loaded, Identity), TlsError> {
        let before = stamp(dir);
        let cas = read_certs(&dir.join(CA_CERT))?;
        let roots = roots_of(&dir.join(CA_CERT), &cas)?;
        let chain = read_certs(&dir.join(CERT))?;
        let key = read_key(&dir.join(KEY))?;
        let crls = read_crls(&dir.join(CRL))?;
        let identity = identity_of(&chain[0]).ok_or_else(|| TlsError::Pem {
            path: dir.join(CERT),
            why: "not a certificate issued by `ferry cluster issue-cert` (no ferry role in its subject)"
                .into(),
        })?;
        let signer =
            rustls::crypto::ring::sign::any_supported_type(&key).map_err(|e| TlsError::Pem {
                path: dir.join(KEY),
                why: e.to_string(),
            })?;
        let certified = rustls::sign::CertifiedKey::new(chain.clone(), signer);
        certified.keys_match().map_err(|e| TlsError::Pem {
            path: dir.join(KEY),
            why: format!("not the key of {}: {e}", dir.join(CERT).display()),
        })?;
        let crl_number = crls
            .first()
            .and_then(|c| crl_facts(c.as_ref()).ok())
            .map(|f| f.0);
        let client = |lenient: bool| {
            let b = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
                .with_crls(crls.iter().cloned())
                .only_check_end_entity_revocation();
            if lenient {
                b.allow_unauthenticated().build()
            } else {
                b.build()
            }
            .map_err(config_err)
        };
        let server =
            rustls::client::WebPkiServerVerifier::builder_with_provider(roots.clone(), provider())
                .with_crls(crls.iter().cloned())
                .only_check_end_entity_revocation()
                .build()
                .map_err(config_err)?;
        let loaded = Loaded {
            expires_ms: expires_ms(&chain[0]),
            serial: serial_of(&chain[0]),
            strict: client(false)?,
            lenient: client(true)?,
            server,
            roots,
            cas,
            chain,
            key: Arc::new(key),
            certified: Arc::new(certified),
            crl_number,
            stamp: before,
        };
        Ok((loaded, identity))
    }
}

/// A revocation list's number and revoked serials (big-endian bytes).
pub fn crl_facts(der: &[u8]) -> Result<(u64, Vec<Vec<u8>>), String> {
    let (_, crl) = x509_parser::parse_x509_crl(der).map_err(|e| e.to_string())?;
    let number = crl
        .crl_number()
        .and_then(|n| u64::try_from(n.clone()).ok())
        .ok_or("a revocation list without a number this side of 2^64")?;
    let serials = crl
        .iter_revoked_certificates()
        .map(|r| r.raw_serial().to_vec())
        .collect();
    Ok((number, serials))
}

/// A revocation list's number and revoked serials (hex), from PEM.
pub fn crl_facts_pem(pem: &str) -> Result<(u64, Vec<String>), String> {
    use rustls::pki_types::pem::PemObject;
    let der = CertificateRevocationListDer::from_pem_slice(pem.as_bytes())
        .map_err(|e| format!("not a PEM revocation list: {e:?}"))?;
    let (n, serials) = crl_facts(der.as_ref())?;
    Ok((n, serials.iter().map(|s| hex(s)).collect()))
}

/// The serial number (hex) of the first certificate in `pem`.
pub fn serial_of_pem(pem: &str) -> Option<String> {
    serial_of(rustls_pemfile_certs(pem.as_bytes()).ok()?.first()?)
}

/// A certificate's serial number, hex.
pub fn serial_of(cert: &CertificateDer<'_>) -> Option<String> {
    let (_, x) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    Some(hex(x.raw_serial()))
}

impl Pki {
    pub fn load(dir: &Path) -> Result<Pki, TlsError> {
        let (loaded, identity) = Loaded::read(dir)?;
        Ok(Pki {
            dir: dir.into(),
            identity,
            live: Arc::new(Live {
                current: std::sync::RwLock::new(Arc::new(loaded)),
                pending: std::sync::Mutex::new(None),
                generation: Default::default(),
                changed: tokio::sync::watch::Sender::new(0),
            }),
        })
    }

    fn now(&self) -> Arc<Loaded> {
        self.live
            .current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Reads the directory again when its files changed since the last
    /// reading; `Ok(true)` when something new took effect. A directory
    /// caught half-written, or holding a certificate of another identity,
    /// is an error and the current state stays.
    pub fn reload(&self) -> Result<bool, TlsError> {
        if stamp(&self.dir) == self.now().stamp {
            return Ok(false);
        }
        let (loaded, identity) = Loaded::read(&self.dir)?;
        if identity != self.identity {
            return Err(TlsError::Name(format!(
                "{} now holds a certificate of {identity}, not of {}: kept the old one",
                self.dir.display(),
                self.identity
            )));
        }
        *self.live.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(loaded);
        let generation = self
            .live
            .generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        self.live.changed.send_replace(generation);
        Ok(true)
    }

    /// Reloads every `every` for as long as the process runs (an admin who
    /// replaces the files by hand needs no restart); logs each change.
    pub fn watch(&self, every: Duration) {
        let pki = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                match pki.reload() {
                    Ok(true) => tracing::info!(
                        event = "certificate_reloaded",
                        serial = %pki.serial().unwrap_or_default(),
                        crl = ?pki.crl_number(),
                        "{}: new certificate files in effect",
                        pki.dir.display()
                    ),
                    Ok(false) => {}
                    Err(e) => tracing::warn!("certificate files not reloaded: {e}"),
                }
            }
        });
    }

    /// Told each reading that took effect (a renewed certificate, a new
    /// revocation list): a server then lets every open connection end, so
    /// each client's next request is a handshake against what is now in
    /// force ([`crate::server::serve_with`]).
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.live.changed.subscribe()
    }

    /// TLS for an HTTPS server ([`Pki::server_config`]) whose connections
    /// end when this certificate or the revocation list in force changes.
    pub fn server_tls(
        &self,
        require_client_cert: bool,
    ) -> Result<crate::server::ServerTls, TlsError> {
        Ok(crate::server::ServerTls {
            config: self.server_config(require_client_cert)?,
            changes: Some(self.changes()),
        })
    }

    /// Counts the readings that took effect: a holder of something derived
    /// from the key (a ticket signer) makes it again when this moved.
    pub fn generation(&self) -> u64 {
        self.live
            .generation
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// When this component's own certificate stops being valid (Unix ms).
    pub fn expires_ms(&self) -> Option<u64> {
        self.now().expires_ms
    }

    /// This component's certificate's serial number, hex.
    pub fn serial(&self) -> Option<String> {
        self.now().serial.clone()
    }

    /// The number of the revocation list in force, if any.
    pub fn crl_number(&self) -> Option<u64> {
        self.now().crl_number
    }

    /// The certificate in force, PEM.
    pub fn certificate_pem(&self) -> String {
        pem::encode(&pem::Pem::new("CERTIFICATE", self.now().chain[0].to_vec()))
    }

    /// The current certificate and key (ticket signing).
    pub(crate) fn current_key(&self) -> (CertificateDer<'static>, Arc<PrivateKeyDer<'static>>) {
        let now = self.now();
        (now.chain[0].clone(), now.key.clone())
    }

    /// Starts a renewal: a new key, kept here until [`Pki::install`], and a
    /// signing request for it (PEM) naming this component.
    pub fn signing_request(&self) -> Result<String, TlsError> {
        let key = rcgen::KeyPair::generate().map_err(rc)?;
        let mut p = rcgen::CertificateParams::new(vec![self.identity.name.clone()]).map_err(rc)?;
        p.distinguished_name = subject(self.identity.role, &self.identity.name);
        let csr = p.serialize_request(&key).map_err(rc)?.pem().map_err(rc)?;
        *self.live.pending.lock().unwrap_or_else(|p| p.into_inner()) = Some(key.serialize_pem());
        Ok(csr)
    }

    /// Ends a renewal: `cert_pem`, signed by the cluster CA for the key of
    /// the last [`Pki::signing_request`] and for this same identity, is
    /// written (key first, each file replaced whole) and takes effect.
    pub fn install(&self, cert_pem: &str) -> Result<(), TlsError> {
        let bad = |why: String| TlsError::Refused {
            what: "certificate",
            value: self.identity.to_string(),
            why,
        };
        let chain = rustls_pemfile_certs(cert_pem.as_bytes()).map_err(bad)?;
        let cert = chain
            .first()
            .ok_or_else(|| bad("no CERTIFICATE in it".into()))?;
        let pending = self
            .live
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| {
                bad("no key is waiting for it: ask for a signing request first".into())
            })?;
        let key = rcgen::KeyPair::from_pem(&pending).map_err(rc)?;
        let (_, x) = x509_parser::parse_x509_certificate(cert.as_ref())
            .map_err(|e| bad(format!("unreadable: {e}")))?;
        if x.public_key().raw != key.public_key_der().as_slice() {
            return Err(bad(
                "it is not for the key this component is waiting with".into()
            ));
        }
        match identity_of(cert) {
            Some(id) if id == self.identity => {}
            other => {
                return Err(bad(format!(
                    "it names {}, not this component",
                    other.map_or("no Ferry identity".into(), |i| i.to_string())
                )))
            }
        }
        self.now()
            .strict
            .verify_client_cert(cert, &chain[1..], UnixTime::now())
            .map_err(|e| bad(format!("not valid in this cluster: {e}")))?;
        replace(&self.dir.join(KEY), &key.serialize_pem(), true)?;
        replace(&self.dir.join(CERT), cert_pem, false)?;
        *self.live.pending.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.reload().map(|_| ())
    }

    /// Puts a revocation list signed by the cluster CA in force (and in
    /// `crl.pem`); refuses one older than the list in force. Returns its number.
    pub fn install_crl(&self, pem: &str) -> Result<u64, TlsError> {
        use rustls::pki_types::pem::PemObject;
        let bad = |why: String| TlsError::Refused {
            what: "revocation list",
            value: String::new(),
            why,
        };
        let der = CertificateRevocationListDer::from_pem_slice(pem.as_bytes())
            .map_err(|e| bad(format!("not PEM: {e:?}")))?;
        let (number, _) = crl_facts(der.as_ref()).map_err(bad)?;
        let now = self.now();
        if let Some(have) = now.crl_number {
            if number < have {
                return Err(bad(format!(
                    "number {number} is older than the list in force ({have})"
                )));
            }
        }
        verify_crl(&now.cas, der.as_ref()).map_err(bad)?;
        replace(&self.dir.join(CRL), pem, false)?;
        self.reload()?;
        Ok(number)
    }

    /// Writes `out` as a VM's NBD client credentials (`client-cert.pem`,
    /// `client-key.pem`, `ca-cert.pem`): a new key, and a certificate for
    /// role `vm` naming `vm`, signed with this (agent's) key and followed by
    /// this certificate, so a storage node can tell which VM on which host
    /// it is ([`vm_identity`]). It ends when this certificate ends. The
    /// VM's QEMU holds no key of its host's.
    pub fn vm_credentials(&self, vm: &str, out: &Path) -> Result<(), TlsError> {
        if self.identity.role != Role::Agent {
            return Err(TlsError::Name(format!(
                "{} signs no VM certificates (an agent's does)",
                self.identity
            )));
        }
        let now = self.now();
        let pem = |label: &str, der: &[u8]| pem::encode(&pem::Pem::new(label, der.to_vec()));
        let own_key = rcgen::KeyPair::try_from(now.key.secret_der()).map_err(rc)?;
        let issuer = rcgen::CertificateParams::from_ca_cert_der(&now.chain[0])
            .map_err(rc)?
            .self_signed(&own_key)
            .map_err(rc)?;
        let mut p = leaf_params(Role::Vm, vm, vec![], CERT_DAYS)?;
        p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        if let Some(end) = expires_ms(&now.chain[0]) {
            let end = time::OffsetDateTime::from_unix_timestamp((end / 1000) as i64)
                .map_err(|e| TlsError::Generate(e.to_string()))?;
            p.not_after = p.not_after.min(end);
        }
        let key = rcgen::KeyPair::generate().map_err(rc)?;
        let cert = p.signed_by(&key, &issuer, &own_key).map_err(rc)?;
        std::fs::create_dir_all(out).map_err(io(out))?;
        write_private(&out.join("client-key.pem"), &key.serialize_pem())?;
        write_private(
            &out.join("client-cert.pem"),
            &(cert.pem() + &pem("CERTIFICATE", &now.chain[0])),
        )?;
        let cas: String = now.cas.iter().map(|c| pem("CERTIFICATE", c)).collect();
        write_private(&out.join(CA_CERT), &cas)
    }

    /// TLS for a storage node's NBD: clients with a certificate of the
    /// cluster, or a VM's certificate signed by an agent whose own
    /// certificate is of the cluster and not revoked ([`Pki::vm_credentials`]).
    pub fn nbd_server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let verifier = Arc::new(self.nbd_clients());
        let mut c = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(config_err)?
            .with_client_cert_verifier(verifier)
            .with_cert_resolver(Arc::new(LiveCert(self.clone())));
        no_resumption(&mut c);
        Ok(Arc::new(c))
    }

    /// Whether an NBD client's certificate chain, as its handshake presented
    /// it at `at` (Unix seconds), still passes [`Pki::nbd_server_config`]'s
    /// check against the CA and revocation list in force now. The dates are
    /// judged as at the handshake: a certificate that expires while its
    /// connection is open keeps it, as in any TLS session, and a VM's QEMU
    /// cannot renew its own. A storage node asks again at each
    /// [`Pki::changes`], so a revoked host (or a VM whose agent's
    /// certificate was revoked) loses the disk connections it holds.
    pub fn nbd_client_passes(&self, chain: &[CertificateDer<'_>], at: u64) -> Result<(), String> {
        let (leaf, intermediates) = chain
            .split_first()
            .ok_or_else(|| "no client certificate".to_string())?;
        self.nbd_clients()
            .verify_client_cert(
                leaf,
                intermediates,
                UnixTime::since_unix_epoch(Duration::from_secs(at)),
            )
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// The check of an NBD client's chain, at its handshake and after.
    fn nbd_clients(&self) -> VmClients {
        VmClients(LiveClients {
            pki: self.clone(),
            lenient: false,
            // no hint: a VM's chain starts below the CA
            hints: vec![],
        })
    }

    /// TLS for an HTTPS server ([`component_alpn`]); `require_client_cert`: refuse clients without a
    /// certificate of this cluster (agents, storage nodes); otherwise one is
    /// verified when offered (the control service, whose users bring tokens).
    /// Revoked certificates are refused either way.
    pub fn server_config(&self, require_client_cert: bool) -> Result<Arc<ServerConfig>, TlsError> {
        let verifier = Arc::new(LiveClients {
            pki: self.clone(),
            lenient: !require_client_cert,
            hints: self.now().roots.subjects(),
        });
        let mut c = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(config_err)?
            .with_client_cert_verifier(verifier)
            .with_cert_resolver(Arc::new(LiveCert(self.clone())));
        c.alpn_protocols = component_alpn();
        no_resumption(&mut c);
        Ok(Arc::new(c))
    }

    /// TLS for a component's HTTP client: this certificate, and HTTP/2
    /// offered first ([`component_alpn`]).
    pub fn http_client_config(&self) -> Result<Arc<ClientConfig>, TlsError> {
        let mut c = (*self.client_config()?).clone();
        c.alpn_protocols = component_alpn();
        Ok(Arc::new(c))
    }

    /// The cluster CA and revocation list in force, as a client-certificate check.
    pub fn client_verifier(&self) -> Arc<dyn ClientCertVerifier> {
        Arc::new(LiveClients {
            pki: self.clone(),
            lenient: false,
            hints: self.now().roots.subjects(),
        })
    }

    /// The cluster CA as trust roots.
    pub fn roots(&self) -> Arc<RootCertStore> {
        self.now().roots.clone()
    }

    /// TLS for a client that presents this certificate.
    pub fn client_config(&self) -> Result<Arc<ClientConfig>, TlsError> {
        Ok(Arc::new(
            ClientConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .map_err(config_err)?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(LiveServers(self.clone())))
                .with_client_cert_resolver(Arc::new(LiveCert(self.clone()))),
        ))
    }
}

fn subject(role: Role, name: &str) -> rcgen::DistinguishedName {
    let mut dn = rcgen::DistinguishedName::new();
    dn.push(rcgen::DnType::OrganizationName, "ferry");
    dn.push(rcgen::DnType::OrganizationalUnitName, role.as_str());
    dn.push(rcgen::DnType::CommonName, name.to_string());
    dn
}

/// Writes `path` whole: a temporary file beside it, then a rename.
fn replace(path: &Path, text: &str, private: bool) -> Result<(), TlsError> {
    let tmp = path.with_extension("pem.new");
    if private {
        write_private(&tmp, text)?;
    } else {
        write_public(&tmp, text)?;
    }
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// Checks that one of the CA certificates `cas` signed the revocation list `der`.
fn verify_crl(cas: &[CertificateDer<'static>], der: &[u8]) -> Result<(), String> {
    let (_, crl) = x509_parser::parse_x509_crl(der).map_err(|e| e.to_string())?;
    for ca in cas {
        let Ok((_, ca)) = x509_parser::parse_x509_certificate(ca.as_ref()) else {
            continue;
        };
        if ca.subject() == crl.issuer() && crl.verify_signature(ca.public_key()).is_ok() {
            return Ok(());
        }
    }
    Err("not signed by this cluster's CA".into())
}

/// The handshake-signature half of a verifier: the same for every one of
/// them (the certificate's own key, the provider's algorithms).
macro_rules! signature_checks {
    () => {
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(message, cert, dss, &algorithms())
        }
        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(message, cert, dss, &algorithms())
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            algorithms().supported_schemes()
        }
    };
}

fn algorithms() -> rustls::crypto::WebPkiSupportedAlgorithms {
    rustls::crypto::ring::default_provider().signature_verification_algorithms
}

/// The certificate in force, for servers and clients alike.
#[derive(Debug)]
struct LiveCert(Pki);

impl rustls::server::ResolvesServerCert for LiveCert {
    fn resolve(
        &self,
        _: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.now().certified.clone())
    }
}

impl rustls::client::ResolvesClientCert for LiveCert {
    fn resolve(
        &self,
        _: &[&[u8]],
        _: &[SignatureScheme],
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.now().certified.clone())
    }
    fn has_certs(&self) -> bool {
        true
    }
}

/// Client certificates checked against the roots and list in force.
#[derive(Debug)]
struct LiveClients {
    pki: Pki,
    lenient: bool,
    /// The CA names sent as a hint, as they were when the server started.
    hints: Vec<DistinguishedName>,
}

impl LiveClients {
    fn inner(&self) -> Arc<dyn ClientCertVerifier> {
        let now = self.pki.now();
        if self.lenient {
            now.lenient.clone()
        } else {
            now.strict.clone()
        }
    }
}

impl ClientCertVerifier for LiveClients {
    fn client_auth_mandatory(&self) -> bool {
        !self.lenient
    }
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &self.hints
    }
    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner()
            .verify_client_cert(end_entity, intermediates, now)
    }
    signature_checks!();
}

/// NBD clients: the cluster's certificates, or a VM's signed by an agent.
#[derive(Debug)]
struct VmClients(LiveClients);

impl ClientCertVerifier for VmClients {
    fn client_auth_mandatory(&self) -> bool {
        true
    }
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &self.0.hints
    }
    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let direct = self.0.verify_client_cert(end_entity, intermediates, now);
        if direct.is_ok() || identity_of(end_entity).map(|i| i.role) != Some(Role::Vm) {
            return direct;
        }
        let bad = |why: &str| {
            rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(
                Arc::new(VmCertError(why.to_string())),
            )))
        };
        let agent = intermediates
            .first()
            .ok_or_else(|| bad("a VM certificate without its agent's"))?;
        // the agent's certificate: the cluster's, in its dates, not revoked
        self.0.verify_client_cert(agent, &[], now)?;
        if identity_of(agent).map(|i| i.role) != Some(Role::Agent) {
            return Err(bad("a VM certificate signed by no agent"));
        }
        let (_, leaf) = x509_parser::parse_x509_certificate(end_entity.as_ref())
            .map_err(|_| bad("unreadable VM certificate"))?;
        let (_, signer) = x509_parser::parse_x509_certificate(agent.as_ref())
            .map_err(|_| bad("unreadable agent certificate"))?;
        if leaf.issuer() != signer.subject() {
            return Err(bad("the VM certificate names another issuer"));
        }
        leaf.verify_signature(Some(signer.public_key()))
            .map_err(|_| bad("the VM certificate's signature is not its agent's"))?;
        let t = now.as_secs() as i64;
        let v = leaf.validity();
        if t < v.not_before.timestamp() || t > v.not_after.timestamp() {
            return Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::Expired,
            ));
        }
        if leaf.is_ca() {
            return Err(bad("a VM certificate may sign nothing"));
        }
        Ok(ClientCertVerified::assertion())
    }
    signature_checks!();
}

#[derive(Debug)]
struct VmCertError(String);

impl std::fmt::Display for VmCertError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for VmCertError {}

/// Who a verified NBD client chain says it is: a VM's certificate is
/// (`vm`, the VM's name, the host whose agent signed it); any other, its
/// identity and no host. Only call on a chain the handshake verified.
pub fn vm_identity(chain: &[CertificateDer<'_>]) -> Option<(Identity, Option<String>)> {
    let id = identity_of(chain.first()?)?;
    if id.role != Role::Vm {
        return Some((id, None));
    }
    let host = identity_of(chain.get(1)?).filter(|a| a.role == Role::Agent)?;
    Some((id, Some(host.name)))
}

/// Server certificates checked against the roots and list in force.
#[derive(Debug)]
struct LiveServers(Pki);

impl ServerCertVerifier for LiveServers {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.0
            .now()
            .server
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
    }
    signature_checks!();
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
