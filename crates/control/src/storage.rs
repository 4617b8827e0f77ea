//! The control service's side of storage: disks live on storage nodes,
//! policies are the cluster's (every node gets a copy), flows are gathered
//! from every node. Attaching a disk to a VM asks the VM's agent to plug it.

use std::time::Duration;

use ferry_api::storage::{
    BackupRequest, CheckpointInfo, CheckpointRequest, DiskAttachRequest, DiskCreateRequest,
    DiskInfo, DiskMoveRequest, DiskResizeRequest, DiskSetRequest, FlowInfo, JobInfo, Policy,
    PolicyUpdate, QosSettings, ReplicaRequest,
};
use ferry_api::{ApiError, VmInfo};

use crate::Control;

const NODE_TIMEOUT: Duration = Duration::from_secs(10);

/// Storage operations of the one command API.
#[derive(Debug, Clone)]
pub enum StorageCommand {
    ListDisks,
    CreateDisk(DiskCreateRequest),
    ResizeDisk {
        name: String,
        size: u64,
    },
    SetDisk {
        name: String,
        req: DiskSetRequest,
    },
    RemoveDisk {
        name: String,
    },
    AttachDisk {
        name: String,
        req: DiskAttachRequest,
    },
    /// Starts a backup on the disk's node (a path there; admin only).
    Backup {
        name: String,
        req: BackupRequest,
    },
    /// The disk's last copy job (a backup or checkpoint being taken).
    Job {
        name: String,
    },
    ListCheckpoints {
        name: String,
    },
    CreateCheckpoint {
        name: String,
        req: CheckpointRequest,
    },
    RemoveCheckpoint {
        name: String,
        checkpoint: String,
    },
    /// Refused while a VM has the disk attached, naming them.
    RevertCheckpoint {
        name: String,
        checkpoint: String,
    },
    /// Moves the disk to another storage node while guests use it (a
    /// stream of its progress; see `crate::disk_move`).
    MoveDisk {
        name: String,
        req: DiskMoveRequest,
    },
    /// The disk's last move.
    MoveStatus {
        name: String,
    },
    Replicate {
        name: String,
        req: ReplicaRequest,
    },
    /// Every replica, or one disk's.
    ListReplicas {
        name: Option<String>,
    },
    StopReplica {
        name: String,
    },
    /// The replica becomes the disk (its primary's node is gone).
    FailoverReplica {
        name: String,
    },
    ListPolicies,
    NewPolicy(Policy),
    UpdatePolicy {
        name: String,
        update: PolicyUpdate,
    },
    RemovePolicy {
        name: String,
    },
    ListFlows,
    ListNodes,
    GetSettings,
    SetSettings(QosSettings),
}

impl StorageCommand {
    /// (subject, action) of a command that changes something, for the event log.
    pub fn mutation(&self) -> Option<(String, &'static str)> {
        use StorageCommand::*;
        Some(match self {
            CreateDisk(r) => (r.name.clone(), "create disk"),
            ResizeDisk { name, .. } => (name.clone(), "resize disk"),
            SetDisk { name, .. } => (name.clone(), "set disk policy"),
            RemoveDisk { name } => (name.clone(), "remove disk"),
            AttachDisk { name, .. } => (name.clone(), "attach disk"),
            Backup { name, .. } => (name.clone(), "back up disk"),
            CreateCheckpoint { name, .. } => (name.clone(), "checkpoint disk"),
            RemoveCheckpoint { name, .. } => (name.clone(), "remove a checkpoint of disk"),
            RevertCheckpoint { name, .. } => (name.clone(), "revert disk"),
            MoveDisk { name, .. } => (name.clone(), "move disk"),
            Replicate { name, .. } => (name.clone(), "replicate disk"),
            StopReplica { name } => (name.clone(), "stop the replica of disk"),
            FailoverReplica { name } => (name.clone(), "fail over disk"),
            NewPolicy(p) => (p.name.clone(), "new policy"),
            UpdatePolicy { name, .. } => (name.clone(), "update policy"),
            RemovePolicy { name } => (name.clone(), "remove policy"),
            SetSettings(_) => ("qos".into(), "set normalization"),
            ListDisks
            | Job { .. }
            | ListCheckpoints { .. }
            | MoveStatus { .. }
            | ListReplicas { .. }
            | ListPolicies
            | ListFlows
            | ListNodes
            | GetSettings => return None,
        })
    }
}

fn json<T: serde::Serialize>(v: T) -> Result<serde_json::Value, ApiError> {
    serde_json::to_value(v).map_err(ApiError::internal)
}

impl Control {
    fn first_node(&self) -> Result<(&String, &ferry_net::client::Client), ApiError> {
        self.storage
            .iter()
            .next()
            .ok_or_else(|| ApiError::unavailable("storage", "no storage node is registered"))
    }

    /// Asks every storage node for the list at `path`, all at once: one
    /// answer per node, in node order.
    pub(crate) async fn ask_every_node<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        timeout: Duration,
    ) -> Vec<Result<Vec<T>, ApiError>> {
        let calls = self
            .storage
            .values()
            .map(|c| c.get::<Vec<T>>(path, timeout));
        futures::future::join_all(calls).await
    }

    /// Every node's list at `path`, concatenated; the first node's error fails it.
    async fn gather<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<Vec<T>, ApiError> {
        let mut out = Vec::new();
        for r in self.ask_every_node(path, NODE_TIMEOUT).await {
            out.extend(r?);
        }
        Ok(out)
    }

    /// The cluster's disks: each node's primaries (the copies it keeps for
    /// moves and replicas are not disks of their own). A node that does
    /// not answer is left out (`storage nodes` shows it), unless none answers.
    async fn list_disks(&self) -> Result<Vec<DiskInfo>, ApiError> {
        Ok(self.answering_disks().await?.0)
    }

    /// [`Self::list_disks`], and the nodes that did not answer.
    async fn answering_disks(&self) -> Result<(Vec<DiskInfo>, Vec<String>), ApiError> {
        let answers = self
            .ask_every_node::<DiskInfo>("/disks", NODE_TIMEOUT)
            .await;
        let (mut out, mut down, mut last) = (Vec::new(), Vec::new(), None);
        for (node, r) in self.storage.keys().zip(answers) {
            match r {
                Ok(l) => out.extend(l),
                Err(e) => {
                    tracing::warn!(
                        node,
                        "disks of a storage node that does not answer left out: {e}"
                    );
                    down.push(node.clone());
                    last = Some(e);
                }
            }
        }
        if down.len() == self.storage.len() {
            if let Some(e) = last {
                return Err(e);
            }
        }
        out.retain(|d| d.role.is_primary());
        out.sort_by(|a, b| a.name.cmp(&b.name));
        // two primaries of one name: an old primary back after a failover
        let mut i = 1;
        while i < out.len() {
            if out[i].name == out[i - 1].name {
                let (a, b) = (out[i - 1].node.clone(), out[i].node.clone());
                match self.settle_twin(&out[i].name, &a, &b).await {
                    Some(keep) if keep == a => {
                        out.remove(i);
                    }
                    Some(_) => {
                        out.remove(i - 1);
                    }
                    None => i += 1,
                }
            } else {
                i += 1;
            }
        }
        Ok((out, down))
    }

    pub(crate) async fn locate_disk(
        &self,
        name: &str,
    ) -> Result<(DiskInfo, &ferry_net::client::Client), ApiError> {
        let (disks, down) = self.answering_disks().await?;
        let d = match disks.into_iter().find(|d| d.name == name) {
            Some(d) => d,
            None if !down.is_empty() => {
                return Err(ApiError::unavailable(
                    format!("disk {name}"),
                    format!(
                        "not on any storage node that answers, and {} does not answer",
                        down.join(", ")
                    ),
                ))
            }
            None => return Err(ApiError::not_found("disk", name)),
        };
        let c = self
            .storage
            .get(&d.node)
            .ok_or_else(|| ApiError::not_found("storage node", &d.node))?;
        Ok((d, c))
    }

    pub async fn storage_command(
        &self,
        cmd: StorageCommand,
    ) -> Result<serde_json::Value, ApiError> {
        match cmd {
            StorageCommand::ListDisks => json(self.list_disks().await?),
            StorageCommand::CreateDisk(req) => {
                let node = match &req.node {
                    Some(n) => self
                        .storage
                        .get(n)
                        .ok_or_else(|| ApiError::not_found("storage node", n))?,
                    None => self.first_node()?.1,
                };
                if self.list_disks().await?.iter().any(|d| d.name == req.name) {
                    return Err(ApiError::AlreadyExists {
                        kind: "disk".into(),
                        name: req.name,
                    });
                }
                json(
                    node.post::<_, DiskInfo>("/disks", &req, NODE_TIMEOUT)
                        .await?,
                )
            }
            StorageCommand::ResizeDisk { name, size } => {
                let (_, c) = self.locate_disk(&name).await?;
                let r: DiskInfo = c
                    .put(
                        &format!("/disks/{name}/size"),
                        &DiskResizeRequest { size },
                        NODE_TIMEOUT,
                    )
                    .await?;
                // every guest with the disk open sees the new size at once
                let mut failed = Vec::new();
                // and its replica grows with it (the next round sends the rest)
                for p in self.replicas(Some(&name)).await.unwrap_or_default() {
                    let Some(n) = self.storage.get(&p.to) else {
                        continue;
                    };
                    if let Err(e) = n
                        .put::<_, DiskInfo>(
                            &format!("/disks/{name}/size"),
                            &DiskResizeRequest { size: r.size },
                            NODE_TIMEOUT,
                        )
                        .await
                    {
                        failed.push(format!("its replica on {}: {e}", p.to));
                    }
                }
                for vm in self.list_vms().await? {
                    if vm.state == "incoming" || !vm.spec.disks.iter().any(|d| d.disk == name) {
                        continue;
                    }
                    let path = format!("/vms/{}/disks/{name}/size", vm.name);
                    let body = DiskResizeRequest { size: r.size };
                    if let Err(e) = self
                        .host(&vm.host)?
                        .put::<_, VmInfo>(&path, &body, Duration::from_secs(30))
                        .await
                    {
                        failed.push(format!("{} on {}: {e}", vm.name, vm.host));
                    }
                }
                if !failed.is_empty() {
                    return Err(ApiError::Conflict {
                        reason: format!(
                            "disk {name} grew to {} bytes, but these guests do not see it yet: {}",
                            r.size,
                            failed.join("; ")
                        ),
                    });
                }
                json(r)
            }
            StorageCommand::SetDisk { name, req } => {
                let (_, c) = self.locate_disk(&name).await?;
                json(
                    c.put::<_, DiskInfo>(&format!("/disks/{name}/policy"), &req, NODE_TIMEOUT)
                        .await?,
                )
            }
            StorageCommand::RemoveDisk { name } => {
                let (_, c) = self.locate_disk(&name).await?;
                json(
                    c.delete::<DiskInfo>(&format!("/disks/{name}"), NODE_TIMEOUT)
                        .await?,
                )
            }
            StorageCommand::AttachDisk { name, req } => {
                let (disk, _) = self.locate_disk(&name).await?;
                let (host, info) = self.locate(&req.vm).await?;
                let mut disks = info.spec.ferry_disks();
                disks.insert(disk.name.clone());
                let grant = crate::access::Grant::new([host.clone()].into(), disks);
                self.grant(&req.vm, grant).await?;
                let body = ferry_api::DiskPlug {
                    disk: disk.name.clone(),
                    uri: format!("{}/{}", disk.uri, req.vm),
                };
                let vm: VmInfo = self
                    .host(&host)?
                    .post(
                        &format!("/vms/{}/disks", req.vm),
                        &body,
                        Duration::from_secs(30),
                    )
                    .await?;
                json(vm)
            }
            StorageCommand::Backup { name, req } => {
                let (_, c) = self.locate_disk(&name).await?;
                json(
                    c.post::<_, JobInfo>(&format!("/disks/{name}/backups"), &req, NODE_TIMEOUT)
                        .await?,
                )
            }
            StorageCommand::Job { name } => {
                let (_, c) = self.locate_disk(&name).await?;
                json(
                    c.get::<JobInfo>(&format!("/disks/{name}/job"), NODE_TIMEOUT)
                        .await?,
                )
            }
            StorageCommand::ListCheckpoints { name } => {
                let (_, c) = self.locate_disk(&name).await?;
                json(
                    c.get::<Vec<CheckpointInfo>>(
                        &format!("/disks/{name}/checkpoints"),
                        NODE_TIMEOUT,
                    )
                    .await?,
                )
            }
            StorageCommand::CreateCheckpoint { name, req } => {
                let (_, c) = self.locate_disk(&name).await?;
                json(
                    c.post::<_, JobInfo>(&format!("/disks/{name}/checkpoints"), &req, NODE_TIMEOUT)
                        .await?,
                )
            }
            StorageCommand::RemoveCheckpoint { name, checkpoint } => {
                let (_, c) = self.locate_disk(&name).await?;
                json(
                    c.delete::<CheckpointInfo>(
                        &format!("/disks/{name}/checkpoints/{checkpoint}"),
                        NODE_TIMEOUT,
                    )
                    .await?,
                )
            }
            StorageCommand::RevertCheckpoint { name, checkpoint } => {
                let (_, c) = self.locate_disk(&name).await?;
                let users: Vec<String> = self
                    .list_vms()
                    .await?
                    .into_iter()
                    .filter(|vm| vm.spec.disks.iter().any(|d| d.disk == name))
                    .map(|vm| format!("{} on {}", vm.name, vm.host))
                    .collect();
                if !users.is_empty() {
                    return Err(ApiError::Conflict {
                        reason: format!(
                            "disk {name} is attached to {}: reverting it under a running guest would corrupt it (remove those VMs or their disk first)",
                            users.join(", ")
                        ),
                    });
                }
                json(
                    c.post::<_, DiskInfo>(
                        &format!("/disks/{name}/checkpoints/{checkpoint}/revert"),
                        &serde_json::json!({}),
                        Duration::from_secs(600),
                    )
                    .await?,
                )
            }
            StorageCommand::MoveDisk { name, .. } => Err(ApiError::internal(format!(
                "a move of disk {name} is a stream (run through execute)"
            ))),
            StorageCommand::MoveStatus { name } => json(self.disk_move(&name)?),
            StorageCommand::Replicate { name, req } => {
                json(self.replicate_disk(&name, &req).await?)
            }
            StorageCommand::ListReplicas { name } => json(self.replicas(name.as_deref()).await?),
            StorageCommand::StopReplica { name } => json(self.stop_replica(&name).await?),
            StorageCommand::FailoverReplica { name } => json(self.failover_replica(&name).await?),
            StorageCommand::ListPolicies => {
                let (_, c) = self.first_node()?;
                json(c.get::<Vec<Policy>>("/qos/policies", NODE_TIMEOUT).await?)
            }
            StorageCommand::NewPolicy(p) => {
                p.validate()?;
                let (_, c) = self.first_node()?;
                let have: Vec<Policy> = c.get("/qos/policies", NODE_TIMEOUT).await?;
                if have.iter().any(|x| x.name == p.name) {
                    return Err(ApiError::AlreadyExists {
                        kind: "policy".into(),
                        name: p.name,
                    });
                }
                self.put_policy_everywhere(&p).await?;
                json(p)
            }
            StorageCommand::UpdatePolicy { name, update } => {
                let (_, c) = self.first_node()?;
                let have: Vec<Policy> = c.get("/qos/policies", NODE_TIMEOUT).await?;
                let old = have
                    .iter()
                    .find(|x| x.name == name)
                    .ok_or_else(|| ApiError::not_found("policy", &name))?;
                let p = update.apply(old);
                p.validate()?;
                self.put_policy_everywhere(&p).await?;
                json(p)
            }
            StorageCommand::RemovePolicy { name } => {
                let mut removed = None;
                for c in self.storage.values() {
                    match c
                        .delete::<Policy>(&format!("/qos/policies/{name}"), NODE_TIMEOUT)
                        .await
                    {
                        Ok(p) => removed = Some(p),
                        Err(ApiError::NotFound { .. }) => {}
                        Err(e) => return Err(e),
                    }
                }
                json(removed.ok_or_else(|| ApiError::not_found("policy", &name))?)
            }
            StorageCommand::ListFlows => json(self.gather::<FlowInfo>("/qos/flows").await?),
            StorageCommand::ListNodes => json(self.storage_nodes().await),
            StorageCommand::GetSettings => {
                let (_, c) = self.first_node()?;
                json(c.get::<QosSettings>("/qos/settings", NODE_TIMEOUT).await?)
            }
            StorageCommand::SetSettings(s) => {
                s.validate()?;
                for c in self.storage.values() {
                    let _: QosSettings = c.put("/qos/settings", &s, NODE_TIMEOUT).await?;
                }
                json(s)
            }
        }
    }

    /// Asks every storage node for its disks; an answer is a heartbeat.
    pub async fn storage_nodes(&self) -> Vec<ferry_api::storage::StorageNodeEntry> {
        let calls = self.storage.iter().map(|(name, c)| async move {
            let r = c
                .get::<Vec<DiskInfo>>("/disks", Duration::from_secs(2))
                .await;
            if let Ok(disks) = &r {
                self.learn_endpoints(name, disks);
            }
            ferry_api::storage::StorageNodeEntry {
                name: name.clone(),
                url: c.base().to_string(),
                reachable: r.is_ok(),
                error: r.as_ref().err().map(|e| e.to_string()),
                disks: r.map(|d| d.len() as u32).unwrap_or(0),
            }
        });
        futures::future::join_all(calls).await
    }

    /// One round of the cluster-wide policy manager: gathers every node's
    /// flows, splits Aggregated policies that span nodes
    /// ([`crate::policy_manager::allocate`]) and pushes the allocations that
    /// changed (clearing those no longer needed). Returns how many it pushed.
    pub async fn manage_policies(&self) -> Result<usize, ApiError> {
        if self.storage.len() < 2 {
            return Ok(0);
        }
        let (_, first) = self.first_node()?;
        let policies: Vec<Policy> = first.get("/qos/policies", NODE_TIMEOUT).await?;
        let policies = policies.into_iter().map(|p| (p.name.clone(), p)).collect();
        let flows: Vec<FlowInfo> = self.gather("/qos/flows").await?;
        let demands: Vec<crate::policy_manager::FlowDemand> = flows
            .iter()
            .filter(|f| f.connections > 0)
            .map(|f| crate::policy_manager::FlowDemand {
                flow: f.id.clone(),
                node: f.node.clone(),
                policy: f.policy.clone(),
                // a flow kept waiting asks for more than it gets
                demand_iops: if f.backlogged > 0.5 {
                    2.0 * f.iops
                } else {
                    f.iops
                },
            })
            .collect();
        let want = crate::policy_manager::allocate(&policies, &demands);
        let mut applied = self.allocations.lock().await;
        let mut pushed = 0;
        for f in &flows {
            let key = (f.node.clone(), f.id.clone());
            let target = want.get(&key).copied();
            if applied.get(&key).copied() == target {
                continue;
            }
            let Some(c) = self.storage.get(&f.node) else {
                continue;
            };
            let body = serde_json::json!({ "flow": f.id, "allocation": target });
            let _: FlowInfo = c.put("/qos/allocations", &body, NODE_TIMEOUT).await?;
            match target {
                Some(a) => applied.insert(key, a),
                None => applied.remove(&key),
            };
            pushed += 1;
        }
        Ok(pushed)
    }

    async fn put_policy_everywhere(&self, p: &Policy) -> Result<(), ApiError> {
        if self.storage.is_empty() {
            return Err(ApiError::unavailable(
                "storage",
                "no storage node is registered",
            ));
        }
        for c in self.storage.values() {
            let _: Policy = c
                .put(&format!("/qos/policies/{}", p.name), p, NODE_TIMEOUT)
                .await?;
        }
        Ok(())
    }
}
