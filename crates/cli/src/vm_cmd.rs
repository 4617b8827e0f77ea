//! `ferry vm …`: a thin front end over the control API (`ferry host` is in `host_cmd`).

use std::time::Duration;

use clap::Subcommand;
use ferry_api::size::{human_bytes, parse_size};
use ferry_api::{
    ApiError, AtExpiry, CheckResult, ConvergenceChoice, MigrationEvent, MigrationOption,
    MigrationReport, MoveRequest, VmCreateRequest, VmInfo, VmSpec,
};
use ferry_net::client::Client;
use futures::StreamExt;

use crate::output::{mbit, print_json, shorten, Table};
use crate::Cli;

pub(crate) const T: Duration = Duration::from_secs(90);

// parsed once per process: a large variant costs nothing worth boxing
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub enum VmCmd {
    /// Create and boot a VM on a host: the lab's workload guest, or a
    /// user's VM from `--spec FILE` and hardware flags.
    Create {
        name: String,
        /// The host to run it on; without it, the placement engine picks
        /// one (the placement rules, then the most free memory).
        #[arg(long)]
        host: Option<String>,
        /// Guest memory (e.g. 1G); required unless the spec file gives it.
        #[arg(long)]
        memory: Option<String>,
        /// Memory the workload fills with its verifiable pattern
        /// (default: 75% of --memory, leaving the guest at least 128M).
        #[arg(long)]
        fill: Option<String>,
        /// Bytes per second the workload rewrites (default 8M).
        #[arg(long)]
        dirty_rate: Option<String>,
        /// Bytes per second the workload re-verifies.
        #[arg(long, default_value = "32M")]
        verify_rate: String,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Fill memory with a pattern that compresses (~7x) instead of not at all.
        #[arg(long)]
        compressible: bool,
        #[command(flatten)]
        hardware: crate::vm_spec::HardwareArgs,
        /// Restart it on another host when its host fails.
        #[arg(long)]
        ha: bool,
        /// HA restart priority, higher first (0..=1000, default 100).
        #[arg(long, requires = "ha")]
        priority: Option<u32>,
        #[arg(long)]
        json: bool,
    },
    /// Boot a stopped VM on its host (or on --host).
    Start {
        name: String,
        /// Boot it on this host instead of its placement.
        #[arg(long)]
        host: Option<String>,
        /// Its host does not answer and is known to be powered off (or
        /// fenced): start it elsewhere all the same (admin). If that host
        /// ran it and came back, two copies would run.
        #[arg(long, requires = "host")]
        confirm_powered_off: bool,
        #[arg(long)]
        json: bool,
    },
    /// Stop a VM at once (QEMU ends; the guest is not asked). It keeps its
    /// definition, disks and placement.
    Stop {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Ask the guest to power off (ACPI); stopped when it has not within
    /// --timeout.
    Shutdown {
        name: String,
        /// Seconds the guest has (1..=3600).
        #[arg(long, default_value_t = ferry_api::ha::DEFAULT_SHUTDOWN_S)]
        timeout: u64,
        #[arg(long)]
        json: bool,
    },
    /// Reset the guest (a hard reboot; QEMU runs on).
    Reboot {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Shut down, then start.
    Restart {
        name: String,
        #[arg(long, default_value_t = ferry_api::ha::DEFAULT_SHUTDOWN_S)]
        timeout: u64,
        #[arg(long)]
        json: bool,
    },
    /// Change a VM's HA policy.
    Set {
        name: String,
        /// on|off: restarted elsewhere when its host fails.
        #[arg(long, value_parser = ["on", "off"])]
        ha: Option<String>,
        #[arg(long)]
        priority: Option<u32>,
        /// At most N restarts …
        #[arg(long)]
        restart_limit: Option<u32>,
        /// … within this many seconds; past it, left stopped.
        #[arg(long)]
        restart_window: Option<u64>,
        #[arg(long)]
        json: bool,
    },
    /// List VMs and where they run.
    List {
        #[arg(long)]
        json: bool,
    },
    /// The end of the VM's serial console, read on its host.
    Console {
        name: String,
        /// How much of the log's end (at most 1M).
        #[arg(long, default_value = "16K")]
        bytes: String,
        #[arg(long)]
        json: bool,
    },
    /// Is the guest intact and still running? Exit status 1 if not.
    Check {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Show and settle a migration of the VM left in doubt (its RUN
    /// unanswered, or a post-copy broken): each host with a record asks the
    /// other side now. Exit status 1 while it stays in doubt.
    Resolve {
        name: String,
        /// The migration's target host is gone for good: resume the guest on
        /// its source (admin). Needs --confirm-powered-off.
        #[arg(long, value_name = "HOST")]
        target_lost: Option<String>,
        /// Confirms that the host given to --target-lost is powered off or
        /// fenced: if it ran the guest and came back, two copies would run.
        #[arg(long)]
        confirm_powered_off: bool,
        /// The target runs the whole guest although the source QEMU never
        /// reported its post-copy completed: stop the source QEMU (admin).
        #[arg(long)]
        target_has_all: bool,
        #[arg(long)]
        json: bool,
    },
    /// Stop and remove a VM.
    Rm { name: String },
    /// Live-migrate a VM to another host.
    Move {
        name: String,
        #[arg(long)]
        to: String,
        /// Performance option: tcp (QEMU's one stream, one NIC), multichannel
        /// (every healthy NIC through Ferry's transport), compression (the
        /// transport on one NIC, frames compressed when that wins), auto
        /// (multichannel with compression when it wins; default: the source
        /// host's setting, else auto).
        #[arg(long, value_enum)]
        option: Option<OptionArg>,
        #[command(flatten)]
        convergence: ConvergenceArgs,
        /// Print NDJSON events instead of a progress bar.
        #[arg(long)]
        json: bool,
    },
}

/// Convergence flags, for one move (`vm move`) or as a host's default
/// (`host set`); what is not given comes from the host, then the defaults
/// (throttle allow, post-copy forbid, 150 s per GiB, 300 ms downtime).
#[derive(clap::Args, Clone)]
pub struct ConvergenceArgs {
    /// If pre-copy does not converge: switch to post-copy (allow) or not (forbid).
    #[arg(long, value_enum)]
    postcopy: Option<Allow>,
    /// Let QEMU throttle the guest's vCPUs when pre-copy does not converge.
    #[arg(long, value_enum)]
    throttle: Option<Allow>,
    /// Pre-copy time allowed per GiB of guest memory, seconds (at least 20 s in all).
    #[arg(long)]
    timeout_per_gib: Option<u64>,
    /// At the timeout: postcopy, pause (pause the guest and copy the rest) or
    /// cancel (default: postcopy when allowed, else cancel).
    #[arg(long, value_enum)]
    at_expiry: Option<ExpiryArg>,
    /// The most downtime the guest may see, e.g. 100ms or 1s: Ferry keeps
    /// copying until the switch-over fits it. auto (default): at most 300
    /// ms, aiming for the smallest the guest's dirtying allows.
    #[arg(long)]
    max_downtime: Option<String>,
}

impl ConvergenceArgs {
    pub(crate) fn choice(&self) -> Result<ConvergenceChoice, ApiError> {
        let (max_downtime_ms, downtime_auto) = match self.max_downtime.as_deref() {
            None => (None, None),
            Some("auto") => (None, Some(true)),
            Some(s) => (Some(parse_ms("--max-downtime", s)?), Some(false)),
        };
        Ok(ConvergenceChoice {
            throttle: self.throttle.map(|a| a == Allow::Allow),
            postcopy: self.postcopy.map(|a| a == Allow::Allow),
            timeout_per_gib_s: self.timeout_per_gib,
            at_expiry: self.at_expiry.map(|e| match e {
                ExpiryArg::Postcopy => AtExpiry::Postcopy,
                ExpiryArg::Pause => AtExpiry::Pause,
                ExpiryArg::Cancel => AtExpiry::Cancel,
            }),
            max_downtime_ms,
            downtime_auto,
        })
    }
}

/// `300ms`, `2s` or a bare number of milliseconds; errors name the flag.
fn parse_ms(flag: &str, s: &str) -> Result<u64, ApiError> {
    let t = s.trim();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1000.0)
    } else {
        (t, 1.0)
    };
    match num.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok((v * scale).round() as u64),
        _ => Err(ApiError::invalid(
            flag,
            format!("'{s}' is not a duration such as 300ms or 1s"),
        )),
    }
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExpiryArg {
    Postcopy,
    Pause,
    Cancel,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Allow {
    Allow,
    Forbid,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum OptionArg {
    Tcp,
    Multichannel,
    Compression,
    Mptcp,
    MptcpRelay,
    Auto,
}

impl From<OptionArg> for MigrationOption {
    fn from(o: OptionArg) -> Self {
        match o {
            OptionArg::Tcp => MigrationOption::Tcp,
            OptionArg::Multichannel => MigrationOption::Multichannel,
            OptionArg::Compression => MigrationOption::Compression,
            OptionArg::Mptcp => MigrationOption::Mptcp,
            OptionArg::MptcpRelay => MigrationOption::MptcpRelay,
            OptionArg::Auto => MigrationOption::Auto,
        }
    }
}

/// Builds a VM spec from CLI sizes; errors name the flag.
pub fn spec_from_args(
    name: &str,
    memory: &str,
    fill: Option<&str>,
    dirty: &str,
    verify: &str,
    seed: u64,
) -> Result<VmSpec, ApiError> {
    let memory = parse_size("--memory", memory)?;
    let fill = match fill {
        Some(f) => parse_size("--fill", f)?,
        None => (memory / 4 * 3).min(memory.saturating_sub(ferry_api::GUEST_OVERHEAD)),
    };
    let spec = VmSpec {
        verify_rate: parse_size("--verify-rate", verify)?,
        seed,
        ..VmSpec::workload(name, memory, fill, parse_size("--dirty-rate", dirty)?)
    };
    spec.validate().map_err(|e| match e {
        ApiError::InvalidArgument { field, reason } => ApiError::InvalidArgument {
            field: format!("--{field}").replace('_', "-"),
            reason,
        },
        e => e,
    })?;
    Ok(spec)
}

pub async fn run_vm(cli: &Cli, cmd: &VmCmd) -> anyhow::Result<i32> {
    // the credential is read after the arguments are checked, so a bad flag
    // is named even where no cluster is reachable
    let client = || cli.client();
    match cmd {
        VmCmd::Create {
            name,
            host,
            memory,
            fill,
            dirty_rate,
            verify_rate,
            seed,
            compressible,
            hardware,
            ha,
            priority,
            json,
        } => {
            let spec = if hardware.any() {
                let mut spec = match &hardware.spec {
                    Some(file) => crate::vm_spec::read_spec_file(file, name)?,
                    None => {
                        let memory = memory.as_deref().ok_or_else(|| {
                            ApiError::invalid(
                                "--memory",
                                "give --memory or a --spec file with memory",
                            )
                        })?;
                        VmSpec::workload(name, parse_size("--memory", memory)?, 0, 0)
                    }
                };
                if let Some(m) = memory {
                    spec.memory = parse_size("--memory", m)?;
                }
                if let Some(f) = fill {
                    spec.fill = parse_size("--fill", f)?;
                }
                if let Some(d) = dirty_rate {
                    spec.dirty_rate = parse_size("--dirty-rate", d)?;
                }
                spec.seed = *seed;
                hardware.apply(&mut spec)?;
                spec.validate()?;
                spec
            } else {
                let memory = memory.as_deref().ok_or_else(|| {
                    ApiError::invalid("--memory", "give the guest's memory (e.g. 1G)")
                })?;
                let mut spec = spec_from_args(
                    name,
                    memory,
                    fill.as_deref(),
                    dirty_rate.as_deref().unwrap_or("8M"),
                    verify_rate,
                    *seed,
                )?;
                spec.compressible = *compressible;
                hardware.apply(&mut spec)?;
                spec.validate()?;
                spec
            };
            let vm: VmInfo = client()?
                .post(
                    "/vms",
                    &VmCreateRequest {
                        host: host.clone().unwrap_or_default(),
                        spec,
                        ha: ha.then(|| ferry_api::ha::HaPolicy {
                            enabled: true,
                            priority: priority.unwrap_or(100),
                            ..Default::default()
                        }),
                    },
                    T,
                )
                .await?;
            if *json {
                print_json(&vm);
            } else {
                println!(
                    "vm {} started on {} ({} memory, {} filled)",
                    vm.name,
                    vm.host,
                    human_bytes(vm.spec.memory),
                    human_bytes(vm.spec.fill)
                );
            }
            Ok(0)
        }
        VmCmd::Start {
            name,
            host,
            confirm_powered_off,
            json,
        } => {
            let req = ferry_api::ha::ActionRequest {
                timeout_s: None,
                host: host.clone(),
                confirm_powered_off: *confirm_powered_off,
            };
            let v: VmInfo = client()?
                .post(&format!("/vms/{name}/start"), &req, T)
                .await?;
            if *json {
                print_json(&v);
            } else {
                println!("vm {} started on {}", v.name, v.host);
            }
            Ok(0)
        }
        VmCmd::Stop { name, json } | VmCmd::Reboot { name, json } => {
            let action = if matches!(cmd, VmCmd::Stop { .. }) {
                "stop"
            } else {
                "reboot"
            };
            let r: ferry_api::ha::Stopped = client()?
                .post(&format!("/vms/{name}/{action}"), &serde_json::json!({}), T)
                .await?;
            print_stopped(&r, *json);
            Ok(0)
        }
        VmCmd::Shutdown {
            name,
            timeout,
            json,
        } => {
            let req = ferry_api::ha::ActionRequest {
                timeout_s: Some(*timeout),
                ..Default::default()
            };
            let r: ferry_api::ha::Stopped = client()?
                .post(
                    &format!("/vms/{name}/shutdown"),
                    &req,
                    Duration::from_secs(timeout + 30),
                )
                .await?;
            print_stopped(&r, *json);
            Ok(0)
        }
        VmCmd::Restart {
            name,
            timeout,
            json,
        } => {
            let req = ferry_api::ha::ActionRequest {
                timeout_s: Some(*timeout),
                ..Default::default()
            };
            let r: serde_json::Value = client()?
                .post(
                    &format!("/vms/{name}/restart"),
                    &req,
                    Duration::from_secs(timeout + 90),
                )
                .await?;
            if *json {
                print_json(&r);
            } else {
                println!(
                    "vm {name}: {} and started on {}",
                    r["shutdown"]["how"]
                        .as_str()
                        .unwrap_or("?")
                        .replace('_', " "),
                    r["started"]["host"].as_str().unwrap_or("?")
                );
            }
            Ok(0)
        }
        VmCmd::Set {
            name,
            ha,
            priority,
            restart_limit,
            restart_window,
            json,
        } => {
            let u = ferry_api::ha::HaUpdate {
                enabled: ha.as_deref().map(|s| s == "on"),
                priority: *priority,
                restart_limit: *restart_limit,
                restart_window_s: *restart_window,
            };
            if u == ferry_api::ha::HaUpdate::default() {
                return Err(ApiError::invalid(
                    "ferry vm set",
                    "give at least one of --ha, --priority, --restart-limit, --restart-window",
                )
                .into());
            }
            let p: ferry_api::ha::HaPolicy =
                client()?.put(&format!("/vms/{name}/ha"), &u, T).await?;
            if *json {
                print_json(&p);
            } else {
                println!(
                    "vm {name}: HA {}, priority {}, at most {} restarts in {} s",
                    if p.enabled { "on" } else { "off" },
                    p.priority,
                    p.restart_limit,
                    p.restart_window_s
                );
            }
            Ok(0)
        }
        VmCmd::List { json } => {
            let vms: Vec<VmInfo> = client()?.get("/vms", T).await?;
            if *json {
                print_json(&vms);
            } else {
                let mut t = Table::new(&[
                    "NAME", "HOST", "STATE", "MEMORY", "FILL", "DIRTY/S", "CPU", "ACCEL", "PID",
                    "QEMU",
                ]);
                let in_clear = vms.iter().any(|v| v.moves_encrypted == Some(false));
                for v in vms {
                    let now = ferry_api::util::now_ms();
                    let state = match (&v.in_doubt, &v.problem, &v.storage_pause) {
                        (Some(_), _, _) => format!("{} (in doubt)", v.state),
                        // paused now, or stopped by the pause's window
                        (None, _, Some(p)) if p.state != ferry_api::PauseState::Resumed => {
                            p.describe(now)
                        }
                        (None, Some(_), _) => format!("{} (check failed)", v.state),
                        _ => v.state,
                    };
                    t.row(vec![
                        v.name,
                        v.host,
                        state,
                        human_bytes(v.spec.memory),
                        human_bytes(v.spec.fill),
                        human_bytes(v.spec.dirty_rate),
                        v.spec.cpu.clone(),
                        v.accel.clone(),
                        v.pid.map(|p| p.to_string()).unwrap_or_default(),
                        match &v.confinement {
                            Some(c) if c.holds() => format!("uid {}, seccomp", c.uid),
                            Some(c) => format!("NOT CONFINED (uid {})", c.uid),
                            None => String::new(),
                        },
                    ]);
                }
                t.print();
                if in_clear {
                    println!(
                        "moves: IN CLEAR (cluster setting encryption = off: guest memory \
                         crosses the migration network unencrypted)"
                    );
                }
            }
            Ok(0)
        }
        VmCmd::Console { name, bytes, json } => {
            let n = parse_size("--bytes", bytes)?;
            let r: ferry_api::ConsoleTail = client()?
                .get(&format!("/vms/{name}/console?bytes={n}"), T)
                .await?;
            if *json {
                print_json(&r);
            } else {
                print!("{}", r.text);
            }
            Ok(0)
        }
        VmCmd::Check { name, json } => {
            let r: CheckResult = client()?.get(&format!("/vms/{name}/check"), T).await?;
            if *json {
                print_json(&r);
            } else {
                print_check(&r);
            }
            Ok(if r.ok() { 0 } else { 1 })
        }
        VmCmd::Resolve {
            name,
            target_lost,
            confirm_powered_off,
            target_has_all,
            json,
        } => {
            let req = ferry_api::ResolveRequest {
                target_lost: target_lost.clone(),
                confirm_powered_off: *confirm_powered_off,
                target_has_all: *target_has_all,
            };
            // refused here before anything is asked, with the same words
            req.check()?;
            let r: Vec<ferry_api::ResolveReport> = client()?
                .post(&format!("/vms/{name}/resolve"), &req, T)
                .await?;
            if *json {
                print_json(&r);
            } else if r.is_empty() {
                println!("{name}: no migration in doubt");
            } else {
                for x in &r {
                    println!(
                        "{} on {} ({} of migration {}): {} → {}{}: {}",
                        x.vm,
                        x.host,
                        x.side,
                        x.migration_id,
                        x.phase_before,
                        x.phase,
                        if x.in_doubt { ", still in doubt" } else { "" },
                        x.detail
                    );
                }
            }
            Ok(if r.iter().any(|x| x.in_doubt) { 1 } else { 0 })
        }
        VmCmd::Rm { name } => {
            let _: serde_json::Value = client()?.delete(&format!("/vms/{name}"), T).await?;
            println!("vm {name} removed");
            Ok(0)
        }
        VmCmd::Move {
            name,
            to,
            option,
            convergence,
            json,
        } => {
            let conv = convergence.choice()?;
            let outcome =
                move_vm(&client()?, name, to, option.map(Into::into), conv, *json).await?;
            match outcome {
                Ok(report) => {
                    if !*json {
                        print_report(&report);
                    }
                    Ok(0)
                }
                Err(e) => {
                    if !*json {
                        eprintln!("error: {e}");
                    }
                    Ok(1)
                }
            }
        }
    }
}

pub fn print_check(r: &CheckResult) {
    let console = if r.problems.is_empty() {
        String::new()
    } else {
        format!("; console: {}", r.problems.join(" | "))
    };
    let verdict = if r.ok() { "OK" } else { "NOT OK" };
    match r.vcpu_ms {
        // a user's guest: its vCPUs, and its guest agent when it has one
        Some(ms) => println!(
            "{} on {}: {verdict} — QEMU {}, vCPUs used {ms} ms during the check ({}){}{console}",
            r.vm,
            r.host,
            r.qemu_status,
            if r.advancing { "advancing" } else { "stalled" },
            match r.guest_agent {
                Some(true) => ", guest agent answers and its clock advances",
                Some(false) => ", guest agent NOT answering",
                None => "",
            },
        ),
        None => println!(
            "{} on {}: {verdict} — QEMU {}, counter {}→{} ({}), {} integrity errors, {} full sweeps{console}",
            r.vm,
            r.host,
            r.qemu_status,
            r.tick_first.map(|t| t.to_string()).unwrap_or("-".into()),
            r.tick_last.map(|t| t.to_string()).unwrap_or("-".into()),
            if r.advancing { "advancing" } else { "stalled" },
            r.errors,
            r.sweeps.unwrap_or(0),
        ),
    }
}

/// Runs a move through the control API, rendering events as a progress bar
/// (or NDJSON lines with `json`). Returns the report or the migration's error.
pub async fn move_vm(
    c: &Client,
    name: &str,
    to: &str,
    option: Option<MigrationOption>,
    convergence: ConvergenceChoice,
    json: bool,
) -> anyhow::Result<Result<MigrationReport, ApiError>> {
    let mut events = c
        .post_events::<_, MigrationEvent>(
            &format!("/vms/{name}/move"),
            &MoveRequest {
                to: to.into(),
                option,
                convergence,
            },
        )
        .await?;
    let bar = crate::output::byte_bar(format!("{name} → {to}"), 1, json);
    let mut outcome = Err(ApiError::internal(
        "the event stream ended without a result",
    ));
    while let Some(ev) = events.next().await {
        let ev = ev.unwrap_or_else(|error| MigrationEvent::Failed { error });
        if json {
            println!("{}", serde_json::to_string(&ev).unwrap_or_default());
        }
        match ev {
            MigrationEvent::Step { step, detail } if !json => {
                let line = format!("  {step:<12} {detail}");
                if bar.is_hidden() {
                    println!("{line}");
                } else {
                    bar.println(line);
                }
            }
            MigrationEvent::Step { .. } => {}
            MigrationEvent::Warning { message } if !json => {
                let line = format!("warning: {message}");
                if bar.is_hidden() {
                    eprintln!("{line}");
                } else {
                    bar.println(line);
                }
            }
            MigrationEvent::Warning { .. } => {}
            MigrationEvent::Path(c) if !json => {
                let line = format!("  path         {} {}: {}", c.nic, c.action, c.reason);
                if bar.is_hidden() {
                    println!("{line}");
                } else {
                    bar.println(line);
                }
            }
            MigrationEvent::Path(_) => {}
            MigrationEvent::Progress(p) => {
                bar.set_length(p.total.max(1));
                bar.set_position(p.total.saturating_sub(p.remaining));
                let per_nic: Vec<String> = p
                    .nic_tx_bytes
                    .iter()
                    .filter(|(_, b)| **b > 0)
                    .map(|(n, b)| format!("{n} {}", human_bytes(*b)))
                    .collect();
                let eta = match (p.converging, p.eta_ms) {
                    (Some(false), _) => "not converging (dirty ≥ path)".to_string(),
                    (_, Some(ms)) => format!("switch-over in ~{:.1}s", ms as f64 / 1000.0),
                    _ => "switch-over in -".to_string(),
                };
                if p.phase == "disks" {
                    bar.set_message(format!(
                        "disks {} copied {} of {} [{}]",
                        mbit(p.throughput),
                        human_bytes(p.transferred),
                        human_bytes(p.total),
                        per_nic.join(", ")
                    ));
                    continue;
                }
                bar.set_message(format!(
                    "{} {} sent {}, dirty {}/s, round {}, throttle {}%, {eta} [{}]",
                    p.phase,
                    mbit(p.throughput),
                    human_bytes(p.transferred),
                    human_bytes(p.dirty_rate),
                    p.rounds,
                    p.throttle_pct,
                    per_nic.join(", ")
                ));
            }
            MigrationEvent::Completed(r) => {
                bar.finish_and_clear();
                outcome = Ok(*r);
                break;
            }
            MigrationEvent::Failed { error } => {
                bar.abandon();
                outcome = Err(error);
                break;
            }
        }
    }
    Ok(outcome)
}

pub fn print_report(r: &MigrationReport) {
    println!(
        "moved {} {} → {} in {:.2} s (running there after {:.2} s, transfer {:.2} s), downtime {} ms seen by the guest (QEMU {} ms, then {} ms to run it; at most {} ms asked), {} at {} over {}; {} rounds",
        r.vm,
        r.from,
        r.to,
        r.total_ms as f64 / 1000.0,
        r.running_ms as f64 / 1000.0,
        r.transfer_ms as f64 / 1000.0,
        r.guest_downtime_ms,
        r.downtime_ms,
        r.guest_downtime_ms.saturating_sub(r.downtime_ms),
        r.max_downtime_ms,
        human_bytes(r.bytes_transferred),
        mbit(r.throughput),
        r.data_path,
        r.rounds
    );
    let per_nic: Vec<String> = r
        .nic_tx_bytes
        .iter()
        .map(|(n, b)| format!("{n} {}", human_bytes(*b)))
        .collect();
    if !r.downtime_reason.is_empty() {
        println!("  downtime: {}", r.downtime_reason);
    }
    println!("  bytes per NIC: {}", per_nic.join(", "));
    if !r.disks.is_empty() {
        let d: Vec<String> = r
            .disks
            .iter()
            .map(|d| {
                format!(
                    "{} ({}, {} moved)",
                    d.name,
                    human_bytes(d.size),
                    human_bytes(d.bytes)
                )
            })
            .collect();
        let per_nic: Vec<String> = r
            .disk_nic_tx_bytes
            .iter()
            .map(|(n, b)| format!("{n} {}", human_bytes(*b)))
            .collect();
        println!(
            "  local drives: {}, in step after {:.1} s; bytes per NIC: {}",
            d.join(", "),
            r.disks[0].ready_ms as f64 / 1000.0,
            per_nic.join(", ")
        );
    }
    match (r.cpu.target_s, r.cpu.per_gib_s) {
        (Some(t), Some(g)) => println!(
            "  CPU: {:.2} s source + {t:.2} s target = {g:.2} s per GiB moved (QEMU and agent)",
            r.cpu.source_s
        ),
        _ => println!("  CPU: {:.2} s source (QEMU and agent)", r.cpu.source_s),
    }
    if let Some(q) = &r.qemu_codec {
        println!(
            "  QEMU compressed: {} {:.2}× ({:.1} MiB of pages in {:.1} MiB), {:.2} CPU-s in its send threads",
            q.codec,
            q.ratio,
            q.raw_bytes as f64 / 1048576.0,
            q.sent_bytes as f64 / 1048576.0,
            q.cpu_s
        );
    }
    if r.compression_ratio > 1.0 {
        let codecs: Vec<String> = r
            .codecs
            .iter()
            .map(|c| {
                format!(
                    "{} {:.0}% of bytes at {:.2}×, {:.2} CPU-s",
                    c.codec,
                    c.share * 100.0,
                    c.ratio,
                    c.cpu_s
                )
            })
            .collect();
        println!(
            "  compression: {:.2}× over {} frames ({})",
            r.compression_ratio,
            r.frames_compressed,
            codecs.join("; ")
        );
    }
    if r.phase != "precopy" || r.max_throttle_pct > 0 {
        println!(
            "  converged in {}, vCPU throttle up to {}%",
            r.phase, r.max_throttle_pct
        );
    }
    if !r.carriers.is_empty() {
        let c: Vec<String> = r
            .carriers
            .iter()
            .map(|c| {
                format!(
                    "{} {} ({} failures)",
                    c.nic,
                    if c.up { "up" } else { "down" },
                    c.failures
                )
            })
            .collect();
        println!(
            "  carriers{}: {}; {} frames resent",
            if r.encryption == "sealed-carriers" {
                " (sealed, AES-256-GCM)"
            } else {
                ""
            },
            c.join(", "),
            r.frames_resent
        );
    }
    print!("  ");
    print_check(&r.check);
}

/// `ferry events`: the event log as a table or JSON.
pub async fn events(cli: &Cli, limit: usize, json: bool) -> anyhow::Result<i32> {
    let c = cli.client()?;
    let ev: Vec<ferry_api::Event> = c.get(&format!("/events?limit={limit}"), T).await?;
    if json {
        print_json(&ev);
        return Ok(0);
    }
    let mut t = Table::new(&["ID", "AGE", "KIND", "SUBJECT", "DETAIL"]);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    for e in ev {
        let detail = shorten(&e.detail.to_string(), 80);
        t.row(vec![
            e.id.to_string(),
            format!("{:.0} s", now.saturating_sub(e.at_ms) as f64 / 1e3),
            e.kind,
            e.subject,
            detail,
        ]);
    }
    t.print();
    Ok(0)
}

/// `ferry operations [ID]`: migrations and drains the control service
/// runs or ran; with an ID, that one's events.
pub async fn operations(cli: &Cli, id: Option<&str>, json: bool) -> anyhow::Result<i32> {
    let c = cli.client()?;
    if let Some(id) = id {
        let op: ferry_api::Operation = c.get(&format!("/operations/{id}"), T).await?;
        if json {
            print_json(&op);
        } else {
            for ev in &op.events {
                let kind = ev.get("event").and_then(|e| e.as_str()).unwrap_or("?");
                println!("{kind:>9}  {}", shorten(&ev.to_string(), 111));
            }
            let to = op
                .target
                .as_deref()
                .map(|t| format!(" → {t}"))
                .unwrap_or_default();
            println!(
                "{} {} on {}{to}: {} ({} events, by {})",
                format!("{:?}", op.kind).to_lowercase(),
                op.subject,
                op.source,
                format!("{:?}", op.state).to_lowercase(),
                op.event_count,
                op.by
            );
        }
        return Ok(0);
    }
    let ops: Vec<ferry_api::Operation> = c.get("/operations", T).await?;
    if json {
        print_json(&ops);
        return Ok(0);
    }
    let mut t = Table::new(&["ID", "KIND", "SUBJECT", "FROM", "TO", "BY", "STATE"]);
    for o in ops {
        t.row(vec![
            o.id,
            format!("{:?}", o.kind).to_lowercase(),
            o.subject,
            o.source,
            o.target.unwrap_or_default(),
            o.by,
            format!("{:?}", o.state).to_lowercase(),
        ]);
    }
    t.print();
    Ok(0)
}

/// A stop, shutdown or reboot as `--json` or a line.
fn print_stopped(r: &ferry_api::ha::Stopped, json: bool) {
    if json {
        print_json(r);
    } else {
        println!(
            "vm {} on {}: {} ({} ms)",
            r.vm,
            r.host,
            r.how.replace('_', " "),
            r.took_ms
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_sizes_become_a_spec() {
        let s = spec_from_args("vm1", "1G", Some("768M"), "20M", "32M", 1).unwrap();
        assert_eq!(
            (s.memory, s.fill, s.dirty_rate),
            (1 << 30, 768 << 20, 20 << 20)
        );
        assert_eq!(
            spec_from_args("vm1", "1G", None, "0", "1M", 1)
                .unwrap()
                .fill,
            768 << 20
        );
    }

    #[test]
    fn bad_sizes_name_the_flag() {
        let e = spec_from_args("vm1", "lots", None, "1M", "1M", 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--memory"), "{e}");
        let e = spec_from_args("vm1", "1G", Some("2G"), "1M", "1M", 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--fill"), "{e}");
    }
}
