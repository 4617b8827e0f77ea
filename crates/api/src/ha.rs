//! High availability: a VM's desired state and HA policy, the lease each
//! agent holds with the control service, and what the cluster knows of a
//! host that stopped renewing it.
//!
//! The rule is the one moves keep: never two running copies. A host whose
//! lease lapsed is restarted elsewhere only once
//! - its own agent must have stopped its HA guests (the self-fence deadline,
//!   [`SELF_FENCE_MS`], has passed since its last renewal, plus a margin),
//! - a second signal agrees (a peer hears its agent say it fenced itself
//!   over a migration fabric, or nothing answers on any fabric and it holds
//!   no NBD connection), and
//! - the storage nodes have revoked its grants (a write it sends later is
//!   refused, see the export generation in `ferry_api::storage`).

use serde::{Deserialize, Serialize};

use crate::ApiError;

/// The control service renews each agent's lease this often.
pub const LEASE_RENEW_MS: u64 = 1_000;
/// A lease is granted for this long from each renewal.
pub const LEASE_TTL_MS: u64 = 4_000;
/// An agent whose lease was not renewed for this long stops its HA guests
/// itself: by then the cluster may restart them elsewhere.
pub const SELF_FENCE_MS: u64 = LEASE_TTL_MS;
/// A host whose lease was not renewed for this long is suspect.
pub const SUSPECT_MS: u64 = 3_000;
/// The control service restarts a suspect host's VMs no earlier than this
/// after its last renewal: the self-fence deadline (checked every 200 ms)
/// and time for a SIGKILLed QEMU to die.
pub const RESTART_AFTER_MS: u64 = SELF_FENCE_MS + 1_000;

// the order the timings must keep, checked when built
const _: () = {
    assert!(RESTART_AFTER_MS > SELF_FENCE_MS);
    assert!(SUSPECT_MS < SELF_FENCE_MS);
    assert!(LEASE_RENEW_MS * 3 <= SUSPECT_MS);
};

/// What a VM should be doing, as its owner asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Desired {
    #[default]
    Running,
    Stopped,
}

/// A VM's HA policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HaPolicy {
    /// Restarted on another host when its host fails.
    #[serde(default)]
    pub enabled: bool,
    /// Higher restarts first (0..=1000).
    #[serde(default = "default_priority")]
    pub priority: u32,
    /// At most this many HA restarts within `restart_window_s`; past it
    /// the VM is left stopped, with an event.
    #[serde(default = "default_restart_limit")]
    pub restart_limit: u32,
    #[serde(default = "default_restart_window")]
    pub restart_window_s: u64,
}

fn default_priority() -> u32 {
    100
}
fn default_restart_limit() -> u32 {
    3
}
fn default_restart_window() -> u64 {
    3_600
}

impl Default for HaPolicy {
    fn default() -> Self {
        HaPolicy {
            enabled: false,
            priority: default_priority(),
            restart_limit: default_restart_limit(),
            restart_window_s: default_restart_window(),
        }
    }
}

pub const MAX_PRIORITY: u32 = 1_000;

impl HaPolicy {
    pub fn validate(&self) -> Result<(), ApiError> {
        if self.priority > MAX_PRIORITY {
            return Err(ApiError::invalid(
                "ha.priority",
                format!("{} is above {MAX_PRIORITY}", self.priority),
            ));
        }
        if self.restart_limit == 0 || self.restart_limit > 100 {
            return Err(ApiError::invalid(
                "ha.restart_limit",
                format!("{} is outside 1..=100", self.restart_limit),
            ));
        }
        if !(10..=7 * 86_400).contains(&self.restart_window_s) {
            return Err(ApiError::invalid(
                "ha.restart_window_s",
                format!("{} is outside 10..=604800 s", self.restart_window_s),
            ));
        }
        Ok(())
    }

    /// Whether a restart now (`now_ms`) stays within the limit, given the
    /// restarts already made (`past`, Unix ms).
    pub fn may_restart(&self, past: &[u64], now_ms: u64) -> bool {
        let since = now_ms.saturating_sub(self.restart_window_s * 1_000);
        (past.iter().filter(|t| **t >= since).count() as u32) < self.restart_limit
    }
}

/// A change of a VM's HA policy (`PUT /vms/{name}/ha`); fields left out
/// keep their value.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HaUpdate {
    #[serde(default)]
    pub enabled: Option<bool>,
    #[serde(default)]
    pub priority: Option<u32>,
    #[serde(default)]
    pub restart_limit: Option<u32>,
    #[serde(default)]
    pub restart_window_s: Option<u64>,
}

impl HaUpdate {
    pub fn apply(&self, p: &HaPolicy) -> Result<HaPolicy, ApiError> {
        let n = HaPolicy {
            enabled: self.enabled.unwrap_or(p.enabled),
            priority: self.priority.unwrap_or(p.priority),
            restart_limit: self.restart_limit.unwrap_or(p.restart_limit),
            restart_window_s: self.restart_window_s.unwrap_or(p.restart_window_s),
        };
        n.validate()?;
        Ok(n)
    }
}

/// A lifecycle action on a VM (`POST /vms/{name}/{action}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Boots a stopped VM on its host.
    Start,
    /// Stops QEMU at once (a pulled plug); the VM keeps its definition,
    /// disks and placement.
    Stop,
    /// ACPI power-down; stopped when the guest has not turned itself off
    /// within the timeout.
    Shutdown,
    /// A hard reset of the guest (QEMU keeps running).
    Reboot,
    /// Shutdown, then start.
    Restart,
}

impl Action {
    pub fn parse(s: &str) -> Result<Action, ApiError> {
        match s {
            "start" => Ok(Action::Start),
            "stop" => Ok(Action::Stop),
            "shutdown" => Ok(Action::Shutdown),
            "reboot" => Ok(Action::Reboot),
            "restart" => Ok(Action::Restart),
            _ => Err(ApiError::invalid(
                "action",
                format!("'{s}' is none of start, stop, shutdown, reboot, restart"),
            )),
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Action::Start => "start",
            Action::Stop => "stop",
            Action::Shutdown => "shutdown",
            Action::Reboot => "reboot",
            Action::Restart => "restart",
        }
    }
}

/// The body of a lifecycle action.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActionRequest {
    /// Shutdown: seconds the guest has to power itself off (default 60).
    #[serde(default)]
    pub timeout_s: Option<u64>,
    /// Start: boot it on this host instead of its placement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Start elsewhere while its host does not answer: the admin's word
    /// that the host is powered off (or fenced), so no copy of it runs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub confirm_powered_off: bool,
}

pub const DEFAULT_SHUTDOWN_S: u64 = 60;
pub const MAX_SHUTDOWN_S: u64 = 3_600;

/// What an agent answers to a shutdown or stop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stopped {
    pub vm: String,
    pub host: String,
    /// `powered_off` (the guest turned itself off), `stopped` (QEMU was
    /// stopped: asked, or the guest did not power off in time), `reset`.
    pub how: String,
    /// A shutdown: asked through the guest agent (`guest-agent`) or the
    /// ACPI power button (`acpi`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via: Option<String>,
    pub took_ms: u64,
}

/// The lease the control service renews on an agent (`PUT /lease`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRenewal {
    /// How long the lease holds from now.
    pub ttl_ms: u64,
    /// The agent stops its HA guests when no renewal came for this long.
    pub self_fence_ms: u64,
    /// The VMs the cluster would restart elsewhere: those the agent stops
    /// when it fences itself.
    pub ha_vms: Vec<String>,
    /// The other hosts' probe addresses on the migration fabrics: a lapsed
    /// agent asks them whether the cluster renews *their* leases before it
    /// fences itself (a control service down for every host restarts
    /// nothing, so nobody fences).
    #[serde(default)]
    pub peers: Vec<PeerAddresses>,
}

/// A host's probe addresses (`IP:PORT`) on its migration fabrics.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerAddresses {
    pub host: String,
    pub addresses: Vec<String>,
}

/// A peer renewed this recently proves the cluster renews leases without us.
pub const PEER_FRESH_MS: u64 = 2_500;

/// An agent's side of its lease (`GET /lease`, and in `HostInfo`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseState {
    /// `leased`, `unleased` (never given one since it started, or the
    /// control service stopped renewing before its deadline), `fenced` (its
    /// HA guests were stopped for a lapsed lease).
    pub state: String,
    /// Milliseconds since the last renewal (absent: none yet).
    #[serde(default)]
    pub since_renewal_ms: Option<u64>,
    /// VMs stopped by the last self-fence.
    #[serde(default)]
    pub fenced_vms: Vec<String>,
}

/// What a peer agent learned probing a host's migration fabrics
/// (`POST /peers/alive`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum Liveness {
    /// Its agent answered, proving the cluster credential, in this lease state.
    Answered { state: String, address: String },
    /// Its kernel answered (port unreachable): the host is up, its agent is not.
    AgentDown { address: String },
    /// Nothing answered on any address.
    Silent,
}

/// Asks a peer to probe `host` at these addresses (`IP:PORT`).
pub type AliveRequest = PeerAddresses;

/// A host as the HA manager sees it (`ferry host list`'s `health`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    /// Its lease is renewed.
    #[default]
    Ok,
    /// Its lease lapsed; the second signal is being asked.
    Suspect,
    /// Up, but the cluster cannot manage it (its agent is down, or only its
    /// storage answers): its VMs are left where they are.
    Unmanaged,
    /// Confirmed failed and fenced: its HA VMs run elsewhere.
    Failed,
}

/// One VM as the control service keeps it: its definition and what its
/// owner wants of it, whether or not a host runs it now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmRecord {
    pub spec: crate::VmSpec,
    /// Where it runs, or ran last (its placement).
    pub host: String,
    #[serde(default)]
    pub desired: Desired,
    #[serde(default)]
    pub ha: HaPolicy,
    /// HA restarts made (Unix ms), for the restart limit.
    #[serde(default)]
    pub restarts: Vec<u64>,
    /// Why it is stopped when its owner did not ask (`host host2 failed`,
    /// `restart limit reached`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_because: Option<String>,
    /// An HA restart under way, written before the boot: a leader that
    /// dies after booting the VM leaves this for the next one, which
    /// completes the restart (its count and its event) when it finds the
    /// VM running on `to`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restarting: Option<Restarting>,
}

/// An HA restart of a VM from a failed host, begun and not yet recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Restarting {
    pub from: String,
    pub to: String,
}

/// A leader of the control instances (etcd) that dies is replaced within
/// this; every instance renews the agents' leases meanwhile, so no lease
/// lapses for it.
pub const LEADER_TTL_S: u64 = 3;

/// `GET /cluster/control`: the instance that answers, and who leads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlStatus {
    /// This instance (`HOSTNAME:PORT`, or its configured `instance`).
    pub instance: String,
    /// Whether this instance leads: it runs failovers, the storage access
    /// sync, the policy manager and rolling drains.
    pub leading: bool,
    /// The leader (itself with one instance on SQLite); `None` while the
    /// instances elect one.
    pub leader: Option<String>,
    /// `sqlite` (one instance) or `etcd` (shared by several).
    pub store: String,
    /// Since when this instance leads (Unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leading_since_ms: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_restart_limit_counts_only_restarts_within_the_window() {
        let p = HaPolicy {
            enabled: true,
            restart_limit: 2,
            restart_window_s: 60,
            ..Default::default()
        };
        let now = 1_000_000;
        assert!(p.may_restart(&[], now));
        assert!(p.may_restart(&[now - 10_000], now));
        assert!(!p.may_restart(&[now - 10_000, now - 20_000], now));
        // one of them is older than the window
        assert!(p.may_restart(&[now - 10_000, now - 61_000], now));
    }

    #[test]
    fn a_bad_policy_names_its_field() {
        let e = HaUpdate {
            priority: Some(5_000),
            ..Default::default()
        }
        .apply(&HaPolicy::default())
        .unwrap_err();
        assert!(e.to_string().contains("ha.priority"), "{e}");
        let e = HaUpdate {
            restart_limit: Some(0),
            ..Default::default()
        }
        .apply(&HaPolicy::default())
        .unwrap_err();
        assert!(e.to_string().contains("ha.restart_limit"), "{e}");
        assert!(Action::parse("explode").is_err());
        assert_eq!(Action::parse("shutdown").unwrap(), Action::Shutdown);
    }
}
