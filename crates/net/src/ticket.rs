//! Move tickets: the control service's word that one move may happen.
//!
//! A source agent hands a VM to a target with `POST /incoming`. Over TLS
//! the target takes it only with a ticket that the control service signed
//! for that move. A host holding one agent certificate therefore cannot
//! push VMs onto its peers on its own.
//!
//! ## Wire form
//! A ticket is a JSON object with three strings:
//!
//! ```text
//! claims     JSON text, exactly the bytes signed:
//!            {"v":1,"vm":NAME,"spec":SPEC_DIGEST,"source":HOST,"target":HOST,
//!             "nonce":32 HEX,"issued_ms":T,"expires_ms":T + LIFETIME}
//! signature  hex: ECDSA P-256 SHA-256 over `claims`, ASN.1 DER form
//! issuer     hex: the signer's certificate, DER
//! ```
//!
//! `SPEC_DIGEST` is [`spec_digest`]: SHA-256 of the VM's spec as listings
//! show it (secrets withheld), in hex, so the control service, which never
//! holds secrets, and the target compute the same digest.
//!
//! ## Acceptance
//! [`TicketVerifier::admit`] checks, in this order, and stops at the first
//! failure:
//! 1. each part is within its size bound and is lowercase hex where hex is due;
//! 2. the issuer certificate chains to the cluster CA, is valid now, and its
//!    role is `control`;
//! 3. the signature verifies with the issuer's key;
//! 4. the claims parse (unknown fields refused) and `v` is 1;
//! 5. the ticket was issued no later than [`CLOCK_SKEW`] from now, and has not expired;
//! 6. `source`, `target`, `vm` and `spec` are those of the request;
//! 7. its nonce has not been admitted before (one ticket, one move).
//!
//! The ticket is bound to the caller's certificate by step 6: the target has
//! already required the request's `source` to be the caller's name.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ring::rand::SystemRandom;
use ring::signature::{self, EcdsaKeyPair, KeyPair as _, UnparsedPublicKey};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use serde::{Deserialize, Serialize};
use sha2::Digest as _;

use crate::tls::{identity_of, Pki, Role, TlsError};
use ferry_api::util::hex;
use ferry_api::VmSpec;

/// How long a ticket the control service signs stays good.
pub const LIFETIME: Duration = Duration::from_secs(60);
/// How far ahead of the target's clock a ticket's issue time may be.
pub const CLOCK_SKEW: Duration = Duration::from_secs(30);
/// Size bounds of the parts, in characters.
pub const MAX_CLAIMS: usize = 2048;
pub const MAX_SIGNATURE: usize = 2 * 80;
pub const MAX_ISSUER: usize = 2 * 4096;

/// A signed ticket, as it travels (the type is the API's).
pub use ferry_api::Ticket;

/// What a ticket says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Claims {
    pub v: u32,
    pub vm: String,
    pub spec: String,
    pub source: String,
    pub target: String,
    pub nonce: String,
    pub issued_ms: u64,
    pub expires_ms: u64,
}

/// What the target knows of the move it is asked to take.
#[derive(Debug, Clone, Copy)]
pub struct Expect<'a> {
    pub vm: &'a str,
    pub spec: &'a str,
    pub source: &'a str,
    pub target: &'a str,
}

/// Why a ticket was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TicketError {
    #[error("no ticket: a target takes a VM only with the control service's ticket for the move")]
    Missing,
    #[error("ticket {part} is malformed: {why}")]
    Malformed { part: &'static str, why: String },
    #[error("ticket issuer is not the cluster's control service: {why}")]
    Issuer { why: String },
    #[error("ticket signature does not verify with its issuer's key")]
    Signature,
    #[error("ticket expired {ago_ms} ms ago")]
    Expired { ago_ms: u64 },
    #[error(
        "ticket is issued {ahead_ms} ms in this host's future (more than the allowed clock skew)"
    )]
    Future { ahead_ms: u64 },
    #[error("ticket is for {field} '{ticket}', the request says '{request}'")]
    Mismatch {
        field: &'static str,
        ticket: String,
        request: String,
    },
    #[error("ticket was already used (nonce {nonce})")]
    Replayed { nonce: String },
}

impl From<TicketError> for ferry_api::ApiError {
    fn from(e: TicketError) -> Self {
        ferry_api::ApiError::BadTicket {
            reason: e.to_string(),
        }
    }
}

/// The digest a ticket names a spec by: SHA-256 of the spec with its
/// secrets withheld, as JSON, in hex.
pub fn spec_digest(spec: &VmSpec) -> String {
    let bytes = serde_json::to_vec(&spec.redacted()).unwrap_or_default();
    hex(&sha2::Sha256::digest(&bytes))
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn unhex(part: &'static str, s: &str, max: usize) -> Result<Vec<u8>, TicketError> {
    let bad = |why: String| TicketError::Malformed { part, why };
    if s.len() > max {
        return Err(bad(format!("{} characters, at most {max}", s.len())));
    }
    if s.is_empty() || !s.len().is_multiple_of(2) {
        return Err(bad("not an even, non-empty number of hex digits".into()));
    }
    s.as_bytes()
        .chunks(2)
        .map(|p| {
            let d = |c: u8| match c {
                b'0'..=b'9' => Some(c - b'0'),
                b'a'..=b'f' => Some(c - b'a' + 10),
                _ => None,
            };
            match (d(p[0]), d(p[1])) {
                (Some(h), Some(l)) => Ok(h << 4 | l),
                _ => Err(bad("not lowercase hex".into())),
            }
        })
        .collect()
}

/// A ticket's parts, decoded.
#[derive(Debug)]
pub struct Parts<'a> {
    pub claims: &'a [u8],
    pub signature: Vec<u8>,
    /// The issuer's certificate, DER.
    pub issuer: Vec<u8>,
}

/// Step 1: a ticket's parts decoded, within their bounds.
pub fn parts(t: &Ticket) -> Result<Parts<'_>, TicketError> {
    if t.claims.len() > MAX_CLAIMS {
        return Err(TicketError::Malformed {
            part: "claims",
            why: format!("{} bytes, at most {MAX_CLAIMS}", t.claims.len()),
        });
    }
    let sig = unhex("signature", &t.signature, MAX_SIGNATURE)?;
    let issuer = unhex("issuer", &t.issuer, MAX_ISSUER)?;
    Ok(Parts {
        claims: t.claims.as_bytes(),
        signature: sig,
        issuer,
    })
}

impl Claims {
    /// Step 4: claims text parsed and its version known.
    pub fn parse(text: &[u8]) -> Result<Claims, TicketError> {
        let c: Claims = serde_json::from_slice(text).map_err(|e| TicketError::Malformed {
            part: "claims",
            why: e.to_string(),
        })?;
        if c.v != 1 {
            return Err(TicketError::Malformed {
                part: "claims",
                why: format!("version {}, this host knows 1", c.v),
            });
        }
        Ok(c)
    }

    /// Steps 5 and 6 at time `now` (ms since the epoch).
    pub fn check(&self, want: &Expect<'_>, now: u64) -> Result<(), TicketError> {
        if now > self.expires_ms {
            return Err(TicketError::Expired {
                ago_ms: now - self.expires_ms,
            });
        }
        let skew = CLOCK_SKEW.as_millis() as u64;
        if self.issued_ms > now + skew {
            return Err(TicketError::Future {
                ahead_ms: self.issued_ms - now,
            });
        }
        for (field, ticket, request) in [
            ("source", &self.source, want.source),
            ("target", &self.target, want.target),
            ("vm", &self.vm, want.vm),
            ("spec digest", &self.spec, want.spec),
        ] {
            if ticket != request {
                return Err(TicketError::Mismatch {
                    field,
                    ticket: ticket.chars().take(80).collect(),
                    request: request.into(),
                });
            }
        }
        Ok(())
    }
}

impl Pki {
    /// Signs move tickets with this certificate's key (the control service's).
    pub fn ticket_signer(&self) -> Result<TicketSigner, TlsError> {
        let (cert, key) = self.current_key();
        TicketSigner::new(&cert, &key).map_err(|why| TlsError::Pem {
            path: self.dir.join(crate::tls::KEY),
            why,
        })
    }
}

/// A signer that follows its component's certificate: after a renewal
/// ([`Pki::install`]) tickets are signed with the new key.
pub struct LiveSigner {
    pki: Pki,
    cached: Mutex<(u64, Arc<TicketSigner>)>,
}

impl std::fmt::Debug for LiveSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LiveSigner({:?})", self.pki)
    }
}

impl LiveSigner {
    pub fn new(pki: &Pki) -> Result<LiveSigner, TlsError> {
        Ok(LiveSigner {
            cached: Mutex::new((pki.generation(), Arc::new(pki.ticket_signer()?))),
            pki: pki.clone(),
        })
    }

    /// See [`TicketSigner::sign`]; the key is the certificate's in force.
    pub fn sign(&self, spec: &VmSpec, source: &str, target: &str, now: u64) -> Ticket {
        let signer = {
            let mut c = self.cached.lock().unwrap_or_else(|p| p.into_inner());
            let generation = self.pki.generation();
            if c.0 != generation {
                match self.pki.ticket_signer() {
                    Ok(s) => *c = (generation, Arc::new(s)),
                    Err(e) => tracing::warn!("tickets still signed with the old key: {e}"),
                }
            }
            c.1.clone()
        };
        signer.sign(spec, source, target, now)
    }
}

/// The control service's side: signs tickets with its certificate's key.
pub struct TicketSigner {
    key: EcdsaKeyPair,
    issuer: String,
    rng: SystemRandom,
}

impl std::fmt::Debug for TicketSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TicketSigner({} bytes of issuer)", self.issuer.len() / 2)
    }
}

impl TicketSigner {
    /// From a certificate and its PKCS#8 key (what `ferry cluster
    /// issue-cert` writes: ECDSA P-256).
    pub fn new(cert: &CertificateDer<'_>, key: &PrivateKeyDer<'_>) -> Result<TicketSigner, String> {
        let PrivateKeyDer::Pkcs8(k) = key else {
            return Err("the key is not PKCS#8".into());
        };
        let rng = SystemRandom::new();
        let key = EcdsaKeyPair::from_pkcs8(
            &signature::ECDSA_P256_SHA256_ASN1_SIGNING,
            k.secret_pkcs8_der(),
            &rng,
        )
        .map_err(|e| format!("not an ECDSA P-256 key: {e}"))?;
        let (_, x) = x509_parser::parse_x509_certificate(cert.as_ref())
            .map_err(|e| format!("certificate: {e}"))?;
        if x.public_key().subject_public_key.data.as_ref() != key.public_key().as_ref() {
            return Err("the key is not the certificate's".into());
        }
        Ok(TicketSigner {
            key,
            issuer: hex(cert.as_ref()),
            rng,
        })
    }

    /// A ticket for moving `spec`'s VM from `source` to `target`, good for
    /// [`LIFETIME`] from `now`.
    pub fn sign(&self, spec: &VmSpec, source: &str, target: &str, now: u64) -> Ticket {
        let nonce: [u8; 16] = rand::random();
        let claims = Claims {
            v: 1,
            vm: spec.name.clone(),
            spec: spec_digest(spec),
            source: source.into(),
            target: target.into(),
            nonce: hex(&nonce),
            issued_ms: now,
            expires_ms: now + LIFETIME.as_millis() as u64,
        };
        self.sign_claims(&claims)
    }

    /// The signature over `bytes`, hex; signing fails only when the
    /// system's random source does (then empty, which no target admits).
    fn sign_raw(&self, bytes: &[u8]) -> String {
        self.key
            .sign(&self.rng, bytes)
            .map(|s| hex(s.as_ref()))
            .unwrap_or_default()
    }

    /// Signs claims as given (tests sign bad ones this way).
    pub fn sign_claims(&self, claims: &Claims) -> Ticket {
        let text = serde_json::to_string(claims).unwrap_or_default();
        let sig = self.sign_raw(text.as_bytes());
        Ticket {
            claims: text,
            signature: sig,
            issuer: self.issuer.clone(),
        }
    }
}

/// The target's side: the cluster CA and the nonces already admitted.
pub struct TicketVerifier {
    verifier: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    seen: Mutex<BTreeMap<String, u64>>,
}

impl TicketVerifier {
    /// Issuers checked by `verifier` (a [`Pki::client_verifier`]: the CA
    /// and the revocation list in force).
    pub fn with_verifier(
        verifier: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    ) -> TicketVerifier {
        TicketVerifier {
            verifier,
            seen: Mutex::new(BTreeMap::new()),
        }
    }

    pub fn new(roots: Arc<RootCertStore>) -> Result<TicketVerifier, String> {
        let verifier = WebPkiClientVerifier::builder_with_provider(
            roots,
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .map_err(|e| e.to_string())?;
        Ok(TicketVerifier {
            verifier,
            seen: Mutex::new(BTreeMap::new()),
        })
    }

    /// Steps 1 to 4: a ticket the control service signed, its claims.
    pub fn verify(&self, t: &Ticket, now: u64) -> Result<Claims, TicketError> {
        let Parts {
            claims,
            signature: sig,
            issuer,
        } = parts(t)?;
        let cert = CertificateDer::from(issuer);
        let when = UnixTime::since_unix_epoch(Duration::from_millis(now));
        self.verifier
            .verify_client_cert(&cert, &[], when)
            .map_err(|e| TicketError::Issuer { why: e.to_string() })?;
        let id = identity_of(&cert).ok_or_else(|| TicketError::Issuer {
            why: "its certificate names no Ferry role".into(),
        })?;
        if id.role != Role::Control {
            return Err(TicketError::Issuer {
                why: format!("signed by {id}"),
            });
        }
        let (_, x) = x509_parser::parse_x509_certificate(cert.as_ref())
            .map_err(|e| TicketError::Issuer { why: e.to_string() })?;
        UnparsedPublicKey::new(
            &signature::ECDSA_P256_SHA256_ASN1,
            x.public_key().subject_public_key.data.as_ref(),
        )
        .verify(claims, &sig)
        .map_err(|_| TicketError::Signature)?;
        Claims::parse(claims)
    }

    /// Every step: admits `t` for the move `want` once.
    pub fn admit(
        &self,
        t: Option<&Ticket>,
        want: &Expect<'_>,
        now: u64,
    ) -> Result<Claims, TicketError> {
        let c = self.verify(t.ok_or(TicketError::Missing)?, now)?;
        c.check(want, now)?;
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.retain(|_, expires| *expires >= now);
        if seen.contains_key(&c.nonce) {
            return Err(TicketError::Replayed {
                nonce: c.nonce.clone(),
            });
        }
        seen.insert(c.nonce.clone(), c.expires_ms);
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::{Authority, CertRequest, Pki};

    struct Cluster {
        _dir: tempfile::TempDir,
        control: Pki,
        agent: Pki,
        other_control: Pki,
    }

    fn cluster() -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let ca = Authority::create(&dir.path().join("ca"), "t").unwrap();
        let issue = |role, name: &str, out: &str| {
            let req = CertRequest {
                role,
                name: name.into(),
                san: vec![],
                days: 1,
            };
            ca.issue(&req, &dir.path().join(out)).unwrap();
            Pki::load(&dir.path().join(out)).unwrap()
        };
        let control = issue(Role::Control, "control", "control");
        let agent = issue(Role::Agent, "host2", "agent");
        // a control certificate of another cluster
        let other = Authority::create(&dir.path().join("ca2"), "u").unwrap();
        let req = CertRequest {
            role: Role::Control,
            name: "control".into(),
            san: vec![],
            days: 1,
        };
        other.issue(&req, &dir.path().join("c2")).unwrap();
        let other_control = Pki::load(&dir.path().join("c2")).unwrap();
        Cluster {
            _dir: dir,
            control,
            agent,
            other_control,
        }
    }

    fn spec() -> VmSpec {
        VmSpec::workload("vm1", 256 << 20, 0, 0)
    }

    fn expect(digest: &str) -> Expect<'_> {
        Expect {
            vm: "vm1",
            spec: digest,
            source: "host2",
            target: "host1",
        }
    }

    #[test]
    fn a_control_ticket_is_admitted_once() {
        let c = cluster();
        let v = TicketVerifier::new(c.control.roots()).unwrap();
        let now = now_ms();
        let t = c
            .control
            .ticket_signer()
            .unwrap()
            .sign(&spec(), "host2", "host1", now);
        let d = spec_digest(&spec());
        let claims = v.admit(Some(&t), &expect(&d), now + 1000).unwrap();
        assert_eq!(
            (claims.vm.as_str(), claims.target.as_str()),
            ("vm1", "host1")
        );
        assert!(matches!(
            v.admit(Some(&t), &expect(&d), now + 2000),
            Err(TicketError::Replayed { .. })
        ));
    }

    #[test]
    fn tickets_not_for_this_move_are_refused() {
        let c = cluster();
        let v = TicketVerifier::new(c.control.roots()).unwrap();
        let s = c.control.ticket_signer().unwrap();
        let now = now_ms();
        let d = spec_digest(&spec());
        let t = |src: &str, tgt: &str| s.sign(&spec(), src, tgt, now);
        assert_eq!(v.admit(None, &expect(&d), now), Err(TicketError::Missing));
        // another source, another target, another VM, another spec
        for (ticket, field) in [
            (t("host3", "host1"), "source"),
            (t("host2", "host3"), "target"),
        ] {
            match v.admit(Some(&ticket), &expect(&d), now) {
                Err(TicketError::Mismatch { field: f, .. }) => assert_eq!(f, field),
                r => panic!("{field}: {r:?}"),
            }
        }
        let mut other = spec();
        other.name = "vm2".into();
        let r = v.admit(
            Some(&s.sign(&other, "host2", "host1", now)),
            &expect(&d),
            now,
        );
        assert!(
            matches!(r, Err(TicketError::Mismatch { field: "vm", .. })),
            "{r:?}"
        );
        let mut bigger = spec();
        bigger.memory *= 2;
        let r = v.admit(
            Some(&s.sign(&bigger, "host2", "host1", now)),
            &expect(&d),
            now,
        );
        assert!(
            matches!(
                r,
                Err(TicketError::Mismatch {
                    field: "spec digest",
                    ..
                })
            ),
            "{r:?}"
        );
        // expired, and issued too far ahead
        let old = t("host2", "host1");
        let r = v.admit(
            Some(&old),
            &expect(&d),
            now + LIFETIME.as_millis() as u64 + 1,
        );
        assert!(matches!(r, Err(TicketError::Expired { .. })), "{r:?}");
        let ahead = s.sign(&spec(), "host2", "host1", now + 3_600_000);
        let r = v.admit(Some(&ahead), &expect(&d), now);
        assert!(matches!(r, Err(TicketError::Future { .. })), "{r:?}");
    }

    #[test]
    fn only_the_clusters_control_service_signs_tickets() {
        let c = cluster();
        let v = TicketVerifier::new(c.control.roots()).unwrap();
        let now = now_ms();
        let d = spec_digest(&spec());
        // an agent's own certificate signs a ticket for itself
        let by_agent = c
            .agent
            .ticket_signer()
            .unwrap()
            .sign(&spec(), "host2", "host1", now);
        let r = v.admit(Some(&by_agent), &expect(&d), now);
        assert!(
            matches!(&r, Err(TicketError::Issuer { why }) if why.contains("agent host2")),
            "{r:?}"
        );
        // another cluster's control service
        let foreign = c
            .other_control
            .ticket_signer()
            .unwrap()
            .sign(&spec(), "host2", "host1", now);
        let r = v.admit(Some(&foreign), &expect(&d), now);
        assert!(matches!(r, Err(TicketError::Issuer { .. })), "{r:?}");
        // the control service's certificate, a claim changed after signing
        let mut t = c
            .control
            .ticket_signer()
            .unwrap()
            .sign(&spec(), "host2", "host3", now);
        t.claims = t.claims.replace("host3", "host1");
        assert_eq!(
            v.admit(Some(&t), &expect(&d), now),
            Err(TicketError::Signature)
        );
        // the control service's certificate with an agent's signature
        let mut t = by_agent.clone();
        t.issuer = c.control.ticket_signer().unwrap().issuer.clone();
        assert_eq!(
            v.admit(Some(&t), &expect(&d), now),
            Err(TicketError::Signature)
        );
    }

    #[test]
    fn malformed_parts_are_named() {
        let c = cluster();
        let v = TicketVerifier::new(c.control.roots()).unwrap();
        let good = c
            .control
            .ticket_signer()
            .unwrap()
            .sign(&spec(), "host2", "host1", now_ms());
        let cases = [
            (
                Ticket {
                    signature: "zz".into(),
                    ..good.clone()
                },
                "signature",
            ),
            (
                Ticket {
                    signature: "abc".into(),
                    ..good.clone()
                },
                "signature",
            ),
            (
                Ticket {
                    issuer: "AB".into(),
                    ..good.clone()
                },
                "issuer",
            ),
            (
                Ticket {
                    issuer: "00".repeat(MAX_ISSUER),
                    ..good.clone()
                },
                "issuer",
            ),
            (
                Ticket {
                    claims: " ".repeat(MAX_CLAIMS + 1),
                    ..good.clone()
                },
                "claims",
            ),
        ];
        for (t, part) in cases {
            match v.verify(&t, now_ms()) {
                Err(TicketError::Malformed { part: p, .. }) => assert_eq!(p, part),
                r => panic!("{part}: {r:?}"),
            }
        }
        // signed claims that are not the claims Ferry writes
        let s = c.control.ticket_signer().unwrap();
        let mut t = s.sign_claims(&Claims::parse(good.claims.as_bytes()).unwrap());
        t.claims = t.claims.replace("\"v\":1", "\"v\":2");
        let t = Ticket {
            signature: s.sign_raw(t.claims.as_bytes()),
            ..t
        };
        assert!(matches!(
            v.verify(&t, now_ms()),
            Err(TicketError::Malformed { part: "claims", .. })
        ));
    }
}
