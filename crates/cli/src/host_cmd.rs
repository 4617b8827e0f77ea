//! `ferry host …`: list, drain, resume, settings and validation — a thin
//! front end over the control API.

use std::time::Duration;

use clap::Subcommand;
use ferry_api::drain::{DrainEvent, DrainReport, DrainRequest, HostSettings, MigrationLimit};
use ferry_api::size::human_bytes;
use ferry_api::validation::{CheckStatus, ValidationReport};
use ferry_api::ValidateRequest;
use ferry_api::{ApiError, HostEntry};
use ferry_net::client::Client;
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};

use crate::output::{print_json, Table};
use crate::vm_cmd::{ConvergenceArgs, OptionArg, T};
use crate::Cli;

#[derive(Subcommand)]
pub enum HostCmd {
    /// List hosts with memory, NICs and VMs.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Set (key=value) or remove (--unset KEY) a host's labels, which host
    /// groups select by.
    Label {
        host: String,
        labels: Vec<String>,
        #[arg(long)]
        unset: Vec<String>,
    },
    /// Move every VM off a host (it takes no new VMs until `ferry host resume`).
    Drain {
        host: String,
        /// Targets, comma separated (default: every other host).
        #[arg(long, value_delimiter = ',')]
        to: Vec<String>,
        /// Simultaneous migrations: auto or 1..16 (default: the host's setting, auto).
        /// auto: up to 4 (8 if every step pays), one more at a time while
        /// it raises the rate, the next starting as one finishes.
        #[arg(long)]
        max_parallel: Option<String>,
        /// Performance option (default: the host's setting, else auto).
        #[arg(long, value_enum)]
        option: Option<OptionArg>,
        #[arg(long)]
        json: bool,
    },
    /// Let a drained host take VMs again.
    Resume { host: String },
    /// Host settings.
    Set {
        host: String,
        /// Simultaneous migrations (incoming + outgoing): auto or 1..16.
        #[arg(long)]
        max_migrations: Option<String>,
        /// Default performance option for migrations from this host.
        #[arg(long, value_enum)]
        migration_option: Option<OptionArg>,
        #[command(flatten)]
        convergence: ConvergenceArgs,
    },
    /// Check hosts and paths against the live-migration speed checklist:
    /// MTU end to end, links, per-path throughput, CPU power states, NIC
    /// queues, RDMA, consistency. Exit status 1 if any check fails.
    Validate {
        /// The host to validate (with every path touching it).
        host: Option<String>,
        /// Validate every host.
        #[arg(long, conflicts_with = "host")]
        all: bool,
        /// Length of each per-path throughput test in ms (0 skips them).
        #[arg(long, default_value_t = 1000)]
        throughput_ms: u64,
        /// Show passing checks too.
        #[arg(long)]
        verbose: bool,
        #[arg(long)]
        json: bool,
    },
}

pub async fn run_host(cli: &Cli, cmd: &HostCmd) -> anyhow::Result<i32> {
    // as in run_vm: arguments first, then the credential
    let client = || cli.client();
    match cmd {
        HostCmd::Label {
            host,
            labels,
            unset,
        } => crate::placement_cmd::label(cli, host, labels, unset).await,
        HostCmd::Drain {
            host,
            to,
            max_parallel,
            option,
            json,
        } => {
            let max_parallel = max_parallel
                .as_deref()
                .map(|m| MigrationLimit::parse("--max-parallel", m))
                .transpose()?;
            let req = DrainRequest {
                to: to.clone(),
                max_parallel,
                option: option.map(Into::into),
            };
            let report = drain_host(&client()?, host, &req, *json).await?;
            Ok(
                if report.failed.is_empty() && report.unplaceable.is_empty() {
                    0
                } else {
                    1
                },
            )
        }
        HostCmd::Resume { host } => {
            let _: serde_json::Value = client()?
                .post(&format!("/hosts/{host}/resume"), &serde_json::json!({}), T)
                .await?;
            println!("{host} takes VMs again");
            Ok(0)
        }
        HostCmd::Set {
            host,
            max_migrations,
            migration_option,
            convergence,
        } => {
            let settings = HostSettings {
                max_migrations: max_migrations
                    .as_deref()
                    .map(|m| MigrationLimit::parse("--max-migrations", m))
                    .transpose()?,
                migration_option: migration_option.map(Into::into),
                convergence: convergence.choice()?,
            };
            if settings == HostSettings::default() {
                return Err(ApiError::invalid(
                    "host set",
                    "nothing to set: give --max-migrations, --migration-option or a convergence flag",
                )
                .into());
            }
            let r: serde_json::Value = client()?
                .put(&format!("/hosts/{host}/settings"), &settings, T)
                .await?;
            println!(
                "{host}: {}",
                serde_json::to_string(&r["settings"]).unwrap_or_default()
            );
            Ok(0)
        }
        HostCmd::Validate {
            host,
            all,
            throughput_ms,
            verbose,
            json,
        } => {
            if host.is_none() && !*all {
                anyhow::bail!("name a host to validate, or pass --all");
            }
            let req = ValidateRequest {
                hosts: host.iter().cloned().collect(),
                throughput_ms: *throughput_ms,
            };
            let r: ValidationReport = client()?
                .post("/validate", &req, Duration::from_secs(300))
                .await?;
            if *json {
                print_json(&r);
            } else {
                let mut t =
                    Table::new(&["STATUS", "CHECK", "HOST", "NIC", "PEER", "OBSERVED", "FIX"]);
                let mut rows: Vec<_> = r
                    .checks
                    .iter()
                    .filter(|c| *verbose || c.status != CheckStatus::Pass)
                    .collect();
                rows.sort_by(|a, b| {
                    b.status
                        .cmp(&a.status)
                        .then(a.check.cmp(&b.check))
                        .then(a.host.cmp(&b.host))
                });
                for ch in rows {
                    t.row(vec![
                        ch.status.label().into(),
                        ch.check.clone(),
                        ch.host.clone(),
                        ch.nic.clone().unwrap_or_default(),
                        ch.peer.clone().unwrap_or_default(),
                        ch.observed.clone(),
                        ch.fix.clone().unwrap_or_default(),
                    ]);
                }
                t.print();
                println!(
                    "{}: {} passed, {} warnings, {} failed, {} not available{}",
                    r.hosts.join(","),
                    r.passed,
                    r.warned,
                    r.failed,
                    r.not_available,
                    if *verbose {
                        ""
                    } else {
                        " (passing checks hidden; --verbose shows them)"
                    }
                );
            }
            Ok(if r.failed > 0 { 1 } else { 0 })
        }
        HostCmd::List { json } => {
            let hosts: Vec<HostEntry> = client()?.get("/hosts", T).await?;
            if *json {
                print_json(&hosts);
                return Ok(0);
            }
            let mut t = Table::new(&["HOST", "AGENT", "MEMORY FREE", "NICS", "VMS"]);
            // NIC pairs as the agents last probed them (a move or `host validate` probes)
            let mut paths = Table::new(&["HOST", "NIC", "REACHES", "PEER NIC", "PROBED"]);
            let mut any_path = false;
            for h in &hosts {
                for p in h.info.iter().flat_map(|i| &i.paths) {
                    any_path = true;
                    paths.row(vec![
                        h.name.clone(),
                        p.nic.clone(),
                        match (p.reachable, p.rtt_us, &p.error) {
                            (true, Some(us), _) => format!("yes ({:.2} ms)", us as f64 / 1e3),
                            (true, None, _) => "yes".into(),
                            (false, _, Some(e)) => format!("no: {e}"),
                            (false, _, None) => "no".into(),
                        },
                        format!("{} {} {}", p.peer, p.peer_nic, p.peer_address),
                        format!("{:.0} s ago", p.age_ms as f64 / 1e3),
                    ]);
                }
            }
            for h in hosts {
                let (free, nics, vms) = match &h.info {
                    Some(i) => (
                        format!(
                            "{} of {}",
                            human_bytes(i.memory_free),
                            human_bytes(i.memory_total)
                        ),
                        i.nics
                            .iter()
                            .map(|n| {
                                format!(
                                    "{}:{}{}",
                                    n.name,
                                    n.address,
                                    if n.up { "" } else { "(down)" }
                                )
                            })
                            .collect::<Vec<_>>()
                            .join(" "),
                        i.vms
                            .iter()
                            .map(|v| v.name.clone())
                            .collect::<Vec<_>>()
                            .join(","),
                    ),
                    None => (
                        "-".into(),
                        h.error.clone().unwrap_or_default(),
                        String::new(),
                    ),
                };
                t.row(vec![
                    h.name,
                    match (h.reachable, h.down, h.last_heartbeat_ms) {
                        (true, false, _) => "up".into(),
                        (_, true, Some(ms)) => {
                            format!("DOWN (no heartbeat for {:.1} s)", ms as f64 / 1e3)
                        }
                        (_, true, None) => "DOWN (never answered)".into(),
                        (false, false, _) => "UNREACHABLE".into(),
                    },
                    free,
                    nics,
                    vms,
                ]);
            }
            t.print();
            if any_path {
                println!();
                paths.print();
            }
            Ok(0)
        }
    }
}

/// Runs a drain through the control API: a bar per VM and one overall (or
/// NDJSON events with `json`), then a report table. Returns the report.
pub async fn drain_host(
    c: &Client,
    host: &str,
    req: &DrainRequest,
    json: bool,
) -> anyhow::Result<DrainReport> {
    use indicatif::MultiProgress;
    let mut events = c
        .post_events::<_, DrainEvent>(&format!("/hosts/{host}/drain"), req)
        .await?;
    let mp = MultiProgress::new();
    if json {
        mp.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let style = ProgressStyle::with_template("{prefix:>24} [{bar:30}] {bytes}/{total_bytes} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    let overall = mp.add(ProgressBar::new(0));
    overall.set_style(style.clone());
    overall.set_prefix(format!("drain {host}"));
    let mut bars: std::collections::BTreeMap<String, ProgressBar> = Default::default();
    let say = |mp: &MultiProgress, line: String| {
        if mp.is_hidden() {
            if !json {
                println!("{line}");
            }
        } else {
            let _ = mp.println(line);
        }
    };
    let mut moved_bytes = 0u64;
    while let Some(ev) = events.next().await {
        let ev = ev?;
        if json {
            println!("{}", serde_json::to_string(&ev).unwrap_or_default());
        }
        match ev {
            DrainEvent::Plan {
                moves,
                unplaceable,
                limit,
            } => {
                overall.set_length(moves.iter().map(|m| m.memory).sum::<u64>().max(1));
                for m in &moves {
                    say(
                        &mp,
                        format!(
                            "  plan        {} ({}) → {}",
                            m.vm,
                            human_bytes(m.memory),
                            m.to
                        ),
                    );
                }
                for u in &unplaceable {
                    say(
                        &mp,
                        format!(
                            "  stays       {} ({}): {}",
                            u.vm,
                            human_bytes(u.memory),
                            u.reason
                        ),
                    );
                }
                say(
                    &mp,
                    format!("  limit       {limit} simultaneous migrations"),
                );
            }
            DrainEvent::Started { vm, to, attempt } => {
                let b = mp.add(ProgressBar::new(1));
                b.set_style(style.clone());
                b.set_prefix(format!("{vm} → {to}"));
                if attempt > 1 {
                    b.set_message(format!("attempt {attempt}"));
                }
                bars.insert(vm, b);
            }
            DrainEvent::Progress {
                vm,
                remaining,
                total,
                ..
            } => {
                if let Some(b) = bars.get(&vm) {
                    b.set_length(total.max(1));
                    b.set_position(total.saturating_sub(remaining));
                }
            }
            DrainEvent::Moved(d) => {
                if let Some(b) = bars.remove(&d.vm) {
                    b.finish_and_clear();
                }
                moved_bytes += d.bytes;
                overall
                    .set_position(overall.position() + d.bytes.min(overall.length().unwrap_or(0)));
                say(
                    &mp,
                    format!(
                        "  moved       {} → {} in {:.1} s, downtime {} ms{}",
                        d.vm,
                        d.to,
                        d.total_ms as f64 / 1000.0,
                        d.downtime_ms,
                        if d.attempts > 1 {
                            format!(" (attempt {})", d.attempts)
                        } else {
                            String::new()
                        }
                    ),
                );
            }
            DrainEvent::Retry {
                vm,
                failed_on,
                reason,
                next,
            } => {
                if let Some(b) = bars.remove(&vm) {
                    b.abandon();
                }
                say(
                    &mp,
                    format!("  retry       {vm}: failed on {failed_on} ({reason}); next {next}"),
                );
            }
            DrainEvent::Failed { vm, reason } => {
                if let Some(b) = bars.remove(&vm) {
                    b.abandon();
                }
                say(&mp, format!("  FAILED      {vm}: {reason}"));
            }
            DrainEvent::Limit { limit, reason } => {
                say(&mp, format!("  limit       {limit}: {reason}"))
            }
            DrainEvent::Warning { message } => say(&mp, format!("  warning     {message}")),
            DrainEvent::Classes { nics, .. } => {
                let per_nic: Vec<String> = nics
                    .iter()
                    .filter(|n| n.up && !n.classes.is_empty())
                    .map(|n| {
                        let c: Vec<String> = n
                            .classes
                            .iter()
                            .map(|c| format!("{} {:.0}", c.class.name(), c.tx_rate / 1e6))
                            .collect();
                        format!("{}: {}", n.nic, c.join(", "))
                    })
                    .collect();
                overall.set_message(format!("Mbit/s {}", per_nic.join(" | ")));
            }
            DrainEvent::Done(r) => {
                overall.finish_and_clear();
                if !json {
                    print_drain(&r, moved_bytes);
                }
                return Ok(r);
            }
        }
    }
    anyhow::bail!("the drain's event stream ended without a report")
}

pub fn print_drain(r: &DrainReport, bytes: u64) {
    let mut t = Table::new(&[
        "VM", "TO", "TOTAL", "TRANSFER", "DOWNTIME", "MOVED", "ATTEMPTS",
    ]);
    for d in &r.moved {
        t.row(vec![
            d.vm.clone(),
            d.to.clone(),
            format!("{:.2} s", d.total_ms as f64 / 1000.0),
            format!("{:.2} s", d.transfer_ms as f64 / 1000.0),
            format!("{} ms", d.downtime_ms),
            human_bytes(d.bytes),
            d.attempts.to_string(),
        ]);
    }
    for u in r.unplaceable.iter().chain(&r.failed) {
        t.row(vec![
            u.vm.clone(),
            format!("stays on {}", r.host),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            u.reason.clone(),
        ]);
    }
    t.print();
    println!(
        "drained {}: {} moved, {} stayed, {} in {:.1} s (limits {:?})",
        r.host,
        r.moved.len(),
        r.unplaceable.len() + r.failed.len(),
        human_bytes(bytes),
        r.total_ms as f64 / 1000.0,
        r.limits
    );
}
