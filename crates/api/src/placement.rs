//! Placement rules, host groups and labels: what the control service's
//! placement engine (`ferry_control::placement`) must honour wherever it puts
//! a VM (a create without `--host`, a drain, a rolling drain, an HA restart,
//! the balancer).
//!
//! A **rule** ties VMs together or apart, or to a group of hosts:
//!
//! | kind | strict (`--strict`, the default) | soft (`--soft`) |
//! |---|---|---|
//! | `affinity` | the VMs run on one host | … when a host can take them all |
//! | `anti-affinity` | no two of the VMs share a host | … while hosts are left |
//! | `host-affinity` | the VMs run only in the group (*must*) | … in the group when it has room (*should*) |
//! | `host-anti-affinity` | the VMs never run in the group (*must not*) | … out of it when they can |
//! | `exclude` | the balancer never moves the VMs (drains still do) | — |
//!
//! A **host group** is a list of hosts, a set of labels (`storage=fast`: every
//! host carrying them all), or both (either makes a member). Labels are set
//! per host (`ferry host label`).
//!
//! A strict rule is never broken by a placement Ferry makes: a move or
//! restart that would break one is refused, naming the rule. A soft rule is
//! broken only when no placement keeps it, and the placement says which and
//! why. A rule that cannot be met on the cluster as it is is refused when made.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::types::validate_name;
use crate::ApiError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RuleKind {
    Affinity,
    AntiAffinity,
    HostAffinity,
    HostAntiAffinity,
    Exclude,
}

impl RuleKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RuleKind::Affinity => "affinity",
            RuleKind::AntiAffinity => "anti-affinity",
            RuleKind::HostAffinity => "host-affinity",
            RuleKind::HostAntiAffinity => "host-anti-affinity",
            RuleKind::Exclude => "exclude",
        }
    }

    /// Whether the rule names a host group.
    pub fn needs_group(self) -> bool {
        matches!(self, RuleKind::HostAffinity | RuleKind::HostAntiAffinity)
    }
}

impl std::fmt::Display for RuleKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

fn strict_default() -> bool {
    true
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rule {
    pub name: String,
    pub kind: RuleKind,
    pub vms: Vec<String>,
    /// The host group of a `host-affinity` or `host-anti-affinity` rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Strict (must) or soft (should).
    #[serde(default = "strict_default")]
    pub strict: bool,
}

impl Rule {
    /// Checks the rule on its own (names, VM counts, its group named when
    /// needed); [`PlacementConfig::check`] checks it against the others.
    pub fn validate(&self) -> Result<(), ApiError> {
        validate_name("rule name", &self.name)?;
        if self.vms.is_empty() {
            return Err(ApiError::invalid(
                "vms",
                format!("rule {} names no VM", self.name),
            ));
        }
        let mut seen = BTreeSet::new();
        for v in &self.vms {
            validate_name("vms", v)?;
            if !seen.insert(v) {
                return Err(ApiError::invalid(
                    "vms",
                    format!("rule {} names VM {v} twice", self.name),
                ));
            }
        }
        if matches!(self.kind, RuleKind::Affinity | RuleKind::AntiAffinity) && self.vms.len() < 2 {
            return Err(ApiError::invalid(
                "vms",
                format!("an {} rule relates at least two VMs", self.kind),
            ));
        }
        match (&self.group, self.kind.needs_group()) {
            (None, true) => Err(ApiError::invalid(
                "group",
                format!("a {} rule names a host group", self.kind),
            )),
            (Some(_), false) => Err(ApiError::invalid(
                "group",
                format!("an {} rule relates VMs, not a host group", self.kind),
            )),
            (Some(g), true) => validate_name("group", g),
            (None, false) => {
                if self.kind == RuleKind::Exclude && !self.strict {
                    return Err(ApiError::invalid(
                        "strict",
                        "an exclude rule has no soft form",
                    ));
                }
                Ok(())
            }
        }
    }

    /// "strict anti-affinity rule db-apart", as refusals name it.
    pub fn describe(&self) -> String {
        let how = if self.kind == RuleKind::Exclude {
            ""
        } else if self.strict {
            "strict "
        } else {
            "soft "
        };
        format!("{how}{} rule {}", self.kind, self.name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostGroup {
    pub name: String,
    /// Members by name.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// Members by label: every host carrying all of these.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

impl HostGroup {
    pub fn validate(&self) -> Result<(), ApiError> {
        validate_name("group name", &self.name)?;
        if self.hosts.is_empty() && self.labels.is_empty() {
            return Err(ApiError::invalid(
                "hosts",
                format!("group {} names no host and no label", self.name),
            ));
        }
        for h in &self.hosts {
            validate_name("hosts", h)?;
        }
        for (k, v) in &self.labels {
            validate_label(k, v)?;
        }
        Ok(())
    }

    pub fn contains(&self, host: &str, labels: Option<&BTreeMap<String, String>>) -> bool {
        self.hosts.iter().any(|h| h == host)
            || (!self.labels.is_empty()
                && labels.is_some_and(|l| self.labels.iter().all(|(k, v)| l.get(k) == Some(v))))
    }
}

/// A label's key and value: `[a-z0-9._-]`, 1–63 characters each, keys
/// starting with a letter.
pub fn validate_label(key: &str, value: &str) -> Result<(), ApiError> {
    let ok = |s: &str| {
        !s.is_empty()
            && s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
    };
    if !ok(key) || !key.as_bytes()[0].is_ascii_lowercase() {
        return Err(ApiError::invalid(
            "label",
            format!("key {key:?}: 1-63 of [a-z0-9._-], starting with a letter"),
        ));
    }
    if !ok(value) {
        return Err(ApiError::invalid(
            "label",
            format!("value {value:?} of {key}: 1-63 of [a-z0-9._-]"),
        ));
    }
    Ok(())
}

/// Parses `key=value`.
pub fn parse_label(s: &str) -> Result<(String, String), ApiError> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| ApiError::invalid("label", format!("{s:?} is not key=value")))?;
    validate_label(k, v)?;
    Ok((k.to_string(), v.to_string()))
}

/// Everything placement honours, kept by the control service (store key
/// `placement`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementConfig {
    #[serde(default)]
    pub rules: Vec<Rule>,
    #[serde(default)]
    pub groups: Vec<HostGroup>,
    /// Host → its labels.
    #[serde(default)]
    pub labels: BTreeMap<String, BTreeMap<String, String>>,
}

impl PlacementConfig {
    pub fn group(&self, name: &str) -> Option<&HostGroup> {
        self.groups.iter().find(|g| g.name == name)
    }

    pub fn in_group(&self, group: &str, host: &str) -> bool {
        self.group(group)
            .is_some_and(|g| g.contains(host, self.labels.get(host)))
    }

    /// The checks that need no cluster state: every rule valid, its group
    /// defined, and no two strict rules contradicting each other (two VMs
    /// kept together by one and apart by another; VMs kept together whose
    /// host rules leave no host of `hosts` to share).
    pub fn check(&self, hosts: &[String]) -> Result<(), ApiError> {
        for g in &self.groups {
            g.validate()?;
        }
        for r in &self.rules {
            r.validate()?;
            if let Some(g) = &r.group {
                if self.group(g).is_none() {
                    return Err(ApiError::not_found("host group", g));
                }
            }
        }
        for a in self
            .rules
            .iter()
            .filter(|r| r.strict && r.kind == RuleKind::Affinity)
        {
            for b in self
                .rules
                .iter()
                .filter(|r| r.strict && r.kind == RuleKind::AntiAffinity)
            {
                let both: Vec<&String> = a.vms.iter().filter(|v| b.vms.contains(v)).collect();
                if both.len() >= 2 {
                    return Err(ApiError::Conflict {
                        reason: format!(
                            "{} keeps {} and {} together, {} keeps them apart",
                            a.describe(),
                            both[0],
                            both[1],
                            b.describe()
                        ),
                    });
                }
            }
        }
        // each VM's hosts by its strict host rules; VMs kept together share them
        for vm in self
            .rules
            .iter()
            .flat_map(|r| r.vms.iter())
            .collect::<BTreeSet<_>>()
        {
            let together: BTreeSet<&String> = self
                .rules
                .iter()
                .filter(|r| r.strict && r.kind == RuleKind::Affinity && r.vms.contains(vm))
                .flat_map(|r| r.vms.iter())
                .chain(std::iter::once(vm))
                .collect();
            let mut why = Vec::new();
            let left: Vec<&String> = hosts
                .iter()
                .filter(|h| {
                    self.rules.iter().all(|r| {
                        let applies = r.strict
                            && r.kind.needs_group()
                            && r.vms.iter().any(|v| together.contains(v));
                        if !applies {
                            return true;
                        }
                        let g = r.group.as_deref().unwrap_or_default();
                        let inside = self.in_group(g, h);
                        let ok = (r.kind == RuleKind::HostAffinity) == inside;
                        if !ok && !why.contains(&r.describe()) {
                            why.push(r.describe());
                        }
                        ok
                    })
                })
                .collect();
            if left.is_empty() && !hosts.is_empty() && !why.is_empty() {
                let mut who: Vec<&&String> = together.iter().collect();
                who.sort();
                return Err(ApiError::Conflict {
                    reason: format!(
                        "no host may run {}: {}",
                        who.iter()
                            .map(|s| s.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                        why.join(", ")
                    ),
                });
            }
        }
        Ok(())
    }
}

/// `GET /placement`: the rules, groups and labels, and the strict rules the
/// cluster breaks as it runs now (a rule made while VMs broke it; the
/// balancer moves them first).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementStatus {
    #[serde(flatten)]
    pub config: PlacementConfig,
    #[serde(default)]
    pub broken: Vec<String>,
}

/// `POST /placement/rules` adds a rule, `POST /placement/groups` a group;
/// `PUT /hosts/NAME/labels` sets and removes a host's labels.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabelUpdate {
    #[serde(default)]
    pub set: BTreeMap<String, String>,
    #[serde(default)]
    pub unset: Vec<String>,
}

/// One VM to move, as a drain or the balancer plans it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannedPlacement {
    pub vm: String,
    pub to: String,
    /// The soft rules this placement breaks, each with why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub breaks: Vec<String>,
}

/// `POST /cluster/balance`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BalanceRequest {
    /// Plan only.
    #[serde(default)]
    pub dry_run: bool,
    /// The spread of host load (standard deviation, 0–1) the balancer
    /// leaves alone; [`DEFAULT_THRESHOLD`] when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold: Option<f64>,
}

/// Host load spreads below this are left alone (the cluster setting
/// `balance_threshold_pct` defaults to the same, 10).
pub const DEFAULT_THRESHOLD: f64 = 0.10;
/// A move is worth making only if it lowers the hosts' squared load
/// deviations, Σ(load − mean)², at least this much (a 1 GiB VM moved
/// between hosts of 64 GiB whose loads differ by 0.05 does).
pub const MIN_IMPROVEMENT: f64 = 0.001;
/// The automatic balancer acts once the spread was over its threshold at
/// this many checks running (a load that merely peaked once is left).
pub const HOLD_ROUNDS: u32 = 3;
/// A VM the automatic balancer moved stays put this long, then twice as
/// long after its next move, up to [`COOLDOWN_MAX_MS`].
pub const COOLDOWN_MS: u64 = 15 * 60_000;
pub const COOLDOWN_MAX_MS: u64 = 6 * 3_600_000;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BalanceMove {
    pub vm: String,
    pub from: String,
    pub to: String,
    /// Predicted bytes on the wire: its memory plus what it dirties while copied.
    pub bytes: u64,
    /// Predicted time, s, at the live-migration class's share of the links.
    pub seconds: f64,
    /// How much the hosts' squared load deviations, Σ(load − mean)², fall.
    pub benefit: f64,
    /// The strict rule the move mends (a VM breaking it where it runs), made
    /// whatever it does to the spread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mends: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostLoad {
    pub host: String,
    pub cpu: f64,
    pub memory: f64,
    /// Its guests' NIC and disk traffic over its NICs' capacity (0 when
    /// the capacity is not known).
    #[serde(default)]
    pub net: f64,
    pub load: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BalancePlan {
    pub moves: Vec<BalanceMove>,
    pub spread_before: f64,
    pub spread_after: f64,
    pub threshold: f64,
    pub before: Vec<HostLoad>,
    pub after: Vec<HostLoad>,
    /// Why it stopped where it did.
    pub why: String,
    /// Whether the moves were started (not a dry run).
    #[serde(default)]
    pub started: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(name: &str, kind: RuleKind, vms: &[&str], group: Option<&str>, strict: bool) -> Rule {
        Rule {
            name: name.into(),
            kind,
            vms: vms.iter().map(|s| s.to_string()).collect(),
            group: group.map(str::to_string),
            strict,
        }
    }

    #[test]
    fn rules_are_checked_alone() {
        let e = rule("a", RuleKind::AntiAffinity, &["db1"], None, true).validate();
        assert!(e.unwrap_err().to_string().contains("at least two VMs"));
        let e = rule("a", RuleKind::HostAffinity, &["db1"], None, true).validate();
        assert!(e.unwrap_err().to_string().contains("names a host group"));
        let e = rule("a", RuleKind::Affinity, &["x", "x"], None, true).validate();
        assert!(e.unwrap_err().to_string().contains("twice"));
        let e = rule("a", RuleKind::Exclude, &["x"], None, false).validate();
        assert!(e.unwrap_err().to_string().contains("no soft form"));
        rule("a", RuleKind::HostAffinity, &["db1"], Some("fast"), false)
            .validate()
            .unwrap();
    }

    #[test]
    fn contradicting_strict_rules_are_refused_naming_both() {
        let mut c = PlacementConfig {
            rules: vec![
                rule("with", RuleKind::Affinity, &["a", "b", "c"], None, true),
                rule("apart", RuleKind::AntiAffinity, &["c", "a"], None, true),
            ],
            ..Default::default()
        };
        let hosts = vec!["h1".to_string(), "h2".to_string()];
        let e = c.check(&hosts).unwrap_err().to_string();
        assert!(e.contains("rule with") && e.contains("rule apart"), "{e}");
        c.rules[1].strict = false;
        c.check(&hosts).unwrap();
    }

    #[test]
    fn vms_kept_together_with_disjoint_host_rules_are_refused() {
        let c = PlacementConfig {
            rules: vec![
                rule("with", RuleKind::Affinity, &["a", "b"], None, true),
                rule("a-fast", RuleKind::HostAffinity, &["a"], Some("fast"), true),
                rule("b-slow", RuleKind::HostAffinity, &["b"], Some("slow"), true),
            ],
            groups: vec![
                HostGroup {
                    name: "fast".into(),
                    hosts: vec![],
                    labels: [("storage".to_string(), "fast".to_string())].into(),
                },
                HostGroup {
                    name: "slow".into(),
                    hosts: vec!["h2".into()],
                    labels: BTreeMap::new(),
                },
            ],
            labels: [(
                "h1".to_string(),
                [("storage".to_string(), "fast".to_string())].into(),
            )]
            .into(),
        };
        let e = c
            .check(&["h1".into(), "h2".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no host may run a, b") && e.contains("a-fast"),
            "{e}"
        );
        assert!(c.in_group("fast", "h1") && !c.in_group("fast", "h2"));
    }

    #[test]
    fn labels_are_checked() {
        assert!(parse_label("storage=fast").is_ok());
        assert!(parse_label("storage")
            .unwrap_err()
            .to_string()
            .contains("key=value"));
        assert!(parse_label("Storage=x").is_err());
        assert!(parse_label("s=").is_err());
    }
}
