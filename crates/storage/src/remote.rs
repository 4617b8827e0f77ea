//! Copies of a disk on another node, written by this one over NBD
//! ([`crate::nbd::client`]): the target of `ferry disk move`, and replicas.
//!
//! A push keeps a dirty map of the disk ([`crate::tracking`]) and works in
//! rounds. Round 0 starts the map, then sends every allocated extent; each
//! later round takes the map (leaving it empty) and sends the granules it
//! marked, read from the live file. A change marks the map before it lands,
//! so a round that starts at instant T leaves the target holding every
//! write acknowledged before T (some newer ones too): T is the push's
//! `synced_ms`, and `lag_ms` is how old that is.
//!
//! - **Move**: rounds follow each other until what is left to send would
//!   take about [`IN_STEP_TIME`] (state `in_step`), then keep the target in
//!   step until [`Node::finish_push`]: with the disk's writes held
//!   ([`crate::tracking::Tracking::freeze`]) the last changes are sent and
//!   flushed, and the copy here is *retired* (persisted, no change lands
//!   any more): the commit point, after which the target holds the disk.
//!   Any failure before it leaves the disk here as it was.
//! - **Replica**: a round every `every_ms`; a round that fails gives its
//!   changes back to the map and the next one tries again (the lag grows
//!   meanwhile). Recorded with the disk, restarted with the node (from a
//!   full round: dirty maps live in memory).

use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_api::storage::{DiskRole, PushInfo, PushKind, PushRequest, PushState};
use ferry_api::util::{lock, now_ms};
use ferry_api::ApiError;
use tokio::sync::{oneshot, watch};

use crate::export::Export;
use crate::jobs::{copying, ended, map_name, Order, Push, ReplicaRecord};
use crate::nbd::client::{Client, MAX_WRITE};
use crate::node::Node;
use crate::tracking::Bitmap;

/// A move is in step when what is left would take about this long to send.
pub const IN_STEP_TIME: Duration = Duration::from_millis(250);
/// … or is at most this much.
pub const IN_STEP_BYTES: u64 = 4 << 20;
/// Writes sent at once (each up to [`MAX_WRITE`]).
const BATCH: usize = 16;
/// Shortest replica period.
pub const MIN_EVERY: Duration = Duration::from_secs(1);

impl Node {
    /// Starts pushing disk `disk` to node `req.to` (`POST /disks/{d}/push`).
    pub fn start_push(
        self: &Arc<Self>,
        disk: &str,
        req: &PushRequest,
    ) -> Result<PushInfo, ApiError> {
        ferry_api::storage::check_name("to", &req.to)?;
        ferry_api::types::parse_nbd_uri(&req.uri)?;
        if req.to == self.cfg.name {
            return Err(ApiError::invalid("to", format!("{} is this node", req.to)));
        }
        let every = match (req.kind, req.every_ms) {
            (PushKind::Replica, Some(ms)) if Duration::from_millis(ms) >= MIN_EVERY => Some(ms),
            (PushKind::Replica, _) => {
                return Err(ApiError::invalid(
                    "every_ms",
                    format!(
                        "a replica needs a period of at least {} ms",
                        MIN_EVERY.as_millis()
                    ),
                ))
            }
            (PushKind::Move, _) => None,
        };
        match self.role(disk)? {
            DiskRole::Primary => {}
            r => {
                return Err(ApiError::Conflict {
                    reason: format!(
                    "disk {disk} here is not the disk itself ({r:?}): it is not pushed from here"
                ),
                })
            }
        }
        let export = self.with_disk(disk, |e| e.clone())?;
        let mut pushes = lock(&self.pushes.map);
        if let Some(p) = pushes.get(disk) {
            let i = p.info();
            if copying(&i) {
                return Err(ApiError::Conflict {
                    reason: format!(
                        "disk {disk} is already being copied to {} ({}): one copy at a time{}",
                        i.to,
                        kind_name(i.kind),
                        if i.kind == PushKind::Replica {
                            " (stop the replica first: `ferry disk replica stop`)"
                        } else {
                            ""
                        }
                    ),
                });
            }
        }
        let info = PushInfo {
            disk: disk.to_string(),
            node: self.cfg.name.clone(),
            to: req.to.clone(),
            kind: req.kind,
            state: PushState::Copying,
            rounds: 0,
            bytes_sent: 0,
            round_total: 0,
            round_done: 0,
            dirty_bytes: 0,
            rate: 0.0,
            synced_ms: None,
            lag_ms: None,
            every_ms: every,
            final_ms: None,
            error: None,
        };
        let (order, orders) = watch::channel(Order::Run);
        let push = Arc::new(Push {
            info: Mutex::new(info),
            order,
            finish: Mutex::new(None),
        });
        pushes.insert(disk.to_string(), push.clone());
        drop(pushes);
        if req.kind == PushKind::Replica {
            self.set_replica(
                disk,
                Some(ReplicaRecord {
                    to: req.to.clone(),
                    uri: req.uri.clone(),
                    every_ms: every.unwrap_or_default(),
                }),
            )?;
        }
        tracing::info!(disk, to = %req.to, kind = ?req.kind, "push started");
        let started = push.info();
        let node = self.clone();
        let (disk, uri) = (disk.to_string(), req.uri.clone());
        tokio::spawn(async move {
            let name = map_name(&push.info().to);
            let r = run(&node, &export, &disk, &uri, &push, orders).await;
            export.tracking.end_map(&name);
            push.update(|i| match r {
                Ok(s) => i.state = s,
                Err(e) => {
                    tracing::warn!(disk, "push to {} failed: {e}", i.to);
                    i.state = PushState::Failed;
                    i.error = Some(e);
                }
            });
        });
        Ok(started)
    }

    /// The disk's push (`GET /disks/{d}/push`).
    pub fn push_info(&self, disk: &str) -> Result<PushInfo, ApiError> {
        lock(&self.pushes.map)
            .get(disk)
            .map(|p| p.info())
            .ok_or_else(|| ApiError::not_found("push of disk", disk))
    }

    /// Refuses while a push of `disk` runs (a disk with a replica or a
    /// move under way is not removed under it).
    pub(crate) fn refuse_pushed(&self, disk: &str) -> Result<(), ApiError> {
        match lock(&self.pushes.map).get(disk).map(|p| p.info()) {
            Some(i) if copying(&i) => Err(ApiError::Conflict {
                reason: format!(
                    "disk {disk} is being copied to {} ({}): stop that first",
                    i.to,
                    kind_name(i.kind)
                ),
            }),
            _ => Ok(()),
        }
    }

    /// Every push of this node (`GET /pushes`).
    pub fn list_pushes(&self) -> Vec<PushInfo> {
        lock(&self.pushes.map).values().map(|p| p.info()).collect()
    }

    /// Ends a move in step: its final round with the disk's writes held,
    /// then the copy here is retired (`POST /disks/{d}/push/finish`).
    pub async fn finish_push(&self, disk: &str) -> Result<PushInfo, ApiError> {
        let push = lock(&self.pushes.map)
            .get(disk)
            .cloned()
            .ok_or_else(|| ApiError::not_found("push of disk", disk))?;
        let i = push.info();
        let Some(tx) = lock(&push.finish).take() else {
            return Err(ApiError::Conflict {
                reason: format!(
                    "the push of disk {disk} to {} is not a move in step ({:?})",
                    i.to, i.state
                ),
            });
        };
        let (reply, answer) = oneshot::channel();
        tx.send(reply).map_err(|_| ApiError::Conflict {
            reason: format!("the push of disk {disk} ended"),
        })?;
        answer
            .await
            .map_err(|_| ApiError::internal("the push ended without an answer"))?
            .map_err(|e| ApiError::Conflict {
                reason: format!("disk {disk}'s final copy to {}: {e}", i.to),
            })
    }

    /// Stops the disk's push (`DELETE /disks/{d}/push`); a replica is
    /// forgotten (its copy on the other node stays until removed there).
    pub fn cancel_push(&self, disk: &str) -> Result<PushInfo, ApiError> {
        let push = lock(&self.pushes.map)
            .get(disk)
            .cloned()
            .ok_or_else(|| ApiError::not_found("push of disk", disk))?;
        push.order.send_replace(Order::Cancel);
        if push.info().kind == PushKind::Replica {
            self.set_replica(disk, None)?;
        }
        let mut i = push.info();
        if !ended(i.state) || i.kind == PushKind::Replica {
            i.state = PushState::Cancelled;
            push.update(|x| x.state = PushState::Cancelled);
        }
        Ok(i)
    }

    /// The disk lives on node `to` now (`POST /disks/{d}/retire`): a push
    /// of it stops, and the copy here is retired.
    pub fn retire_to(
        &self,
        disk: &str,
        to: &str,
    ) -> Result<ferry_api::storage::DiskInfo, ApiError> {
        if let Some(p) = lock(&self.pushes.map).get(disk) {
            p.order.send_replace(Order::Cancel);
        }
        self.retire(disk, to)
    }

    /// Restarts the replicas recorded with this node's disks.
    pub fn resume_replicas(self: &Arc<Self>) {
        for (disk, r) in self.replicas() {
            let req = PushRequest {
                to: r.to.clone(),
                uri: r.uri.clone(),
                kind: PushKind::Replica,
                every_ms: Some(r.every_ms),
            };
            match self.start_push(&disk, &req) {
                Ok(_) => tracing::info!(disk, to = %r.to, "replica resumed (a full round first)"),
                Err(e) => tracing::warn!(disk, to = %r.to, "replica not resumed: {e}"),
            }
        }
    }
}

fn kind_name(k: PushKind) -> &'static str {
    match k {
        PushKind::Move => "a move",
        PushKind::Replica => "a replica",
    }
}

/// Reads `[off, off + len)` of the export's file (zeroes past its end).
fn read_range(export: &Export, off: u64, len: usize) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let mut done = 0;
    while done < len {
        match export.file().read_at(&mut buf[done..], off + done as u64)? {
            0 => break,
            n => done += n,
        }
    }
    Ok(buf)
}

/// Sends the granules `map` marks; returns the bytes sent.
async fn send_map(
    client: &mut Client,
    export: &Arc<Export>,
    map: &Bitmap,
    push: &Push,
) -> Result<u64, String> {
    if export.size() > client.size {
        return Err(format!(
            "disk {} grew to {} bytes, past the copy's {} (its next round starts afresh)",
            export.name,
            export.size(),
            client.size
        ));
    }
    let size = export.size();
    let mut pieces = Vec::new();
    for (mut off, len) in map.extents(size) {
        let end = off + len;
        while off < end {
            let n = (end - off).min(MAX_WRITE as u64);
            pieces.push((off, n as usize));
            off += n;
        }
    }
    let total: u64 = pieces.iter().map(|p| p.1 as u64).sum();
    push.update(|i| {
        i.round_total = total;
        i.round_done = 0;
    });
    let mut sent = 0;
    let account = |n: u64| {
        push.update(|i| {
            i.round_done += n;
            i.bytes_sent += n;
        })
    };
    // two batches in flight: the next is read and sent while the last's
    // replies come; a batch counts once no more than the next is unanswered
    let mut unanswered: Option<u64> = None;
    for batch in pieces.chunks(BATCH) {
        let (e, b) = (export.clone(), batch.to_vec());
        let bufs = tokio::task::spawn_blocking(move || {
            b.iter()
                .map(|(off, n)| read_range(&e, *off, *n).map(|d| (*off, d)))
                .collect::<std::io::Result<Vec<_>>>()
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("reading {}: {e}", export.name))?;
        let writes: Vec<(u64, &[u8])> = bufs.iter().map(|(o, d)| (*o, d.as_slice())).collect();
        client
            .send_writes(&writes)
            .await
            .map_err(|e| e.to_string())?;
        client
            .wait_writes(writes.len())
            .await
            .map_err(|e| e.to_string())?;
        if let Some(n) = unanswered.replace(bufs.iter().map(|(_, d)| d.len() as u64).sum()) {
            sent += n;
            account(n);
        }
    }
    client.wait_writes(0).await.map_err(|e| e.to_string())?;
    if let Some(n) = unanswered {
        sent += n;
        account(n);
    }
    client.flush().await.map_err(|e| e.to_string())?;
    Ok(sent)
}

/// One round: takes the map (round 0: the allocated extents) and sends
/// it; on failure the changes go back to the map. Returns the round's
/// start (ms) once the target holds it.
async fn round(
    client: &mut Client,
    export: &Arc<Export>,
    name: &str,
    first: bool,
    push: &Push,
) -> Result<u64, String> {
    let t0 = now_ms();
    let started = Instant::now();
    let map = if first {
        let mut b = Bitmap::default();
        for (off, len) in export.data_extents().map_err(|e| e.to_string())? {
            b.set_range(off, len);
        }
        // changes before the map started are in the extents read after it
        b
    } else {
        export.tracking.take_map(name).unwrap_or_default()
    };
    push.update(|i| {
        if i.state != PushState::InStep {
            i.state = PushState::Copying;
        }
    });
    match send_map(client, export, &map, push).await {
        Ok(n) => {
            let dt = started.elapsed().as_secs_f64();
            push.update(|i| {
                i.rounds += 1;
                i.synced_ms = Some(t0);
                if n >= 1 << 20 && dt > 0.0 {
                    i.rate = n as f64 / dt;
                }
                i.error = None;
            });
            Ok(t0)
        }
        Err(e) => {
            if !first {
                export.tracking.restore_dirty(name, Some(map));
            }
            Err(e)
        }
    }
}

/// Holds every change to `export` off until the returned sender is
/// dropped or sent to (the gate's write side lives in a thread of its own).
async fn hold_writes(export: &Arc<Export>) -> std::sync::mpsc::Sender<()> {
    let (release, wait) = std::sync::mpsc::channel::<()>();
    let (held, is_held) = oneshot::channel();
    let e = export.clone();
    std::thread::spawn(move || {
        let _frozen = e.tracking.freeze();
        let _ = held.send(());
        let _ = wait.recv();
    });
    let _ = is_held.await;
    release
}

async fn run(
    node: &Arc<Node>,
    export: &Arc<Export>,
    disk: &str,
    uri: &str,
    push: &Arc<Push>,
    mut orders: watch::Receiver<Order>,
) -> Result<PushState, String> {
    let info = push.info();
    let name = map_name(&info.to);
    let tls = node.cfg.client_tls.clone();
    let connect = || async {
        let c = Client::connect(uri, tls.clone())
            .await
            .map_err(|e| format!("opening {uri}: {e}"))?;
        if c.size < export.size() {
            return Err(format!(
                "{uri} holds {} bytes, the disk {}",
                c.size,
                export.size()
            ));
        }
        Ok(c)
    };
    let cancelled = |o: &watch::Receiver<Order>| matches!(*o.borrow(), Order::Cancel);
    export.tracking.start_map(&name);
    match info.kind {
        PushKind::Move => {
            let mut client = connect().await?;
            round(&mut client, export, &name, true, push).await?;
            let (finish_tx, mut finish_rx) = oneshot::channel();
            let mut finish_tx = Some(finish_tx);
            loop {
                if cancelled(&orders) {
                    return Ok(PushState::Cancelled);
                }
                let dirty = export.tracking.dirty_bytes(&name).unwrap_or(0);
                let rate = push.info().rate.max(1.0);
                push.update(|i| i.dirty_bytes = dirty);
                let small = dirty <= IN_STEP_BYTES
                    || Duration::from_secs_f64(dirty as f64 / rate) <= IN_STEP_TIME;
                if small {
                    if let Some(tx) = finish_tx.take() {
                        *lock(&push.finish) = Some(tx);
                        push.update(|i| i.state = PushState::InStep);
                        tracing::info!(disk, dirty, "move in step");
                    }
                    tokio::select! {
                        r = &mut finish_rx => {
                            let Ok(reply) = r else { return Ok(PushState::Cancelled) };
                            let r = final_round(node, &mut client, export, disk, &name, push).await;
                            let state = if r.is_ok() { PushState::Done } else { PushState::Failed };
                            let out = r.clone().map(|()| {
                                push.update(|i| i.state = state);
                                push.info()
                            });
                            let _ = reply.send(out);
                            return r.map(|()| state);
                        }
                        _ = orders.changed() => continue,
                        _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                    }
                }
                round(&mut client, export, &name, false, push).await?;
            }
        }
        PushKind::Replica => {
            let every = Duration::from_millis(info.every_ms.unwrap_or(30_000));
            let mut client: Option<Client> = None;
            let mut first = true;
            loop {
                if cancelled(&orders) {
                    return Ok(PushState::Cancelled);
                }
                let next = tokio::time::Instant::now() + every;
                let r = async {
                    if client.is_none() {
                        client = Some(connect().await?);
                    }
                    let c = client.as_mut().ok_or("no connection")?;
                    round(c, export, &name, first, push).await
                }
                .await;
                match r {
                    Ok(_) => {
                        first = false;
                        let dirty = export.tracking.dirty_bytes(&name).unwrap_or(0);
                        push.update(|i| {
                            i.state = PushState::Idle;
                            i.dirty_bytes = dirty;
                        });
                    }
                    Err(e) => {
                        // the next round tries again on a new connection
                        client = None;
                        tracing::warn!(disk, "replica round failed: {e}");
                        push.update(|i| {
                            i.state = PushState::Failed;
                            i.error = Some(e);
                        });
                    }
                }
                tokio::select! {
                    _ = orders.changed() => {}
                    _ = tokio::time::sleep_until(next) => {}
                }
            }
        }
    }
}

/// A move's last round: writes held, the last changes sent and flushed,
/// then the copy here retired — the commit point.
async fn final_round(
    node: &Node,
    client: &mut Client,
    export: &Arc<Export>,
    disk: &str,
    name: &str,
    push: &Push,
) -> Result<(), String> {
    let t = Instant::now();
    let release = hold_writes(export).await;
    let r = round(client, export, name, false, push).await;
    let r = match r {
        Ok(_) => {
            let to = push.info().to;
            node.retire(disk, &to)
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
        Err(e) => Err(e),
    };
    drop(release);
    let ms = t.elapsed().as_millis() as u64;
    push.update(|i| i.final_ms = Some(ms));
    tracing::info!(disk, final_ms = ms, ok = r.is_ok(), "move's final round");
    r
}
