//! Host drain: every VM off a host, as many at once as pays, none lost.

use serde::{Deserialize, Serialize};

use crate::{ApiError, ConvergenceChoice, MigrationOption};

/// `ferry host drain H`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainRequest {
    /// Targets to use; empty for every other host that takes VMs.
    #[serde(default)]
    pub to: Vec<String>,
    /// Simultaneous migrations; `None` uses the host's setting (default auto).
    #[serde(default)]
    pub max_parallel: Option<MigrationLimit>,
    /// `None`: the host's default, else auto.
    #[serde(default)]
    pub option: Option<MigrationOption>,
}

/// How many migrations a host runs at once (incoming plus outgoing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum MigrationLimit {
    /// Start at 4 and follow measured aggregate throughput.
    #[default]
    Auto,
    Fixed(u32),
}

impl MigrationLimit {
    pub const MAX: u32 = 16;

    /// Parses `auto` or a number 1..=16; errors name `field`.
    pub fn parse(field: &str, s: &str) -> Result<Self, ApiError> {
        if s == "auto" {
            return Ok(MigrationLimit::Auto);
        }
        match s.parse::<u32>() {
            Ok(n) if (1..=Self::MAX).contains(&n) => Ok(MigrationLimit::Fixed(n)),
            _ => Err(ApiError::invalid(
                field,
                format!("'{s}' is not auto or a number 1..{}", Self::MAX),
            )),
        }
    }
}

/// `ferry host set H …`: what is `None` is left as it was.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostSettings {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_migrations: Option<MigrationLimit>,
    /// Performance option for migrations from this host that choose none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_option: Option<MigrationOption>,
    /// Convergence defaults for migrations from this host.
    #[serde(default, skip_serializing_if = "ConvergenceChoice::is_empty")]
    pub convergence: ConvergenceChoice,
}

impl HostSettings {
    /// `newer` where it says something, else `self`.
    pub fn updated(&self, newer: &HostSettings) -> HostSettings {
        HostSettings {
            max_migrations: newer.max_migrations.or(self.max_migrations),
            migration_option: newer.migration_option.or(self.migration_option),
            convergence: newer.convergence.or(self.convergence),
        }
    }

    /// Refuses values no migration could follow, naming the field.
    pub fn check(&self) -> Result<(), ApiError> {
        if let Some(MigrationLimit::Fixed(n)) = self.max_migrations {
            if n == 0 || n > MigrationLimit::MAX {
                return Err(ApiError::invalid(
                    "max_migrations",
                    format!("{n} is outside 1..{}", MigrationLimit::MAX),
                ));
            }
        }
        self.convergence.resolve().map(|_| ())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedMove {
    pub vm: String,
    pub memory: u64,
    pub to: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unplaceable {
    pub vm: String,
    pub memory: u64,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrainedVm {
    pub vm: String,
    pub to: String,
    pub attempts: u32,
    pub total_ms: u64,
    pub transfer_ms: u64,
    /// The downtime the guest saw (see `MigrationReport::guest_downtime_ms`).
    pub downtime_ms: u64,
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrainReport {
    pub host: String,
    pub moved: Vec<DrainedVm>,
    pub unplaceable: Vec<Unplaceable>,
    /// VMs whose every attempt failed; each still runs on the drained host.
    pub failed: Vec<Unplaceable>,
    pub total_ms: u64,
    pub bytes: u64,
    /// The simultaneous-migration limits used, in order.
    pub limits: Vec<u32>,
}

/// One line of a drain's NDJSON event stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum DrainEvent {
    /// E.g. a path between the host and a target that validation marked failed.
    Warning {
        message: String,
    },
    Plan {
        moves: Vec<PlannedMove>,
        unplaceable: Vec<Unplaceable>,
        limit: u32,
    },
    Started {
        vm: String,
        to: String,
        attempt: u32,
    },
    Progress {
        vm: String,
        transferred: u64,
        remaining: u64,
        total: u64,
    },
    Moved(DrainedVm),
    Retry {
        vm: String,
        failed_on: String,
        reason: String,
        next: String,
    },
    Failed {
        vm: String,
        reason: String,
    },
    Limit {
        limit: u32,
        reason: String,
    },
    /// Every 2 s while bandwidth classes are set: what each class of the
    /// drained host sends per NIC.
    Classes {
        host: String,
        nics: Vec<crate::bandwidth::NicClasses>,
    },
    Done(DrainReport),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_parse_and_name_the_flag() {
        assert_eq!(
            MigrationLimit::parse("--max-parallel", "auto").unwrap(),
            MigrationLimit::Auto
        );
        assert_eq!(
            MigrationLimit::parse("--max-parallel", "3").unwrap(),
            MigrationLimit::Fixed(3)
        );
        for bad in ["0", "17", "many", "-1"] {
            let e = MigrationLimit::parse("--max-parallel", bad)
                .unwrap_err()
                .to_string();
            assert!(e.contains("--max-parallel"), "{e}");
        }
    }

    #[test]
    fn settings_update_only_what_is_said_and_layer_under_a_move() {
        let old: HostSettings = serde_json::from_str(r#"{"max_migrations":{"fixed":3}}"#).unwrap();
        let newer: HostSettings =
            serde_json::from_str(r#"{"migration_option":"tcp","convergence":{"postcopy":true}}"#)
                .unwrap();
        let s = old.updated(&newer);
        assert_eq!(s.max_migrations, Some(MigrationLimit::Fixed(3)));
        assert_eq!(s.migration_option, Some(MigrationOption::Tcp));
        // a move's own choice wins over the host default, gaps take the host's
        let mv = ConvergenceChoice {
            at_expiry: Some(crate::AtExpiry::Pause),
            postcopy: Some(false),
            ..Default::default()
        };
        let c = mv.or(s.convergence).resolve().unwrap();
        assert!(!c.postcopy && c.throttle);
        assert_eq!(c.expiry(), crate::AtExpiry::Pause);
        // host default alone: post-copy at expiry
        assert_eq!(
            s.convergence.resolve().unwrap().expiry(),
            crate::AtExpiry::Postcopy
        );
    }

    #[test]
    fn impossible_policies_name_the_field() {
        for (json, field) in [
            (r#"{"convergence":{"at_expiry":"postcopy"}}"#, "at_expiry"),
            (
                r#"{"convergence":{"max_downtime_ms":5}}"#,
                "max_downtime_ms",
            ),
            (
                r#"{"convergence":{"timeout_per_gib_s":0}}"#,
                "timeout_per_gib_s",
            ),
            (r#"{"max_migrations":{"fixed":40}}"#, "max_migrations"),
        ] {
            let s: HostSettings = serde_json::from_str(json).unwrap();
            let e = s.check().unwrap_err().to_string();
            assert!(e.contains(field), "{json}: {e}");
        }
        let e = serde_json::from_str::<HostSettings>(r#"{"convergence":{"at_expiry":"later"}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("later"), "{e}");
    }

    #[test]
    fn drain_events_are_tagged() {
        let e = DrainEvent::Limit {
            limit: 4,
            reason: "start".into(),
        };
        let s = serde_json::to_string(&e).unwrap();
        assert!(s.starts_with(r#"{"event":"limit""#), "{s}");
    }
}
