//! Rolling drain of a cluster: every host in turn drained, kept in
//! maintenance until it is resumed, then the next — for patching or
//! rebooting each host while no VM stops (Hyper-V's Cluster-Aware Updating,
//! Proxmox's maintenance mode).
//!
//! The control service keeps one [`RollingStatus`] in its durable state and
//! carries it out in the background: a client that goes away, or a control
//! service restarted mid-way, loses nothing; the run goes on from the phase
//! each host was in.

use serde::{Deserialize, Serialize};

use crate::drain::{DrainedVm, MigrationLimit, Unplaceable};
use crate::{ApiError, MigrationOption};

/// `ferry cluster drain-rolling`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RollingRequest {
    /// Hosts in the order to drain them; empty for every host, by name.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// Hosts draining or in maintenance at once (hosts down or drained by
    /// hand count too).
    #[serde(default = "one")]
    pub max_hosts_down: u32,
    /// Simultaneous migrations of each host's drain (`None`: its setting).
    #[serde(default)]
    pub max_parallel: Option<MigrationLimit>,
    #[serde(default)]
    pub option: Option<MigrationOption>,
    /// The name of a program in the control service's hooks directory
    /// (`hooks_dir`, which only its administrator fills), run every few
    /// seconds while a host is in maintenance — no shell, no arguments,
    /// `FERRY_HOST` set; exit status 0 says the host is healthy again and
    /// resumes it. Without one, `ferry host resume HOST` does. Naming a
    /// hook takes the admin role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hook: Option<String>,
}

/// A hook's name: 1-64 of `[A-Za-z0-9._-]`, not starting with a dot or a
/// dash — a file name in the hooks directory, never a path or a command.
pub fn validate_hook_name(h: &str) -> Result<(), ApiError> {
    let ok = !h.is_empty()
        && h.len() <= 64
        && !h.starts_with(['.', '-'])
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            "hook",
            format!(
                "'{}' is not a hook's name: give the name of a program in the control service's hooks_dir (1-64 of A-Z, a-z, 0-9, '.', '_', '-')",
                h.escape_debug()
            ),
        ))
    }
}

fn one() -> u32 {
    1
}

impl Default for RollingRequest {
    fn default() -> Self {
        RollingRequest {
            hosts: Vec::new(),
            max_hosts_down: 1,
            max_parallel: None,
            option: None,
            hook: None,
        }
    }
}

impl RollingRequest {
    /// Refuses what no rolling drain could follow, naming the field.
    /// `known`: the cluster's hosts.
    pub fn check(&self, known: &[String]) -> Result<(), ApiError> {
        for (i, h) in self.hosts.iter().enumerate() {
            if !known.contains(h) {
                return Err(ApiError::invalid(
                    "hosts",
                    format!("'{h}' is not a host of this cluster ({})", known.join(", ")),
                ));
            }
            if self.hosts[..i].contains(h) {
                return Err(ApiError::invalid("hosts", format!("'{h}' is named twice")));
            }
        }
        let n = if self.hosts.is_empty() {
            known.len()
        } else {
            self.hosts.len()
        };
        if self.max_hosts_down == 0 || self.max_hosts_down as usize >= known.len().max(1) {
            return Err(ApiError::invalid(
                "max_hosts_down",
                format!(
                    "{} leaves no host to take the VMs: give 1..{}",
                    self.max_hosts_down,
                    known.len().saturating_sub(1).max(1)
                ),
            ));
        }
        if n == 0 {
            return Err(ApiError::invalid("hosts", "no host to drain"));
        }
        if let Some(MigrationLimit::Fixed(p)) = self.max_parallel {
            if p == 0 || p > MigrationLimit::MAX {
                return Err(ApiError::invalid(
                    "max_parallel",
                    format!("{p} is outside 1..{}", MigrationLimit::MAX),
                ));
            }
        }
        if let Some(h) = &self.hook {
            validate_hook_name(h)?;
        }
        Ok(())
    }
}

/// Where one host of a rolling drain is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Not drained yet; takes VMs.
    Pending,
    /// Its VMs are moving off.
    Draining,
    /// Empty, takes no VMs, waiting to be resumed.
    Maintenance,
    /// Resumed: takes VMs again.
    Done,
    /// Its drain left VMs on it (they still run there); the run stops.
    Failed,
}

impl Phase {
    /// Draining or in maintenance: not a place for VMs.
    pub fn down(self) -> bool {
        matches!(self, Phase::Draining | Phase::Maintenance)
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Pending => "pending",
            Phase::Draining => "draining",
            Phase::Maintenance => "maintenance",
            Phase::Done => "done",
            Phase::Failed => "failed",
        })
    }
}

/// A running drain of one host, as its events say.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainProgress {
    pub planned: u32,
    pub moved: u32,
    /// VMs moving now.
    pub running: Vec<String>,
    /// The simultaneous-migration limit the drain's scheduler chose last.
    pub limit: u32,
}

/// One host of a rolling drain: its phase, when it entered each, and its
/// drain's report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RollingHost {
    pub host: String,
    pub phase: Phase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draining_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maintenance_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub done_ms: Option<u64>,
    /// How many times its drain was started (more than once after a control
    /// service restart).
    #[serde(default)]
    pub drains: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<DrainProgress>,
    #[serde(default)]
    pub moved: Vec<DrainedVm>,
    /// VMs its drain could not move (they run on it still).
    #[serde(default)]
    pub left: Vec<Unplaceable>,
    /// How it was resumed, or why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl RollingHost {
    pub fn pending(host: &str) -> RollingHost {
        RollingHost {
            host: host.into(),
            phase: Phase::Pending,
            draining_ms: None,
            maintenance_ms: None,
            done_ms: None,
            drains: 0,
            progress: None,
            moved: Vec::new(),
            left: Vec::new(),
            reason: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RollingState {
    Running,
    /// Every host drained and resumed.
    Done,
    /// Stopped by `ferry cluster drain-rolling --stop`: hosts stay as they are.
    Stopped,
    /// A host could not be drained (see its `reason` and `message`).
    Failed,
}

/// The cluster's rolling drain (`GET /cluster/rolling`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RollingStatus {
    pub request: RollingRequest,
    pub state: RollingState,
    pub hosts: Vec<RollingHost>,
    pub started_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_ms: Option<u64>,
    /// What the run waits for now, or why it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The most hosts down (draining, in maintenance, or down by
    /// themselves) seen at once while it ran.
    #[serde(default)]
    pub most_down: u32,
    /// The control instance carrying the run out, and when it last wrote
    /// (Unix ms): with several instances on one state, another takes the
    /// run over once its owner has been silent for a while.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(default)]
    pub owner_ms: u64,
}

impl RollingStatus {
    pub fn host_mut(&mut self, host: &str) -> Option<&mut RollingHost> {
        self.hosts.iter_mut().find(|h| h.host == host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known() -> Vec<String> {
        ["h1", "h2", "h3"].iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_bad_request_names_its_field() {
        let ok = RollingRequest::default();
        ok.check(&known()).unwrap();
        let cases = [
            (r#"{"hosts":["h1","h9"]}"#, "hosts"),
            (r#"{"hosts":["h1","h1"]}"#, "hosts"),
            (r#"{"max_hosts_down":0}"#, "max_hosts_down"),
            (r#"{"max_hosts_down":3}"#, "max_hosts_down"),
            (r#"{"max_parallel":{"fixed":40}}"#, "max_parallel"),
            (r#"{"hook":"  "}"#, "hook"),
            (r#"{"hook":"touch /tmp/x"}"#, "hook"),
            (r#"{"hook":"../../bin/sh"}"#, "hook"),
        ];
        for (json, field) in cases {
            let r: RollingRequest = serde_json::from_str(json).unwrap();
            let e = r.check(&known()).unwrap_err().to_string();
            assert!(e.contains(field), "{json}: {e}");
        }
        // an unknown field is refused when read
        assert!(serde_json::from_str::<RollingRequest>(r#"{"max_down":1}"#).is_err());
    }
}
