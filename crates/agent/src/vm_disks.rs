//! The storage resilience room's disk side: disks plugged, grown, held
//! while they change storage node, switched and released, and a storage
//! node's connections made again (a storage outage itself is
//! `crate::resilience`).

use std::sync::Arc;

use ferry_api::types::DiskUse;
use ferry_api::{ApiError, VmInfo, VmSpec};

use crate::host::{Agent, Held, Role, HOLD_MAX};
use crate::qemu::{self, QemuVm};
use ferry_api::util::error_chain;

impl Agent {
    /// Hot-plugs an NBD disk into a running VM; the disk joins the VM's spec,
    /// so a migration target starts with it plugged.
    pub async fn plug_disk(
        &self,
        name: &str,
        plug: ferry_api::DiskPlug,
    ) -> Result<VmInfo, ApiError> {
        plug.parse_uri()?;
        let mut st = self.state.lock().await;
        let slot = st
            .vms
            .get_mut(name)
            .ok_or_else(|| ApiError::not_found("vm", name))?;
        let q = slot.settled_qemu(name)?;
        if slot.spec.disks.iter().any(|d| d.disk == plug.disk) {
            return Err(ApiError::AlreadyExists {
                kind: format!("disk of vm {name}"),
                name: plug.disk,
            });
        }
        let index = slot.spec.disks.len();
        if index >= ferry_api::MAX_VM_DISKS {
            return Err(ApiError::invalid(
                "disk",
                format!("vm {name} has {index} disks, the most it takes"),
            ));
        }
        let node = qemu::BlockNode::disk(index, &plug).expect("a parsed URI");
        q.qmp
            .plug_disk(index, node.blockdev(&self.cfg.qemu))
            .await
            .map_err(|e| ApiError::unavailable(format!("plugging {} into {name}", plug.disk), e))?;
        slot.spec.disks.push(plug);
        let spec = slot.spec.clone();
        drop(st);
        // a restarted agent takes the VM back with its disks
        if let Err(e) = q.record(&spec).await {
            tracing::error!(vm = %name, error = %error_chain(&e), "recording the plugged disk");
        }
        tracing::info!(vm = %name, disks = spec.disks.len(), "disk plugged");
        Ok(self.vm_info(&spec, &Role::Running, Some(&q)).await)
    }

    /// Disk `disk` of VM `name` grew to `size` on its storage node: the
    /// guest sees the new size at once: a fresh connection under its node
    /// ([`Agent::reconnect_node`]), then `block_resize`.
    pub async fn grow_disk(&self, name: &str, disk: &str, size: u64) -> Result<VmInfo, ApiError> {
        let st = self.state.lock().await;
        let slot = st
            .vms
            .get(name)
            .ok_or_else(|| ApiError::not_found("vm", name))?;
        let q = slot.settled_qemu(name)?;
        let (index, plug) = slot
            .spec
            .disks
            .iter()
            .enumerate()
            .find(|(_, d)| d.disk == disk)
            .ok_or_else(|| ApiError::not_found(&format!("disk of vm {name}"), disk))?;
        plug.parse_uri()?;
        let spec = slot.spec.clone();
        drop(st);
        let node = format!("disk{index}");
        self.reconnect_node(&q, &spec, &node)
            .await
            .map_err(|e| ApiError::unavailable(format!("growing disk {disk} of {name}"), e))?;
        q.qmp
            .block_resize(&node, size)
            .await
            .map_err(|e| ApiError::unavailable(format!("growing disk {disk} of {name}"), e))?;
        tracing::info!(vm = %name, disk, size, "disk grown");
        Ok(self.vm_info(&spec, &Role::Running, Some(&q)).await)
    }

    /// Pauses VM `name` while its disk `disk` changes storage node: QEMU
    /// completes every request in flight first, so the old node holds
    /// all the guest wrote. Asked again, answers the same hold.
    pub async fn hold_for_disk(
        self: &Arc<Self>,
        name: &str,
        disk: &str,
    ) -> Result<VmInfo, ApiError> {
        let mut st = self.state.lock().await;
        let slot = st
            .vms
            .get_mut(name)
            .ok_or_else(|| ApiError::not_found("vm", name))?;
        let q = slot.settled_qemu(name)?;
        if slot.spec.disk_use(disk).is_none() {
            return Err(ApiError::not_found(&format!("disk of vm {name}"), disk));
        }
        if let Some(h) = &slot.held {
            if h.disk != disk {
                return Err(ApiError::Conflict {
                    reason: format!("vm {name} is held for a move of disk {}", h.disk),
                });
            }
        } else {
            let status = q
                .qmp
                .status()
                .await
                .map_err(|e| ApiError::unavailable(format!("vm {name}"), e))?;
            let resume = status.status == "running";
            if resume {
                q.qmp
                    .stop()
                    .await
                    .map_err(|e| ApiError::unavailable(format!("pausing vm {name}"), e))?;
            }
            let id = ferry_api::util::now_ms();
            slot.held = Some(Held {
                disk: disk.to_string(),
                resume,
                id,
            });
            tracing::info!(vm = name, disk, resume, "held for a move of its disk");
            let (agent, vm) = (self.clone(), name.to_string());
            tokio::spawn(async move {
                tokio::time::sleep(HOLD_MAX).await;
                let still = {
                    let st = agent.state.lock().await;
                    st.vms
                        .get(&vm)
                        .and_then(|s| s.held.as_ref())
                        .is_some_and(|h| h.id == id)
                };
                if still {
                    tracing::warn!(
                        vm,
                        "hold for a disk move not released within {HOLD_MAX:?}: releasing it"
                    );
                    let _ = agent.release_disk(&vm, None).await;
                }
            });
        }
        let spec = slot.spec.clone();
        drop(st);
        Ok(self.vm_info(&spec, &Role::Running, Some(&q)).await)
    }

    /// Disk `disk` of VM `name` is served at `uri` now (`None`: where it
    /// was): a new connection is swapped in and kept in the VM's spec, and
    /// a guest held for the move runs again.
    pub async fn switch_disk(
        &self,
        name: &str,
        disk: &str,
        uri: Option<String>,
    ) -> Result<VmInfo, ApiError> {
        if let Some(uri) = uri {
            ferry_api::types::parse_nbd_uri(&uri)?;
            let mut st = self.state.lock().await;
            let slot = st
                .vms
                .get_mut(name)
                .ok_or_else(|| ApiError::not_found("vm", name))?;
            let q = slot.settled_qemu(name)?;
            let mut spec = slot.spec.clone();
            let node = match spec.disk_use(disk) {
                Some(DiskUse::Plugged(i)) if spec.disks[i].uri != uri => {
                    spec.disks[i].uri = uri.clone();
                    Some(format!("disk{i}"))
                }
                Some(DiskUse::Drive(i)) if spec.drives[i].nbd.as_deref() != Some(&uri) => {
                    spec.drives[i].nbd = Some(uri.clone());
                    Some(format!("drive{i}"))
                }
                Some(_) => None,
                None => return Err(ApiError::not_found(&format!("disk of vm {name}"), disk)),
            };
            if let Some(node) = node {
                if let Err(e) = self.reconnect_node(&q, &spec, &node).await {
                    // QEMU flushes the connection it replaces first: one
                    // that lost a write to a node that is gone cannot be
                    // flushed, so only a new QEMU opens the disk there
                    let lost =
                        matches!(q.qmp.status().await, Ok(s) if s.status == crate::qemu::IO_ERROR);
                    if !lost || !spec.drives.iter().all(|d| d.local.is_none()) {
                        return Err(ApiError::unavailable(
                            format!("switching disk {disk} of {name} to {uri}"),
                            e,
                        ));
                    }
                    drop(st);
                    tracing::warn!(vm = name, disk, "the old connection lost writes to a node that is gone ({e}): restarting the guest on {uri}");
                    return self.restart_with(name, spec).await;
                }
                slot.spec = spec.clone();
                drop(st);
                if let Err(e) = q.record(&spec).await {
                    tracing::error!(vm = %name, error = %error_chain(&e), "recording the switched disk");
                }
                tracing::info!(vm = name, disk, uri, "disk switched to its new node");
            }
        }
        self.release_disk(name, Some(disk)).await
    }

    /// Starts VM `name` again from `spec`: its QEMU stops, a new one boots
    /// (the guest's memory is lost; what it wrote to its disks is not).
    pub(crate) async fn restart_with(&self, name: &str, spec: VmSpec) -> Result<VmInfo, ApiError> {
        let Some(q) = self.release(name).await else {
            return Err(ApiError::not_found("vm", name));
        };
        q.stop().await;
        self.remove_vm_dir(&q.dir, &format!("{name}.restarted"));
        self.create_vm(spec).await
    }

    /// Ends a hold (of disk `disk`, or any): the guest runs again if it ran before.
    pub(crate) async fn release_disk(
        &self,
        name: &str,
        disk: Option<&str>,
    ) -> Result<VmInfo, ApiError> {
        let mut st = self.state.lock().await;
        let slot = st
            .vms
            .get_mut(name)
            .ok_or_else(|| ApiError::not_found("vm", name))?;
        let q = slot.settled_qemu(name)?;
        let held = match (&slot.held, disk) {
            (Some(h), Some(d)) if h.disk != d => None,
            _ => slot.held.take(),
        };
        if let Some(h) = held {
            if h.resume {
                q.qmp
                    .cont()
                    .await
                    .map_err(|e| ApiError::unavailable(format!("resuming vm {name}"), e))?;
            }
            tracing::info!(vm = name, disk = %h.disk, "released after a move of its disk");
        }
        let spec = slot.spec.clone();
        drop(st);
        Ok(self.vm_info(&spec, &Role::Running, Some(&q)).await)
    }

    /// Opens a new NBD connection for block node `node` of a VM
    /// (`disk{i}` or `drive{i}` of `spec`) and swaps it in; the connection
    /// it replaces goes. `Ok(false)`: the node does not read over NBD.
    pub async fn reconnect_node(
        &self,
        q: &QemuVm,
        spec: &VmSpec,
        node: &str,
    ) -> Result<bool, crate::qmp::QmpError> {
        let Some(n) = qemu::block_nodes(spec).into_iter().find(|n| n.name == node) else {
            return Ok(false);
        };
        if !matches!(n.backing, qemu::Backing::Nbd { .. }) {
            return Ok(false);
        }
        // a new name for each connection; the ones it replaces go
        let prefix = format!("{node}-f");
        let old: Vec<String> = q
            .qmp
            .block_nodes()
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|n| n.starts_with(&prefix))
            .collect();
        let file_node = format!("{prefix}{}", ferry_api::util::now_ms());
        q.qmp
            .swap_file(
                node,
                n.driver,
                n.read_only,
                n.file(&self.cfg.qemu),
                &file_node,
            )
            .await?;
        for n in old {
            let _ = q.qmp.blockdev_del(&n).await;
        }
        Ok(true)
    }
}
