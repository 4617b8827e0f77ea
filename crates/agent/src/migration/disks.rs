//! Shared-nothing migration, the source's side: a VM's local drives are
//! mirrored into the skeleton before its memory moves.
//!
//! ```text
//!  source QEMU                                              target QEMU (skeleton)
//!  drive{i} ─blockdev-mirror─▶ nbd node mirror-drive{i}     NBD server (nbd.sock)
//!                               │ unix mirror-ID.sock        ▲ export drive{i}, writable
//!                               ▼                            │
//!                     disk session (Ferry transport) ═carriers on every NIC═▶
//! ```
//!
//! The mirror copies every block (holes as write-zeroes requests) and every
//! write the guest makes meanwhile; once each job is `ready` the memory
//! moves with `pause-before-switchover`. When QEMU stops there, the guest is
//! paused: each ready job is cancelled, which completes it in step with its
//! copy and leaves the source on its own disk ([`DiskMirror::complete`]),
//! then the migration goes on. Any failure before that leaves the guest
//! running on its own disks ([`DiskMirror::abort`]); the target discards
//! its partial copies with its skeleton.
//!
//! The disks' NBD connections ride a transport session of their own, apart
//! from the memory's, so a NIC lost mid-mirror fails over the same way; its
//! frames are always sealed ([`SEALED`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ferry_api::{DiskCopyProgress, DiskCopyReport, LocalDiskCopy, VmSpec};

use crate::host::error_chain;
use crate::qemu::QemuConfig;
use crate::qmp::{BlockJobInfo, Qmp};

/// The disks' session seals every frame (AES-256-GCM), whatever the
/// cluster's `encryption` says of memory: a disk's bytes never cross a
/// network in clear.
pub const SEALED: bool = true;

/// The skeleton's NBD server socket, in its directory.
pub const NBD_SOCK: &str = "nbd.sock";

/// A mirror whose offset has not moved for this long, not yet ready, has
/// lost its path (every carrier down, or the target gone).
pub const MIRROR_STALL: Duration = Duration::from_secs(20);

/// A copy whose remaining bytes have not reached a new low for this long
/// does not converge: the guest rewrites its drives faster than the links
/// copy them.
pub const MIRROR_NOT_CONVERGING: Duration = Duration::from_secs(60);

/// How long completing (or abandoning) the mirrors may take.
const SETTLE_WITHIN: Duration = Duration::from_secs(30);

/// One local drive to copy.
#[derive(Debug, Clone)]
pub struct LocalCopy {
    pub drive: usize,
    pub name: String,
    pub size: u64,
}

impl LocalCopy {
    fn job(&self) -> String {
        format!("mirror-drive{}", self.drive)
    }
    fn node(&self) -> String {
        format!("drive{}", self.drive)
    }
}

/// The local drives of `spec` and their virtual sizes.
pub async fn local_copies(cfg: &QemuConfig, spec: &VmSpec) -> Result<Vec<LocalCopy>, String> {
    let mut out = Vec::new();
    for (i, path, _) in crate::local_disk::files(cfg, spec) {
        let size = crate::local_disk::virtual_size(&path).await?;
        out.push(LocalCopy {
            drive: i,
            name: spec.drives[i].local.clone().unwrap_or_default(),
            size,
        });
    }
    Ok(out)
}

/// What the target is told to create.
pub fn requests(copies: &[LocalCopy]) -> Vec<LocalDiskCopy> {
    copies
        .iter()
        .map(|c| LocalDiskCopy {
            drive: c.drive,
            size: c.size,
        })
        .collect()
}

/// The source's running mirrors and the session that carries them.
pub struct DiskMirror {
    pub session: ferry_transport::Session,
    sock: PathBuf,
    copies: Vec<LocalCopy>,
    started: Instant,
    ready_ms: Option<u64>,
    /// Each job's length when it completed.
    moved: BTreeMap<usize, u64>,
    /// Nodes added (removed again on abort).
    nodes: Vec<String>,
    jobs: Vec<String>,
}

impl DiskMirror {
    /// Starts the disk session (carriers `(nic, local, remote)`) with its
    /// socket at `sock`, and one mirror job per copy into the target's
    /// export of the same drive. On error everything started is undone.
    pub async fn start(
        qmp: &Qmp,
        session_id: [u8; 16],
        keys: &ferry_transport::Keys<'_>,
        (sock, vm): (PathBuf, &crate::qemu::QemuVm),
        carriers: Vec<(String, std::net::IpAddr, std::net::SocketAddr)>,
        copies: Vec<LocalCopy>,
        reorder_window: u64,
    ) -> Result<DiskMirror, String> {
        let session = ferry_transport::Session::source(session_id, keys, sock.clone(), carriers)
            .await
            .map_err(|e| error_chain(&e))?;
        if let Err(e) = vm.give_socket(&sock) {
            session.close();
            return Err(e);
        }
        session.set_reorder_window(reorder_window);
        let mut m = DiskMirror {
            session,
            sock,
            copies,
            started: Instant::now(),
            ready_ms: None,
            moved: BTreeMap::new(),
            nodes: Vec::new(),
            jobs: Vec::new(),
        };
        if let Err(e) = m.start_jobs(qmp).await {
            m.abort(qmp).await;
            return Err(e);
        }
        Ok(m)
    }

    async fn start_jobs(&mut self, qmp: &Qmp) -> Result<(), String> {
        // an earlier move's copy whose node QEMU would not let go of then
        // (still in use as that move was abandoned) goes now
        remove_leftovers(qmp).await;
        for c in self.copies.clone() {
            let target = format!("mirror-{}", c.node());
            qmp.blockdev_add(serde_json::json!({
                "driver": "nbd",
                "node-name": target,
                "server": {"type": "unix", "path": self.sock.display().to_string()},
                "export": c.node(),
            }))
            .await
            .map_err(|e| {
                format!(
                    "connecting to the target's copy of {}: {}",
                    c.node(),
                    error_chain(&e)
                )
            })?;
            self.nodes.push(target.clone());
            qmp.mirror(&c.job(), &c.node(), &target)
                .await
                .map_err(|e| format!("mirroring {}: {}", c.node(), error_chain(&e)))?;
            self.jobs.push(c.job());
        }
        Ok(())
    }

    /// The copies so far; an error names a job that failed or vanished.
    pub async fn progress(&mut self, qmp: &Qmp) -> Result<DiskCopyProgress, String> {
        let jobs = qmp.block_jobs().await.map_err(|e| error_chain(&e))?;
        let mut p = DiskCopyProgress {
            ready: true,
            ..Default::default()
        };
        for c in &self.copies {
            let j = find(&jobs, &c.job())?;
            if let Some(e) = &j.error {
                return Err(format!("the copy of {} failed: {e}", c.node()));
            }
            if j.status == "concluded" || j.status == "aborting" {
                return Err(format!("the copy of {} ended ({})", c.node(), j.status));
            }
            p.done += j.offset;
            p.total += j.len;
            p.ready &= j.ready;
        }
        if p.ready && self.ready_ms.is_none() {
            self.ready_ms = Some(self.started.elapsed().as_millis() as u64);
        }
        Ok(p)
    }

    /// With the guest paused (pre-switchover): completes every mirror in
    /// step with its copy. The source keeps its own disks.
    pub async fn complete(&mut self, qmp: &Qmp) -> Result<(), String> {
        for c in &self.copies {
            qmp.cancel_job(&c.job(), false)
                .await
                .map_err(|e| format!("completing the copy of {}: {}", c.node(), error_chain(&e)))?;
        }
        let jobs = wait_concluded(qmp, &self.jobs).await?;
        for c in &self.copies {
            let j = find(&jobs, &c.job())?;
            if let Some(e) = &j.error {
                return Err(format!("the copy of {} failed at its end: {e}", c.node()));
            }
            if j.offset != j.len {
                return Err(format!(
                    "the copy of {} ended at {} of {} bytes",
                    c.node(),
                    j.offset,
                    j.len
                ));
            }
            self.moved.insert(c.drive, j.len);
        }
        for c in &self.copies {
            let _ = qmp.dismiss_job(&c.job()).await;
        }
        self.jobs.clear();
        Ok(())
    }

    /// Abandons every copy: the session closes first (so an NBD request
    /// waiting on a dead path fails at once), then the jobs are cancelled
    /// and their nodes removed. The guest keeps its own disks throughout.
    pub async fn abort(&mut self, qmp: &Qmp) {
        self.session.close();
        abandon(
            qmp,
            &std::mem::take(&mut self.jobs),
            &std::mem::take(&mut self.nodes),
        )
        .await;
        let _ = std::fs::remove_file(&self.sock);
    }

    /// Ends the session after a completed copy.
    pub fn close(&self) {
        self.session.close();
        let _ = std::fs::remove_file(&self.sock);
    }

    /// Bytes the disks' carriers sent, per NIC.
    pub fn nic_bytes(&self) -> BTreeMap<String, u64> {
        self.session
            .stats()
            .carriers
            .iter()
            .map(|c| (c.nic.clone(), c.tx_bytes))
            .collect()
    }

    pub fn reports(&self) -> Vec<DiskCopyReport> {
        self.copies
            .iter()
            .map(|c| DiskCopyReport {
                drive: c.drive,
                name: c.name.clone(),
                size: c.size,
                bytes: self.moved.get(&c.drive).copied().unwrap_or(0),
                ready_ms: self.ready_ms.unwrap_or(0),
            })
            .collect()
    }

    pub fn describe(&self) -> String {
        let names: Vec<String> = self
            .copies
            .iter()
            .map(|c| format!("{} ({})", c.name, ferry_api::size::human_bytes(c.size)))
            .collect();
        names.join(", ")
    }
}

/// What a source agent that died mid-copy left in its QEMU: the mirror
/// jobs (failed once the agent's session died with it) and their target
/// nodes. Removed at restart, with the guest on its own drives.
pub async fn remove_leftovers(qmp: &Qmp) {
    let Ok(jobs) = qmp.block_jobs().await else {
        return;
    };
    let ours = |n: &String| n.starts_with("mirror-drive");
    let jobs: Vec<String> = jobs.into_iter().map(|j| j.device).filter(ours).collect();
    let nodes: Vec<String> = qmp
        .block_nodes()
        .await
        .unwrap_or_default()
        .into_iter()
        .filter(ours)
        .collect();
    abandon(qmp, &jobs, &nodes).await;
}

/// Cancels `jobs` (forced), waits for them to conclude, dismisses them,
/// then removes `nodes`: best effort, each failure logged.
async fn abandon(qmp: &Qmp, jobs: &[String], nodes: &[String]) {
    for id in jobs {
        if let Err(e) = qmp.cancel_job(id, true).await {
            tracing::debug!(job = %id, error = %error_chain(&e), "cancelling a disk copy");
        }
    }
    if let Err(e) = wait_concluded(qmp, jobs).await {
        tracing::warn!(error = %e, "abandoning the disk copies");
    }
    for id in jobs {
        let _ = qmp.dismiss_job(id).await;
    }
    for n in nodes {
        // a node QEMU still holds (its NBD client winding down after the
        // job ended) is let go of a moment later
        let mut tries = 0;
        while let Err(e) = qmp.blockdev_del(n).await {
            tries += 1;
            if tries >= DEL_TRIES {
                tracing::warn!(node = %n, error = %error_chain(&e), "removing a mirror's target node");
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Attempts, 100 ms apart, to remove a mirror's target node.
const DEL_TRIES: u32 = 20;

/// Waits until every job of `ids` has concluded; returns every job then.
async fn wait_concluded(qmp: &Qmp, ids: &[String]) -> Result<Vec<BlockJobInfo>, String> {
    let t0 = Instant::now();
    loop {
        let jobs = qmp.block_jobs().await.map_err(|e| error_chain(&e))?;
        let pending = jobs
            .iter()
            .any(|j| ids.contains(&j.device) && j.status != "concluded");
        if !pending {
            return Ok(jobs);
        }
        if t0.elapsed() > SETTLE_WITHIN {
            return Err(format!(
                "the disk copies did not end within {} s",
                SETTLE_WITHIN.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn find<'a>(jobs: &'a [BlockJobInfo], id: &str) -> Result<&'a BlockJobInfo, String> {
    jobs.iter()
        .find(|j| j.device == id)
        .ok_or_else(|| format!("the disk copy job {id} is gone"))
}

/// The socket the source QEMU's NBD clients connect to.
pub fn mirror_sock(vm_dir: &Path, id: &str) -> PathBuf {
    vm_dir.join(format!("mirror-{id}.sock"))
}
