//! What this host can give a VM, and the check that a VM's spec gets it
//! before anything starts.
//!
//! - The accelerator: KVM when `/dev/kvm` opens, the CPU has hardware
//!   virtualization (`vmx`/`svm`: a KVM without it, such as PVM, runs no
//!   ordinary guest) and a probe guest runs under it; TCG otherwise.
//! - The CPU models QEMU can run here under that accelerator
//!   (`query-cpu-definitions`: a model with unavailable features cannot),
//!   narrowed by the agent's `cpu_models` when the administrator keeps a
//!   cluster to a common baseline; and the full expansion of `host` and
//!   `max`, which a migration's two ends must agree on.
//! - `preflight`: every bridge, drive path, kernel and firmware file and
//!   the CPU model a spec names, checked on the host that is about to start
//!   it — at `vm create`, and on a migration's target before its skeleton.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use ferry_api::hardware::Firmware;
use ferry_api::VmSpec;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// CPU models whose meaning depends on the host: both ends of a move must
/// expand them to the same features.
pub const HOST_DEPENDENT_MODELS: [&str; 2] = ["host", "max"];

/// The expansion of a CPU model: property → value.
pub type Expansion = BTreeMap<String, Value>;

/// What QEMU can run on this host.
#[derive(Debug, Clone, Default)]
pub struct CpuCatalog {
    /// Model (and alias) → the features this host lacks for it.
    pub models: BTreeMap<String, Vec<String>>,
    /// Full expansions of [`HOST_DEPENDENT_MODELS`] this host can run.
    pub expansions: BTreeMap<String, Expansion>,
    /// The machine types QEMU here knows (`query-machines`, aliases too).
    pub machines: Vec<String>,
    /// Machine type (and alias) → the most vCPUs QEMU gives it (`cpu-max`).
    pub cpu_max: BTreeMap<String, u32>,
}

/// A real-mode firmware image (64 KiB, code at the reset vector): writes
/// 0x21 to the `isa-debug-exit` port, so QEMU exits with status 67 once a
/// vCPU has run it.
fn probe_rom() -> Vec<u8> {
    let mut rom = vec![0u8; 65536];
    // mov al, 0x21 ; out 0xf4, al ; hlt ; jmp $-2
    let code = [0xB0, 0x21, 0xE6, 0xF4, 0xF4, 0xEB, 0xFD];
    rom[0xFFF0..0xFFF0 + code.len()].copy_from_slice(&code);
    rom
}

/// `kvm` when KVM can run ordinary guests here, else `tcg`.
pub fn detect_accel(binary: &str) -> String {
    let kvm_opens = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    let hw_virt = std::fs::read_to_string("/proc/cpuinfo")
        .map(|c| {
            c.lines()
                .filter(|l| l.starts_with("flags"))
                .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"))
        })
        .unwrap_or(false);
    if kvm_opens && hw_virt && runs_probe(binary, "kvm") {
        "kvm".into()
    } else {
        "tcg".into()
    }
}

fn runs_probe(binary: &str, accel: &str) -> bool {
    let rom = std::env::temp_dir().join(format!("ferry-probe-{}.rom", std::process::id()));
    if std::fs::write(&rom, probe_rom()).is_err() {
        return false;
    }
    let child = std::process::Command::new(binary)
        .args([
            "-accel",
            accel,
            "-machine",
            "q35",
            "-m",
            "16",
            "-nodefaults",
        ])
        .args(["-display", "none", "-bios"])
        .arg(&rom)
        .args(["-device", "isa-debug-exit,iobase=0xf4,iosize=0x04"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn();
    let ok = match child {
        Ok(mut c) => {
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            loop {
                match c.try_wait() {
                    Ok(Some(st)) => break st.code() == Some(67),
                    Ok(None) if std::time::Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => {
                        let _ = c.kill();
                        let _ = c.wait();
                        break false;
                    }
                }
            }
        }
        Err(_) => false,
    };
    let _ = std::fs::remove_file(&rom);
    ok
}

/// Asks a QEMU with no machine what CPU models it can run here.
pub async fn probe_cpus(binary: &str, accel: &str) -> Result<CpuCatalog, String> {
    let mut child = tokio::process::Command::new(binary)
        .args(["-machine", "none", "-accel", accel, "-nodefaults"])
        .args(["-display", "none", "-qmp", "stdio"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("starting {binary}: {e}"))?;
    let mut stdin = child.stdin.take().ok_or("no stdin")?;
    let mut lines = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
    let talk = async {
        let mut answers = Vec::new();
        let mut cmds = vec![
            serde_json::json!({"execute": "qmp_capabilities"}),
            serde_json::json!({"execute": "query-cpu-definitions"}),
        ];
        for m in HOST_DEPENDENT_MODELS {
            cmds.push(serde_json::json!({"execute": "query-cpu-model-expansion",
                "arguments": {"type": "full", "model": {"name": m}}}));
        }
        cmds.push(serde_json::json!({"execute": "query-machines"}));
        // greeting
        lines
            .next_line()
            .await
            .map_err(|e| e.to_string())?
            .ok_or("QEMU closed QMP")?;
        for c in cmds {
            stdin
                .write_all(format!("{c}\n").as_bytes())
                .await
                .map_err(|e| e.to_string())?;
            loop {
                let l = lines
                    .next_line()
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or("QEMU closed QMP")?;
                let v: Value = serde_json::from_str(&l).map_err(|e| e.to_string())?;
                if v.get("event").is_some() {
                    continue;
                }
                answers.push(v);
                break;
            }
        }
        let _ = stdin.write_all(b"{\"execute\":\"quit\"}\n").await;
        Ok::<_, String>(answers)
    };
    let answers = tokio::time::timeout(Duration::from_secs(20), talk)
        .await
        .map_err(|_| "QEMU did not answer within 20 s".to_string())??;
    let _ = tokio::time::timeout(Duration::from_secs(3), child.wait()).await;
    let n = 2 + HOST_DEPENDENT_MODELS.len();
    let mut cat = catalog_of(&answers[1], &answers[2..n])?;
    cat.machines = machines_of(&answers[n])?;
    cat.cpu_max = cpu_max_of(&answers[n]);
    Ok(cat)
}

/// Reads `query-machines`' `cpu-max` per name and alias.
pub fn cpu_max_of(answer: &Value) -> BTreeMap<String, u32> {
    let mut out = BTreeMap::new();
    for m in answer
        .get("return")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let Some(max) = m.get("cpu-max").and_then(Value::as_u64) else {
            continue;
        };
        for n in [m.get("name"), m.get("alias")].into_iter().flatten() {
            if let Some(n) = n.as_str() {
                out.insert(n.to_string(), max.min(u32::MAX as u64) as u32);
            }
        }
    }
    out
}

/// What keeps `spec`'s vCPUs from running on `cat`'s QEMU: more than its
/// machine type's `cpu-max`.
pub fn vcpu_problem(cat: &CpuCatalog, spec: &ferry_api::VmSpec) -> Option<String> {
    let max = *cat.cpu_max.get(&spec.machine)?;
    (spec.vcpus > max).then(|| {
        format!(
            "{} vCPUs on machine {} (QEMU here gives it at most {max})",
            spec.vcpus, spec.machine
        )
    })
}

/// Reads `query-machines`: every name and alias.
pub fn machines_of(answer: &Value) -> Result<Vec<String>, String> {
    let list = answer
        .get("return")
        .and_then(Value::as_array)
        .ok_or_else(|| format!("query-machines: {answer}"))?;
    let mut out: Vec<String> = list
        .iter()
        .flat_map(|m| [m.get("name"), m.get("alias")])
        .flatten()
        .filter_map(|v| v.as_str().map(String::from))
        .collect();
    out.sort();
    out.dedup();
    Ok(out)
}

/// Reads `query-cpu-definitions` and the expansions of
/// [`HOST_DEPENDENT_MODELS`] (an error answer: not runnable here).
pub fn catalog_of(defs: &Value, expansions: &[Value]) -> Result<CpuCatalog, String> {
    let list = defs
        .get("return")
        .and_then(Value::as_array)
        .ok_or_else(|| format!("query-cpu-definitions: {defs}"))?;
    let mut cat = CpuCatalog::default();
    for d in list {
        let Some(name) = d.get("name").and_then(Value::as_str) else {
            continue;
        };
        let lacks: Vec<String> = d
            .get("unavailable-features")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|f| f.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        cat.models.insert(name.to_string(), lacks.clone());
        if let Some(alias) = d.get("alias-of").and_then(Value::as_str) {
            cat.models.entry(alias.to_string()).or_insert(lacks);
        }
    }
    for (m, e) in HOST_DEPENDENT_MODELS.iter().zip(expansions) {
        if let Some(props) = e.pointer("/return/model/props").and_then(Value::as_object) {
            cat.expansions.insert(
                m.to_string(),
                props.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            );
        }
    }
    Ok(cat)
}

/// Why this host cannot run `cpu` (None: it can). `allowed` is the agent's
/// `cpu_models`, if set; `source` the source host's expansion of a
/// host-dependent model, on a migration's target.
pub fn cpu_problem(
    cat: &CpuCatalog,
    allowed: Option<&[String]>,
    cpu: &str,
    source: Option<&Expansion>,
) -> Option<String> {
    if let Some(allowed) = allowed {
        if !allowed.iter().any(|a| a == cpu) {
            return Some(format!(
                "CPU model {cpu} (this host offers only {})",
                allowed.join(", ")
            ));
        }
    }
    match cat.models.get(cpu) {
        None => return Some(format!("CPU model {cpu} (QEMU here does not know it)")),
        Some(lacks) if !lacks.is_empty() => {
            return Some(format!(
                "CPU model {cpu} (this host lacks {})",
                lacks.join(", ")
            ))
        }
        Some(_) => {}
    }
    if HOST_DEPENDENT_MODELS.contains(&cpu) {
        let Some(mine) = cat.expansions.get(cpu) else {
            return Some(format!("CPU model {cpu} (QEMU here cannot expand it)"));
        };
        if let Some(theirs) = source {
            let differ: Vec<&String> = mine
                .keys()
                .chain(theirs.keys())
                .filter(|k| mine.get(*k) != theirs.get(*k))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            if !differ.is_empty() {
                let shown: Vec<&str> = differ.iter().take(8).map(|s| s.as_str()).collect();
                return Some(format!(
                    "CPU model {cpu} (the two hosts' {cpu} differ in {} features: {}{})",
                    differ.len(),
                    shown.join(", "),
                    if differ.len() > 8 { ", …" } else { "" }
                ));
            }
        }
    }
    None
}

/// Host files the agent needs for UEFI guests.
#[derive(Debug, Clone)]
pub struct Ovmf {
    pub code: std::path::PathBuf,
    /// The variable store every new UEFI guest starts from (copied).
    pub vars: std::path::PathBuf,
}

impl Default for Ovmf {
    fn default() -> Self {
        Ovmf {
            code: "/usr/share/OVMF/OVMF_CODE_4M.fd".into(),
            vars: "/usr/share/OVMF/OVMF_VARS_4M.fd".into(),
        }
    }
}

/// True when `name` is a Linux bridge of this host.
pub fn is_bridge(name: &str) -> bool {
    Path::new("/sys/class/net")
        .join(name)
        .join("bridge")
        .is_dir()
}

/// The backing file a qcow2 image's header names, if any (None: none, or
/// not a qcow2 image); see [`ferry_api::hardware::qcow2_backing`].
pub fn qcow2_backing(path: &Path) -> Option<String> {
    use std::io::Read;
    let f = std::fs::File::open(path).ok()?;
    let mut head = Vec::new();
    f.take(ferry_api::hardware::QCOW2_HEAD as u64)
        .read_to_end(&mut head)
        .ok()?;
    ferry_api::hardware::qcow2_backing(&head)
}

/// Everything in `spec` this host lacks (empty: it can run it). The CPU
/// model is checked by the caller ([`cpu_problem`]), which has the catalog.
pub fn missing_here(spec: &VmSpec, ovmf: &Ovmf) -> Vec<String> {
    let mut missing = Vec::new();
    for n in &spec.nics {
        if !is_bridge(&n.bridge) {
            missing.push(format!("bridge {} (for NIC {})", n.bridge, n.mac));
        }
    }
    for (i, d) in spec.drives.iter().enumerate() {
        if let Some(p) = &d.path {
            match std::fs::metadata(p) {
                Ok(m)
                    if m.is_file()
                        || std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()) => {}
                Ok(_) => missing.push(format!(
                    "disk path {p} (drives[{i}]) is not a file or block device"
                )),
                Err(e) => missing.push(format!("disk path {p} (drives[{i}]): {e}")),
            }
            if let Some(b) = qcow2_backing(Path::new(p)) {
                missing.push(format!(
                    "disk path {p} (drives[{i}]) is a qcow2 image on a backing file ({}), which Ferry never opens: give a standalone image (qemu-img convert)",
                    b.escape_debug()
                ));
            }
        }
    }
    if let Some(k) = &spec.kernel {
        for p in std::iter::once(&k.kernel).chain(k.initrd.as_ref()) {
            if !Path::new(p).is_file() {
                missing.push(format!("kernel file {p}"));
            }
        }
    }
    if spec.firmware == Firmware::Uefi {
        for p in [&ovmf.code, &ovmf.vars] {
            if !p.is_file() {
                missing.push(format!("UEFI firmware file {} (package ovmf)", p.display()));
            }
        }
    }
    missing
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cat() -> CpuCatalog {
        let defs = serde_json::json!({"return": [
            {"name": "qemu64", "unavailable-features": []},
            {"name": "Skylake-Client-v1", "unavailable-features": ["pcid", "hle"], "alias-of": "Skylake-Client"},
            {"name": "max", "unavailable-features": []},
            {"name": "host", "unavailable-features": []},
        ]});
        let max = serde_json::json!({"return": {"model": {"name": "max", "props": {"sse4.2": true, "avx2": false}}}});
        let host = serde_json::json!({"error": {"class": "GenericError", "desc": "kvm"}});
        catalog_of(&defs, &[host, max]).unwrap()
    }

    #[test]
    fn a_model_runs_only_without_missing_features() {
        let c = cat();
        assert_eq!(cpu_problem(&c, None, "qemu64", None), None);
        let why = cpu_problem(&c, None, "Skylake-Client", None).unwrap();
        assert!(why.contains("lacks pcid, hle"), "{why}");
        assert!(cpu_problem(&c, None, "EPYC-Zen9", None)
            .unwrap()
            .contains("does not know"));
        assert!(cpu_problem(&c, None, "host", None)
            .unwrap()
            .contains("cannot expand"));
    }

    #[test]
    fn an_allow_list_narrows_the_models() {
        let allowed = vec!["qemu64".to_string()];
        assert_eq!(cpu_problem(&cat(), Some(&allowed), "qemu64", None), None);
        let why = cpu_problem(&cat(), Some(&allowed), "max", None).unwrap();
        assert!(why.contains("offers only qemu64"), "{why}");
    }

    #[test]
    fn host_dependent_models_must_expand_alike() {
        let c = cat();
        let same = c.expansions["max"].clone();
        assert_eq!(cpu_problem(&c, None, "max", Some(&same)), None);
        let mut other = same.clone();
        other.insert("avx2".into(), Value::Bool(true));
        let why = cpu_problem(&c, None, "max", Some(&other)).unwrap();
        assert!(why.contains("differ in 1 features: avx2"), "{why}");
    }

    #[test]
    fn a_qcow2_backing_file_is_named() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.qcow2");
        let mut h = vec![0u8; 512];
        h[0..4].copy_from_slice(b"QFI\xfb");
        h[8..16].copy_from_slice(&100u64.to_be_bytes());
        h[16..20].copy_from_slice(&11u32.to_be_bytes());
        h[100..111].copy_from_slice(b"/etc/shadow");
        std::fs::write(&p, &h).unwrap();
        assert_eq!(qcow2_backing(&p).as_deref(), Some("/etc/shadow"));
        h[8..16].copy_from_slice(&0u64.to_be_bytes());
        std::fs::write(&p, &h).unwrap();
        assert_eq!(qcow2_backing(&p), None);
        std::fs::write(&p, b"raw data, not qcow2").unwrap();
        assert_eq!(qcow2_backing(&p), None);
    }

    #[test]
    fn machines_are_read_with_their_aliases() {
        let a = serde_json::json!({"return": [
            {"name": "pc-q35-10.0", "alias": "q35", "cpu-max": 4096},
            {"name": "pc-q35-9.2"},
            {"name": "none"},
        ]});
        assert_eq!(
            machines_of(&a).unwrap(),
            vec!["none", "pc-q35-10.0", "pc-q35-9.2", "q35"]
        );
        assert!(machines_of(&serde_json::json!({"error": {}})).is_err());
        let max = cpu_max_of(&a);
        assert_eq!(max.get("q35"), Some(&4096));
        assert_eq!(max.get("pc-q35-10.0"), Some(&4096));
        assert_eq!(max.get("pc-q35-9.2"), None);
        let cat = CpuCatalog {
            cpu_max: max,
            ..Default::default()
        };
        let mut spec = ferry_api::VmSpec::workload("big", 256 << 30, 0, 0);
        spec.vcpus = 64;
        assert_eq!(vcpu_problem(&cat, &spec), None);
        spec.vcpus = 5000;
        let why = vcpu_problem(&cat, &spec).unwrap();
        assert!(
            why.contains("5000 vCPUs on machine q35") && why.contains("at most 4096"),
            "{why}"
        );
    }

    #[test]
    fn the_probe_rom_ends_in_the_reset_vector() {
        let r = probe_rom();
        assert_eq!(r.len(), 65536);
        assert_eq!(&r[0xFFF0..0xFFF4], &[0xB0, 0x21, 0xE6, 0xF4]);
    }

    #[test]
    fn a_missing_bridge_and_path_are_named() {
        let mut s = VmSpec::workload("v", 256 << 20, 0, 0);
        s.nics.push(ferry_api::hardware::GuestNic {
            bridge: "no-such-br0".into(),
            mac: "52:54:00:00:00:01".into(),
        });
        s.drives.push(ferry_api::hardware::Drive {
            path: Some("/nonexistent/disk.img".into()),
            ..Default::default()
        });
        s.firmware = Firmware::Uefi;
        let ovmf = Ovmf {
            code: "/nonexistent/OVMF_CODE.fd".into(),
            vars: "/nonexistent/OVMF_VARS.fd".into(),
        };
        let m = missing_here(&s, &ovmf);
        assert!(m[0].contains("bridge no-such-br0"), "{m:?}");
        assert!(m[1].contains("/nonexistent/disk.img"), "{m:?}");
        assert!(
            m[2].contains("UEFI firmware file /nonexistent/OVMF_CODE.fd"),
            "{m:?}"
        );
    }
}
