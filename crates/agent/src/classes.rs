//! Bandwidth classes enforced with Linux traffic control.
//!
//! The planner ([`ferry_api::bandwidth::plan`]) decides rates; this module
//! makes each migration NIC's egress follow them and reports what each class
//! sends. Per NIC that is up:
//!
//! ```text
//! <root: the link's own qdisc, e.g. the lab's tbf, or none>
//!   └─ htb 10:  (default → 10:30)
//!        └─ 10:1  rate = ceil = link rate
//!             ├─ 10:10 live-migration  rate = guarantee, ceil = cap
//!             ├─ 10:20 storage
//!             └─ 10:30 default
//! u32 filters: TCP to/from the migration ports (7424+256) → 10:10,
//!              TCP to/from port 10809 (NBD) → 10:20
//! ```
//!
//! HTB lends what a class does not use to the others up to their ceilings,
//! which is the work-conserving minimum share. Where the NIC already has a
//! rate-limiting root qdisc (the lab's tbf shaping a veth to a link rate),
//! HTB goes under it as its child and takes the link rate from it; else HTB
//! is the root and the rate comes from sysfs or `--nic-rate`.
//!
//! [`Classes::reconcile`] runs every second: it re-plans from the NICs up
//! now (an absolute cap moves to the survivors when a NIC is lost), and
//! re-applies where the kernel's state differs from the plan (a NIC back, a
//! link rate changed, the qdisc replaced by someone else).

use std::collections::BTreeMap;
use std::time::Instant;

use ferry_api::bandwidth::{
    plan, BandwidthPolicy, ClassStatus, HostBandwidth, NicClasses, NicLink, NicPlan, TrafficClass,
    MIGRATION_PORT_BASE, MIGRATION_PORT_MASK, NBD_PORT,
};
use serde_json::Value;

use crate::facts::nics;

const HANDLE: &str = "10:";

fn classid(c: TrafficClass) -> &'static str {
    match c {
        TrafficClass::LiveMigration => "10:10",
        TrafficClass::Storage => "10:20",
        TrafficClass::Default => "10:30",
    }
}

fn tc(args: &[&str]) -> Result<String, String> {
    ferry_api::util::run_command("tc", args)
}

fn tc_json(args: &[&str]) -> Vec<Value> {
    tc(args)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or_default()
}

/// What the kernel has on one NIC: the root qdisc's handle and rate if it
/// is a rate limiter, and whether Ferry's HTB is there.
#[derive(Debug, Default)]
struct Kernel {
    /// `(handle, rate bit/s)` of a tbf root.
    tbf: Option<(String, u64)>,
    htb: bool,
}

fn kernel(nic: &str) -> Kernel {
    let mut k = Kernel::default();
    for q in tc_json(&["-j", "qdisc", "show", "dev", nic]) {
        let kind = q["kind"].as_str().unwrap_or_default();
        let handle = q["handle"].as_str().unwrap_or_default();
        if kind == "tbf" && q["root"].as_bool() == Some(true) {
            // tc -j reports tbf's rate in bytes per second
            let rate = q["options"]["rate"].as_u64().unwrap_or(0) * 8;
            k.tbf = Some((handle.to_string(), rate));
        }
        if kind == "htb" && handle == HANDLE {
            k.htb = true;
        }
    }
    k
}

/// Bytes sent per class on a NIC, from HTB's counters.
fn class_bytes(nic: &str) -> BTreeMap<TrafficClass, u64> {
    // `tc -j` prints no JSON for classes here: read the text form
    parse_class_bytes(&tc(&["-s", "class", "show", "dev", nic]).unwrap_or_default())
}

/// `class htb 10:10 parent … \n Sent 1234 bytes 5 pkt …` → bytes per class.
fn parse_class_bytes(text: &str) -> BTreeMap<TrafficClass, u64> {
    let mut out = BTreeMap::new();
    let mut current = None;
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["class", "htb", handle, ..] => {
                current = TrafficClass::ALL
                    .into_iter()
                    .find(|k| classid(*k) == *handle);
            }
            ["Sent", bytes, "bytes", ..] => {
                if let (Some(c), Ok(b)) = (current.take(), bytes.parse::<u64>()) {
                    out.insert(c, b);
                }
            }
            _ => {}
        }
    }
    out
}

#[derive(Default)]
pub struct Classes {
    policy: BandwidthPolicy,
    /// What was applied per NIC, and under which parent.
    applied: BTreeMap<String, NicPlan>,
    /// Last byte counters per NIC and class, with when they were read.
    last: BTreeMap<String, (Instant, BTreeMap<TrafficClass, u64>)>,
    rates: BTreeMap<String, BTreeMap<TrafficClass, f64>>,
    error: Option<String>,
    /// The migration NICs, and the storage NIC if separate.
    nics: crate::NicSelection,
    storage_nic: Option<String>,
    /// Rate for NICs without a rate-limiting root or a sysfs speed, bit/s.
    fallback_rate: Option<u64>,
    /// No policy, and the last pass found no classes to remove: nothing to
    /// do until the policy changes.
    idle: bool,
}

impl Classes {
    pub fn new(
        fallback_rate: Option<u64>,
        nics: crate::NicSelection,
        storage_nic: Option<String>,
    ) -> Classes {
        Classes {
            fallback_rate,
            nics,
            storage_nic,
            ..Default::default()
        }
    }

    /// The NICs whose classes this manages: the migration NICs and the
    /// storage NIC.
    fn managed(&self) -> Vec<ferry_api::NicInfo> {
        let mut v = nics(&self.nics);
        if let Some(name) = &self.storage_nic {
            let only = crate::NicSelection {
                names: vec![name.clone()],
                networks: vec![],
            };
            for n in nics(&only) {
                if !v.iter().any(|m| m.name == n.name) {
                    v.push(n);
                }
            }
        }
        v
    }

    pub fn policy(&self) -> &BandwidthPolicy {
        &self.policy
    }

    /// Nothing for [`Classes::reconcile`] to do until the policy changes.
    pub fn is_idle(&self) -> bool {
        self.idle
    }

    pub fn set_policy(&mut self, p: BandwidthPolicy) {
        if p != self.policy {
            self.policy = p;
            self.applied.clear();
            self.idle = false;
        }
    }

    fn link_rate(&self, nic: &str, k: &Kernel) -> u64 {
        if let Some((_, r)) = &k.tbf {
            return *r;
        }
        let speed = std::fs::read_to_string(format!("/sys/class/net/{nic}/speed"))
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .filter(|s| *s > 0)
            .map(|mbit| mbit as u64 * 1_000_000);
        speed.or(self.fallback_rate).unwrap_or(0)
    }

    /// Brings every NIC's classes in line with the policy; measures rates.
    pub fn reconcile(&mut self) {
        if self.idle {
            return;
        }
        let mut links = Vec::new();
        let mut kernels = BTreeMap::new();
        for n in self.managed() {
            let k = kernel(&n.name);
            links.push(NicLink {
                nic: n.name.clone(),
                rate: self.link_rate(&n.name, &k),
                up: n.up,
            });
            kernels.insert(n.name, k);
        }
        let plans = plan(&self.policy, &links);
        let mut errors = Vec::new();
        for l in &links {
            let k = &kernels[&l.nic];
            let want = plans.iter().find(|p| p.nic == l.nic);
            match want {
                _ if self.policy.classes.is_empty() => {
                    if k.htb {
                        if let Err(e) = remove(&l.nic, k) {
                            errors.push(e);
                        }
                    }
                    self.applied.remove(&l.nic);
                }
                None => {
                    // down: re-applied when it comes back
                    self.applied.remove(&l.nic);
                }
                Some(p) => {
                    let same = self.applied.get(&l.nic) == Some(p);
                    if !k.htb || !same {
                        match apply(p, k) {
                            Ok(()) => {
                                self.applied.insert(l.nic.clone(), p.clone());
                            }
                            Err(e) => {
                                errors.push(e);
                                self.applied.remove(&l.nic);
                            }
                        }
                    }
                }
            }
        }
        self.error = (!errors.is_empty()).then(|| errors.join("; "));
        // with no policy, one clean pass (leftovers of an earlier run removed)
        // is enough until the policy changes
        self.idle = self.policy.classes.is_empty() && errors.is_empty();
        // rates per class since the last round
        let now = Instant::now();
        for nic in self.applied.keys().cloned().collect::<Vec<_>>() {
            let bytes = class_bytes(&nic);
            if let Some((t, before)) = self.last.get(&nic) {
                let dt = (now - *t).as_secs_f64().max(1e-3);
                let r = bytes
                    .iter()
                    .map(|(c, b)| {
                        let d = b.saturating_sub(*before.get(c).unwrap_or(b));
                        (*c, d as f64 * 8.0 / dt)
                    })
                    .collect();
                self.rates.insert(nic.clone(), r);
            }
            self.last.insert(nic, (now, bytes));
        }
        self.last.retain(|n, _| self.applied.contains_key(n));
        self.rates.retain(|n, _| self.applied.contains_key(n));
    }

    pub fn status(&self, host: &str) -> HostBandwidth {
        let nics = self
            .managed()
            .into_iter()
            .map(|n| {
                let applied = self.applied.get(&n.name);
                let bytes = self
                    .last
                    .get(&n.name)
                    .map(|(_, b)| b.clone())
                    .unwrap_or_default();
                let rates = self.rates.get(&n.name);
                NicClasses {
                    up: n.up,
                    // without a policy, read now (a drain sizes itself by it)
                    link_rate: applied
                        .map(|p| p.link_rate)
                        .unwrap_or_else(|| self.link_rate(&n.name, &kernel(&n.name))),
                    classes: applied
                        .map(|p| {
                            p.classes
                                .iter()
                                .map(|c| ClassStatus {
                                    class: c.class,
                                    rate: c.rate,
                                    ceil: c.ceil,
                                    tx_bytes: bytes.get(&c.class).copied().unwrap_or(0),
                                    tx_rate: rates
                                        .and_then(|r| r.get(&c.class))
                                        .copied()
                                        .unwrap_or(0.0),
                                })
                                .collect()
                        })
                        .unwrap_or_default(),
                    nic: n.name,
                }
            })
            .collect();
        HostBandwidth {
            host: host.to_string(),
            policy: self.policy.clone(),
            nics,
            error: self.error.clone(),
            cpu_busy: None,
        }
    }
}

fn parent_of(k: &Kernel) -> Vec<String> {
    match &k.tbf {
        Some((h, _)) => vec!["parent".into(), format!("{}1", h)],
        None => vec!["root".into()],
    }
}

/// Makes `nic`'s HTB follow `p` (creating it and its filters if missing).
fn apply(p: &NicPlan, k: &Kernel) -> Result<(), String> {
    let nic = p.nic.as_str();
    let bits = |b: u64| format!("{}bit", b.max(8));
    if !k.htb {
        let parent = parent_of(k);
        let mut a: Vec<&str> = vec!["qdisc", "replace", "dev", nic];
        a.extend(parent.iter().map(String::as_str));
        a.extend(["handle", HANDLE, "htb", "default", "30"]);
        tc(&a)?;
    }
    let link = bits(p.link_rate);
    tc(&[
        "class", "replace", "dev", nic, "parent", HANDLE, "classid", "10:1", "htb", "rate", &link,
        "ceil", &link, "quantum", "60000",
    ])?;
    for c in &p.classes {
        let (rate, ceil) = (bits(c.rate), bits(c.ceil));
        tc(&[
            "class",
            "replace",
            "dev",
            nic,
            "parent",
            "10:1",
            "classid",
            classid(c.class),
            "htb",
            "rate",
            &rate,
            "ceil",
            &ceil,
            "quantum",
            "60000",
        ])?;
    }
    if !k.htb {
        let mig = format!("{MIGRATION_PORT_BASE}");
        let mask = format!("{MIGRATION_PORT_MASK:#06x}");
        let nbd = format!("{NBD_PORT}");
        for (dir, port, mask, class) in [
            ("dport", &mig, mask.as_str(), TrafficClass::LiveMigration),
            ("sport", &mig, mask.as_str(), TrafficClass::LiveMigration),
            ("dport", &nbd, "0xffff", TrafficClass::Storage),
            ("sport", &nbd, "0xffff", TrafficClass::Storage),
        ] {
            tc(&[
                "filter",
                "add",
                "dev",
                nic,
                "parent",
                HANDLE,
                "protocol",
                "ip",
                "prio",
                "1",
                "u32",
                "match",
                "ip",
                "protocol",
                "6",
                "0xff",
                "match",
                "ip",
                dir,
                port,
                mask,
                "classid",
                classid(class),
            ])?;
        }
    }
    Ok(())
}

fn remove(nic: &str, k: &Kernel) -> Result<(), String> {
    match &k.tbf {
        // back to the tbf's own default child
        Some((h, _)) => tc(&[
            "qdisc",
            "replace",
            "dev",
            nic,
            "parent",
            &format!("{h}1"),
            "pfifo",
        ])
        .map(|_| ()),
        None => tc(&["qdisc", "del", "dev", nic, "root"]).map(|_| ()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_counters_are_read_from_tc_text() {
        let text = "class tbf 85a9:1 parent 85a9: leaf 10: \n\
class htb 10:1 root rate 300Mbit ceil 300Mbit burst 1537b cburst 1537b \n \
Sent 999 bytes 3 pkt (dropped 0, overlimits 0 requeues 0) \n\
class htb 10:10 parent 10:1 prio 0 rate 3Mbit ceil 120Mbit burst 1599b cburst 1575b \n \
Sent 638921793 bytes 421000 pkt (dropped 0, overlimits 0 requeues 0) \n \
backlog 0b 0p requeues 0\n\
class htb 10:30 parent 10:1 prio 0 rate 3Mbit ceil 300Mbit\n \
Sent 42 bytes 1 pkt (dropped 0, overlimits 0 requeues 0) \n";
        let b = parse_class_bytes(text);
        assert_eq!(b.get(&TrafficClass::LiveMigration), Some(&638921793));
        assert_eq!(b.get(&TrafficClass::Default), Some(&42));
        assert_eq!(b.get(&TrafficClass::Storage), None);
    }
}
