//! The executor of the source's sequence ([`super::sequence`]): one
//! [`Move`] holds what its steps learn, runs each step's I/O (QMP, the
//! target agent, the journal, the carriers) and feeds the outcome to
//! `sequence::next`, which alone decides what comes next and how a failure
//! ends the move.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_api::{
    ApiError, Convergence, HostInfo, IncomingReply, IncomingRequest, MigrateRequest,
    MigrationOption, MigrationReport, VmSpec,
};
use ferry_net::client::Client;

use super::auto::{
    auto_choice, auto_one_pair, own_channels, qemu_compresses, relay_fits, sample_memory,
};
use super::sequence::{self, Action, OnDisk, Outcome, Step};
use super::{carrier_pairs, cpus, disks, fail, own_endpoint, tcp_uri, Events, Failure, Plan};
use crate::commit::{Record, Side, SourcePhase};
use crate::host::{error_chain, Agent};
use crate::qemu::QemuVm;
use crate::qmp::MigrationParameters;

/// What the `Plan` step chose for a move.
pub(super) struct Chosen {
    pub paths: Vec<ferry_api::NicPath>,
    pub option: MigrationOption,
    pub compress: ferry_transport::CompressMode,
    pub copies: Vec<disks::LocalCopy>,
    pub conv: Convergence,
    /// What the skeleton step's event adds (auto's choice, the disks).
    pub notes: String,
    pub qemu_zstd: Option<u8>,
    pub sample_ratio: Option<f64>,
    pub qemu_channels: bool,
    pub stream_windows: bool,
    /// The switch-over waits for the target QEMU to load what it was sent
    /// (QEMU's `switchover-ack`, held by the source's carriers; see
    /// `watch::Hold`).
    pub switchover_hold: bool,
}

/// One move, from the source: the context its steps share.
pub(super) struct Move<'a> {
    pub agent: &'a Agent,
    pub id: &'a str,
    pub spec: &'a VmSpec,
    pub vm: &'a Arc<QemuVm>,
    pub req: &'a MigrateRequest,
    pub ev: &'a Events,
    pub started: Instant,
    pub target: Client,
    pub tinfo: Option<HostInfo>,
    pub chosen: Option<Chosen>,
    pub session_key: [u8; 16],
    pub disk_session: [u8; 16],
    /// This move's own key (see `IncomingRequest::key`): it authenticates
    /// and seals its carriers and keys its QEMUs' TLS.
    pub move_key: [u8; 32],
    /// Both QEMUs speak TLS with this move's key (see `qemu_tls`).
    pub qemu_tls: bool,
    pub reply: Option<IncomingReply>,
    pub mirror: Option<disks::DiskMirror>,
    pub plan: Option<Plan>,
    pub stream: Option<super::watch::Streaming>,
    pub watch: Option<super::watch::Watch>,
    /// The commit record is written before post-copy starts.
    pub committed: bool,
    pub end: super::finish::End,
    pub report: Option<MigrationReport>,
}

impl<'a> Move<'a> {
    pub fn new(
        agent: &'a Agent,
        id: &'a str,
        (spec, vm): (&'a VmSpec, &'a Arc<QemuVm>),
        req: &'a MigrateRequest,
        ev: &'a Events,
        started: Instant,
    ) -> Move<'a> {
        let target = agent.peer(&req.target, &req.target_url);
        Move {
            agent,
            id,
            spec,
            vm,
            req,
            ev,
            started,
            target,
            tinfo: None,
            chosen: None,
            session_key: rand::random(),
            disk_session: rand::random(),
            move_key: rand::random(),
            qemu_tls: false,
            reply: None,
            mirror: None,
            plan: None,
            stream: None,
            watch: None,
            committed: false,
            end: Default::default(),
            report: None,
        }
    }

    /// Runs the sequence to its end: each step's outcome to
    /// `sequence::next`, each of its ends carried out here.
    pub async fn run(mut self) -> Result<MigrationReport, Failure> {
        let mut state = sequence::State::new();
        let mut action = sequence::FIRST;
        let mut failure: Option<Failure> = None;
        loop {
            match action {
                Action::Do(step) => {
                    let outcome = match self.step(step).await {
                        Ok(o) => o,
                        Err(f) => {
                            failure = Some(f);
                            Outcome::Failed(self.on_disk())
                        }
                    };
                    (state, action) = sequence::next(state, outcome);
                }
                Action::Fail => return Err(self.failure(failure)),
                Action::RollBack { mirrored } => {
                    if let (true, Some(m)) = (mirrored, self.mirror.as_mut()) {
                        m.abort(&self.vm.qmp).await;
                    }
                    let session = match &self.plan {
                        Some(Plan::Multichannel { session, .. }) => Some(session),
                        _ => None,
                    };
                    self.agent
                        .roll_back(self.id, self.vm, &self.target, session)
                        .await;
                    self.close();
                    return Err(self.failure(failure));
                }
                Action::AfterCommit { .. } => {
                    if let Some(m) = self.mirror.as_mut() {
                        m.close();
                    }
                    let f = self.failure(failure);
                    let f = self
                        .agent
                        .failed_after_commit(self.id, self.spec, self.req, self.ev, f)
                        .await;
                    self.close();
                    return Err(f);
                }
                Action::Report { .. } => {
                    if let Some(m) = self.mirror.as_mut() {
                        m.close();
                    }
                    self.close();
                    return self
                        .report
                        .take()
                        .ok_or_else(|| fail("final-check", "the move ended without a report"));
                }
            }
        }
    }

    /// The failure a move ended with (a step that failed without one is a
    /// fault of this executor, said as such).
    fn failure(&self, f: Option<Failure>) -> Failure {
        f.unwrap_or_else(|| fail("run", "the sequence ended without a failure to report"))
    }

    /// What the journal holds for this move now: decides, after a failure,
    /// whether it is before or after the commit.
    fn on_disk(&self) -> OnDisk {
        match self.agent.moves.journal.read(self.id, true) {
            Ok(None) => OnDisk::Nothing,
            Ok(Some(Record {
                side: Side::Source(SourcePhase::Copying),
                ..
            })) => OnDisk::Copying,
            Ok(Some(_)) => OnDisk::Past,
            Err(_) => OnDisk::Unreadable,
        }
    }

    /// The carriers closed and QEMU's socket removed.
    fn close(&self) {
        if let Some(Plan::Multichannel { session, sock, .. }) = &self.plan {
            session.close();
            let _ = std::fs::remove_file(sock);
        }
    }

    async fn step(&mut self, step: Step) -> Result<Outcome, Failure> {
        match step {
            Step::Establish => self.establish().await,
            Step::Plan => self.plan().await,
            Step::Record => self.record(),
            Step::Skeleton => self.skeleton().await,
            Step::Disks => self.disks().await,
            Step::Connect => self.connect().await,
            Step::Stream => self.start_stream().await,
            Step::Copy | Step::Postcopy => self.watch().await,
            Step::PostcopyCheck => self.postcopy_check().await,
            Step::PostcopyCommit => self.postcopy_commit().await,
            Step::PostcopyStart => self.postcopy_start().await,
            Step::Tick => self.tick().await,
            Step::Ready => self.ready().await,
            Step::Commit => self.commit().await,
            Step::Run => self.send_run().await,
            Step::Cleanup => self.cleanup().await,
        }
    }

    pub fn chosen(&self) -> &Chosen {
        self.chosen.as_ref().expect("the Plan step ran")
    }

    pub fn plan_ref(&self) -> &Plan {
        self.plan.as_ref().expect("the Connect step ran")
    }

    /// Steps 1-3: the target agent answers as the host asked for, and accepts
    /// this host's credential; 3. its free memory.
    async fn establish(&mut self) -> Result<Outcome, Failure> {
        let (agent, req, ev) = (self.agent, self.req, self.ev);
        let credential = if agent.pki.is_some() {
            "its certificate"
        } else {
            "the cluster credential"
        };
        let tinfo: HostInfo = self
            .target
            .get("/host", Duration::from_secs(5))
            .await
            .map_err(|e| match e {
                ApiError::Unauthorized { .. } => fail(
                    "permission",
                    format!("{} refused this host ({credential})", req.target),
                ),
                e => fail("establish", e.to_string()),
            })?;
        if tinfo.name != req.target {
            return Err(fail(
                "establish",
                format!(
                    "the agent at {} is {}, not {}",
                    req.target_url, tinfo.name, req.target
                ),
            ));
        }
        let me = &agent.cfg.name;
        ev.step(
            "establish",
            format!("{me} → {} (agent {})", req.target, req.target_url),
        )
        .await;
        ev.step(
            "permission",
            if agent.pki.is_some() {
                format!(
                    "mutual TLS: {}'s certificate verified, this host's accepted",
                    req.target
                )
            } else {
                format!(
                    "{} accepted the cluster credential (insecure HTTP)",
                    req.target
                )
            },
        )
        .await;
        ev.step(
            "memory",
            format!(
                "{} has {} bytes free; the VM needs {}",
                req.target, tinfo.memory_free, self.spec.memory
            ),
        )
        .await;
        self.tinfo = Some(tinfo);
        Ok(Outcome::Done)
    }

    /// The NIC pairs that reach the target, the option (auto's choice) and
    /// whether QEMU compresses or opens its own channels.
    async fn plan(&mut self) -> Result<Outcome, Failure> {
        let (agent, req, spec, vm) = (self.agent, self.req, self.spec, self.vm);
        let tinfo = self.tinfo.as_ref().expect("the Establish step ran");
        // which NIC here reaches which NIC there, probed (cached while no link changes)
        let paths = crate::probe::usable(&agent.paths_for_move(tinfo).await, &agent.nics());
        // compression is tried (only when it wins) for auto and compression
        let compress = match req.option {
            MigrationOption::Auto | MigrationOption::Compression => {
                ferry_transport::CompressMode::Adaptive
            }
            _ => ferry_transport::CompressMode::Off,
        };
        // shared-nothing: the VM's local drives are mirrored before its memory
        let copies = disks::local_copies(&agent.cfg.qemu, spec)
            .await
            .map_err(|e| fail("establish", e))?;
        let mut conv = req.convergence;
        let mut notes = String::new();
        if !copies.is_empty() && conv.postcopy {
            // the mirrors end with the guest paused before the switch-over
            conv.postcopy = false;
            if conv.at_expiry == Some(ferry_api::AtExpiry::Postcopy) {
                conv.at_expiry = Some(ferry_api::AtExpiry::Pause);
            }
            notes = "; post-copy off: local drives are copied before the switch-over".into();
        }
        let (option, mut sampled, auto_note) = self.choose_option(&paths).await;
        notes = format!("{auto_note}{notes}");
        // a move that may compress over Ferry's carriers: does QEMU compress
        // in its multifd channels (post-copy has one stream, no multifd)
        let takes = |f: &str| tinfo.features.iter().any(|x| x == f);
        let carriers = matches!(
            option,
            MigrationOption::Multichannel | MigrationOption::Compression
        );
        // compression's one link: the first pair probed to work. `auto`'s
        // carriers over several NICs (drains among them) keep QEMU's zstd for
        // memory that compresses: zstd on memory that does not is measured on
        // one link only (BENCHMARKS.md), so their rate counts as unknown (0)
        let compression_link = if option == MigrationOption::Compression {
            agent.first_link_bits(&paths).await
        } else {
            0
        };
        let (qemu_zstd, sample_ratio) = if compress == ferry_transport::CompressMode::Adaptive
            && carriers
            && !conv.postcopy
            && takes(ferry_api::FEATURE_QEMU_ZSTD)
        {
            let (ratio, idle) = match sampled {
                Some(s) => s,
                None => self.sample().await,
            };
            sampled = Some((ratio, idle));
            let (level, why) = qemu_compresses(ratio, idle, cpus(), compression_link);
            let (level, why) = qemu_takes_zstd(vm, level, why).await;
            notes.push_str(&format!("; {why}"));
            (level, ratio)
        } else {
            (None, None)
        };
        // compression whose pages QEMU sends as they are, over a link faster
        // than the spare CPU loads them: QEMU's own channels, no relay
        let qemu_channels = match sampled {
            Some((ratio, idle))
                if option == MigrationOption::Compression
                    && qemu_zstd.is_none()
                    && !conv.postcopy
                    && copies.is_empty()
                    && takes(ferry_api::FEATURE_QEMU_CHANNELS) =>
            {
                match own_channels(ratio, idle, cpus(), compression_link, req.encryption) {
                    Some(why) => {
                        notes.push_str(&format!("; {why}"));
                        true
                    }
                    None => false,
                }
            }
            _ => false,
        };
        let option = if qemu_channels {
            MigrationOption::Tcp
        } else {
            option
        };
        // Ferry's carriers keep each stream within a window of what the target
        // QEMU has taken: when it loads slower than the links deliver (what
        // QEMU compressed, or a CPU-bound target) its backlog stays small
        let stream_windows = carriers && !qemu_channels && takes(ferry_api::FEATURE_STREAM_WINDOWS);
        // plain pre-copy over Ferry's carriers: QEMU switches over once the
        // target has loaded what it was sent (a mirrored move's switch-over
        // already waits, paused, for its drives; post-copy commits early)
        let switchover_hold = stream_windows
            && !conv.postcopy
            && copies.is_empty()
            && takes(ferry_api::FEATURE_SWITCHOVER_HOLD);
        let disks = !copies.is_empty();
        self.chosen = Some(Chosen {
            paths,
            option,
            compress,
            copies,
            conv,
            notes,
            qemu_zstd,
            sample_ratio,
            qemu_channels,
            stream_windows,
            switchover_hold,
        });
        Ok(Outcome::Planned { disks })
    }

    /// What `auto` and compression judge by: how a sample of the guest's
    /// memory compresses, and the host's idle CPU share.
    async fn sample(&self) -> (Option<f64>, Option<f64>) {
        (
            sample_memory(self.vm, self.spec.memory).await,
            self.agent.idle_now().await,
        )
    }

    /// The option a move takes (auto's choice with its reason), and the
    /// memory sample and idle CPU when it read them.
    async fn choose_option(
        &self,
        paths: &[ferry_api::NicPath],
    ) -> (MigrationOption, Option<(Option<f64>, Option<f64>)>, String) {
        let (agent, req) = (self.agent, self.req);
        match req.option {
            MigrationOption::Auto if paths.len() > 1 => {
                let mptcp = ferry_transport::mptcp::available();
                let mut sampled = None;
                let (ratio, idle) = if mptcp && !req.encryption {
                    let s = self.sample().await;
                    sampled = Some(s);
                    s
                } else {
                    (None, None)
                };
                // the links this move would use, and whether the idle CPU
                // could relay them at that rate
                let used: Vec<String> = paths.iter().map(|p| p.nic.clone()).collect();
                let link_bits = agent.link_bits(used).await;
                let relay_room = idle
                    .filter(|i| relay_fits(*i, cpus(), link_bits))
                    .map(|_| link_bits);
                let (o, why) = auto_choice(mptcp, req.encryption, ratio, idle, relay_room);
                (o, sampled, format!("; auto: {why}"))
            }
            // one NIC pair: compress when that pays, else QEMU's own stream
            // (in clear; sealed carriers when encrypted)
            MigrationOption::Auto if paths.len() == 1 => {
                let s = self.sample().await;
                let (o, why) = auto_one_pair(s.0, s.1, req.encryption);
                (o, Some(s), format!("; auto: {why}"))
            }
            MigrationOption::Auto => (MigrationOption::Tcp, None, String::new()),
            o => (o, None, String::new()),
        }
    }

    /// The record exists before the target hears of the migration: a
    /// target that asks always finds an answer.
    fn record(&mut self) -> Result<Outcome, Failure> {
        self.agent
            .moves
            .journal
            .write(&Record {
                migration_id: self.id.into(),
                vm: self.spec.name.clone(),
                peer: self.req.target.clone(),
                peer_url: self.req.target_url.clone(),
                side: Side::Source(SourcePhase::Copying),
                updated: 0,
                // only Ferry's carriers seal: a move in QEMU's own TLS can
                // recover its post-copy stream in TLS too
                sealed: self.req.encryption && super::carried_by_ferry(self.chosen().option),
            })
            .map_err(|e| fail("memory", error_chain(&e)))?;
        Ok(Outcome::Done)
    }

    /// Step 4, `POST /incoming`: the target reserves the memory and starts its
    /// QEMU paused, waiting for the stream.
    async fn skeleton(&mut self) -> Result<Outcome, Failure> {
        let (agent, req, spec) = (self.agent, self.req, self.spec);
        let c = self.chosen();
        // a host-dependent CPU model: the target compares its own expansion
        let cpu_expansion = if crate::hardware::HOST_DEPENDENT_MODELS.contains(&spec.cpu.as_str()) {
            agent
                .cpu_catalog()
                .await
                .ok()
                .and_then(|c| c.expansions.get(&spec.cpu).cloned())
        } else {
            None
        };
        let incoming = IncomingRequest {
            source_url: agent.cfg.url.clone(),
            migration_id: self.id.into(),
            source: agent.cfg.name.clone(),
            spec: spec.clone(),
            ticket: req.ticket.clone(),
            reachable_nics: c.paths.iter().map(|p| p.peer_nic.clone()).collect(),
            option: c.option,
            session: Some(ferry_transport::session_to_hex(&self.session_key)),
            postcopy: c.conv.postcopy,
            sealed: req.encryption && super::carried_by_ferry(c.option),
            key: ferry_transport::session_to_hex(&self.move_key),
            qemu_tls: req.encryption && !super::carried_by_ferry(c.option),
            cpu_expansion,
            local_disks: disks::requests(&c.copies),
            disk_session: (!c.copies.is_empty())
                .then(|| ferry_transport::session_to_hex(&self.disk_session)),
            qemu_zstd: c.qemu_zstd,
            stream_windows: c.stream_windows,
            qemu_channels: c.qemu_channels,
            switchover_ack: c.switchover_hold,
        };
        let reply: IncomingReply = self
            .target
            .post("/incoming", &incoming, Duration::from_secs(30))
            .await
            .map_err(|e| match e {
                e @ (ApiError::InsufficientMemory { .. } | ApiError::HostCannotRun { .. }) => {
                    Failure {
                        step: "memory",
                        reason: e.to_string(),
                        passthrough: Some(Box::new(e)),
                        after: super::AfterCommit::No,
                    }
                }
                e => fail("skeleton", e.to_string()),
            })?;
        let waits_on = if reply.carriers.is_empty() {
            format!("{} ({})", reply.uri, reply.nic)
        } else {
            let c: Vec<String> = reply
                .carriers
                .iter()
                .map(|c| format!("{} {}", c.nic, c.address))
                .collect();
            format!("a local socket; carriers accepted on {}", c.join(", "))
        };
        self.ev
            .step(
                "skeleton",
                format!(
                    "QEMU on {} waits on {waits_on}{}",
                    req.target,
                    self.chosen().notes
                ),
            )
            .await;
        self.reply = Some(reply);
        Ok(Outcome::Done)
    }

    /// Step 4b, shared-nothing: every local drive in step with its copy there.
    /// A mirror that fails is aborted here (the sequence then rolls back).
    async fn disks(&mut self) -> Result<Outcome, Failure> {
        let agent = self.agent;
        let reply = self.reply.as_ref().expect("the Skeleton step ran");
        let carriers = carrier_pairs(&reply.disk_carriers, &self.chosen().paths);
        if carriers.is_empty() {
            return Err(fail("disks", "no NIC pair to carry the disks' copy"));
        }
        // disk bytes never cross a network in clear: sealed whatever
        // the cluster's encryption says of memory
        let keys = ferry_transport::Keys {
            secret: &self.move_key,
            sealed: disks::SEALED,
        };
        let copies = self.chosen().copies.clone();
        let mut m = disks::DiskMirror::start(
            &self.vm.qmp,
            self.disk_session,
            &keys,
            (disks::mirror_sock(&self.vm.dir, self.id), self.vm),
            carriers,
            copies,
            agent.cfg.reorder_window,
        )
        .await
        .map_err(|e| fail("disks", e))?;
        let copied = agent
            .copy_disks(
                self.id,
                &mut m,
                self.vm,
                &self.target,
                self.ev,
                self.started,
            )
            .await;
        if let Err(f) = copied {
            m.abort(&self.vm.qmp).await;
            return Err(f);
        }
        self.mirror = Some(m);
        Ok(Outcome::Done)
    }

    /// Step 5, what carries the stream: Ferry's carriers (or MPTCP) dialled to
    /// the target's listeners, or QEMU's own TCP to a listener checked
    /// against the probed pairs.
    async fn connect(&mut self) -> Result<Outcome, Failure> {
        let c = self.chosen();
        let reply = self.reply.as_ref().expect("the Skeleton step ran");
        let plan = match c.option {
            MigrationOption::Mptcp | MigrationOption::MptcpRelay => self.mptcp_plan(reply)?,
            MigrationOption::Multichannel | MigrationOption::Compression => {
                self.carriers_plan(reply).await?
            }
            _ => Plan::Tcp {
                uri: tcp_uri(reply, &c.paths).map_err(|why| {
                    fail(
                        "connection",
                        format!("refused the target's listener: {why}"),
                    )
                })?,
                nic: reply.nic.clone(),
                multifd: c.qemu_channels,
            },
        };
        self.plan = Some(plan);
        Ok(Outcome::Done)
    }

    fn mptcp_plan(&self, reply: &IncomingReply) -> Result<Plan, Failure> {
        let (agent, c) = (self.agent, self.chosen());
        let sock = self.vm.dir.join(format!("out-{}.sock", self.id));
        // the target's listener takes every address; the connection
        // starts on the first pair probed to work
        let first = reply.carriers.iter().find_map(|l| {
            let (p, remote) = own_endpoint(&l.nic, &l.address, &c.paths).ok()?;
            Some((p.address.parse().ok()?, remote))
        });
        let Some((local, remote)) = first else {
            return Err(fail("connection", "no NIC pair to carry the migration"));
        };
        let nic_addrs: Vec<(String, std::net::IpAddr)> = agent
            .nics()
            .iter()
            .filter_map(|n| Some((n.name.clone(), n.address.parse().ok()?)))
            .collect();
        let session = self.session_key;
        let started = ferry_transport::mptcp::prepare_host(&nic_addrs)
            .map_err(|e| e.to_string())
            .and_then(|_| {
                if c.option == MigrationOption::Mptcp {
                    // QEMU gets the socket itself (see `start_stream`)
                    ferry_transport::Spliced::source_handoff(
                        session,
                        &self.move_key,
                        local,
                        remote,
                        nic_addrs,
                    )
                } else {
                    ferry_transport::Spliced::source(
                        session,
                        &self.move_key,
                        sock.clone(),
                        local,
                        remote,
                        nic_addrs,
                    )
                }
                .map_err(|e| error_chain(&e))
            })
            .map_err(|e| fail("connection", e))?;
        if c.option != MigrationOption::Mptcp {
            if let Err(e) = self.vm.give_socket(&sock) {
                started.close();
                return Err(fail("connection", e));
            }
        }
        Ok(Plan::Multichannel {
            session: ferry_transport::Carriers::Mptcp(started),
            sock,
            option: c.option.name(),
            qemu_zstd: None,
        })
    }

    async fn carriers_plan(&self, reply: &IncomingReply) -> Result<Plan, Failure> {
        let (agent, c) = (self.agent, self.chosen());
        let sock = self.vm.dir.join(format!("out-{}.sock", self.id));
        // compression is the one-NIC option: the target's first carrier
        let offered = if c.option == MigrationOption::Compression {
            &reply.carriers[..reply.carriers.len().min(1)]
        } else {
            &reply.carriers[..]
        };
        let carriers = carrier_pairs(offered, &c.paths);
        if carriers.is_empty() {
            return Err(fail("connection", "no NIC pair to carry the migration"));
        }
        let keys = ferry_transport::Keys {
            secret: &self.move_key,
            sealed: self.req.encryption,
        };
        let s = ferry_transport::Session::source(self.session_key, &keys, sock.clone(), carriers)
            .await
            .map_err(|e| fail("connection", error_chain(&e)))?;
        if let Err(e) = self.vm.give_socket(&sock) {
            s.close();
            return Err(fail("connection", e));
        }
        s.set_reorder_window(agent.cfg.reorder_window);
        s.set_compression(c.compress);
        s.set_windows(c.stream_windows);
        // QEMU's return path, its switch-over acknowledgement first, waits
        // here until the target has caught up (`watch::Hold`)
        s.hold_local_writes(c.switchover_hold);
        if c.qemu_zstd.is_some() {
            // until QEMU's own figures come in
            s.set_expansion(1.0 / c.sample_ratio.unwrap_or(1.0));
        }
        Ok(Plan::Multichannel {
            session: ferry_transport::Carriers::Ferry(s),
            sock,
            option: c.option.name(),
            qemu_zstd: c.qemu_zstd,
        })
    }

    /// The bytes QEMU sent per NIC since the stream started (TCP plans).
    pub fn tx_since_start(&self) -> BTreeMap<String, u64> {
        let before = &self.stream.as_ref().expect("the Stream step ran").tx_before;
        super::tx_since(before)
    }
}

/// QEMU told to compress its multifd channels with zstd at `level`; a QEMU
/// built without zstd refuses, and its pages then go as they are.
async fn qemu_takes_zstd(vm: &QemuVm, level: Option<u8>, why: String) -> (Option<u8>, String) {
    if level.is_none() {
        return (level, why);
    }
    let asked = vm
        .qmp
        .set_parameters(MigrationParameters {
            multifd_compression: Some(crate::qmp::multifd_compression(true)),
            ..Default::default()
        })
        .await;
    match asked {
        Ok(()) => (level, why),
        Err(e) => (
            None,
            format!("QEMU sends pages as they are: it cannot compress with zstd ({e})"),
        ),
    }
}
