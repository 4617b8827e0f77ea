//! `ferry demo`: Ferry's main job on its embedded defaults. Brings up a lab
//! (3 hosts × 2 NICs at 1 Gbit/s), boots three VMs, live-migrates each,
//! checks every guest, and prints a report table. Uses the same control API
//! as every other front end.

use std::time::Duration;

use clap::Args;
use ferry_api::size::human_bytes;
use ferry_api::{CheckResult, MigrationReport, VmCreateRequest, VmInfo};

use crate::lab_cmd::{self, UpArgs};
use crate::output::{mbit, print_json, Table};
use crate::vm_cmd::{move_vm, print_check, spec_from_args};
use crate::Cli;

#[derive(Args)]
pub struct DemoArgs {
    /// Remove the lab when done (default: leave it up to explore).
    #[arg(long)]
    down: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// (name, host, memory, fill, dirty rate, destination)
const PLAN: [(&str, &str, &str, &str, &str, &str); 3] = [
    ("demo-a", "host1", "1G", "768M", "16M", "host2"),
    ("demo-b", "host1", "768M", "512M", "8M", "host3"),
    ("demo-c", "host2", "512M", "320M", "4M", "host1"),
];

pub async fn run(cli: &Cli, a: &DemoArgs) -> anyhow::Result<i32> {
    let up = UpArgs {
        hosts: 3,
        nics: 2,
        rate: "1gbit".into(),
        mtu: 1500,
        host_memory: "6G".into(),
        replace: true,
        json: false,
    };
    lab_cmd::up(cli, &up).await?;
    let c = cli.client()?;
    let t = Duration::from_secs(90);
    for (name, host, memory, fill, dirty, _) in PLAN {
        let spec = spec_from_args(name, memory, Some(fill), dirty, "32M", 1)?;
        let vm: VmInfo = c
            .post(
                "/vms",
                &VmCreateRequest {
                    host: host.into(),
                    spec,
                },
                t,
            )
            .await?;
        println!(
            "booted {} on {} ({} memory, {} filled, {}/s dirtied)",
            vm.name, vm.host, memory, fill, dirty
        );
    }
    // let every guest finish filling its memory before it moves
    for (name, ..) in PLAN {
        let r: CheckResult = c.get(&format!("/vms/{name}/check"), t).await?;
        print_check(&r);
    }
    let rate_bps = ferry_lab::topology::parse_rate(&up.rate)? as f64;
    let mut reports: Vec<MigrationReport> = Vec::new();
    let mut failed = 0;
    for (name, _, _, _, _, to) in PLAN {
        match move_vm(&c, name, to, ferry_api::MigrationOption::Auto, false).await? {
            Ok(r) => reports.push(r),
            Err(e) => {
                failed += 1;
                eprintln!("move of {name} failed: {e}");
            }
        }
    }
    if a.json {
        print_json(&reports);
    } else {
        println!();
        let mut t = Table::new(&[
            "VM",
            "FROM",
            "TO",
            "TOTAL",
            "QEMU",
            "DOWNTIME",
            "MOVED",
            "THROUGHPUT",
            "TIME/IDEAL",
            "GUEST",
        ]);
        for r in &reports {
            let nics_used = r
                .nic_tx_bytes
                .values()
                .filter(|b| **b > (1 << 20))
                .count()
                .max(1) as f64;
            let ideal_ms = r.bytes_transferred as f64 * 8.0 / (rate_bps * nics_used) * 1000.0;
            t.row(vec![
                r.vm.clone(),
                r.from.clone(),
                r.to.clone(),
                format!("{:.2} s", r.total_ms as f64 / 1000.0),
                format!("{:.2} s", r.transfer_ms as f64 / 1000.0),
                format!("{} ms", r.downtime_ms),
                human_bytes(r.bytes_transferred),
                mbit(r.throughput),
                format!("{:.2}", r.transfer_ms as f64 / ideal_ms.max(1.0)),
                if r.check.ok() {
                    "intact, running".into()
                } else {
                    "NOT OK".into()
                },
            ]);
        }
        t.print();
        println!(
            "\nlink: {} per NIC; TIME/IDEAL = transfer time ÷ (bytes moved ÷ the rate of the NICs used)",
            up.rate
        );
    }
    if a.down {
        lab_cmd::down();
    } else {
        println!("the lab is still up: try `ferry vm list`, `ferry lab status`; remove it with `ferry lab down`");
    }
    Ok(if failed == 0 && reports.iter().all(|r| r.check.ok()) {
        0
    } else {
        1
    })
}
