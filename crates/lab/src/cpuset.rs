//! Lab hosts with CPUs of their own (`ferry lab up --cpus`).
//!
//! The lab's hosts share one machine's CPUs. Left alone, a host whose guest
//! is busy borrows the idle core of another, which two real servers never
//! do, and a measurement of one host's CPU then counts the other's. With
//! `--cpus`, each host's agent runs in a cgroup whose `cpuset` is that
//! host's CPUs; its QEMUs and all their threads are its children and stay
//! in it.
//!
//! - cgroup v1 (a `cpuset` hierarchy): `ferry-lab/HOST` in it. The agent
//!   puts each QEMU in cgroups of its own under the memory and cpu
//!   hierarchies only, so the QEMU keeps the agent's cpuset.
//! - cgroup v2: the agent puts each QEMU in `ferry/HOST/VM`, so the cpuset
//!   is set on `ferry/HOST` and the agent itself runs in its leaf
//!   `ferry/HOST/agent` (v2 keeps processes in leaves only).
//!
//! The plan is pure (host → CPU list); [`group`] makes the cgroup.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::LabError;

const BASE: &str = "/sys/fs/cgroup";

/// Parses a kernel CPU list (`0-3,6`), as in `/sys/devices/system/cpu/online`.
pub fn parse_list(s: &str) -> Result<Vec<u32>, LabError> {
    let bad = || LabError::Invalid(format!("`{s}` is not a CPU list (like 0 or 0-3,6)"));
    let mut cpus = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a, b),
            None => (part, part),
        };
        let (a, b): (u32, u32) = (
            a.trim().parse().map_err(|_| bad())?,
            b.trim().parse().map_err(|_| bad())?,
        );
        if a > b || b >= 4096 {
            return Err(bad());
        }
        cpus.extend(a..=b);
    }
    if cpus.is_empty() {
        return Err(bad());
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// `cpus` as a kernel CPU list, ranges joined (`0-2,5`).
pub fn format_list(cpus: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    out.join(",")
}

/// This machine's online CPUs.
pub fn online() -> Result<Vec<u32>, LabError> {
    let p = Path::new("/sys/devices/system/cpu/online");
    let s = std::fs::read_to_string(p).map_err(|e| LabError::io(p, e))?;
    parse_list(&s)
}

/// Which CPUs each host gets, from `--cpus`: `split` shares the online CPUs
/// out evenly, in order (hosts beyond the CPUs' number share them round the
/// ring: `host3` of three on two CPUs gets CPU 0 again); or `HOST=LIST,…`
/// names each host's (`host1=0,host2=1-3`), hosts not named unpinned.
pub fn plan(
    arg: &str,
    hosts: &[String],
    online: &[u32],
) -> Result<BTreeMap<String, String>, LabError> {
    let mut out = BTreeMap::new();
    if online.is_empty() {
        return Err(LabError::Invalid("this machine lists no online CPU".into()));
    }
    if arg == "split" {
        let n = hosts.len();
        for (i, h) in hosts.iter().enumerate() {
            let mine: Vec<u32> = if n <= online.len() {
                let (per, extra) = (online.len() / n, online.len() % n);
                let start = i * per + i.min(extra);
                let len = per + usize::from(i < extra);
                online[start..start + len].to_vec()
            } else {
                vec![online[i % online.len()]]
            };
            out.insert(h.clone(), format_list(&mine));
        }
        return Ok(out);
    }
    // HOST=LIST pairs; a list may hold commas itself, so a pair starts at
    // each `NAME=`
    let mut pairs: Vec<(String, String)> = Vec::new();
    for piece in arg.split(',') {
        match piece.split_once('=') {
            Some((h, l)) => pairs.push((h.trim().to_string(), l.to_string())),
            None => match pairs.last_mut() {
                Some((_, l)) => {
                    l.push(',');
                    l.push_str(piece);
                }
                None => {
                    return Err(LabError::Invalid(format!(
                        "--cpus `{arg}`: expected `split` or HOST=CPUS,… (like host1=0,host2=1)"
                    )))
                }
            },
        }
    }
    for (h, l) in pairs {
        if !hosts.contains(&h) {
            return Err(LabError::Invalid(format!(
                "--cpus names {h}, which this lab does not have (hosts: {})",
                hosts.join(", ")
            )));
        }
        let cpus = parse_list(&l).map_err(|e| LabError::Invalid(format!("--cpus for {h}: {e}")))?;
        if let Some(c) = cpus.iter().find(|c| !online.contains(c)) {
            return Err(LabError::Invalid(format!(
                "--cpus gives {h} CPU {c}, which is not online here (online: {})",
                format_list(online)
            )));
        }
        if out.insert(h.clone(), format_list(&cpus)).is_some() {
            return Err(LabError::Invalid(format!("--cpus names {h} twice")));
        }
    }
    Ok(out)
}

/// Whether this machine has cgroup v2's unified hierarchy with `cpuset`.
fn v2() -> bool {
    std::fs::read_to_string(Path::new(BASE).join("cgroup.controllers"))
        .is_ok_and(|c| c.split_whitespace().any(|x| x == "cpuset"))
}

fn write(p: &Path, v: &str) -> Result<(), LabError> {
    std::fs::write(p, v).map_err(|e| LabError::io(p, e))
}

/// Makes `host`'s cgroup with CPUs `cpus` (a CPU list) and returns the
/// `cgroup.procs` file its agent joins.
pub fn group(host: &str, cpus: &str) -> Result<PathBuf, LabError> {
    if v2() {
        // ferry/HOST holds the cpuset; the agent goes in its leaf, the
        // agent's QEMUs in ferry/HOST/VM beside it
        let base = Path::new(BASE);
        let ferry = base.join("ferry");
        let host_dir = ferry.join(host);
        let leaf = host_dir.join("agent");
        std::fs::create_dir_all(&leaf).map_err(|e| LabError::io(&leaf, e))?;
        for at in [base, ferry.as_path(), host_dir.as_path()] {
            write(&at.join("cgroup.subtree_control"), "+cpuset")?;
        }
        write(&host_dir.join("cpuset.cpus"), cpus)?;
        return Ok(leaf.join("cgroup.procs"));
    }
    let root = Path::new(BASE).join("cpuset");
    if !root.join("cpuset.cpus").exists() {
        return Err(LabError::Invalid(format!(
            "--cpus needs a cpuset cgroup controller: neither {BASE}/cgroup.controllers lists \
             cpuset nor is {} mounted",
            root.display()
        )));
    }
    let read = |p: &Path| {
        std::fs::read_to_string(p)
            .map(|s| s.trim().to_string())
            .map_err(|e| LabError::io(p, e))
    };
    let mems = read(&root.join("cpuset.mems"))?;
    let all = read(&root.join("cpuset.cpus"))?;
    // v1: a child's cpus and mems must be set before a task may join, at every level
    let lab = root.join("ferry-lab");
    let dir = lab.join(host);
    std::fs::create_dir_all(&dir).map_err(|e| LabError::io(&dir, e))?;
    for (d, c) in [(&lab, all.as_str()), (&dir, cpus)] {
        write(&d.join("cpuset.cpus"), c)?;
        write(&d.join("cpuset.mems"), &mems)?;
    }
    Ok(dir.join("cgroup.procs"))
}

/// Removes the lab's cpuset cgroups that no process is left in.
pub fn remove_all() -> Vec<String> {
    let mut removed = Vec::new();
    let mut rm = |d: &Path| {
        if std::fs::remove_dir(d).is_ok() {
            removed.push(d.display().to_string());
        }
    };
    let v1 = Path::new(BASE).join("cpuset").join("ferry-lab");
    if let Ok(rd) = std::fs::read_dir(&v1) {
        for e in rd.flatten() {
            if e.path().is_dir() {
                rm(&e.path());
            }
        }
        rm(&v1);
    }
    if v2() {
        if let Ok(rd) = std::fs::read_dir(Path::new(BASE).join("ferry")) {
            for e in rd.flatten() {
                rm(&e.path().join("agent"));
            }
        }
    }
    removed
}

/// The CPUs process `pid` may run on (its `Cpus_allowed_list`).
pub fn allowed(pid: u32) -> Option<String> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|v| v.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(n: u32) -> Vec<String> {
        (1..=n).map(|i| format!("host{i}")).collect()
    }

    #[test]
    fn cpu_lists_parse_and_print_as_the_kernel_writes_them() {
        assert_eq!(parse_list("0-3,6\n").unwrap(), vec![0, 1, 2, 3, 6]);
        assert_eq!(parse_list("1").unwrap(), vec![1]);
        assert_eq!(format_list(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        for bad in ["", "a", "3-1", "0-", "1-99999", "-1"] {
            assert!(parse_list(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn split_shares_the_cpus_out_evenly_and_in_order() {
        let p = plan("split", &hosts(2), &[0, 1]).unwrap();
        assert_eq!(p["host1"], "0");
        assert_eq!(p["host2"], "1");
        let p = plan("split", &hosts(3), &[0, 1, 2, 3, 4, 5, 6, 7]).unwrap();
        assert_eq!(p["host1"], "0-2");
        assert_eq!(p["host2"], "3-5");
        assert_eq!(p["host3"], "6-7");
        // more hosts than CPUs: round the ring
        let p = plan("split", &hosts(3), &[0, 1]).unwrap();
        assert_eq!((p["host1"].as_str(), p["host3"].as_str()), ("0", "0"));
    }

    #[test]
    fn named_cpus_are_checked_against_the_lab_and_the_machine() {
        let p = plan("host1=0,host2=1-3,5", &hosts(2), &[0, 1, 2, 3, 4, 5]).unwrap();
        assert_eq!(p["host1"], "0");
        assert_eq!(p["host2"], "1-3,5");
        let e = plan("host9=0", &hosts(2), &[0, 1]).unwrap_err().to_string();
        assert!(e.contains("host9") && e.contains("does not have"), "{e}");
        let e = plan("host1=4", &hosts(2), &[0, 1]).unwrap_err().to_string();
        assert!(e.contains("CPU 4") && e.contains("not online"), "{e}");
        let e = plan("host1=x", &hosts(2), &[0, 1]).unwrap_err().to_string();
        assert!(e.contains("host1"), "{e}");
        assert!(plan("0,1", &hosts(2), &[0, 1]).is_err());
        assert!(plan("host1=0,host1=1", &hosts(2), &[0, 1]).is_err());
    }
}
