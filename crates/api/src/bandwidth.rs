//! Bandwidth per traffic class: what the user sets, and the pure planner
//! that turns it into per-NIC rates and ceilings.
//!
//! Three classes share every migration NIC: `live-migration`, `storage`
//! and `default` (everything else). Per class:
//!
//! - a **minimum share**, percent of each NIC: guaranteed when the class has
//!   traffic, lent to the others when it has none (work-conserving);
//! - a **hard cap**, percent of each NIC or an absolute rate for the whole
//!   host. An absolute cap is split over the NICs that are up now in
//!   proportion to their rates, so losing a NIC gives the survivors the
//!   whole cap (up to their own rate), instead of leaving the class at a
//!   fraction of it as a fixed per-NIC number would.
//!
//! The planner below is the whole policy; agents enforce its output with
//! Linux traffic control (HTB classes) and re-plan whenever a NIC goes down
//! or up or its rate changes.

use serde::{Deserialize, Serialize};

use crate::ApiError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TrafficClass {
    LiveMigration,
    Storage,
    Default,
}

impl TrafficClass {
    pub const ALL: [TrafficClass; 3] = [
        TrafficClass::LiveMigration,
        TrafficClass::Storage,
        TrafficClass::Default,
    ];

    pub fn name(self) -> &'static str {
        match self {
            TrafficClass::LiveMigration => "live-migration",
            TrafficClass::Storage => "storage",
            TrafficClass::Default => "default",
        }
    }

    pub fn parse(field: &str, s: &str) -> Result<Self, ApiError> {
        Self::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| {
                ApiError::invalid(
                    field,
                    format!("'{s}' is not live-migration, storage or default"),
                )
            })
    }
}

/// A hard cap: percent of each NIC, or bits per second for the whole host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cap {
    Percent(u32),
    BitsPerSec(u64),
}

impl Cap {
    /// `60%`, or a rate such as `600mbit`, `1gbit`, `250kbit`, `1000000` (bit/s).
    pub fn parse(field: &str, s: &str) -> Result<Cap, ApiError> {
        let t = s.trim().to_ascii_lowercase();
        if let Some(p) = t.strip_suffix('%') {
            return match p.trim().parse::<u32>() {
                Ok(v) if (1..=100).contains(&v) => Ok(Cap::Percent(v)),
                _ => Err(ApiError::invalid(
                    field,
                    format!("'{s}' is not a percentage 1%..100%"),
                )),
            };
        }
        parse_rate(&t)
            .filter(|b| *b >= 1_000_000)
            .map(Cap::BitsPerSec)
            .ok_or_else(|| {
                ApiError::invalid(
                    field,
                    format!("'{s}' is not a percentage (60%) or a rate of at least 1mbit (600mbit, 1gbit)"),
                )
            })
    }

    pub fn describe(self) -> String {
        match self {
            Cap::Percent(p) => format!("{p}%"),
            Cap::BitsPerSec(b) => format!("{} Mbit/s", b / 1_000_000),
        }
    }
}

fn parse_rate(t: &str) -> Option<u64> {
    crate::util::parse_rate_bits(t)
}

/// One class's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassLimits {
    pub class: TrafficClass,
    #[serde(default)]
    pub max: Option<Cap>,
    /// Percent of each NIC, 0 for none.
    #[serde(default)]
    pub min_pct: u32,
}

/// The cluster's bandwidth policy (one limit set per class at most).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BandwidthPolicy {
    #[serde(default)]
    pub classes: Vec<ClassLimits>,
}

/// `ferry bandwidth set --class C [--max M] [--min P%] [--clear]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BandwidthSetRequest {
    pub class: TrafficClass,
    /// `None` leaves the cap as it was; see `clear`.
    #[serde(default)]
    pub max: Option<Cap>,
    #[serde(default)]
    pub min_pct: Option<u32>,
    /// Remove the class's limits (then set what is given).
    #[serde(default)]
    pub clear: bool,
}

/// The share left to `default` at least, so it is never starved.
pub const DEFAULT_FLOOR_PCT: u32 = 5;

impl BandwidthPolicy {
    pub fn get(&self, class: TrafficClass) -> Option<&ClassLimits> {
        self.classes.iter().find(|c| c.class == class)
    }

    /// The policy with `req` applied, checked.
    pub fn with(&self, req: &BandwidthSetRequest) -> Result<BandwidthPolicy, ApiError> {
        let mut out = self.clone();
        let old = if req.clear {
            None
        } else {
            out.get(req.class).copied()
        };
        out.classes.retain(|c| c.class != req.class);
        let new = ClassLimits {
            class: req.class,
            max: req.max.or(old.and_then(|o| o.max)),
            min_pct: req.min_pct.or(old.map(|o| o.min_pct)).unwrap_or(0),
        };
        if new.max.is_some() || new.min_pct > 0 {
            out.classes.push(new);
        }
        out.classes.sort_by_key(|c| c.class);
        out.check()?;
        Ok(out)
    }

    /// Minimums must fit in a NIC with room for the others; a cap below its
    /// own minimum is refused.
    pub fn check(&self) -> Result<(), ApiError> {
        let mut seen = std::collections::BTreeSet::new();
        let mut total = 0;
        for c in &self.classes {
            if !seen.insert(c.class) {
                return Err(ApiError::invalid(
                    "classes",
                    format!("{} is given twice", c.class.name()),
                ));
            }
            if c.min_pct > 100 {
                return Err(ApiError::invalid(
                    "min",
                    format!("{}: {}% is over 100%", c.class.name(), c.min_pct),
                ));
            }
            match c.max {
                Some(Cap::Percent(p)) if !(1..=100).contains(&p) => {
                    return Err(ApiError::invalid(
                        "max",
                        format!("{}: {p}% is outside 1%..100%", c.class.name()),
                    ))
                }
                Some(Cap::Percent(p)) if p < c.min_pct => {
                    return Err(ApiError::invalid(
                        "max",
                        format!(
                            "{}: the cap {p}% is below its minimum {}%",
                            c.class.name(),
                            c.min_pct
                        ),
                    ))
                }
                Some(Cap::BitsPerSec(b)) if b < 1_000_000 => {
                    return Err(ApiError::invalid(
                        "max",
                        format!("{}: {b} bit/s is below 1 Mbit/s", c.class.name()),
                    ))
                }
                _ => {}
            }
            if c.class != TrafficClass::Default {
                total += c.min_pct;
            }
        }
        let floor = self
            .get(TrafficClass::Default)
            .map(|d| d.min_pct)
            .unwrap_or(0)
            .max(DEFAULT_FLOOR_PCT);
        if total + floor > 100 {
            return Err(ApiError::invalid(
                "min",
                format!(
                    "minimums add up to {}% with default's {floor}%: at most 100%",
                    total + floor
                ),
            ));
        }
        Ok(())
    }
}

/// Live-migration traffic is recognized by port: target agents listen for
/// carriers and QEMU streams only on ports `MIGRATION_PORT_BASE ..
/// MIGRATION_PORT_BASE + 256` (a block a `u32` filter matches with
/// `MIGRATION_PORT_MASK`), below the kernel's ephemeral range.
pub const MIGRATION_PORT_BASE: u16 = 7424;
pub const MIGRATION_PORT_MASK: u16 = 0xff00;
/// Storage traffic: NBD's registered port.
pub const NBD_PORT: u16 = 10809;

/// The migration ports in an order starting at a random one, so concurrent
/// migrations rarely race for the same port.
pub fn migration_ports(start: u16) -> impl Iterator<Item = u16> {
    let span = !MIGRATION_PORT_MASK + 1;
    (0..span).map(move |i| MIGRATION_PORT_BASE + (start.wrapping_add(i) % span))
}

/// A free migration port on `addr` (probed by binding it; QEMU binds it
/// right after, so a race with another migration is possible but rare and
/// fails that migration cleanly).
pub fn free_migration_port(addr: std::net::IpAddr, start: u16) -> std::io::Result<u16> {
    for p in migration_ports(start) {
        if std::net::TcpListener::bind((addr, p)).is_ok() {
            return Ok(p);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("every migration port {MIGRATION_PORT_BASE}+256 on {addr} is taken"),
    ))
}

/// A NIC as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicLink {
    pub nic: String,
    /// Link rate, bit/s.
    pub rate: u64,
    pub up: bool,
}

/// One class on one NIC: guaranteed `rate`, never more than `ceil` (bit/s).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassRate {
    pub class: TrafficClass,
    pub rate: u64,
    pub ceil: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicPlan {
    pub nic: String,
    pub link_rate: u64,
    pub classes: Vec<ClassRate>,
}

/// The smallest guaranteed rate a class gets (HTB needs one), as a part of
/// the NIC's rate.
const MIN_RATE_PART: u64 = 100;

/// Per-NIC rates and ceilings for every NIC that is up.
///
/// - guarantee: `min_pct` of the NIC (at least 1%); `default` gets what the
///   others do not guarantee, at least its own minimum and 5%;
/// - ceiling: `Percent(p)` → p% of the NIC; `BitsPerSec(b)` → b × NIC rate ÷
///   Σ rates of the NICs up, at most the NIC's rate; none → the NIC's rate;
/// - a guarantee never exceeds its ceiling.
pub fn plan(policy: &BandwidthPolicy, nics: &[NicLink]) -> Vec<NicPlan> {
    let up: Vec<&NicLink> = nics.iter().filter(|n| n.up && n.rate > 0).collect();
    let total: u64 = up.iter().map(|n| n.rate).sum();
    up.iter()
        .map(|n| {
            let r = n.rate;
            let pct = |p: u32| r / 100 * p as u64 + r % 100 * p as u64 / 100;
            let guaranteed = |c: TrafficClass| {
                let m = policy.get(c).map(|l| l.min_pct).unwrap_or(0);
                pct(m).max(r / MIN_RATE_PART)
            };
            let others: u64 = [TrafficClass::LiveMigration, TrafficClass::Storage]
                .into_iter()
                .map(guaranteed)
                .sum();
            let classes = TrafficClass::ALL
                .into_iter()
                .map(|c| {
                    let ceil = match policy.get(c).and_then(|l| l.max) {
                        None => r,
                        Some(Cap::Percent(p)) => pct(p),
                        Some(Cap::BitsPerSec(b)) => {
                            ((b as u128 * r as u128 / total as u128) as u64).min(r)
                        }
                    }
                    .max(1);
                    let rate = match c {
                        TrafficClass::Default => r.saturating_sub(others).max(guaranteed(c)),
                        _ => guaranteed(c),
                    };
                    ClassRate {
                        class: c,
                        rate: rate.min(ceil),
                        ceil,
                    }
                })
                .collect();
            NicPlan {
                nic: n.nic.clone(),
                link_rate: r,
                classes,
            }
        })
        .collect()
}

/// One class on one NIC, as measured by the host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClassStatus {
    pub class: TrafficClass,
    pub rate: u64,
    pub ceil: u64,
    /// Bytes sent in this class since the class was made.
    pub tx_bytes: u64,
    /// Bits per second over the last second.
    pub tx_rate: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NicClasses {
    pub nic: String,
    pub up: bool,
    pub link_rate: u64,
    /// Empty when no policy is set or the NIC is down.
    pub classes: Vec<ClassStatus>,
}

/// What an agent enforces now (`GET /bandwidth` on an agent).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostBandwidth {
    pub host: String,
    pub policy: BandwidthPolicy,
    pub nics: Vec<NicClasses>,
    /// The last error applying the policy, if any.
    #[serde(default)]
    pub error: Option<String>,
    /// Share of the host's CPU time busy since the previous look (0..1):
    /// where a drain is CPU-bound rather than link-bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_busy: Option<f64>,
}

/// `ferry bandwidth list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BandwidthReport {
    pub policy: BandwidthPolicy,
    pub hosts: Vec<HostBandwidth>,
    /// Hosts that did not answer, with the reason.
    #[serde(default)]
    pub unreachable: Vec<(String, String)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: u64 = 1_000_000;

    fn nic(n: &str, rate_mbit: u64, up: bool) -> NicLink {
        NicLink {
            nic: n.into(),
            rate: rate_mbit * M,
            up,
        }
    }

    fn set(
        p: &BandwidthPolicy,
        class: &str,
        max: Option<&str>,
        min: Option<u32>,
    ) -> BandwidthPolicy {
        p.with(&BandwidthSetRequest {
            class: TrafficClass::parse("--class", class).unwrap(),
            max: max.map(|m| Cap::parse("--max", m).unwrap()),
            min_pct: min,
            clear: false,
        })
        .unwrap()
    }

    fn class(p: &NicPlan, c: TrafficClass) -> ClassRate {
        *p.classes.iter().find(|x| x.class == c).unwrap()
    }

    #[test]
    fn migration_ports_stay_in_the_filtered_block() {
        let ports: std::collections::BTreeSet<u16> = migration_ports(200).collect();
        assert_eq!(ports.len(), 256);
        for p in ports {
            assert_eq!(p & MIGRATION_PORT_MASK, MIGRATION_PORT_BASE, "{p}");
        }
        assert!(MIGRATION_PORT_BASE as u32 + 256 < 32768);
    }

    #[test]
    fn percent_shares_hold_on_every_nic_and_default_takes_the_rest() {
        let p = set(
            &BandwidthPolicy::default(),
            "live-migration",
            Some("60%"),
            Some(30),
        );
        let p = set(&p, "storage", None, Some(40));
        let plan = plan(&p, &[nic("nic1", 500, true), nic("nic2", 500, true)]);
        assert_eq!(plan.len(), 2);
        for n in &plan {
            let lm = class(n, TrafficClass::LiveMigration);
            assert_eq!((lm.rate, lm.ceil), (150 * M, 300 * M));
            let st = class(n, TrafficClass::Storage);
            assert_eq!((st.rate, st.ceil), (200 * M, 500 * M));
            let d = class(n, TrafficClass::Default);
            assert_eq!((d.rate, d.ceil), (150 * M, 500 * M));
            // guarantees never oversubscribe the link
            let sum: u64 = n.classes.iter().map(|c| c.rate).sum();
            assert!(sum <= n.link_rate, "{n:?}");
        }
    }

    #[test]
    fn an_absolute_cap_is_split_over_the_nics_up_and_regained_when_one_is_lost() {
        let p = set(
            &BandwidthPolicy::default(),
            "live-migration",
            Some("600mbit"),
            None,
        );
        let two = plan(&p, &[nic("nic1", 500, true), nic("nic2", 500, true)]);
        for n in &two {
            assert_eq!(class(n, TrafficClass::LiveMigration).ceil, 300 * M);
        }
        // nic2 lost: nic1 carries the whole cap, bounded by its own rate
        let one = plan(&p, &[nic("nic1", 500, true), nic("nic2", 500, false)]);
        assert_eq!(one.len(), 1);
        assert_eq!(class(&one[0], TrafficClass::LiveMigration).ceil, 500 * M);
        let p = set(&p, "live-migration", Some("400mbit"), None);
        let one = plan(&p, &[nic("nic1", 500, true), nic("nic2", 500, false)]);
        assert_eq!(class(&one[0], TrafficClass::LiveMigration).ceil, 400 * M);
        // unequal NICs share in proportion to their rates
        let mixed = plan(&p, &[nic("nic1", 300, true), nic("nic2", 100, true)]);
        assert_eq!(class(&mixed[0], TrafficClass::LiveMigration).ceil, 300 * M);
        assert_eq!(class(&mixed[1], TrafficClass::LiveMigration).ceil, 100 * M);
    }

    #[test]
    fn impossible_policies_are_refused_naming_the_flag() {
        let p = set(&BandwidthPolicy::default(), "storage", None, Some(60));
        let e = p
            .with(&BandwidthSetRequest {
                class: TrafficClass::LiveMigration,
                max: None,
                min_pct: Some(40),
                clear: false,
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("min") && e.contains("105%"), "{e}");
        let e = p
            .with(&BandwidthSetRequest {
                class: TrafficClass::Storage,
                max: Some(Cap::Percent(50)),
                min_pct: None,
                clear: false,
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("below its minimum"), "{e}");
        for bad in ["0%", "101%", "fast", "-5mbit", "10kbit", ""] {
            let e = Cap::parse("--max", bad).unwrap_err().to_string();
            assert!(e.contains("--max"), "{bad}: {e}");
        }
        assert_eq!(
            Cap::parse("--max", "1.5gbit").unwrap(),
            Cap::BitsPerSec(1_500_000_000)
        );
        let e = TrafficClass::parse("--class", "video")
            .unwrap_err()
            .to_string();
        assert!(e.contains("video"), "{e}");
    }

    #[test]
    fn setting_one_field_keeps_the_other_and_clear_removes_the_class() {
        let p = set(
            &BandwidthPolicy::default(),
            "live-migration",
            Some("60%"),
            Some(30),
        );
        let p = set(&p, "live-migration", None, Some(20));
        let lm = *p.get(TrafficClass::LiveMigration).unwrap();
        assert_eq!((lm.max, lm.min_pct), (Some(Cap::Percent(60)), 20));
        let p = p
            .with(&BandwidthSetRequest {
                class: TrafficClass::LiveMigration,
                max: None,
                min_pct: None,
                clear: true,
            })
            .unwrap();
        assert!(p.classes.is_empty());
    }

    #[test]
    fn seeded_random_policies_never_oversubscribe_and_respect_caps() {
        let mut s: u64 = 0x5eed;
        let mut next = |n: u64| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s % n
        };
        for _ in 0..2000 {
            let mut p = BandwidthPolicy::default();
            for c in ["live-migration", "storage"] {
                let min = next(50) as u32;
                let max = match next(3) {
                    0 => None,
                    1 => Some(format!("{}%", (min + next(50) as u32).clamp(1, 100))),
                    _ => Some(format!("{}mbit", 1 + next(3000))),
                };
                if let Ok(q) = p.with(&BandwidthSetRequest {
                    class: TrafficClass::parse("c", c).unwrap(),
                    max: max.map(|m| Cap::parse("m", &m).unwrap()),
                    min_pct: Some(min),
                    clear: false,
                }) {
                    p = q;
                }
            }
            let nics: Vec<NicLink> = (0..1 + next(3))
                .map(|i| nic(&format!("nic{i}"), 10 + next(10_000), next(4) != 0))
                .collect();
            for n in plan(&p, &nics) {
                let sum: u64 = n.classes.iter().map(|c| c.rate).sum();
                assert!(sum <= n.link_rate + 2, "{p:?} {n:?}");
                for c in &n.classes {
                    assert!(c.rate <= c.ceil && c.ceil <= n.link_rate, "{p:?} {n:?}");
                    if let Some(l) = p.get(c.class) {
                        // a minimum is guaranteed whenever the cap allows it
                        let want = n.link_rate * l.min_pct as u64 / 100;
                        assert!(c.rate + 1 >= want.min(c.ceil), "{p:?} {n:?}");
                    }
                }
            }
        }
    }
}
