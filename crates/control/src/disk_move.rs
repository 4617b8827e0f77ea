//! Disks that change storage node while guests use them (`ferry disk
//! move`), and replicas (`ferry disk replicate`, `disk replica …`).
//!
//! A move, run here from start to end (the nodes and agents do each step):
//!
//! ```text
//!  1. target node:  POST /disks/D/incoming      an empty copy only the source writes
//!  2. source node:  POST /disks/D/push (move)   rounds of changes over NBD, until in step
//!  3. every agent with D open: POST …/hold      the guest pauses; QEMU completes its I/O
//!  4. source node:  POST /disks/D/push/finish   writes held, last changes sent, flushed,
//!                                               the source's copy retired  ── COMMIT
//!  5. target node:  POST /disks/D/activate      the copy is the disk, under its policy
//!  6. every agent:  POST …/switch {uri}         a new connection swapped in; the guest runs
//!  7. source node:  DELETE /disks/D             the retired copy goes
//! ```
//!
//! Before the commit any failure is undone: held guests run again on the
//! source's connection (untouched), the push stops, the target's copy is
//! removed. After it the steps are retried until done: the target holds
//! every acknowledged write, and the source refuses any change.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_api::storage::{
    ActivateRequest, DiskInfo, DiskMoveInfo, DiskMovePhase, DiskSwitchRequest, IncomingDiskRequest,
    PushInfo, PushKind, PushRequest, PushState, ReplicaRequest,
};
use ferry_api::util::{lock, now_ms};
use ferry_api::{ApiError, VmInfo};
use futures::stream::{BoxStream, StreamExt};

use crate::Control;

const NODE_TIMEOUT: Duration = Duration::from_secs(10);
const AGENT_TIMEOUT: Duration = Duration::from_secs(30);
/// A move whose copy sends nothing for this long fails.
const STALL: Duration = Duration::from_secs(30);
/// After the commit, how long each remaining step is retried.
const AFTER_COMMIT: Duration = Duration::from_secs(60);

/// The moves this control service ran, by disk (the last of each), and
/// each replica as last seen (shown while its primary's node is down).
#[derive(Default)]
pub struct DiskMoves(
    std::sync::Mutex<BTreeMap<String, DiskMoveInfo>>,
    std::sync::Mutex<BTreeMap<String, PushInfo>>,
);

/// A VM that has the disk open: (VM, host).
type User = (String, String);

impl Control {
    fn set_move(&self, info: &DiskMoveInfo) {
        lock(&self.disk_moves.0).insert(info.disk.clone(), info.clone());
    }

    /// The disk's last move (`GET /disks/{d}/move`).
    pub(crate) fn disk_move(&self, disk: &str) -> Result<DiskMoveInfo, ApiError> {
        lock(&self.disk_moves.0)
            .get(disk)
            .cloned()
            .ok_or_else(|| ApiError::not_found("move of disk", disk))
    }

    /// Starts `ferry disk move`; the stream follows it (a snapshot per
    /// change) to its end. The move runs on when the stream is dropped.
    pub(crate) async fn start_disk_move(
        self: &Arc<Self>,
        name: &str,
        to: &str,
    ) -> Result<BoxStream<'static, serde_json::Value>, ApiError> {
        let (disk, _) = self.locate_disk(name).await?;
        if disk.node == to {
            return Err(ApiError::invalid(
                "to",
                format!("disk {name} is on {to} already"),
            ));
        }
        if !self.storage.contains_key(to) {
            return Err(ApiError::not_found("storage node", to));
        }
        {
            let mut moves = lock(&self.disk_moves.0);
            if let Some(m) = moves.get(name) {
                if matches!(m.phase, DiskMovePhase::Copy | DiskMovePhase::Switch) {
                    return Err(ApiError::Conflict {
                        reason: format!("disk {name} is already moving to {}", m.to),
                    });
                }
            }
            moves.insert(
                name.to_string(),
                DiskMoveInfo {
                    disk: name.to_string(),
                    from: disk.node.clone(),
                    to: to.to_string(),
                    phase: DiskMovePhase::Copy,
                    started_ms: now_ms(),
                    finished_ms: None,
                    size: disk.size,
                    push: None,
                    vms: Vec::new(),
                    guest_pause_ms: None,
                    error: None,
                },
            );
        }
        let me = self.clone();
        let to = to.to_string();
        tokio::spawn(async move {
            let name = disk.name.clone();
            let r = me.run_disk_move(&disk, &to).await;
            let mut info = me
                .disk_move(&name)
                .unwrap_or_else(|_| unreachable_info(&disk, &to));
            info.finished_ms = Some(now_ms());
            match r {
                Ok(()) => info.phase = DiskMovePhase::Done,
                Err(e) => {
                    tracing::warn!(disk = %name, "disk move failed: {e}");
                    info.phase = DiskMovePhase::Failed;
                    info.error = Some(e);
                }
            }
            me.set_move(&info);
            me.log(
                "disk_move",
                &name,
                serde_json::to_value(&info).unwrap_or_default(),
            );
        });
        let me = self.clone();
        let name = name.to_string();
        Ok(futures::stream::unfold(
            (me, name, None::<DiskMoveInfo>, false),
            |(me, name, last, done)| async move {
                if done {
                    return None;
                }
                loop {
                    let now = me.disk_move(&name).ok()?;
                    if last.as_ref() != Some(&now) {
                        let end = matches!(now.phase, DiskMovePhase::Done | DiskMovePhase::Failed);
                        let v = serde_json::to_value(&now).ok()?;
                        return Some((v, (me, name, Some(now), end)));
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            },
        )
        .boxed())
    }

    fn update_move(&self, disk: &str, f: impl FnOnce(&mut DiskMoveInfo)) {
        if let Some(m) = lock(&self.disk_moves.0).get_mut(disk) {
            f(m);
        }
    }

    fn node(&self, name: &str) -> Result<&ferry_net::client::Client, String> {
        self.storage
            .get(name)
            .ok_or_else(|| format!("storage node {name} is not registered"))
    }

    /// The VMs that have disk `disk` open, and where.
    async fn users_of(&self, disk: &str) -> Result<Vec<User>, ApiError> {
        Ok(self
            .list_vms()
            .await?
            .into_iter()
            .filter(|v| v.state != "incoming" && v.spec.disk_use(disk).is_some())
            .map(|v| (v.name, v.host))
            .collect())
    }

    /// Tells VM `vm`'s agent that disk `disk` is served at `uri` now
    /// (`None`: where it was); a guest held for the move runs again.
    async fn switch(
        &self,
        vm: &str,
        host: &str,
        disk: &str,
        uri: Option<String>,
    ) -> Result<VmInfo, ApiError> {
        self.host(host)?
            .post(
                &format!("/vms/{vm}/disks/{disk}/switch"),
                &DiskSwitchRequest { uri },
                AGENT_TIMEOUT,
            )
            .await
    }

    async fn run_disk_move(&self, disk: &DiskInfo, to: &str) -> Result<(), String> {
        let name = &disk.name;
        let (src, dst) = (self.node(&disk.node)?, self.node(to)?);
        let copy = make_copy(dst, disk, false)
            .await
            .map_err(|e| format!("{to}: {e}"))?;
        let mut held: Vec<User> = Vec::new();
        let r = self.copy_and_commit(disk, to, &copy, &mut held).await;
        if let Err(e) = r {
            self.undo_move(disk, to, &held).await;
            return Err(e);
        }
        // committed: the target holds the disk; finish every step
        self.update_move(name, |m| m.phase = DiskMovePhase::Switch);
        let mut left = Vec::new();
        let active: Result<DiskInfo, _> = retry(|| async {
            dst.post(
                &format!("/disks/{name}/activate"),
                &ActivateRequest::default(),
                NODE_TIMEOUT,
            )
            .await
        })
        .await;
        if let Err(e) = active {
            left.push(format!("activating the copy on {to}: {e}"));
        }
        let pause = Instant::now();
        for (vm, host) in &held {
            let uri = Some(format!("{}/{vm}", copy.uri));
            let r = retry(|| self.switch(vm, host, name, uri.clone())).await;
            if let Err(e) = r {
                left.push(format!("switching {vm} on {host}: {e}"));
            }
        }
        let held_ms = self
            .disk_move(name)
            .ok()
            .and_then(|m| m.guest_pause_ms)
            .unwrap_or(0);
        self.update_move(name, |m| {
            m.guest_pause_ms = Some(held_ms + pause.elapsed().as_millis() as u64)
        });
        // the retired copy goes once its last connection has
        let removed: Result<DiskInfo, _> =
            retry(|| async { src.delete(&format!("/disks/{name}"), NODE_TIMEOUT).await }).await;
        if let Err(e) = removed {
            left.push(format!(
                "removing the retired copy on {} (remove it with its node's API): {e}",
                disk.node
            ));
        }
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "disk {name} is on {to} (committed), but: {}",
                left.join("; ")
            ))
        }
    }

    /// Steps 2–4: the copy in rounds, the guests held, the final round.
    async fn copy_and_commit(
        &self,
        disk: &DiskInfo,
        to: &str,
        copy: &DiskInfo,
        held: &mut Vec<User>,
    ) -> Result<(), String> {
        let name = &disk.name;
        let src = self.node(&disk.node)?;
        let _: PushInfo = src
            .post(
                &format!("/disks/{name}/push"),
                &PushRequest {
                    to: to.to_string(),
                    uri: copy.uri.clone(),
                    kind: PushKind::Move,
                    every_ms: None,
                },
                NODE_TIMEOUT,
            )
            .await
            .map_err(|e| format!("{}: {e}", disk.node))?;
        let (mut last_sent, mut last_change) = (0, Instant::now());
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let p: PushInfo = src
                .get(&format!("/disks/{name}/push"), NODE_TIMEOUT)
                .await
                .map_err(|e| format!("{}: {e}", disk.node))?;
            self.update_move(name, |m| m.push = Some(p.clone()));
            match p.state {
                PushState::InStep => break,
                PushState::Failed | PushState::Cancelled | PushState::Done => {
                    return Err(format!(
                        "the copy to {to} ended: {}",
                        p.error.as_deref().unwrap_or("cancelled")
                    ))
                }
                PushState::Copying | PushState::Idle => {}
            }
            if p.bytes_sent != last_sent {
                (last_sent, last_change) = (p.bytes_sent, Instant::now());
            } else if last_change.elapsed() > STALL {
                return Err(format!(
                    "the copy to {to} sent nothing for {} s",
                    STALL.as_secs()
                ));
            }
        }
        // every guest with the disk open pauses; QEMU completes its I/O first
        let users = self.users_of(name).await.map_err(|e| e.to_string())?;
        self.update_move(name, |m| {
            m.vms = users.iter().map(|(v, h)| format!("{v} on {h}")).collect()
        });
        let pause = Instant::now();
        for (vm, host) in &users {
            let r: Result<VmInfo, ApiError> = async {
                self.host(host)?
                    .post(
                        &format!("/vms/{vm}/disks/{name}/hold"),
                        &serde_json::json!({}),
                        AGENT_TIMEOUT,
                    )
                    .await
            }
            .await;
            held.push((vm.clone(), host.clone()));
            r.map_err(|e| format!("holding {vm} on {host}: {e}"))?;
        }
        let done: PushInfo = src
            .post(
                &format!("/disks/{name}/push/finish"),
                &serde_json::json!({}),
                Duration::from_secs(120),
            )
            .await
            .map_err(|e| format!("{}: {e}", disk.node))?;
        tracing::info!(disk = %name, to, final_ms = ?done.final_ms, "disk move committed");
        self.update_move(name, |m| {
            m.push = Some(done);
            m.guest_pause_ms = Some(pause.elapsed().as_millis() as u64);
        });
        Ok(())
    }

    /// A move failed before its commit: the guests run again where they
    /// were, the push stops, the target's copy goes.
    async fn undo_move(&self, disk: &DiskInfo, to: &str, held: &[User]) {
        let name = &disk.name;
        for (vm, host) in held {
            if let Err(e) = self.switch(vm, host, name, None).await {
                // its agent releases it by itself (HOLD_MAX)
                tracing::warn!(vm, host, "releasing after a failed disk move: {e}");
            }
        }
        if let Ok(src) = self.node(&disk.node) {
            let _ = src
                .delete::<PushInfo>(&format!("/disks/{name}/push"), NODE_TIMEOUT)
                .await;
        }
        if let Ok(dst) = self.node(to) {
            let r: Result<DiskInfo, _> = retry_for(Duration::from_secs(10), || async {
                dst.delete(&format!("/disks/{name}"), NODE_TIMEOUT).await
            })
            .await;
            if let Err(e) = r {
                tracing::warn!(disk = %name, node = to, "the failed move's copy stays: {e}");
            }
        }
    }

    /// `ferry disk replicate DISK --to NODE --every T`.
    pub(crate) async fn replicate_disk(
        &self,
        name: &str,
        req: &ReplicaRequest,
    ) -> Result<PushInfo, ApiError> {
        let (disk, src) = self.locate_disk(name).await?;
        if disk.node == req.to {
            return Err(ApiError::invalid(
                "to",
                format!("disk {name} is on {} itself", req.to),
            ));
        }
        let dst = self
            .storage
            .get(&req.to)
            .ok_or_else(|| ApiError::not_found("storage node", &req.to))?;
        let copy = make_copy(dst, &disk, true).await?;
        let r = src
            .post(
                &format!("/disks/{name}/push"),
                &PushRequest {
                    to: req.to.clone(),
                    uri: copy.uri,
                    kind: PushKind::Replica,
                    every_ms: Some(req.every_ms),
                },
                NODE_TIMEOUT,
            )
            .await;
        if r.is_err() {
            let _ = dst
                .delete::<DiskInfo>(&format!("/disks/{name}"), NODE_TIMEOUT)
                .await;
        }
        r
    }

    /// Every replica (`ferry disk replica status`), or disk `name`'s.
    pub(crate) async fn replicas(&self, name: Option<&str>) -> Result<Vec<PushInfo>, ApiError> {
        let mut out = Vec::new();
        let answers = self
            .ask_every_node::<PushInfo>("/pushes", NODE_TIMEOUT)
            .await;
        let mut seen = lock(&self.disk_moves.1);
        for (node, r) in self.storage.keys().zip(answers) {
            match r {
                Ok(list) => {
                    seen.retain(|_, p| p.node != *node);
                    for p in list
                        .into_iter()
                        .filter(|p| p.kind == PushKind::Replica && p.state != PushState::Cancelled)
                    {
                        seen.insert(p.disk.clone(), p.clone());
                        out.push(p);
                    }
                }
                // a node that is down: its replicas as last seen, their lag growing
                Err(e) => out.extend(seen.values().filter(|p| p.node == *node).map(|p| {
                    let mut p = p.clone();
                    p.state = PushState::Failed;
                    p.lag_ms = p.synced_ms.map(|s| now_ms().saturating_sub(s));
                    p.error = Some(format!(
                        "the disk's node does not answer ({e}); the replica holds what was synced"
                    ));
                    p
                })),
            }
        }
        drop(seen);
        out.retain(|p| name.is_none_or(|n| p.disk == n));
        out.sort_by(|a, b| a.disk.cmp(&b.disk));
        Ok(out)
    }

    /// `ferry disk replica stop DISK`: the pushes end, the copy goes.
    pub(crate) async fn stop_replica(&self, name: &str) -> Result<PushInfo, ApiError> {
        let (disk, src) = self.locate_disk(name).await?;
        let p: PushInfo = src
            .delete(&format!("/disks/{name}/push"), NODE_TIMEOUT)
            .await?;
        if p.kind != PushKind::Replica {
            return Err(ApiError::Conflict {
                reason: format!("disk {name}'s copy to {} is a move, not a replica", p.to),
            });
        }
        if let Some(dst) = self.storage.get(&p.to) {
            let r: Result<DiskInfo, _> =
                retry(|| async { dst.delete(&format!("/disks/{name}"), NODE_TIMEOUT).await }).await;
            if let Err(e) = r {
                tracing::warn!(disk = %name, node = %p.to, "replica copy not removed: {e}");
            }
        }
        tracing::info!(disk = %name, node = %disk.node, "replica stopped");
        Ok(p)
    }

    /// `ferry disk replica failover DISK`: the primary's node is gone; its
    /// replica becomes the disk and every VM with it open switches to it.
    pub(crate) async fn failover_replica(&self, name: &str) -> Result<DiskInfo, ApiError> {
        let mut found = None;
        for (node, r) in self.storage.keys().zip(
            self.ask_every_node::<DiskInfo>("/disks", NODE_TIMEOUT)
                .await,
        ) {
            if let Some(d) = r.unwrap_or_default().into_iter().find(|d| d.name == name) {
                if let ferry_api::storage::DiskRole::Replica { of } = &d.role {
                    found = Some((node.clone(), of.clone()));
                }
            }
        }
        let (node, of) = found.ok_or_else(|| ApiError::not_found("replica of disk", name))?;
        if let Some(primary) = self.storage.get(&of) {
            if primary
                .get::<Vec<DiskInfo>>("/disks", Duration::from_secs(3))
                .await
                .is_ok_and(|d| d.iter().any(|d| d.name == name && d.role.is_primary()))
            {
                return Err(ApiError::Conflict {
                    reason: format!(
                        "disk {name}'s primary on {of} answers: a failover is for when it is gone (move the disk with `ferry disk move` instead)"
                    ),
                });
            }
        }
        let dst = self
            .storage
            .get(&node)
            .ok_or_else(|| ApiError::not_found("storage node", &node))?;
        let d: DiskInfo = dst
            .post(
                &format!("/disks/{name}/activate"),
                &ActivateRequest { failover: true },
                NODE_TIMEOUT,
            )
            .await?;
        tracing::warn!(disk = %name, from = %of, to = %node, "replica failed over");
        lock(&self.disk_moves.1).remove(name);
        let mut failed = Vec::new();
        for (vm, host) in self.users_of(name).await? {
            let r = self
                .switch(&vm, &host, name, Some(format!("{}/{vm}", d.uri)))
                .await;
            if let Err(e) = r {
                failed.push(format!("{vm} on {host}: {e}"));
            }
        }
        if !failed.is_empty() {
            return Err(ApiError::Conflict {
                reason: format!(
                    "disk {name} is now served by {node}, but these guests still use {of}: {}",
                    failed.join("; ")
                ),
            });
        }
        Ok(d)
    }

    /// Of two nodes both serving disk `name` as its primary, the one still
    /// replicating it to the other is the old primary back after a
    /// failover: it is retired. Returns the node kept, if it could tell.
    pub(crate) async fn settle_twin(&self, name: &str, a: &str, b: &str) -> Option<String> {
        for (old, new) in [(a, b), (b, a)] {
            let Some(c) = self.storage.get(old) else {
                continue;
            };
            let Ok(p) = c
                .get::<PushInfo>(&format!("/disks/{name}/push"), NODE_TIMEOUT)
                .await
            else {
                continue;
            };
            if p.kind == PushKind::Replica && p.to == new {
                let body = serde_json::json!({ "to": new });
                match c
                    .post::<_, DiskInfo>(&format!("/disks/{name}/retire"), &body, NODE_TIMEOUT)
                    .await
                {
                    Ok(_) => tracing::warn!(
                        disk = name,
                        old,
                        new,
                        "the old primary came back after a failover: retired"
                    ),
                    Err(e) => tracing::warn!(disk = name, old, "retiring the old primary: {e}"),
                }
                return Some(new.to_string());
            }
        }
        None
    }
}

/// An empty copy of `disk` on node `dst` that the disk's node writes: a
/// move's target, or a replica.
async fn make_copy(
    dst: &ferry_net::client::Client,
    disk: &DiskInfo,
    replica: bool,
) -> Result<DiskInfo, ApiError> {
    dst.post(
        &format!("/disks/{}/incoming", disk.name),
        &IncomingDiskRequest {
            from: disk.node.clone(),
            size: disk.size,
            write_through: disk.write_through,
            policy: disk.policy.clone(),
            replica,
        },
        NODE_TIMEOUT,
    )
    .await
}

fn unreachable_info(disk: &DiskInfo, to: &str) -> DiskMoveInfo {
    DiskMoveInfo {
        disk: disk.name.clone(),
        from: disk.node.clone(),
        to: to.to_string(),
        phase: DiskMovePhase::Failed,
        started_ms: now_ms(),
        finished_ms: None,
        size: disk.size,
        push: None,
        vms: Vec::new(),
        guest_pause_ms: None,
        error: None,
    }
}

/// Tries `f` until it succeeds or [`AFTER_COMMIT`] passes (0.2 s apart).
async fn retry<T, F, Fut>(f: F) -> Result<T, ApiError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ApiError>>,
{
    retry_for(AFTER_COMMIT, f).await
}

async fn retry_for<T, F, Fut>(within: Duration, mut f: F) -> Result<T, ApiError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ApiError>>,
{
    let deadline = Instant::now() + within;
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() > deadline => return Err(e),
            Err(e) => {
                tracing::info!("retrying: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}
