//! The target side of a live migration: the paused skeleton, its answers to
//! the source (ready? ran?), RUN, discarding, and asking the source when
//! nobody tells it anything (see [`crate::commit`]).

use std::ops::ControlFlow::{self, Break, Continue};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_api::hardware::DriveFormat;
use ferry_api::{
    ApiError, CarrierEndpoint, IncomingReply, IncomingRequest, IncomingStatus, MigrationOption,
    RecoverReply, SourceStatus,
};

use super::MULTIFD_CHANNELS;
use crate::commit::{
    from_wire_name, target_next, wire_name, Record, Side, SourceAnswer, TargetAction, TargetAnswer,
    TargetEvent, TargetPhase,
};
use crate::datapath::{DataPath, QemuTcp};
use crate::host::{error_chain, Agent, Role};
use crate::qemu::{self, QemuVm};
use crate::qmp::MigrationParameters;

/// `qemu_status` of a look that did not ask QEMU ([`Agent::incoming_alive`]).
const QEMU_UNASKED: &str = "unasked";

/// How often READY asks the skeleton whether it has loaded everything when
/// no `MIGRATION` event woke it first. QEMU's completion event answers READY
/// at once (in the blackout every millisecond is downtime); this look is only
/// the fallback for an event that never comes, so it is rare: each look is
/// a QMP round trip with its task and wake-up (BENCHMARKS.md, "READY woken
/// by QEMU's events").
const READY_POLL: Duration = Duration::from_millis(250);

/// The send buffer of the target's connections to QEMU when QEMU compressed
/// the stream (the kernel doubles it): what waits there is acknowledged and
/// not yet loaded, and at ~20× a default buffer per channel is tens of ms of
/// loading after the source paused.
const COMPRESSED_SNDBUF: usize = 16 << 10;

/// Incoming migration `id` as one look found it ([`Agent::incoming_here`]).
struct IncomingHere {
    /// None: this host never heard of it.
    phase: Option<TargetPhase>,
    /// The journal's record, when the phase came from it.
    rec: Option<Record>,
    /// The waiting skeleton.
    skeleton: Option<Skeleton>,
}

/// A waiting skeleton, as the VM table held it.
struct Skeleton {
    /// Its VM's name.
    vm: String,
    /// Its QEMU (None while it starts).
    qemu: Option<Arc<QemuVm>>,
    /// The source host, as it introduced itself.
    source: String,
}

impl Agent {
    /// Step 3-4 on the target: reserve memory, start a skeleton VM waiting on
    /// the chosen NIC, and report where the source should send.
    pub async fn prepare_incoming(&self, req: IncomingRequest) -> Result<IncomingReply, ApiError> {
        let multichannel = check_incoming(&req)?;
        let key = ferry_transport::key_from_hex(&req.key).ok_or_else(|| {
            ApiError::invalid("key", "give the move's session key: 64 hex digits")
        })?;
        // the NICs the source reached in its probes, up here now
        let usable: Vec<_> = self
            .nics()
            .into_iter()
            .filter(|n| n.up && req.reachable_nics.contains(&n.name))
            .collect();
        let nic = usable.first().cloned().ok_or_else(|| {
            ApiError::unavailable(
                format!("a migration path from {} to {}", req.source, self.cfg.name),
                "no NIC of the source reaches a NIC up here",
            )
        })?;
        let dir = self.vm_dir(&req.spec.name, &format!(".in-{}", req.migration_id));
        let role = Role::Incoming {
            migration_id: req.migration_id.clone(),
            source: req.source.clone(),
            source_url: req.source_url.clone(),
            dir: dir.clone(),
            since: Instant::now(),
            agent_cpu_at_start: crate::host::own_cpu(),
        };
        // when each part of the skeleton's start ended (ms since the request), logged with it
        let t0 = Instant::now();
        let mut parts: Vec<(&str, u64)> = Vec::new();
        let lap = |name: &'static str, parts: &mut Vec<(&str, u64)>| {
            parts.push((name, t0.elapsed().as_millis() as u64));
        };
        // the memory step: room for the guest, and everything it needs here
        req.spec.validate()?;
        self.preflight(&req.spec, req.cpu_expansion.as_ref())
            .await?;
        lap("preflight", &mut parts);
        // shared-nothing: each local drive is made here empty, and must not
        // be there already (a file of this host's own is never overwritten)
        let copies = self.incoming_disks(&req)?;
        self.reserve(&req.spec, role).await?;
        // the record exists before the skeleton does: a restart finds it
        let waiting = Record {
            migration_id: req.migration_id.clone(),
            vm: req.spec.name.clone(),
            peer: req.source.clone(),
            peer_url: req.source_url.clone(),
            side: Side::Target(TargetPhase::Waiting),
            updated: 0,
            sealed: req.sealed,
        };
        if let Err(e) = self.moves.journal.write(&waiting) {
            self.release(&req.spec.name).await;
            return Err(ApiError::internal(error_chain(&e)));
        }
        let started = async {
            self.create_incoming_disks(&req, &copies).await?;
            lap("disks", &mut parts);
            let vm = qemu::launch(&self.cfg.qemu, &req.spec, &dir, true)
                .await
                .map_err(|e| {
                    ApiError::internal(format!("starting skeleton QEMU: {}", error_chain(&e)))
                })?;
            lap("qemu", &mut parts);
            let vm = Arc::new(vm);
            // registered first, so a failure below still kills this QEMU
            if let Some(slot) = self.state.lock().await.vms.get_mut(&req.spec.name) {
                slot.qemu = Some(vm.clone());
            }
            // a skeleton's QEMU is new: it has no TLS credentials unless given here
            if req.qemu_tls {
                super::qemu_tls::arm(&vm.qmp, &dir, &key, super::qemu_tls::End::Server, vm.owner)
                    .await
                    .map_err(ApiError::internal)?;
            }
            let disk_carriers = if copies.is_empty() {
                Vec::new()
            } else {
                self.export_disks(&req, &vm, &dir, &usable, (&copies, &key))
                    .await?
            };
            let Some(session_id) = multichannel else {
                let uri = self.listen_tcp(&req, &vm, &nic).await?;
                return Ok::<_, ApiError>((uri, Vec::new(), disk_carriers));
            };
            let carriers = self
                .listen_carriers(
                    &req,
                    &vm,
                    &dir,
                    &usable,
                    (session_id, &key),
                    (&mut parts, t0),
                )
                .await?;
            Ok(("ferry-transport".to_string(), carriers, disk_carriers))
        }
        .await;
        match started {
            Ok((uri, carriers, disk_carriers)) => {
                lap("transport", &mut parts);
                tracing::info!(vm = %req.spec.name, source = %req.source, %uri, parts_done_at_ms = ?parts, "skeleton waiting");
                Ok(IncomingReply {
                    migration_id: req.migration_id,
                    uri,
                    fabric: nic.fabric,
                    nic: nic.name,
                    carriers,
                    disk_carriers,
                })
            }
            Err(e) => {
                // its directory goes too (the QEMU log kept)
                self.discard(&req.spec.name).await;
                Err(e)
            }
        }
    }

    /// QEMU's own TCP listener (post-copy allowed, or QEMU's own
    /// channels), on `nic`: the URI the source sends to.
    async fn listen_tcp(
        &self,
        req: &IncomingRequest,
        vm: &QemuVm,
        nic: &ferry_api::NicInfo,
    ) -> Result<String, ApiError> {
        let datapath = QemuTcp;
        let qerr = |e: crate::qmp::QmpError| ApiError::internal(error_chain(&e));
        // READY wakes on QEMU's completion rather than polling for it
        vm.qmp
            .set_capabilities(&[("events", true), ("postcopy-ram", req.postcopy)])
            .await
            .map_err(qerr)?;
        if req.qemu_channels {
            // QEMU's own multifd channels, straight from the source's QEMU
            expect_channels(&vm.qmp, req.qemu_zstd.is_some())
                .await
                .map_err(qerr)?;
        }
        vm.qmp
            .migrate_incoming(
                &datapath
                    .incoming_uri(&nic.address)
                    .map_err(ApiError::internal)?,
            )
            .await
            .map_err(qerr)?;
        let info = vm.qmp.query_migrate().await.map_err(qerr)?;
        let port = info
            .socket_address
            .unwrap_or_default()
            .into_iter()
            .find_map(|a| a.port)
            .ok_or_else(|| ApiError::internal("QEMU did not report its listening port"))?;
        Ok(datapath.source_uri(&nic.address, &port))
    }

    /// Multichannel: QEMU listens on a local socket and Ferry's carriers
    /// (or MPTCP) end here, one listener per NIC the source reached; or
    /// (mptcp) QEMU is handed the authenticated socket. The listeners'
    /// endpoints, for the source to dial.
    async fn listen_carriers(
        &self,
        req: &IncomingRequest,
        vm: &QemuVm,
        dir: &std::path::Path,
        usable: &[ferry_api::NicInfo],
        (session_id, key): ([u8; 16], &[u8; 32]),
        (parts, t0): (&mut Vec<(&'static str, u64)>, Instant),
    ) -> Result<Vec<ferry_api::CarrierEndpoint>, ApiError> {
        let qerr = |e: crate::qmp::QmpError| ApiError::internal(error_chain(&e));
        // multichannel: QEMU listens on a local socket, carriers end
        // here; or (mptcp) QEMU is handed the authenticated socket
        let handoff = req.option == MigrationOption::Mptcp;
        let multifd = !req.postcopy && !handoff;
        if req.qemu_zstd.is_some() && !multifd {
            return Err(ApiError::invalid(
                    "qemu_zstd",
                    "QEMU compresses only in multifd channels: not with post-copy or a handed-off socket",
                ));
        }
        if multifd {
            expect_channels(&vm.qmp, req.qemu_zstd.is_some())
                .await
                .map_err(qerr)?;
        } else {
            vm.qmp
                .set_capabilities(&[
                    ("events", true),
                    ("multifd", false),
                    ("postcopy-ram", req.postcopy),
                ])
                .await
                .map_err(qerr)?;
        }
        if req.switchover_ack {
            if req.postcopy {
                return Err(ApiError::invalid(
                    "switchover_ack",
                    "the switch-over is held in plain pre-copy only: not with post-copy",
                ));
            }
            // the acknowledgement QEMU sends on its return path as the
            // stream opens is what the source's carriers hold
            vm.qmp
                .set_capabilities(&[("return-path", true), ("switchover-ack", true)])
                .await
                .map_err(qerr)?;
        }
        parts.push(("capabilities", t0.elapsed().as_millis() as u64));
        let sock = dir.join("incoming.sock");
        if !handoff {
            vm.qmp
                .migrate_incoming(&format!("unix:{}", sock.display()))
                .await
                .map_err(qerr)?;
        }
        let listen: Vec<(String, std::net::IpAddr)> = usable
            .iter()
            .filter_map(|n| Some((n.name.clone(), n.address.parse().ok()?)))
            .collect();
        let (session, bound) = if matches!(
            req.option,
            MigrationOption::Mptcp | MigrationOption::MptcpRelay
        ) {
            ferry_transport::mptcp::prepare_host(&listen).map_err(ApiError::internal)?;
            let deliver = if handoff {
                let monitor = dir.join(crate::qemu::HANDOFF_SOCK);
                ferry_transport::Deliver::Handoff(Box::new(move |t: &std::net::TcpStream| {
                    use std::os::fd::AsRawFd;
                    crate::qmp::hand_socket(&monitor, t.as_raw_fd(), crate::qmp::HandTo::Incoming)
                        .map_err(|e| error_chain(&e))
                }))
            } else {
                ferry_transport::Deliver::Relay(sock)
            };
            let (s, port) =
                ferry_transport::Spliced::target(session_id, key, listen.clone(), deliver)
                    .map_err(|e| ApiError::internal(error_chain(&e)))?;
            // one listener takes every address: each NIC's address with its port
            let bound = listen
                .into_iter()
                .map(|(n, a)| (n, std::net::SocketAddr::new(a, port)))
                .collect::<Vec<_>>();
            (ferry_transport::Carriers::Mptcp(s), bound)
        } else {
            let keys = ferry_transport::Keys {
                secret: key,
                sealed: req.sealed,
            };
            let (s, bound) = ferry_transport::Session::target(session_id, &keys, listen, sock)
                .await
                .map_err(|e| ApiError::internal(error_chain(&e)))?;
            s.set_reorder_window(self.cfg.reorder_window);
            s.set_windows(req.stream_windows);
            if req.qemu_zstd.is_some() {
                // QEMU compressed: each byte waiting for it is ~20 to load
                s.set_local_send_buffer(COMPRESSED_SNDBUF);
            }
            (ferry_transport::Carriers::Ferry(s), bound)
        };
        if let Some(slot) = self.state.lock().await.vms.get_mut(&req.spec.name) {
            slot.transport = Some(session);
        }
        Ok(endpoints(bound, usable))
    }

    /// Shared-nothing: each local drive made here, empty, listed first
    /// (whatever happens next, they go with the skeleton).
    async fn create_incoming_disks(
        &self,
        req: &IncomingRequest,
        copies: &[IncomingDisk],
    ) -> Result<(), ApiError> {
        let made: Vec<std::path::PathBuf> = copies.iter().map(|c| c.1.clone()).collect();
        if !made.is_empty() {
            // listed before they exist: whatever happens next, they go
            // with the skeleton
            let marker = crate::local_disk::partial_marker(
                &self.cfg.qemu,
                &req.spec.name,
                &req.migration_id,
            );
            crate::local_disk::record_partial(&marker, &made)
                .map_err(|e| ApiError::internal(format!("recording {}: {e}", marker.display())))?;
            for (i, path, format, size) in copies {
                crate::local_disk::create(path, *format, *size)
                    .await
                    .map_err(|e| match e {
                        ApiError::Internal { reason } => {
                            ApiError::internal(format!("drives[{i}]: {reason}"))
                        }
                        e => e,
                    })?;
            }
        }
        Ok(())
    }

    /// The local drives an incoming shared-nothing migration copies here:
    /// (drive index, file, format, size). Every local drive of the spec
    /// must be among them, and none may exist here yet.
    fn incoming_disks(&self, req: &IncomingRequest) -> Result<Vec<IncomingDisk>, ApiError> {
        let mut out = Vec::new();
        let mut present = Vec::new();
        for (i, d) in req.spec.local_drives() {
            let Some(c) = req.local_disks.iter().find(|c| c.drive == i) else {
                return Err(ApiError::invalid(
                    "local_disks",
                    format!("drives[{i}] is a local drive and the request does not copy it"),
                ));
            };
            let path = self
                .cfg
                .qemu
                .local_disk(&req.spec.name, d.local.as_deref().unwrap_or_default());
            if path.exists() {
                present.push(format!(
                    "drives[{i}]: {} exists on {} (a local drive is copied only onto a host without it)",
                    path.display(),
                    self.cfg.name
                ));
            }
            out.push((i, path, d.format, c.size));
        }
        if let Some(c) = req
            .local_disks
            .iter()
            .find(|c| out.iter().all(|o| o.0 != c.drive))
        {
            return Err(ApiError::invalid(
                "local_disks",
                format!("drives[{}] is not a local drive of the spec", c.drive),
            ));
        }
        if !present.is_empty() {
            return Err(ApiError::HostCannotRun {
                host: self.cfg.name.clone(),
                vm: req.spec.name.clone(),
                missing: present,
            });
        }
        if !out.is_empty() && req.disk_session.is_none() {
            return Err(ApiError::invalid(
                "disk_session",
                "copying local drives needs a 32-hex-digit disk session id",
            ));
        }
        Ok(out)
    }

    /// Shared-nothing, on the skeleton: QEMU's NBD server on a socket in
    /// `dir` exports each empty local drive writable (export `drive{i}`),
    /// and a transport session whose carriers listen on every usable NIC
    /// carries the source's NBD connections to it.
    async fn export_disks(
        &self,
        req: &IncomingRequest,
        vm: &QemuVm,
        dir: &std::path::Path,
        usable: &[ferry_api::NicInfo],
        (copies, key): (&[IncomingDisk], &[u8; 32]),
    ) -> Result<Vec<CarrierEndpoint>, ApiError> {
        let qerr = |e: crate::qmp::QmpError| ApiError::internal(error_chain(&e));
        let session = req
            .disk_session
            .as_deref()
            .and_then(ferry_transport::session_from_hex)
            .ok_or_else(|| ApiError::invalid("disk_session", "give 32 hex digits"))?;
        let sock = dir.join(super::disks::NBD_SOCK);
        vm.qmp.nbd_server_start(&sock).await.map_err(qerr)?;
        for (i, ..) in copies {
            let node = format!("drive{i}");
            vm.qmp.export_node(&node, &node).await.map_err(qerr)?;
        }
        let listen: Vec<(String, std::net::IpAddr)> = usable
            .iter()
            .filter_map(|n| Some((n.name.clone(), n.address.parse().ok()?)))
            .collect();
        let keys = ferry_transport::Keys {
            secret: key,
            sealed: super::disks::SEALED,
        };
        let (s, bound) = ferry_transport::Session::target(session, &keys, listen, sock)
            .await
            .map_err(|e| ApiError::internal(error_chain(&e)))?;
        s.set_reorder_window(self.cfg.reorder_window);
        if let Some(slot) = self.state.lock().await.vms.get_mut(&req.spec.name) {
            slot.disk_transport = Some(s);
        }
        Ok(endpoints(bound, usable))
    }

    /// At RUN: the skeleton's disk exports end (the source's mirrors have
    /// completed), and its copies become the VM's own drives.
    async fn end_disk_exports(&self, name: &str, q: &QemuVm) -> Result<(), ApiError> {
        let (session, marker) = {
            let mut st = self.state.lock().await;
            let Some(slot) = st.vms.get_mut(name) else {
                return Ok(());
            };
            let marker = match &slot.role {
                Role::Incoming { migration_id, .. } => Some(crate::local_disk::partial_marker(
                    &self.cfg.qemu,
                    name,
                    migration_id,
                )),
                _ => None,
            };
            (slot.disk_transport.take(), marker)
        };
        let Some(session) = session else {
            return Ok(());
        };
        let stopped = q.qmp.nbd_server_stop().await;
        session.close();
        if let Some(marker) = marker {
            crate::local_disk::keep_partial(&marker);
        }
        stopped.map_err(|e| {
            ApiError::internal(format!(
                "stopping the disk exports before the guest runs: {}",
                error_chain(&e)
            ))
        })
    }

    /// Moves this host's record of incoming migration `id` to `phase`
    /// (fsynced); returns the record.
    fn set_target_phase(&self, id: &str, phase: TargetPhase) -> Result<Record, ApiError> {
        self.moves
            .journal
            .update(id, Side::Target(phase))
            .map_err(|e| ApiError::internal(error_chain(&e)))
    }

    /// Incoming migration `id` as this host holds it, in one look: a
    /// skeleton in the table is waiting; otherwise the journal says (phase
    /// None: never heard of it). An unreadable record is an error, never
    /// "never heard of it": the source must hear no answer rather than
    /// "never ran".
    ///
    /// The skeleton is taken with its phase, never looked up again: RUN
    /// writes Running before it adopts the skeleton, so a look that found
    /// none found Running in the journal, and one that found it acts on
    /// what it found. A second lookup could miss a skeleton adopted in
    /// between and answer "not found", which a committed source reads as
    /// "never ran" (and would resume its own copy).
    async fn incoming_here(&self, id: &str) -> Result<IncomingHere, ApiError> {
        if let Some(skeleton) = self.incoming_slot(id).await {
            return Ok(IncomingHere {
                phase: Some(TargetPhase::Waiting),
                rec: None,
                skeleton: Some(skeleton),
            });
        }
        let (phase, rec) = match self.moves.journal.read(id, false) {
            Ok(Some(r)) => match r.side {
                Side::Target(p) => (Some(p), Some(r)),
                Side::Source(_) => (None, None),
            },
            Ok(None) => (None, None),
            Err(e) => {
                tracing::error!(error = %e, "reading the migration journal");
                return Err(ApiError::internal(format!(
                    "this host's record of migration {id} cannot be read ({}); it answers nothing about it",
                    error_chain(&e)
                )));
            }
        };
        Ok(IncomingHere {
            phase,
            rec,
            skeleton: None,
        })
    }

    /// Drops a skeleton that never ran: its transport session, its QEMU (its
    /// log kept), its reservation; the journal then says Discarded.
    /// A VM that is no longer a skeleton (RUN adopted it meanwhile) is
    /// left alone. Returns whether a skeleton was discarded.
    async fn discard(&self, name: &str) -> bool {
        let slot = {
            let mut st = self.state.lock().await;
            match st.vms.get(name) {
                Some(s) if matches!(s.role, Role::Incoming { .. }) => st.vms.remove(name),
                _ => None,
            }
        };
        let Some(slot) = slot else { return false };
        if let Some(t) = slot.transport {
            t.close();
        }
        if let Some(t) = slot.disk_transport {
            t.close();
        }
        if let Some(q) = &slot.qemu {
            q.kill().await;
        }
        if let Role::Incoming {
            migration_id, dir, ..
        } = &slot.role
        {
            // the partial copies of its local drives, once no QEMU has them
            crate::local_disk::discard_partial(&self.cfg.qemu, name, migration_id);
            self.remove_vm_dir(dir, &format!("{name}.{migration_id}.target"));
            if let Err(e) = self.set_target_phase(migration_id, TargetPhase::Discarded) {
                tracing::error!(error = %e, "recording a discarded skeleton");
            }
            tracing::info!(vm = %name, migration = %migration_id, "skeleton discarded; it never ran");
        }
        true
    }

    /// The source host of incoming migration `id`, as it introduced itself
    /// (a waiting skeleton, or the journal's record); None: unknown here.
    pub async fn incoming_peer(&self, id: &str) -> Option<String> {
        let here = self.incoming_here(id).await.ok()?;
        match here.skeleton {
            Some(s) => Some(s.source),
            None => here.rec.map(|r| r.peer),
        }
    }

    /// The waiting skeleton of incoming migration `id`.
    async fn incoming_slot(&self, id: &str) -> Option<Skeleton> {
        let st = self.state.lock().await;
        st.vms.iter().find_map(|(n, s)| match &s.role {
            Role::Incoming {
                migration_id,
                source,
                ..
            } if migration_id == id => Some(Skeleton {
                vm: n.clone(),
                qemu: s.qemu.clone(),
                source: source.clone(),
            }),
            _ => None,
        })
    }

    /// The QEMU of incoming migration `id` as `here` found it: the waiting
    /// skeleton's, or (running) the adopted guest's, found by its record.
    /// A journal that says waiting with no skeleton in the table (one not
    /// started yet, or being discarded) is "not found": it never ran.
    async fn incoming_qemu(
        &self,
        id: &str,
        here: &IncomingHere,
    ) -> Result<Option<Arc<QemuVm>>, ApiError> {
        Ok(match (here.phase, &here.skeleton, &here.rec) {
            (Some(TargetPhase::Waiting), Some(s), _) => s.qemu.clone(),
            (Some(TargetPhase::Waiting), None, _) => {
                return Err(ApiError::not_found("incoming migration", id))
            }
            (Some(TargetPhase::Running), _, Some(r)) => self
                .state
                .lock()
                .await
                .vms
                .get(&r.vm)
                .and_then(|s| s.qemu.clone()),
            _ => None,
        })
    }

    /// Where incoming migration `id` stands here: a waiting skeleton, a guest
    /// that was told to run, one discarded, or `unknown`.
    pub async fn incoming_status(&self, id: &str) -> Result<IncomingStatus, ApiError> {
        self.incoming_look(id, true).await
    }

    /// [`Agent::incoming_status`] without asking QEMU: whether its process
    /// lives, and `qemu_status` `unasked`. The source's look while it
    /// copies (`GET /incoming/ID?qemu=alive`) needs no more, and a QEMU that is
    /// loading a stream answers `query-status` only between two of its chunks,
    /// hundreds of milliseconds later.
    pub async fn incoming_alive(&self, id: &str) -> Result<IncomingStatus, ApiError> {
        self.incoming_look(id, false).await
    }

    async fn incoming_look(&self, id: &str, ask_qemu: bool) -> Result<IncomingStatus, ApiError> {
        let here = self.incoming_here(id).await?;
        let phase = here.phase;
        let q = self.incoming_qemu(id, &here).await?;
        let mut st = IncomingStatus {
            migration_id: id.into(),
            qemu_status: "none".into(),
            qemu_alive: false,
            cpu_ms: None,
            phase: phase_name(phase),
            resumed_us_ago: None,
        };
        if let Some(q) = q {
            st.qemu_alive = q.alive().await;
            st.qemu_status = if ask_qemu {
                q.qmp
                    .status()
                    .await
                    .map(|s| s.status)
                    .unwrap_or_else(|_| "unreachable".into())
            } else {
                QEMU_UNASKED.into()
            };
        } else if phase == Some(TargetPhase::Waiting) {
            // the skeleton's QEMU is still starting
            st.qemu_alive = true;
            st.qemu_status = "starting".into();
        }
        Ok(st)
    }

    /// CPU this host spent on an incoming migration so far: the target QEMU
    /// since it started plus this agent since the skeleton was asked for
    /// (the whole agent: other migrations at the same time count too).
    async fn incoming_cpu(&self, id: &str, q: &QemuVm) -> Option<u64> {
        let st = self.state.lock().await;
        let at_start = st.vms.values().find_map(|s| match &s.role {
            Role::Incoming {
                migration_id,
                agent_cpu_at_start,
                ..
            } if migration_id == id => Some(*agent_cpu_at_start),
            _ => None,
        })?;
        let agent = crate::host::own_cpu().saturating_sub(at_start);
        let qemu = crate::host::process_cpu(q.pid)?;
        Some((agent + qemu).as_millis() as u64)
    }

    /// Before the commit: waits until the skeleton's QEMU has loaded every
    /// byte and device, paused (it was started with `-S` and has never run).
    pub async fn ready_incoming(&self, id: &str) -> Result<IncomingStatus, ApiError> {
        let q = self
            .incoming_slot(id)
            .await
            .ok_or_else(|| ApiError::not_found("incoming migration", id))?
            .qemu;
        let q = q.ok_or_else(|| ApiError::Conflict {
            reason: "skeleton QEMU is still starting".into(),
        })?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let t0 = Instant::now();
        let mut events = q.qmp.migration_events();
        loop {
            if let Break(r) = self.ready_look(id, &q, t0, deadline).await {
                return r;
            }
            crate::qmp::next_event_or(&mut events, READY_POLL).await;
        }
    }

    /// One look of READY's at the skeleton: Break with READY's answer, or
    /// Continue while QEMU is still loading.
    async fn ready_look(
        &self,
        id: &str,
        q: &QemuVm,
        t0: Instant,
        deadline: Instant,
    ) -> ControlFlow<Result<IncomingStatus, ApiError>> {
        if !q.alive().await {
            return Break(Err(ApiError::internal(
                "the target QEMU exited before the commit",
            )));
        }
        let mig = q.qmp.query_migrate().await.ok().and_then(|i| i.status);
        // the guest's own state matters once QEMU says it has loaded
        // everything (before that, started with -S, it cannot run)
        let run = match mig.as_deref() {
            Some("completed") => q.qmp.status().await.ok(),
            _ => None,
        };
        match (mig.as_deref(), run) {
            (Some("failed"), _) => Break(Err(ApiError::internal(
                "the target QEMU failed to load the migration",
            ))),
            // -S makes this impossible; say so loudly rather than commit on it
            (_, Some(s)) if s.running => Break(Err(ApiError::internal(
                "the target guest runs before the commit (QEMU started without -S?)",
            ))),
            (Some("completed"), _)
                if crate::failpoint::hit("target-at-ready")
                    == Some(crate::failpoint::Action::KillQemu) =>
            {
                q.kill().await;
                Break(Err(ApiError::internal(
                    "the target QEMU exited before the commit",
                )))
            }
            (Some("completed"), Some(s)) => {
                tracing::info!(
                    waited_ms = t0.elapsed().as_millis() as u64,
                    "READY: the skeleton has loaded everything"
                );
                let cpu_ms = self.incoming_cpu(id, q).await;
                Break(Ok(IncomingStatus {
                    migration_id: id.into(),
                    qemu_status: s.status,
                    qemu_alive: true,
                    cpu_ms,
                    phase: phase_name(Some(TargetPhase::Waiting)),
                    resumed_us_ago: None,
                }))
            }
            (m, _) if Instant::now() > deadline => Break(Err(ApiError::internal(format!(
                "the target has not loaded the migration after 30 s (migration {})",
                m.unwrap_or("unknown")
            )))),
            _ => Continue(()),
        }
    }

    /// RUN: the source has recorded its commit, so this host alone may run
    /// the guest. Writes Running, then starts the vCPUs and adopts the VM.
    /// Idempotent: a repeated RUN makes sure the guest runs and says so; a
    /// RUN for a skeleton discarded earlier answers `discarded`.
    pub async fn run_incoming(&self, id: &str) -> Result<IncomingStatus, ApiError> {
        crate::failpoint::hit("target-before-run");
        let here = self.incoming_here(id).await?;
        let Some(phase) = here.phase else {
            return self.incoming_status(id).await;
        };
        match target_next(phase, TargetEvent::Run).1 {
            TargetAction::RecordAndRun => {
                let Some(Skeleton {
                    vm: name, qemu: q, ..
                }) = here.skeleton
                else {
                    return Err(ApiError::not_found("incoming migration", id));
                };
                let q = match q {
                    Some(q) if q.alive().await => q,
                    _ => {
                        // its QEMU is gone: it never ran and never will
                        self.discard(&name).await;
                        return self.incoming_status(id).await;
                    }
                };
                // shared-nothing: the source's mirrors ended before its
                // switch-over; nobody writes these disks but the guest now
                self.end_disk_exports(&name, &q).await?;
                let source = self.set_target_phase(id, TargetPhase::Running)?.peer;
                let cpu_ms = self.incoming_cpu(id, &q).await;
                let events = q.qmp.migration_events();
                let t_cont = Instant::now();
                q.qmp.cont().await.map_err(|e| {
                    ApiError::internal(format!("starting the guest: {}", error_chain(&e)))
                })?;
                let resumed = resumed_at(&events.borrow(), t_cont, Instant::now());
                // switches learn the guest's MACs on this host's port now
                // rather than when the guest next sends (behind the answer:
                // the guest runs, and the source is waiting)
                let has_nics = self
                    .state
                    .lock()
                    .await
                    .vms
                    .get(&name)
                    .is_some_and(|s| !s.spec.nics.is_empty());
                if has_nics {
                    let (q, name) = (q.clone(), name.clone());
                    tokio::spawn(async move {
                        if let Err(e) = q.qmp.announce_self(crate::qmp::ANNOUNCE).await {
                            tracing::warn!(vm = %name, error = %error_chain(&e), "announce-self failed");
                        }
                    });
                }
                self.adopt(&name, id, q.clone()).await;
                tracing::info!(vm = %name, migration = id, "committed by {source}: the guest runs here");
                // what was just done, said without asking QEMU and the
                // journal again
                Ok(IncomingStatus {
                    migration_id: id.into(),
                    qemu_status: "running".into(),
                    qemu_alive: true,
                    cpu_ms,
                    phase: phase_name(Some(TargetPhase::Running)),
                    resumed_us_ago: Some(resumed.elapsed().as_micros() as u64),
                })
            }
            TargetAction::AnswerRunning => {
                // make sure it runs (a `cont` may have been lost with a crash)
                if let Some(r) = here.rec {
                    let q = self
                        .state
                        .lock()
                        .await
                        .vms
                        .get(&r.vm)
                        .and_then(|s| s.qemu.clone());
                    if let Some(q) = q {
                        if q.qmp.status().await.is_ok_and(|s| s.status == "paused") {
                            q.qmp
                                .cont()
                                .await
                                .map_err(|e| ApiError::internal(error_chain(&e)))?;
                        }
                    }
                }
                self.incoming_status(id).await
            }
            _ => self.incoming_status(id).await,
        }
    }

    /// Makes a skeleton that was told to run an ordinary VM of this host. Its
    /// transport stays until QEMU has every page (post-copy pulls after RUN).
    async fn adopt(&self, name: &str, id: &str, q: Arc<QemuVm>) {
        let transport = {
            let mut st = self.state.lock().await;
            let Some(slot) = st.vms.get_mut(name) else {
                return;
            };
            slot.role = Role::Running;
            slot.migrating = false;
            slot.doubt = None;
            slot.transport.take()
        };
        let id = id.to_string();
        tokio::spawn(async move {
            while q.alive().await {
                // a QMP call that fails (QEMU busy faulting pages in over a
                // cut NIC) is asked again: the carriers must outlive post-copy
                if let Ok(i) = q.qmp.query_migrate().await {
                    if matches!(i.status.as_deref(), Some("completed" | "failed") | None) {
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            // the move's TLS credentials (post-copy's recovery used them) go
            super::qemu_tls::disarm(&q.qmp, &q.dir).await;
            // and the hold's capabilities: a later move out of this QEMU,
            // by an agent that does not set them, must not wait for an
            // acknowledgement its target never sends
            let _ = q
                .qmp
                .set_capabilities(&[("return-path", false), ("switchover-ack", false)])
                .await;
            let Some(t) = transport else {
                return;
            };
            // QEMU's last words on the return path (post-copy's shut
            // message, which the source waits for) may still be queued
            // behind a carrier that just came back
            tracing::info!(migration = %id, "incoming migration over; closing its transport once drained");
            t.close_when_drained(Duration::from_millis(500), Duration::from_secs(30))
                .await;
        });
    }

    /// `mptcp` kind: announces the address of this host's NIC `nic` again to
    /// the source, whose NIC reaching it has no subflow on some connection
    /// (its link was down when the connection opened, or the subflow
    /// closed). Returns the NIC announced.
    pub async fn rejoin_incoming(&self, id: &str, nic: &str) -> Result<String, ApiError> {
        let name = self
            .incoming_slot(id)
            .await
            .ok_or_else(|| ApiError::not_found("incoming migration", id))?
            .vm;
        let mptcp = matches!(
            self.state
                .lock()
                .await
                .vms
                .get(&name)
                .and_then(|s| s.transport.as_ref()),
            Some(ferry_transport::Carriers::Mptcp(_))
        );
        if !mptcp {
            return Err(ApiError::invalid(
                "id",
                format!("migration {id} is not carried over mptcp"),
            ));
        }
        let nic = self
            .nics()
            .into_iter()
            .find(|n| n.name == nic)
            .ok_or_else(|| ApiError::invalid("nic", format!("no migration NIC named '{nic}'")))?;
        let addr = nic
            .address
            .parse()
            .map_err(|_| ApiError::internal(format!("{} has no IPv4 address", nic.name)))?;
        ferry_transport::mptcp::announce(&nic.name, addr).map_err(ApiError::internal)?;
        tracing::info!(migration = id, nic = %nic.name, "address announced again for a subflow re-join");
        Ok(nic.name)
    }

    /// Post-copy's stream broke: this host's QEMU (the guest, or a skeleton
    /// RUN has not reached) listens for a new one on NIC `nic`. A QEMU that
    /// has not seen the break yet is made to (`migrate-pause`); one already
    /// listening gives the address it listens on.
    pub async fn resume_incoming_postcopy(
        &self,
        id: &str,
        nic: &str,
    ) -> Result<RecoverReply, ApiError> {
        let here = self.incoming_here(id).await?;
        let q = match here.phase {
            Some(TargetPhase::Waiting | TargetPhase::Running) => {
                self.incoming_qemu(id, &here).await?
            }
            p => {
                return Err(ApiError::Conflict {
                    reason: format!(
                        "incoming migration {id} is {} here: nothing to recover",
                        phase_name(p)
                    ),
                })
            }
        };
        let q = q.ok_or_else(|| ApiError::Conflict {
            reason: format!("incoming migration {id} has no QEMU here"),
        })?;
        let nic = self
            .nics()
            .into_iter()
            .find(|n| n.name == nic)
            .ok_or_else(|| ApiError::invalid("nic", format!("no migration NIC named '{nic}'")))?;
        if !nic.up {
            return Err(ApiError::Conflict {
                reason: format!("{} has no carrier", nic.name),
            });
        }
        let qerr = |e: crate::qmp::QmpError| ApiError::internal(error_chain(&e));
        for _ in 0..50 {
            let status = q.qmp.query_migrate().await.map_err(qerr)?.status;
            match status.as_deref() {
                Some("postcopy-paused") => {
                    let uri = QemuTcp
                        .incoming_uri(&nic.address)
                        .map_err(ApiError::internal)?;
                    q.qmp.migrate_recover(&uri).await.map_err(qerr)?;
                    self.moves
                        .recovering
                        .lock()
                        .await
                        .insert(id.to_string(), (nic.name.clone(), uri.clone()));
                    tracing::warn!(migration = id, %uri, "post-copy's stream broke: listening for a new one");
                    return Ok(RecoverReply { uri, nic: nic.name });
                }
                Some("postcopy-recover-setup" | "postcopy-recover") => {
                    if let Some((nic, uri)) = self.moves.recovering.lock().await.get(id).cloned() {
                        return Ok(RecoverReply { uri, nic });
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Some("postcopy-active") => {
                    // the break was seen at the source only: end this side too
                    let _ = q.qmp.migrate_pause().await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                other => {
                    return Err(ApiError::Conflict {
                        reason: format!(
                            "incoming migration {id} is {} here, not a paused post-copy",
                            other.unwrap_or("none")
                        ),
                    })
                }
            }
        }
        Err(ApiError::internal(
            "the incoming post-copy did not pause within 5 s",
        ))
    }

    /// The source rolled back: discard the skeleton. Refused once the guest
    /// may have run here.
    pub async fn abort_incoming(&self, id: &str) -> Result<(), ApiError> {
        let here = self.incoming_here(id).await?;
        let Some(phase) = here.phase else {
            return Err(ApiError::not_found("incoming migration", id));
        };
        match target_next(phase, TargetEvent::Abort).1 {
            TargetAction::Discard => {
                let Some(skeleton) = here.skeleton else {
                    return Err(ApiError::not_found("incoming migration", id));
                };
                if self.discard(&skeleton.vm).await {
                    return Ok(());
                }
                // RUN adopted it between the look and the discard
                Err(ApiError::Conflict {
                    reason: format!(
                        "migration {id} was committed while it was being discarded and the guest runs on {}; it is not discarded",
                        self.cfg.name
                    ),
                })
            }
            TargetAction::RefuseAbort => Err(ApiError::Conflict {
                reason: format!(
                    "migration {id} was committed and the guest runs on {}; it is not discarded",
                    self.cfg.name
                ),
            }),
            _ => Ok(()),
        }
    }

    /// Run every 2 s: skeletons whose QEMU is gone are discarded; a skeleton
    /// older than `ASK_AFTER` asks its source what became of the migration
    /// (it runs if the source committed, goes if the source gave up, and
    /// waits, in doubt, while the source does not answer).
    pub async fn reap_incoming(self: &Arc<Self>) {
        let waiting: Vec<Waiting> = {
            let st = self.state.lock().await;
            st.vms
                .iter()
                .filter_map(|(n, s)| match &s.role {
                    Role::Incoming {
                        migration_id,
                        source,
                        source_url,
                        since,
                        ..
                    } => Some((
                        n.clone(),
                        migration_id.clone(),
                        s.qemu.clone(),
                        (source.clone(), source_url.clone()),
                        *since,
                    )),
                    _ => None,
                })
                .collect()
        };
        for (name, id, q, source, since) in waiting {
            if let Some(q) = &q {
                if !q.alive().await {
                    if target_next(TargetPhase::Waiting, TargetEvent::QemuGone).1
                        == TargetAction::Discard
                    {
                        self.discard(&name).await;
                    }
                    continue;
                }
            }
            if since.elapsed() < ASK_AFTER || source.1.is_empty() {
                continue;
            }
            let agent = self.clone();
            tokio::spawn(async move { agent.ask_source(&name, &id, (&source.0, &source.1)).await });
        }
    }

    /// What the source agent `(name, URL)` recorded of migration `id`
    /// (None: no answer; `unknown`: it has no record).
    pub async fn source_said(&self, source: (&str, &str), id: &str) -> Option<SourceAnswer> {
        let client = self.peer(source.0, source.1);
        match client
            .get::<SourceStatus>(&format!("/migrations/{id}"), Duration::from_secs(2))
            .await
        {
            Ok(s) => from_wire_name::<SourceAnswer>(&s.phase),
            Err(ApiError::NotFound { .. }) => Some(SourceAnswer::Unknown),
            Err(_) => None,
        }
    }

    /// Asks the source of a waiting skeleton what it recorded, and acts on it.
    pub(super) async fn ask_source(&self, name: &str, id: &str, source: (&str, &str)) -> String {
        let said = self.source_said(source, id).await;
        // whether this skeleton holds the guest matters only once the
        // source says it committed: its QEMU is asked then only
        let status = match said {
            Some(SourceAnswer::Committed | SourceAnswer::Done) => {
                match self.slot_qemu(name).await {
                    Some(q) => q.qmp.query_migrate().await.ok().and_then(|i| i.status),
                    None => None,
                }
            }
            _ => None,
        };
        let holds_guest = crate::commit::skeleton_holds_guest(status.as_deref());
        let (_, action) = target_next(
            TargetPhase::Waiting,
            TargetEvent::SourceSaid { said, holds_guest },
        );
        match action {
            TargetAction::RecordAndRun => match self.run_incoming(id).await {
                Ok(_) => "the source had committed: the guest runs here".into(),
                Err(e) => format!("the source had committed; running failed: {e}"),
            },
            TargetAction::Discard => {
                self.discard(name).await;
                "the source did not commit: the skeleton is discarded".into()
            }
            TargetAction::AwaitGuest => {
                let why = format!(
                    "the source committed, but this skeleton's QEMU does not hold the guest \
                     (incoming {}): it waits for RUN, or for the source to discard it",
                    status.as_deref().unwrap_or("unknown")
                );
                tracing::warn!(vm = %name, migration = id, "{why}");
                why
            }
            TargetAction::AskLater => {
                let why = format!(
                    "the source ({}) does not answer; the skeleton stays paused",
                    source.1
                );
                if let Some(s) = self.state.lock().await.vms.get_mut(name) {
                    if s.doubt.is_none() {
                        tracing::warn!(vm = %name, migration = id, "in doubt: {why}");
                    }
                    s.doubt = Some(why.clone());
                }
                why
            }
            _ => {
                if let Some(s) = self.state.lock().await.vms.get_mut(name) {
                    s.doubt = None;
                }
                "the source is still copying".into()
            }
        }
    }
}

/// A skeleton as the reaper sees it: VM, migration id, QEMU, source agent
/// (name, URL), since.
type Waiting = (
    String,
    String,
    Option<Arc<QemuVm>>,
    (String, String),
    Instant,
);

/// A waiting skeleton asks its source after this long.
pub const ASK_AFTER: Duration = Duration::from_secs(10);

/// The skeleton's QEMU expects the source's multifd channels (over Ferry's
/// carriers or straight from the source's QEMU), zstd-compressed if `zstd`.
async fn expect_channels(qmp: &crate::qmp::Qmp, zstd: bool) -> Result<(), crate::qmp::QmpError> {
    qmp.set_capabilities(&[("events", true), ("multifd", true), ("postcopy-ram", false)])
        .await?;
    qmp.set_parameters(MigrationParameters {
        multifd_channels: Some(MULTIFD_CHANNELS),
        multifd_compression: Some(crate::qmp::multifd_compression(zstd)),
        ..Default::default()
    })
    .await
}

/// What the source is told of listeners bound on usable NICs.
fn endpoints(
    bound: Vec<(String, std::net::SocketAddr)>,
    usable: &[ferry_api::NicInfo],
) -> Vec<CarrierEndpoint> {
    bound
        .into_iter()
        .filter_map(|(name, addr)| {
            let fabric = usable.iter().find(|n| n.name == name)?.fabric;
            Some(CarrierEndpoint {
                fabric,
                nic: name,
                address: addr.to_string(),
            })
        })
        .collect()
}

fn phase_name(p: Option<TargetPhase>) -> String {
    p.map_or_else(|| "unknown".into(), wire_name)
}

/// How the source reads a target's answer.
/// One local drive a shared-nothing move brings here: its index in the
/// spec, its file, format and size.
type IncomingDisk = (usize, std::path::PathBuf, DriveFormat, u64);

pub(super) fn answer_of(st: &IncomingStatus) -> TargetAnswer {
    match st.phase.as_str() {
        // even with its QEMU gone: the target discards it at its next look,
        // and then answers never-ran
        "waiting" => TargetAnswer::Waiting,
        "running" => TargetAnswer::Running,
        _ => TargetAnswer::NeverRan,
    }
}

/// A skeleton request that cannot work is refused naming its field; the
/// carriers' session id for the options that take one.
fn check_incoming(req: &IncomingRequest) -> Result<Option<[u8; 16]>, ApiError> {
    if req.sealed && !super::carried_by_ferry(req.option) {
        return Err(ApiError::invalid(
            "sealed",
            format!(
                "{} sends QEMU's bytes as they are: its encryption is QEMU's TLS (qemu_tls)",
                req.option.name()
            ),
        ));
    }
    if req.qemu_tls && super::carried_by_ferry(req.option) {
        return Err(ApiError::invalid(
            "qemu_tls",
            format!(
                "{} goes over Ferry's carriers, which seal it (sealed)",
                req.option.name()
            ),
        ));
    }
    if req.qemu_channels && req.option != MigrationOption::Tcp {
        return Err(ApiError::invalid(
            "qemu_channels",
            format!("QEMU's own channels go with tcp, not {}", req.option.name()),
        ));
    }
    if req.qemu_channels && req.postcopy {
        return Err(ApiError::invalid(
            "qemu_channels",
            "post-copy has QEMU's one stream, not multifd channels",
        ));
    }
    if req.option == MigrationOption::Tcp && req.qemu_zstd.is_some() && !req.qemu_channels {
        return Err(ApiError::invalid(
            "qemu_zstd",
            "QEMU compresses only in multifd channels: tcp without qemu_channels has one stream",
        ));
    }
    Ok(match req.option {
        MigrationOption::Tcp => None,
        MigrationOption::Multichannel
        | MigrationOption::Compression
        | MigrationOption::Mptcp
        | MigrationOption::MptcpRelay => {
            let id = req
                .session
                .as_deref()
                .and_then(ferry_transport::session_from_hex)
                .ok_or_else(|| {
                    ApiError::invalid("session", "multichannel needs a 32-hex-digit session id")
                })?;
            Some(id)
        }
        MigrationOption::Auto => {
            return Err(ApiError::invalid(
                "option",
                "the source resolves auto before asking",
            ))
        }
    })
}

/// When the skeleton's vCPUs started, on this process's monotonic clock:
/// QEMU's `RESUME` event (stamped as it starts them) if it came after the
/// `cont` was sent at `t_cont`, else `cont_returned` (later than the start,
/// so a guest's downtime dated by it is never too short).
fn resumed_at(
    seen: &crate::qmp::MigrationSeen,
    t_cont: Instant,
    cont_returned: Instant,
) -> Instant {
    seen.resumed
        .and_then(|t| {
            crate::qmp::on_monotonic_clock(
                t,
                Instant::now(),
                std::time::SystemTime::now(),
                Duration::from_secs(60),
            )
        })
        .filter(|r| *r >= t_cont && *r <= cont_returned)
        .unwrap_or(cont_returned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qmp::MigrationSeen;
    use tokio::sync::watch;

    /// An agent holding a skeleton of VM `vm1` for incoming migration
    /// `m1` (no QEMU yet), its journal at RUN's first step: Running.
    async fn running_skeleton(dir: &std::path::Path) -> Arc<Agent> {
        let agent = Agent::for_tests(dir);
        let role = Role::Incoming {
            migration_id: "m1".into(),
            source: "host1".into(),
            source_url: "https://host1".into(),
            dir: dir.join("vms/vm1.in-m1"),
            since: Instant::now(),
            agent_cpu_at_start: Duration::ZERO,
        };
        let spec = ferry_api::VmSpec::workload("vm1", 1 << 30, 256 << 20, 20 << 20);
        agent
            .state
            .lock()
            .await
            .vms
            .insert("vm1".into(), crate::host::VmSlot::new(spec, role, None));
        let rec = Record {
            migration_id: "m1".into(),
            vm: "vm1".into(),
            peer: "host1".into(),
            peer_url: "https://host1".into(),
            side: Side::Target(TargetPhase::Waiting),
            updated: 0,
            sealed: true,
        };
        agent.moves.journal.write(&rec).unwrap();
        assert_eq!(agent.incoming_status("m1").await.unwrap().phase, "waiting");
        agent.set_target_phase("m1", TargetPhase::Running).unwrap();
        agent
    }

    /// Runs `first` while RUN's adoption of `vm1` waits for the VM table
    /// behind it: the table's lock is fair, so the adoption takes it as
    /// soon as `first` lets go of it once. Returns `first`'s result.
    async fn racing_the_adoption<T: Send + 'static>(
        agent: &Arc<Agent>,
        first: impl std::future::Future<Output = T> + Send + 'static,
    ) -> T {
        let table = agent.state.lock().await;
        let first = tokio::spawn(first);
        let adoption = tokio::spawn({
            let agent = agent.clone();
            async move {
                if let Some(s) = agent.state.lock().await.vms.get_mut("vm1") {
                    s.role = Role::Running;
                }
            }
        });
        // both wait for the table, `first` ahead
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        drop(table);
        let out = first.await.unwrap();
        adoption.await.unwrap();
        assert!(matches!(
            agent.state.lock().await.vms.get("vm1").map(|s| &s.role),
            Some(Role::Running)
        ));
        out
    }

    /// RUN's two steps are Running written, then the skeleton adopted. A
    /// look (`GET /incoming/ID`) that finds the skeleton while the adoption
    /// waits behind it must answer from what it found: waiting. Were it to
    /// look the skeleton up again, it would miss it and answer "not
    /// found", which a committed source reads as "never ran" (and resumes
    /// its own copy of the guest). A look after the adoption answers
    /// running.
    #[tokio::test]
    async fn a_look_racing_runs_adoption_answers_waiting_then_running_never_not_found() {
        let dir = tempfile::tempdir().unwrap();
        let agent = running_skeleton(dir.path()).await;
        let look = racing_the_adoption(&agent, {
            let agent = agent.clone();
            async move { agent.incoming_status("m1").await }
        })
        .await;
        match look {
            Ok(st) => assert_eq!(st.phase, "waiting"),
            Err(e) => panic!("a look racing RUN's adoption answered {e:?}"),
        }
        assert_eq!(agent.incoming_status("m1").await.unwrap().phase, "running");
    }

    /// A discard (`DELETE /incoming/ID`) that found the skeleton, racing
    /// RUN's adoption, refuses rather than say it discarded a guest that
    /// runs; the guest stays.
    #[tokio::test]
    async fn a_discard_racing_runs_adoption_is_refused_and_the_guest_stays() {
        let dir = tempfile::tempdir().unwrap();
        let agent = running_skeleton(dir.path()).await;
        let abort = racing_the_adoption(&agent, {
            let agent = agent.clone();
            async move { agent.abort_incoming("m1").await }
        })
        .await;
        match abort {
            Err(ApiError::Conflict { reason }) => {
                assert!(reason.contains("runs on host2"), "{reason}")
            }
            other => panic!("a discard racing RUN's adoption answered {other:?}"),
        }
        assert!(agent.state.lock().await.vms.contains_key("vm1"));
        assert_eq!(agent.incoming_status("m1").await.unwrap().phase, "running");
    }

    /// A discard that comes after RUN adopted the skeleton leaves the
    /// guest alone: only a skeleton is ever discarded.
    #[tokio::test]
    async fn a_discard_after_the_adoption_leaves_the_running_guest() {
        let dir = tempfile::tempdir().unwrap();
        let agent = Agent::for_tests(dir.path());
        let spec = ferry_api::VmSpec::workload("vm1", 1 << 30, 256 << 20, 20 << 20);
        agent.state.lock().await.vms.insert(
            "vm1".into(),
            crate::host::VmSlot::new(spec, Role::Running, None),
        );
        assert!(!agent.discard("vm1").await);
        assert!(agent.state.lock().await.vms.contains_key("vm1"));
    }

    /// READY's loop (`ready_incoming`'s) with a look that answers on its
    /// `n`th call and, before, runs `during` (what happens while QEMU is
    /// asked); returns the paused clock's reading at each look.
    async fn looks(
        events: &mut watch::Receiver<MigrationSeen>,
        n: usize,
        mut during: impl FnMut(usize),
    ) -> Vec<Duration> {
        let t0 = tokio::time::Instant::now();
        let mut at = Vec::new();
        loop {
            at.push(t0.elapsed());
            if at.len() == n {
                return at;
            }
            during(at.len());
            crate::qmp::next_event_or(events, READY_POLL).await;
        }
    }

    fn completed() -> MigrationSeen {
        MigrationSeen {
            count: 1,
            status: "completed".into(),
            sent: None,
            stopped: None,
            resumed: None,
        }
    }

    #[test]
    fn the_guest_is_dated_running_by_qemus_resume_after_the_cont_else_by_the_cont_returning() {
        let ms = Duration::from_millis;
        let (now, wall) = (Instant::now(), std::time::SystemTime::now());
        let (t_cont, returned) = (now - ms(30), now - ms(10));
        let resumed = |ago: u64| MigrationSeen {
            resumed: Some(wall - ms(ago)),
            ..MigrationSeen::default()
        };
        let off = |a: Instant, b: Instant| if a > b { a - b } else { b - a };
        // RESUME 25 ms ago, between the cont sent and its reply: that
        let r = resumed_at(&resumed(25), t_cont, returned);
        assert!(off(r, now - ms(25)) < ms(5), "{:?}", now - r);
        // none seen yet, or one from before the cont (not this start), or
        // after its reply (a clock that stepped): the reply's time
        for seen in [MigrationSeen::default(), resumed(500), resumed(2)] {
            assert_eq!(resumed_at(&seen, t_cont, returned), returned);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn with_no_event_ready_looks_again_every_poll_and_answers() {
        let (_tx, mut rx) = watch::channel(MigrationSeen::default());
        let at = looks(&mut rx, 4, |_| {}).await;
        let want: Vec<_> = (0..4).map(|i| READY_POLL * i).collect();
        assert_eq!(at, want, "the fallback's looks, by the paused clock");
    }

    #[tokio::test(start_paused = true)]
    async fn an_event_wakes_the_next_look_at_once() {
        let (tx, mut rx) = watch::channel(MigrationSeen::default());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(7)).await;
            tx.send(completed()).unwrap();
            // the channel stays open past the look it woke
            tokio::time::sleep(READY_POLL * 10).await;
        });
        let at = looks(&mut rx, 2, |_| {}).await;
        assert_eq!(at, [Duration::ZERO, Duration::from_millis(7)]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_event_sent_during_a_look_is_not_missed() {
        let (tx, mut rx) = watch::channel(MigrationSeen::default());
        // QEMU completes after the first look asked it, before the wait
        let at = looks(&mut rx, 2, |_| tx.send(completed()).unwrap()).await;
        assert_eq!(at, [Duration::ZERO, Duration::ZERO]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_closed_event_channel_falls_back_to_the_poll_without_spinning() {
        let (tx, mut rx) = watch::channel(MigrationSeen::default());
        drop(tx);
        let at = looks(&mut rx, 3, |_| {}).await;
        assert_eq!(at, [Duration::ZERO, READY_POLL, READY_POLL * 2]);
    }
}
