//! `ferry demo`: Ferry's main job on its embedded defaults. Brings up a lab
//! (3 hosts × 2 NICs at 1 Gbit/s), boots four VMs of mixed sizes on host1,
//! plugs one shared disk from the storage service (under the seed-004 QoS
//! policy) into every VM, drains host1 with live migrations (auto: over both
//! NICs, by the kind each guest's memory calls for; simultaneous migrations
//! tuned automatically), checks every guest where it landed, shows the
//! storage flows following their VMs, and prints a report. Meanwhile a
//! Debian guest (its root a storage disk over NBD, a NIC on the guests'
//! bridge, the guest agent) boots on host2; after the drain it moves to
//! host3 and is checked there through its guest agent.
//! Uses the same control API as every front end.

use std::time::Duration;

use clap::Args;
use ferry_api::drain::DrainRequest;
use ferry_api::size::human_bytes;
use ferry_api::storage::{
    DiskAttachRequest, DiskCreateRequest, DiskInfo, DiskSetRequest, FlowInfo, FlowStatus, Policy,
    PolicyKind,
};
use ferry_api::{CheckResult, VmCreateRequest, VmInfo};

use crate::host_cmd::drain_host;
use crate::lab_cmd::{self, UpArgs};
use crate::output::{mbit, print_json, Table};
use crate::vm_cmd::{print_check, spec_from_args};
use crate::Cli;

#[derive(Args)]
pub struct DemoArgs {
    /// Remove the lab when done (default: leave it up to explore).
    #[arg(long)]
    down: bool,
    /// Print the drain's events and report as JSON.
    #[arg(long)]
    json: bool,
}

/// (name, memory, fill, dirty rate)
const GUESTS: [(&str, &str, &str, &str); 4] = [
    ("demo-a", "1G", "768M", "16M"),
    ("demo-b", "768M", "512M", "8M"),
    ("demo-c", "512M", "384M", "8M"),
    ("demo-d", "512M", "256M", "4M"),
];

pub async fn run(cli: &Cli, a: &DemoArgs) -> anyhow::Result<i32> {
    let up = UpArgs {
        hosts: 3,
        nics: 2,
        rate: "1gbit".into(),
        mtu: 1500,
        host_memory: "6G".into(),
        storage_nodes: 1,
        cpus: None,
        replace: true,
        json: false,
    };
    lab_cmd::up(cli, &up).await?;
    let c = cli.client()?;
    let t = Duration::from_secs(180);
    // a real Debian guest boots on host2 behind the workload guests' drain
    let debian = start_debian(&c).await?;
    let boots = GUESTS.iter().map(|(name, memory, fill, dirty)| {
        let c = c.clone();
        async move {
            let spec = spec_from_args(name, memory, Some(fill), dirty, "32M", 1)?;
            let vm: VmInfo = c
                .post(
                    "/vms",
                    &VmCreateRequest {
                        ha: None,
                        host: "host1".into(),
                        spec,
                    },
                    t,
                )
                .await?;
            Ok::<_, anyhow::Error>(vm)
        }
    });
    for vm in futures::future::join_all(boots).await {
        let vm = vm?;
        println!(
            "booted {} on {} ({} memory, {} filled with a verifiable pattern)",
            vm.name,
            vm.host,
            human_bytes(vm.spec.memory),
            human_bytes(vm.spec.fill)
        );
    }
    // a shared disk from the storage service, under the seed-004 policy, in every guest
    let policy = Policy {
        name: "demo".into(),
        kind: PolicyKind::Dedicated,
        min_iops: 250,
        max_iops: 500,
        max_bandwidth: 100 << 20,
    };
    let _ = c.delete::<serde_json::Value>("/qos/policies/demo", t).await;
    let _: Policy = c.post("/qos/policies", &policy, t).await?;
    let disk = DiskCreateRequest {
        name: "demo-shared".into(),
        size: 64 << 20,
        write_through: false,
        node: None,
    };
    let d: DiskInfo = c.post("/disks", &disk, t).await?;
    let _: DiskInfo = c
        .put(
            "/disks/demo-shared/policy",
            &DiskSetRequest {
                policy: Some("demo".into()),
            },
            t,
        )
        .await?;
    for (name, ..) in GUESTS {
        let _: VmInfo = c
            .post(
                "/disks/demo-shared/attach",
                &DiskAttachRequest {
                    vm: name.to_string(),
                },
                t,
            )
            .await?;
    }
    println!(
        "disk {} ({}) attached to every guest, policy demo (min 250, max 500 IOPS, max 100 MiB/s)",
        d.name, d.uri
    );
    println!("\ndraining host1 onto host2 and host3:");
    let req = DrainRequest {
        to: Vec::new(),
        max_parallel: None,
        option: None,
    };
    let report = drain_host(&c, "host1", &req, a.json).await?;
    println!();
    let mut t2 = Table::new(&["VM", "NOW ON", "GUEST"]);
    let mut all_ok = true;
    for d in &report.moved {
        let r: CheckResult = c.get(&format!("/vms/{}/check", d.vm), t).await?;
        all_ok &= r.ok() && r.host == d.to;
        if !a.json {
            print_check(&r);
        }
        t2.row(vec![
            d.vm.clone(),
            r.host.clone(),
            if r.ok() {
                "intact, running".into()
            } else {
                "NOT OK".into()
            },
        ]);
    }
    all_ok &= move_debian(&c, &debian, a.json).await?;
    let flows: Vec<FlowInfo> = c.get("/qos/flows", t).await?;
    all_ok &= flows
        .iter()
        .filter(|f| !f.id.starts_with(DEBIAN_ROOT))
        .all(|f| f.status == FlowStatus::Ok && f.host != "host1");
    if !a.json {
        println!("\nstorage flows after the drain (one per VM per disk, following the VMs):");
        let mut tf = Table::new(&["FLOW", "HOST", "IOPS", "LAT(us)", "MIN", "MAX", "STATUS"]);
        for f in &flows {
            tf.row(vec![
                f.id.clone(),
                f.host.clone(),
                format!("{:.0}", f.iops),
                format!("{:.0}", f.latency_us),
                f.min_iops.to_string(),
                f.max_iops.to_string(),
                format!("{:?}", f.status),
            ]);
        }
        tf.print();
    }
    let rate_bps = ferry_lab::topology::parse_rate(&up.rate)? as f64;
    let secs = report.total_ms as f64 / 1000.0;
    if a.json {
        print_json(&report);
    } else {
        println!(
            "\nhost1 drained in {secs:.1} s: {} moved at {} aggregate; ideal over 2 × {} NICs would be {:.1} s (ratio {:.2})",
            human_bytes(report.bytes),
            mbit(report.bytes as f64 / secs.max(1e-3)),
            up.rate,
            report.bytes as f64 * 8.0 / (2.0 * rate_bps),
            secs / (report.bytes as f64 * 8.0 / (2.0 * rate_bps)).max(1e-3),
        );
    }
    if a.down {
        lab_cmd::down();
    } else {
        println!("the lab is still up: try `ferry vm list`, `ferry host validate --all`; remove it with `ferry lab down`");
    }
    Ok(
        if all_ok && report.failed.is_empty() && report.unplaceable.is_empty() {
            0
        } else {
            1
        },
    )
}

const DEBIAN_VM: &str = "demo-deb";
const DEBIAN_ROOT: &str = "demo-deb-root";

/// Imports the lab's Debian guest into a storage disk and boots it on host2.
async fn start_debian(c: &ferry_net::client::Client) -> anyhow::Result<std::time::Instant> {
    let img = ferry_lab::debian::ensure(false)?;
    let t = Duration::from_secs(120);
    let _ = c
        .delete::<DiskInfo>(&format!("/disks/{DEBIAN_ROOT}"), t)
        .await;
    let tls = crate::Cli::admin_tls_dir(None);
    crate::storage_cmd::import_disk(c, DEBIAN_ROOT, &img.disk, false, None, tls.as_deref()).await?;
    let spec = ferry_lab::debian::spec(
        DEBIAN_VM,
        DEBIAN_ROOT,
        &ferry_lab::topology::guest_addr(0),
        "52:54:00:de:b0:01",
    );
    let started = std::time::Instant::now();
    let vm: VmInfo = c
        .post(
            "/vms",
            &VmCreateRequest {
                ha: None,
                host: "host2".into(),
                spec,
            },
            t,
        )
        .await?;
    println!(
        "booting {} on {} (Debian from Debian packages, SeaBIOS from storage disk {DEBIAN_ROOT} over NBD, cloud-init seed, {}, guest agent)",
        vm.name, vm.host, vm.accel
    );
    Ok(started)
}

/// Waits for the Debian guest's agent, moves the guest host2 → host3 and
/// checks it there. True when all went well.
async fn move_debian(
    c: &ferry_net::client::Client,
    started: &std::time::Instant,
    json: bool,
) -> anyhow::Result<bool> {
    let t = Duration::from_secs(60);
    let booted = loop {
        let r: CheckResult = c.get(&format!("/vms/{DEBIAN_VM}/check"), t).await?;
        if r.ok() {
            break started.elapsed();
        }
        if started.elapsed() > Duration::from_secs(240) {
            println!("{DEBIAN_VM} did not boot: {}", r.summary());
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    if !json {
        println!(
            "\n{DEBIAN_VM} booted: its guest agent answered {:.1} s after create; moving it host2 → host3:",
            booted.as_secs_f64()
        );
    }
    let moved = crate::vm_cmd::move_vm(
        c,
        DEBIAN_VM,
        "host3",
        None,
        ferry_api::ConvergenceChoice::default(),
        json,
    )
    .await?;
    match moved {
        Ok(r) => {
            if !json {
                crate::vm_cmd::print_report(&r);
            }
            // the report ends with the final check on host3
            Ok(r.check.ok() && r.check.host == "host3")
        }
        Err(e) => {
            println!("moving {DEBIAN_VM} failed: {e}");
            Ok(false)
        }
    }
}
