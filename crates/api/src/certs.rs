//! Renewing certificates and revoking them, cluster-wide.
//!
//! The cluster CA's key stays with an administrator (`ferry cluster
//! rotate-certs --ca DIR`): every component makes its new key itself and
//! sends a signing request; only certificates and revocation lists, both
//! public, travel. The control service relays:
//!
//! ```text
//! admin ──POST /cluster/certificates/requests──▶ control ──POST /pki/request──▶ each agent, storage node (and itself)
//!       ◀── [CertRenewal] (current certificate + signing request) ──
//! admin signs each with the CA (same holder, same names, new key)
//! admin ──POST /cluster/certificates [SignedCert]──▶ control ──PUT /pki/certificate──▶ each
//! ```
//!
//! A component takes a certificate only for the key it is waiting with,
//! for its own identity, signed by the CA and not revoked; the next TLS
//! connection it makes or accepts uses it, connections already open go on.
//! The revocation list (`PUT /cluster/crl`, signed by the CA) is kept by the
//! control service and pushed to every agent and storage node, each of which
//! refuses a revoked certificate at the next handshake.

use serde::{Deserialize, Serialize};

/// A component of the cluster that holds a certificate, as the control
/// service names it: `control`, `host:NAME`, `storage:NAME`.
pub type Component = String;

/// One component's side of a renewal (`POST /pki/request`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CertRenewal {
    /// The certificate in force, PEM: who the new one is for, and the names
    /// it is reached at.
    pub certificate: String,
    /// A PKCS#10 request for the new key, PEM.
    pub request: String,
}

/// A renewal asked of one component: its request, or why there is none.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RenewalItem {
    pub component: Component,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renewal: Option<CertRenewal>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A signed certificate for one component.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignedCert {
    pub component: Component,
    pub certificate: String,
}

/// `PUT /pki/certificate` on an agent or storage node.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CertInstall {
    pub certificate: String,
}

/// `PUT /pki/crl` on an agent or storage node, `PUT /cluster/crl` at the
/// control service: a revocation list signed by the cluster CA, PEM.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CrlInstall {
    pub crl: String,
}

/// A component's certificate as it stands.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PkiStatus {
    /// Role and name (`agent host1`).
    pub identity: String,
    /// The certificate's serial number, hex.
    pub serial: String,
    pub expires_ms: Option<u64>,
    /// The revocation list in force, if any.
    pub crl_number: Option<u64>,
}

/// What one component made of a certificate or revocation list sent to it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InstallResult {
    pub component: Component,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<PkiStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The cluster's revocation list (`GET /cluster/crl`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CrlInfo {
    /// 0 when nothing was ever revoked.
    pub number: u64,
    /// Revoked serial numbers, hex.
    pub serials: Vec<String>,
    /// The list, PEM (empty when nothing was ever revoked).
    #[serde(default)]
    pub crl: String,
}
