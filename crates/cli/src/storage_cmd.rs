//! `ferry disk …` and `ferry qos …`: thin front ends over the control API.

use std::time::Duration;

use clap::{Subcommand, ValueEnum};
use ferry_api::size::{human_bytes, parse_size};
use ferry_api::storage::{
    BackupRequest, CheckpointInfo, CheckpointRequest, DiskAttachRequest, DiskCreateRequest,
    DiskInfo, DiskMoveInfo, DiskMovePhase, DiskMoveRequest, DiskResizeRequest, DiskSetRequest,
    FlowInfo, JobInfo, JobKind, JobState, Policy, PolicyKind, PolicyUpdate, PushInfo, QosSettings,
    ReplicaRequest,
};
use ferry_api::VmInfo;

use crate::output::{print_json, Table};
use crate::Cli;

const T: Duration = Duration::from_secs(60);

#[derive(Subcommand)]
pub enum DiskCmd {
    /// Create a disk (a sparse raw file on a storage node, served over NBD).
    Create {
        name: String,
        /// Size, e.g. 1G.
        #[arg(long)]
        size: String,
        /// Every write is durable before it is acknowledged.
        #[arg(long)]
        write_through: bool,
        /// Storage node (default: the first).
        #[arg(long)]
        node: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Create a disk holding an image file's contents (raw, qcow2 or any
    /// format qemu-img reads), written through the disk's own NBD export.
    Import {
        name: String,
        /// The image file.
        file: std::path::PathBuf,
        #[arg(long)]
        write_through: bool,
        #[arg(long)]
        node: Option<String>,
        /// An administrator's certificate directory for NBD over TLS
        /// (`ferry cluster issue-cert --role admin`; default
        /// /etc/ferry/admin-pki, else the lab's).
        #[arg(long)]
        tls_dir: Option<std::path::PathBuf>,
        #[arg(long)]
        json: bool,
    },
    List {
        #[arg(long)]
        json: bool,
    },
    Resize {
        name: String,
        #[arg(long)]
        size: String,
        #[arg(long)]
        json: bool,
    },
    /// Set the disk's QoS policy (its flows follow it within a second).
    Set {
        name: String,
        #[arg(
            long,
            conflicts_with = "no_policy",
            required_unless_present = "no_policy"
        )]
        policy: Option<String>,
        /// Clear the policy: flows run unlimited.
        #[arg(long)]
        no_policy: bool,
        #[arg(long)]
        json: bool,
    },
    /// Remove a disk (refused while a client is connected).
    Rm { name: String },
    /// Plug a disk into a running VM (several VMs may share one disk).
    Attach {
        disk: String,
        vm: String,
        #[arg(long)]
        json: bool,
    },
    /// Back up a disk while guests write to it: a crash-consistent copy of
    /// the instant the command arrives, written by the disk's storage node
    /// to PATH (on that node) as a sparse raw image, with PATH.json.
    Backup {
        disk: String,
        /// Absolute path on the storage node; must not exist yet.
        #[arg(long = "to")]
        path: String,
        /// Only what changed since the disk's last backup.
        #[arg(long)]
        incremental: bool,
        #[command(flatten)]
        copy: CopyOpts,
    },
    /// The disk's last backup or checkpoint job.
    Job {
        disk: String,
        /// Follow it to its end.
        #[arg(long)]
        wait: bool,
        #[arg(long)]
        json: bool,
    },
    /// Checkpoints: point-in-time copies kept on the disk's storage node.
    #[command(subcommand)]
    Checkpoint(CheckpointCmd),
    /// Move a disk to another storage node while guests use it: copied in
    /// rounds of changes, then the guests pause briefly while the last
    /// changes are copied and their connections switch. A failure before
    /// the switch leaves the disk where it was.
    Move {
        disk: String,
        /// The storage node to move it to.
        #[arg(long)]
        to: String,
        /// The progress as NDJSON lines, then the result.
        #[arg(long)]
        json: bool,
    },
    /// Keep an asynchronous replica of a disk on another storage node:
    /// what changed is copied every period.
    Replicate {
        disk: String,
        #[arg(long)]
        to: String,
        /// The period, e.g. 30s.
        #[arg(long, default_value = "30s")]
        every: String,
        #[arg(long)]
        json: bool,
    },
    /// Replicas: their lag, stopping one, failing over to one.
    #[command(subcommand)]
    Replica(ReplicaCmd),
}

#[derive(Subcommand)]
pub enum ReplicaCmd {
    /// Every replica (or one disk's): where, how far behind, how fast.
    Status {
        disk: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Stop replicating a disk; the replica's copy is removed.
    Stop { disk: String },
    /// The disk's primary node is gone: its replica becomes the disk, and
    /// every VM with it open switches to it.
    Failover {
        disk: String,
        #[arg(long)]
        json: bool,
    },
}

/// How a backup or checkpoint copies, and how the command waits for it.
#[derive(clap::Args)]
pub struct CopyOpts {
    /// Bytes per second the copy may read, e.g. 50M (default: unlimited;
    /// writes racing the copy are copied ahead of them at once regardless).
    #[arg(long)]
    max_rate: Option<String>,
    /// Return once the copy has started.
    #[arg(long)]
    no_wait: bool,
    #[arg(long)]
    json: bool,
}

impl CopyOpts {
    fn max_rate(&self) -> anyhow::Result<Option<u64>> {
        Ok(self
            .max_rate
            .as_deref()
            .map(|r| parse_size("--max-rate", r))
            .transpose()?)
    }
}

#[derive(Subcommand)]
pub enum CheckpointCmd {
    /// Take one while guests write (a full copy of the allocated data).
    Create {
        disk: String,
        name: String,
        #[command(flatten)]
        copy: CopyOpts,
    },
    List {
        disk: String,
        #[arg(long)]
        json: bool,
    },
    /// Make the disk what it was at the checkpoint (refused while a VM has
    /// the disk attached).
    Revert {
        disk: String,
        name: String,
        #[arg(long)]
        json: bool,
    },
    Rm {
        disk: String,
        name: String,
    },
}

#[derive(Subcommand)]
pub enum QosCmd {
    /// Storage QoS policies.
    #[command(subcommand)]
    Policy(PolicyCmd),
    /// Flows: one per VM per disk.
    #[command(subcommand)]
    Flow(FlowCmd),
    /// Show or set the IOPS normalization size (default 8K).
    Settings {
        #[arg(long)]
        normalization: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
pub enum KindArg {
    Dedicated,
    Aggregated,
}

#[derive(Subcommand)]
pub enum PolicyCmd {
    New {
        name: String,
        #[arg(long = "type", value_enum)]
        kind: KindArg,
        /// Reserved normalized IOPS.
        #[arg(long, default_value_t = 0)]
        min_iops: u64,
        /// Normalized IOPS cap.
        #[arg(long, default_value_t = 0)]
        max_iops: u64,
        /// Bytes per second cap, e.g. 100MB.
        #[arg(long)]
        max_bandwidth: Option<String>,
        #[arg(long)]
        json: bool,
    },
    List {
        #[arg(long)]
        json: bool,
    },
    Set {
        name: String,
        #[arg(long)]
        min_iops: Option<u64>,
        #[arg(long)]
        max_iops: Option<u64>,
        #[arg(long)]
        max_bandwidth: Option<String>,
        #[arg(long)]
        json: bool,
    },
    Rm {
        name: String,
    },
}

#[derive(Subcommand)]
pub enum FlowCmd {
    List {
        #[arg(long)]
        json: bool,
    },
}

fn bandwidth(s: &Option<String>) -> anyhow::Result<Option<u64>> {
    Ok(s.as_deref()
        .map(|b| parse_size("--max-bandwidth", b))
        .transpose()?)
}

fn print_disks(disks: &[DiskInfo]) {
    let mut t = Table::new(&[
        "NAME",
        "NODE",
        "SIZE",
        "WRITE-THROUGH",
        "POLICY",
        "CONNS",
        "URI",
    ]);
    for d in disks {
        t.row(vec![
            d.name.clone(),
            d.node.clone(),
            human_bytes(d.size),
            if d.write_through { "yes" } else { "no" }.into(),
            d.policy.clone().unwrap_or_else(|| "-".into()),
            d.connections.to_string(),
            d.uri.clone(),
        ]);
    }
    t.print();
}

fn print_policies(ps: &[Policy]) {
    let mut t = Table::new(&["NAME", "TYPE", "MIN IOPS", "MAX IOPS", "MAX BANDWIDTH"]);
    let or_dash = |v: u64, f: &dyn Fn(u64) -> String| if v == 0 { "-".into() } else { f(v) };
    for p in ps {
        t.row(vec![
            p.name.clone(),
            format!("{:?}", p.kind),
            or_dash(p.min_iops, &|v| v.to_string()),
            or_dash(p.max_iops, &|v| v.to_string()),
            or_dash(p.max_bandwidth, &|v| format!("{}/s", human_bytes(v))),
        ]);
    }
    t.print();
}

fn show<T: serde::Serialize>(json: bool, v: &T, human: impl FnOnce()) {
    if json {
        print_json(v)
    } else {
        human()
    }
}

pub async fn run_disk(cli: &Cli, cmd: &DiskCmd) -> anyhow::Result<i32> {
    let c = cli.client()?;
    match cmd {
        DiskCmd::Create {
            name,
            size,
            write_through,
            node,
            json,
        } => {
            let req = DiskCreateRequest {
                name: name.clone(),
                size: parse_size("--size", size)?,
                write_through: *write_through,
                node: node.clone(),
            };
            let d: DiskInfo = c.post("/disks", &req, T).await?;
            show(*json, &d, || print_disks(std::slice::from_ref(&d)));
        }
        DiskCmd::Import {
            name,
            file,
            write_through,
            node,
            tls_dir,
            json,
        } => {
            let tls = crate::Cli::admin_tls_dir(tls_dir.as_ref());
            let d =
                import_disk(&c, name, file, *write_through, node.clone(), tls.as_deref()).await?;
            show(*json, &d, || print_disks(std::slice::from_ref(&d)));
        }
        DiskCmd::List { json } => {
            let d: Vec<DiskInfo> = c.get("/disks", T).await?;
            show(*json, &d, || print_disks(&d));
        }
        DiskCmd::Resize { name, size, json } => {
            let req = DiskResizeRequest {
                size: parse_size("--size", size)?,
            };
            let d: DiskInfo = c.put(&format!("/disks/{name}/size"), &req, T).await?;
            show(*json, &d, || print_disks(std::slice::from_ref(&d)));
        }
        DiskCmd::Set {
            name, policy, json, ..
        } => {
            let req = DiskSetRequest {
                policy: policy.clone(),
            };
            let d: DiskInfo = c.put(&format!("/disks/{name}/policy"), &req, T).await?;
            show(*json, &d, || print_disks(std::slice::from_ref(&d)));
        }
        DiskCmd::Backup {
            disk,
            path,
            incremental,
            copy,
        } => {
            let req = BackupRequest {
                path: path.clone(),
                incremental: *incremental,
                max_rate: copy.max_rate()?,
            };
            let j: JobInfo = c.post(&format!("/disks/{disk}/backups"), &req, T).await?;
            return follow_job(&c, j, copy.no_wait, copy.json).await;
        }
        DiskCmd::Job { disk, wait, json } => {
            let j: JobInfo = c.get(&format!("/disks/{disk}/job"), T).await?;
            return follow_job(&c, j, !*wait, *json).await;
        }
        DiskCmd::Checkpoint(cmd) => return run_checkpoint(&c, cmd).await,
        DiskCmd::Move { disk, to, json } => return move_disk(&c, disk, to, *json).await,
        DiskCmd::Replicate {
            disk,
            to,
            every,
            json,
        } => {
            let every = ferry_api::size::parse_duration("--every", every)?;
            let req = ReplicaRequest {
                to: to.clone(),
                every_ms: every.as_millis() as u64,
            };
            let p: PushInfo = c.post(&format!("/disks/{disk}/replica"), &req, T).await?;
            show(*json, &p, || {
                println!(
                    "disk {} replicated from {} to {} every {}: the first full copy is under way (`ferry disk replica status {}`)",
                    p.disk,
                    p.node,
                    p.to,
                    ferry_api::size::human_duration(every),
                    p.disk
                )
            });
        }
        DiskCmd::Replica(cmd) => return run_replica(&c, cmd).await,
        DiskCmd::Rm { name } => {
            let d: DiskInfo = c.delete(&format!("/disks/{name}"), T).await?;
            println!("disk {} removed from {}", d.name, d.node);
        }
        DiskCmd::Attach { disk, vm, json } => {
            let req = DiskAttachRequest { vm: vm.clone() };
            let v: VmInfo = c.post(&format!("/disks/{disk}/attach"), &req, T).await?;
            show(*json, &v, || {
                println!(
                    "disk {disk} plugged into {vm} on {} ({} disks)",
                    v.host,
                    v.spec.disks.len()
                )
            });
        }
    }
    Ok(0)
}

pub async fn run_qos(cli: &Cli, cmd: &QosCmd) -> anyhow::Result<i32> {
    let c = cli.client()?;
    match cmd {
        QosCmd::Policy(PolicyCmd::New {
            name,
            kind,
            min_iops,
            max_iops,
            max_bandwidth,
            json,
        }) => {
            let p = Policy {
                name: name.clone(),
                kind: match kind {
                    KindArg::Dedicated => PolicyKind::Dedicated,
                    KindArg::Aggregated => PolicyKind::Aggregated,
                },
                min_iops: *min_iops,
                max_iops: *max_iops,
                max_bandwidth: bandwidth(max_bandwidth)?.unwrap_or(0),
            };
            p.validate()?;
            let p: Policy = c.post("/qos/policies", &p, T).await?;
            show(*json, &p, || print_policies(std::slice::from_ref(&p)));
        }
        QosCmd::Policy(PolicyCmd::List { json }) => {
            let ps: Vec<Policy> = c.get("/qos/policies", T).await?;
            show(*json, &ps, || print_policies(&ps));
        }
        QosCmd::Policy(PolicyCmd::Set {
            name,
            min_iops,
            max_iops,
            max_bandwidth,
            json,
        }) => {
            let u = PolicyUpdate {
                min_iops: *min_iops,
                max_iops: *max_iops,
                max_bandwidth: bandwidth(max_bandwidth)?,
            };
            let p: Policy = c.put(&format!("/qos/policies/{name}"), &u, T).await?;
            show(*json, &p, || print_policies(std::slice::from_ref(&p)));
        }
        QosCmd::Policy(PolicyCmd::Rm { name }) => {
            let p: Policy = c.delete(&format!("/qos/policies/{name}"), T).await?;
            println!(
                "policy {} removed; flows of disks naming it run unlimited",
                p.name
            );
        }
        QosCmd::Flow(FlowCmd::List { json }) => {
            let fs: Vec<FlowInfo> = c.get("/qos/flows", T).await?;
            show(*json, &fs, || {
                let mut t = Table::new(&[
                    "FLOW",
                    "INITIATOR",
                    "HOST",
                    "POLICY",
                    "IOPS",
                    "MB/S",
                    "LAT(us)",
                    "MIN",
                    "MAX",
                    "STATUS",
                ]);
                for f in &fs {
                    t.row(vec![
                        f.id.clone(),
                        f.initiator.clone(),
                        f.host.clone(),
                        f.policy.clone().unwrap_or_else(|| "-".into()),
                        format!("{:.0}", f.iops),
                        format!("{:.1}", f.bandwidth / 1e6),
                        format!("{:.0}", f.latency_us),
                        f.min_iops.to_string(),
                        f.max_iops.to_string(),
                        format!("{:?}", f.status),
                    ]);
                }
                t.print();
            });
        }
        QosCmd::Settings {
            normalization,
            json,
        } => {
            let s: QosSettings = match normalization {
                Some(n) => {
                    let s = QosSettings {
                        normalization: parse_size("--normalization", n)?,
                    };
                    s.validate()?;
                    c.put("/qos/settings", &s, T).await?
                }
                None => c.get("/qos/settings", T).await?,
            };
            show(*json, &s, || {
                println!("IOPS normalization: {}", human_bytes(s.normalization))
            });
        }
    }
    Ok(0)
}

/// `ferry storage list`.
pub async fn list_nodes(cli: &Cli, json: bool) -> anyhow::Result<i32> {
    let nodes: Vec<ferry_api::storage::StorageNodeEntry> =
        cli.client()?.get("/storage/nodes", T).await?;
    show(json, &nodes, || {
        let mut t = Table::new(&["NODE", "STATE", "DISKS", "URL"]);
        for n in &nodes {
            t.row(vec![
                n.name.clone(),
                if n.reachable {
                    "up".into()
                } else {
                    format!("DOWN ({})", n.error.clone().unwrap_or_default())
                },
                n.disks.to_string(),
                n.url.clone(),
            ]);
        }
        t.print();
    });
    Ok(0)
}

/// `ferry disk import`: a disk of the image's virtual size, then
/// `qemu-img convert` into its NBD export (zeroes are not sent), over TLS
/// with the administrator's certificate in `tls` when given. A failed copy
/// removes the disk it made.
pub async fn import_disk(
    c: &ferry_net::client::Client,
    name: &str,
    file: &std::path::Path,
    write_through: bool,
    node: Option<String>,
    tls: Option<&std::path::Path>,
) -> anyhow::Result<DiskInfo> {
    use anyhow::Context;
    let info = tokio::process::Command::new("qemu-img")
        .args(["info", "--output", "json"])
        .arg(file)
        .output()
        .await
        .context("running qemu-img (package qemu-utils)")?;
    if !info.status.success() {
        return Err(ferry_api::ApiError::invalid(
            "FILE",
            format!(
                "{}: {}",
                file.display(),
                String::from_utf8_lossy(&info.stderr).trim()
            ),
        )
        .into());
    }
    let v: serde_json::Value = serde_json::from_slice(&info.stdout)?;
    let size = v["virtual-size"]
        .as_u64()
        .context("qemu-img info gave no virtual-size")?;
    let format = v["format"].as_str().unwrap_or("raw").to_string();
    let req = DiskCreateRequest {
        name: name.to_string(),
        size: size.div_ceil(512) * 512,
        write_through,
        node,
    };
    let d: DiskInfo = c.post("/disks", &req, T).await?;
    let mut cmd = tokio::process::Command::new("qemu-img");
    cmd.args(["convert", "-n", "-f", &format]);
    match tls {
        None => {
            cmd.args(["-O", "raw"])
                .arg(file)
                .arg(format!("{}/import", d.uri));
        }
        Some(dir) => {
            let plug = ferry_api::DiskPlug {
                disk: d.name.clone(),
                uri: format!("{}/import", d.uri),
            };
            let (host, port, export) = plug.parse_uri()?;
            cmd.arg("--object")
                .arg(format!(
                    "tls-creds-x509,id=ferry-tls,dir={},endpoint=client",
                    dir.display()
                ))
                .arg("--target-image-opts")
                .arg(file)
                .arg(format!(
                    "driver=raw,file.driver=nbd,file.server.type=inet,file.server.host={host},\
                     file.server.port={port},file.export={export},file.tls-creds=ferry-tls"
                ));
        }
    }
    let out = cmd.output().await.context("running qemu-img convert")?;
    if !out.status.success() {
        let _ = c.delete::<DiskInfo>(&format!("/disks/{name}"), T).await;
        anyhow::bail!(
            "copying {} into disk {name}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(d)
}

async fn run_checkpoint(c: &ferry_net::client::Client, cmd: &CheckpointCmd) -> anyhow::Result<i32> {
    match cmd {
        CheckpointCmd::Create { disk, name, copy } => {
            let req = CheckpointRequest {
                name: name.clone(),
                max_rate: copy.max_rate()?,
            };
            let j: JobInfo = c
                .post(&format!("/disks/{disk}/checkpoints"), &req, T)
                .await?;
            return follow_job(c, j, copy.no_wait, copy.json).await;
        }
        CheckpointCmd::List { disk, json } => {
            let cps: Vec<CheckpointInfo> = c.get(&format!("/disks/{disk}/checkpoints"), T).await?;
            show(*json, &cps, || {
                let mut t = Table::new(&["NAME", "TAKEN", "SIZE", "DATA", "READY"]);
                for cp in &cps {
                    t.row(vec![
                        cp.name.clone(),
                        ferry_api::util::clock_utc(cp.instant_ms),
                        human_bytes(cp.size),
                        human_bytes(cp.bytes),
                        if cp.ready { "yes" } else { "taking" }.into(),
                    ]);
                }
                t.print();
            });
        }
        CheckpointCmd::Revert { disk, name, json } => {
            let d: DiskInfo = c
                .post(
                    &format!("/disks/{disk}/checkpoints/{name}/revert"),
                    &serde_json::json!({}),
                    Duration::from_secs(600),
                )
                .await?;
            show(*json, &d, || {
                println!(
                    "disk {disk} reverted to checkpoint {name} ({})",
                    human_bytes(d.size)
                )
            });
        }
        CheckpointCmd::Rm { disk, name } => {
            let _: CheckpointInfo = c
                .delete(&format!("/disks/{disk}/checkpoints/{name}"), T)
                .await?;
            println!("checkpoint {name} of disk {disk} removed");
        }
    }
    Ok(0)
}

/// `ferry disk move`: follows the move's stream with a progress bar (or
/// NDJSON lines); exit status 1 when it failed.
async fn move_disk(
    c: &ferry_net::client::Client,
    disk: &str,
    to: &str,
    json: bool,
) -> anyhow::Result<i32> {
    use futures::StreamExt;
    let mut events = c
        .post_events::<_, DiskMoveInfo>(
            &format!("/disks/{disk}/move"),
            &DiskMoveRequest { to: to.to_string() },
        )
        .await?;
    let bar = crate::output::byte_bar(format!("{disk} → {to}"), 1, json);
    let mut last = None;
    while let Some(m) = events.next().await {
        let m = m?;
        if json {
            println!("{}", serde_json::to_string(&m).unwrap_or_default());
        }
        if let Some(p) = &m.push {
            bar.set_length(p.round_total.max(1));
            bar.set_position(p.round_done);
            bar.set_message(format!(
                "{:?}, round {}, {} sent, {} changed since, {}",
                m.phase,
                p.rounds + 1,
                human_bytes(p.bytes_sent),
                human_bytes(p.dirty_bytes),
                crate::output::mbit(p.rate)
            ));
        }
        last = Some(m);
    }
    bar.finish_and_clear();
    let Some(m) = last else {
        anyhow::bail!("the move's stream ended without a result");
    };
    if json {
        return Ok(if m.phase == DiskMovePhase::Done { 0 } else { 1 });
    }
    let sent = m.push.as_ref().map(|p| p.bytes_sent).unwrap_or(0);
    let secs = m
        .finished_ms
        .unwrap_or(m.started_ms)
        .saturating_sub(m.started_ms) as f64
        / 1000.0;
    match m.phase {
        DiskMovePhase::Done => {
            println!(
                "disk {} moved {} → {} in {secs:.1} s: {} sent in {} rounds; {} paused {} ms for the final copy and switch",
                m.disk,
                m.from,
                m.to,
                human_bytes(sent),
                m.push.as_ref().map(|p| p.rounds).unwrap_or(0),
                if m.vms.is_empty() { "no guest".to_string() } else { m.vms.join(", ") },
                m.guest_pause_ms.unwrap_or(0)
            );
            Ok(0)
        }
        _ => {
            eprintln!(
                "disk {} move {} → {} failed: {}",
                m.disk,
                m.from,
                m.to,
                m.error.as_deref().unwrap_or("(no reason given)")
            );
            Ok(1)
        }
    }
}

async fn run_replica(c: &ferry_net::client::Client, cmd: &ReplicaCmd) -> anyhow::Result<i32> {
    match cmd {
        ReplicaCmd::Status { disk, json } => {
            let path = match disk {
                Some(d) => format!("/replicas?disk={d}"),
                None => "/replicas".to_string(),
            };
            let list: Vec<PushInfo> = c.get(&path, T).await?;
            show(*json, &list, || {
                let mut t = Table::new(&[
                    "DISK", "FROM", "TO", "EVERY", "STATE", "LAG", "SYNCED", "SENT", "ERROR",
                ]);
                for p in &list {
                    t.row(vec![
                        p.disk.clone(),
                        p.node.clone(),
                        p.to.clone(),
                        p.every_ms
                            .map(|m| ferry_api::size::human_duration(Duration::from_millis(m)))
                            .unwrap_or_default(),
                        format!("{:?}", p.state).to_lowercase(),
                        p.lag_ms
                            .map(|m| format!("{:.1}s", m as f64 / 1000.0))
                            .unwrap_or_else(|| "-".into()),
                        p.synced_ms
                            .map(ferry_api::util::clock_utc)
                            .unwrap_or_else(|| "never".into()),
                        human_bytes(p.bytes_sent),
                        p.error.clone().unwrap_or_default(),
                    ]);
                }
                t.print();
            });
        }
        ReplicaCmd::Stop { disk } => {
            let p: PushInfo = c.delete(&format!("/disks/{disk}/replica"), T).await?;
            println!("replica of {} on {} stopped and removed", p.disk, p.to);
        }
        ReplicaCmd::Failover { disk, json } => {
            let d: DiskInfo = c
                .post(
                    &format!("/disks/{disk}/replica/failover"),
                    &serde_json::json!({}),
                    T,
                )
                .await?;
            show(*json, &d, || {
                println!(
                    "disk {} is now served by {} (its replica); every VM with it open switched to {}",
                    d.name, d.node, d.uri
                )
            });
        }
    }
    Ok(0)
}

/// Follows a copy job to its end with a progress bar (or not, with
/// `no_wait`); exit status 1 when it failed.
async fn follow_job(
    c: &ferry_net::client::Client,
    mut j: JobInfo,
    no_wait: bool,
    json: bool,
) -> anyhow::Result<i32> {
    let what = match j.kind {
        JobKind::Backup => "backup",
        JobKind::IncrementalBackup => "incremental backup",
        JobKind::Checkpoint => "checkpoint",
    };
    if !no_wait {
        let bar = crate::output::byte_bar(format!("{} {what}", j.disk), j.bytes_total, json);
        while j.state == JobState::Running {
            bar.set_position(j.bytes_done);
            bar.set_message(format!(
                "{} preserved ahead of writes",
                human_bytes(j.bytes_preserved)
            ));
            tokio::time::sleep(Duration::from_millis(200)).await;
            j = c.get(&format!("/disks/{}/job", j.disk), T).await?;
        }
        bar.finish_and_clear();
    }
    if json {
        print_json(&j);
    } else {
        match j.state {
            JobState::Running => println!(
                "{what} of {} to {} started (instant {}): {} to copy; follow it with `ferry disk job {} --wait`",
                j.disk,
                j.target,
                ferry_api::util::clock_utc(j.instant_ms),
                human_bytes(j.bytes_total),
                j.disk
            ),
            JobState::Done => println!(
                "{what} of {} to {} done: the disk as of {}, {} copied ({} ahead of guests' writes){}",
                j.disk,
                j.target,
                ferry_api::util::clock_utc(j.instant_ms),
                human_bytes(j.bytes_done),
                human_bytes(j.bytes_preserved),
                j.base
                    .as_ref()
                    .map(|b| format!(", changes since {b}"))
                    .unwrap_or_default()
            ),
            JobState::Failed => {
                eprintln!(
                    "{what} of {} to {} failed: {}",
                    j.disk,
                    j.target,
                    j.error.as_deref().unwrap_or("(no reason given)")
                );
                return Ok(1);
            }
        }
    }
    Ok(0)
}
