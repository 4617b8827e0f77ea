//! Steps 5-8 of a move: QEMU's stream started, then watched through copy,
//! iterate and blackout (or post-copy) until QEMU completes. The copy
//! loop's decisions are `copy_loop`'s; this file reads QEMU, the target and
//! the carriers, and says what it sees.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_api::{IncomingStatus, MigrationEvent, MigrationProgress};

use super::sequence::Outcome;
use super::source::Move;
use super::{
    carrier_bytes, copy_loop, data_path_of, fail, lost, nic_tx, poll_target, progress_event,
    Failure, Plan, COMMIT_SLACK, END_NEAR_BYTES, MULTIFD_CHANNELS, PAUSE_DOWNTIME_MS, POLL,
    POSTCOPY_PAUSED_LIMIT, POSTCOPY_STALL_LIMIT, RECOVER_EVERY,
};
use crate::commit::{Record, Side, SourcePhase, TargetAnswer};
use crate::convergence;
use crate::host::error_chain;
use crate::qmp::{MigrationInfo, MigrationParameters, QmpError};

/// What the Stream step set up, for the steps after it.
pub(super) struct Streaming {
    /// QEMU compresses its multifd channels at this zstd level.
    pub qemu_zstd: Option<u8>,
    pub dplan: crate::downtime::DowntimePlan,
    /// Each NIC's transmitted bytes when the stream started.
    pub tx_before: BTreeMap<String, u64>,
    pub t_migrate: Instant,
    /// This agent's and the source QEMU's CPU when the stream started.
    pub cpu_at_start: (Duration, Duration),
}

/// The copy loop's state across the Copy and Postcopy steps.
pub(super) struct Watch {
    pub copy: copy_loop::CopyLoop,
    pub timeout: Duration,
    rounds: convergence::Rounds,
    pub max_throttle: u64,
    /// The last look's time, QEMU's bytes sent and its bytes left then.
    last_sample: (Instant, u64, u64),
    /// The wait before the next look at QEMU (see [`next_look`]).
    next_look: Duration,
    target_failures: u32,
    last_target_poll: Instant,
    /// When the last progress event went (see [`PROGRESS_EVERY`]).
    last_progress: Option<Instant>,
    /// The carriers' stream windows narrowed for the last pass (see
    /// [`END_STREAM_WINDOW`]).
    window_narrowed: bool,
    /// copy, iterate, blackout: each said once.
    seen: (bool, bool, bool),
    carriers_up_seen: Option<usize>,
    /// RUN's answer while in post-copy.
    pub run_answer: Option<IncomingStatus>,
    last_run_try: Instant,
    postcopy_paused: Option<Instant>,
    last_recover: Instant,
    recover_failed: Option<String>,
    postcopy_moved: (Instant, u64),
    paths_seen: usize,
    /// QEMU's send threads' CPU while it compresses (they end with the
    /// migration, so the last reading while they ran is kept).
    pub qemu_send_cpu: Duration,
    qemu_ratio_from: (u64, u64),
    /// The last pass's decision's path rate and rates text.
    path_rate: f64,
    rates: String,
    /// QEMU's figures when it completed.
    pub info: Option<MigrationInfo>,
    /// When this agent first saw QEMU's source paused (`device`): the
    /// start of the guest's blackout, which [`Move::pause_left`] bounds.
    paused_at: Option<Instant>,
    /// QEMU's `MIGRATION` events: a state change ends a poll's wait.
    events: tokio::sync::watch::Receiver<crate::qmp::MigrationSeen>,
    /// READY, asked of the target as the last pass began (see
    /// [`EarlyReady`]).
    pub early_ready: Option<EarlyReady>,
    /// QEMU's one TCP stream, dialled by the agent: once less than
    /// [`LOWAT_FROM`] remains its unsent bytes are cut to `TCP_NOTSENT_LOWAT`
    /// (128 KiB), and the agent lets go of it. Autotuning lets the kernel
    /// queue megabytes, and each queued byte is blackout once QEMU has
    /// called its copy done (at 1 Gbit/s, ~4 MiB queued was ~30 ms of a
    /// ~40 ms downtime); cut for the whole move, the stream was 19% slower,
    /// as QEMU's thread must refill it every millisecond.
    dialled: Option<std::net::TcpStream>,
    /// The same socket once its unsent bytes are cut, kept to shut it under
    /// QEMU when a switch-over runs past its maximum ([`Move::overrun`]).
    cut: Option<std::net::TcpStream>,
    /// The hold before the switch-over, on a plain pre-copy over Ferry's
    /// carriers (see [`Hold`]).
    pub hold: Option<Hold>,
}

/// The longest the switch-over is held after QEMU's first pass over memory
/// ends: a target that has not caught up by then loads the rest during the
/// blackout, as without a hold; a guest that dirties memory faster than
/// the target catches up pays at most this in the move's time.
pub(super) const HOLD_MAX: Duration = Duration::from_millis(200);
/// The target has caught up when everything the source QEMU had handed
/// over is loaded within this of being looked at: what remains in flight
/// is then a round trip's worth.
pub(super) const CAUGHT_UP_WITHIN: Duration = Duration::from_millis(3);
/// Looks after which the hold ends even if none was that quick: the first
/// waits for what QEMU had handed over when its first pass ended, the
/// second for what it handed over meanwhile (what waited in QEMU's own
/// sockets while the windows were full). A guest that keeps dirtying keeps
/// QEMU sending, and no look is ever quick: its later rounds are the
/// ordinary iteration, which QEMU's limit decides.
pub(super) const HOLD_LOOKS: u32 = 2;

/// The hold before the switch-over. QEMU's `switchover-ack` (on both
/// QEMUs) keeps the source QEMU copying, the guest running, until the
/// target QEMU's acknowledgement arrives on its return path, which the
/// target sends as the stream opens and the source's carriers hold
/// ([`ferry_transport::Session::hold_local_writes`]). Once QEMU's first
/// pass ends (`MIGRATION_PASS` 2), the hold looks at what the target QEMU
/// has read of each stream (the carriers' WINDOW frames): when all that the
/// source QEMU had handed over is read within [`CAUGHT_UP_WITHIN`], after
/// [`HOLD_LOOKS`] such looks, or once [`HOLD_MAX`] has passed, the
/// acknowledgement goes, and QEMU switches over at its next iteration. So
/// the guest is not paused while the target still loads a backlog: pages
/// QEMU sent faster than the target's CPU takes them (fresh huge pages to
/// clear, compressed pages to expand).
pub(super) struct Hold {
    task: tokio::task::JoinHandle<()>,
    /// Set once let go: how long after the first pass, and whether the
    /// target had caught up (or [`HOLD_MAX`] passed).
    done: Arc<std::sync::OnceLock<(Duration, bool)>>,
    /// When QEMU's first pass ended (the hold began to look).
    begun: Arc<std::sync::OnceLock<Instant>>,
}

impl Hold {
    fn start(s: ferry_transport::Session, mut passes: tokio::sync::watch::Receiver<u64>) -> Hold {
        let done = Arc::new(std::sync::OnceLock::new());
        let begun = Arc::new(std::sync::OnceLock::new());
        let (d, b) = (done.clone(), begun.clone());
        let task = tokio::spawn(async move {
            // a QMP connection gone (QEMU's end) ends the wait too
            let _ = passes.wait_for(|p| *p >= 2).await;
            let t0 = Instant::now();
            let _ = b.set(t0);
            let deadline = t0 + HOLD_MAX;
            let mut looks = 0;
            let caught = loop {
                let marks = s.read_marks();
                let look = Instant::now();
                if !s.loaded(&marks, deadline).await {
                    break false;
                }
                looks += 1;
                if look.elapsed() <= CAUGHT_UP_WITHIN || looks >= HOLD_LOOKS {
                    break true;
                }
            };
            s.hold_local_writes(false);
            let _ = d.set((t0.elapsed(), caught));
            tracing::debug!(
                ms = t0.elapsed().as_millis() as u64,
                caught,
                "switch-over let go"
            );
        });
        Hold { task, done, begun }
    }

    /// Between the first pass's end and the hold's release: QEMU iterates
    /// for nothing then, and its rounds are not the guest's.
    pub fn holding(&self) -> bool {
        self.begun.get().is_some() && self.done.get().is_none()
    }

    /// How long the switch-over was held, and whether the target had
    /// caught up; None while it holds.
    pub fn held(&self) -> Option<(Duration, bool)> {
        self.done.get().copied()
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// READY sent to the target while the source is still in its last pass:
/// the target answers the moment its QEMU has loaded everything, so the
/// round trip overlaps the blackout instead of following it. READY only
/// looks; a move that ends another way drops (and aborts) it.
pub(super) struct EarlyReady(tokio::task::JoinHandle<Result<IncomingStatus, String>>);

/// READY (`POST /incoming/ID/ready`): has the target loaded everything?
pub(super) async fn ask_ready(
    target: &ferry_net::client::Client,
    id: &str,
) -> Result<IncomingStatus, ferry_api::ApiError> {
    target
        .post(
            &format!("/incoming/{id}/ready"),
            &serde_json::json!({}),
            Duration::from_secs(40),
        )
        .await
}

impl EarlyReady {
    fn ask(target: &ferry_net::client::Client, id: &str) -> EarlyReady {
        let (target, id) = (target.clone(), id.to_string());
        EarlyReady(tokio::spawn(async move {
            ask_ready(&target, &id).await.map_err(|e| e.to_string())
        }))
    }

    /// The target's answer (an error: ask again, it may have been too early).
    pub async fn answer(mut self) -> Result<IncomingStatus, String> {
        (&mut self.0)
            .await
            .unwrap_or_else(|e| Err(format!("early READY: {e}")))
    }
}

impl Drop for EarlyReady {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Watch {
    /// The copy loop's last rates, as text.
    pub fn rates_text(&self) -> &str {
        &self.rates
    }

    fn new(
        policy: copy_loop::Policy,
        events: tokio::sync::watch::Receiver<crate::qmp::MigrationSeen>,
        dialled: Option<std::net::TcpStream>,
        hold: Option<Hold>,
    ) -> Watch {
        let now = Instant::now();
        Watch {
            timeout: policy.timeout,
            copy: copy_loop::CopyLoop::new(policy, now),
            rounds: Default::default(),
            max_throttle: 0,
            last_sample: (now, 0, 0),
            next_look: POLL,
            target_failures: 0,
            last_target_poll: now,
            last_progress: None,
            window_narrowed: false,
            seen: (false, false, false),
            carriers_up_seen: None,
            run_answer: None,
            last_run_try: now - Duration::from_secs(60),
            postcopy_paused: None,
            last_recover: now - RECOVER_EVERY,
            recover_failed: None,
            postcopy_moved: (now, 0),
            paths_seen: 0,
            qemu_send_cpu: Duration::ZERO,
            qemu_ratio_from: (0, 0),
            path_rate: 0.0,
            rates: String::new(),
            info: None,
            paused_at: None,
            events,
            early_ready: None,
            dialled,
            cut: None,
            hold,
        }
    }
}

fn q(step: &'static str) -> impl Fn(QmpError) -> Failure {
    move |e| fail(step, error_chain(&e))
}

impl Move<'_> {
    fn streaming(&self) -> &Streaming {
        self.stream.as_ref().expect("the Stream step ran")
    }

    fn watching(&mut self) -> &mut Watch {
        self.watch.as_mut().expect("the Stream step ran")
    }

    /// Step 5, QEMU's capabilities and parameters, then `migrate` to the plan's
    /// socket or listener (an MPTCP socket handed over as is).
    pub(super) async fn start_stream(&mut self) -> Result<Outcome, Failure> {
        let (agent, vm) = (self.agent, self.vm);
        let qmp = &vm.qmp;
        let conv = self.chosen().conv;
        let plan = self.plan_ref();
        // post-copy and multifd do not mix in QEMU: with post-copy allowed,
        // Ferry's transport carries QEMU's one stream over every NIC instead;
        // a handed-off MPTCP socket carries QEMU's one stream: no multifd either
        let handoff = match plan {
            Plan::Multichannel { session, .. } => session.handoff_fd(),
            Plan::Tcp { .. } => None,
        };
        let multifd = match plan {
            Plan::Multichannel { .. } => !conv.postcopy && handoff.is_none(),
            Plan::Tcp { multifd, .. } => *multifd,
        };
        let qemu_zstd = match plan {
            Plan::Multichannel { qemu_zstd, .. } => qemu_zstd.filter(|_| multifd),
            Plan::Tcp { .. } => None,
        };
        let mirrored = self.mirror.is_some();
        qmp.set_capabilities(&[
            // its state changes wake the watch at once (see poll_qemu)
            ("events", true),
            ("multifd", multifd),
            ("auto-converge", conv.throttle),
            ("postcopy-ram", conv.postcopy),
            // shared-nothing: QEMU waits, guest paused, while the mirrors end
            ("pause-before-switchover", mirrored),
            // the switch-over waits for the target's acknowledgement, which
            // the carriers hold until the target has caught up (`Hold`)
            ("return-path", self.chosen().switchover_hold),
            ("switchover-ack", self.chosen().switchover_hold),
        ])
        .await
        .map_err(q("connection"))?;
        // the downtime the guest sees is QEMU's and then the switch-over:
        // QEMU gets what the switch-over leaves (see crate::downtime)
        let (switchover, overshoot) = agent.moves.switchovers.expect(&self.req.target);
        let dplan = crate::downtime::DowntimePlan::new(
            conv.max_downtime_ms,
            conv.downtime_auto && !conv.postcopy && !mirrored,
            switchover + COMMIT_SLACK.as_millis() as u64,
            overshoot,
        );
        qmp.set_parameters(MigrationParameters {
            // Ferry paces migrations itself; QEMU's 128 MiB/s default would cap fast links
            max_bandwidth: Some(100 << 30),
            downtime_limit: Some(dplan.limit_ms),
            multifd_channels: multifd.then_some(MULTIFD_CHANNELS),
            multifd_compression: multifd
                .then(|| crate::qmp::multifd_compression(qemu_zstd.is_some())),
            multifd_zstd_level: qemu_zstd,
            cpu_throttle_initial: conv.throttle.then_some(20),
            cpu_throttle_increment: conv.throttle.then_some(10),
            ..Default::default()
        })
        .await
        .map_err(q("connection"))?;
        // QEMU's bytes that Ferry does not frame are QEMU's TLS's to encrypt
        if self.req.encryption && !super::carried_by_ferry(self.chosen().option) {
            super::qemu_tls::arm(
                qmp,
                &vm.dir,
                &self.move_key,
                super::qemu_tls::End::Client,
                vm.owner,
            )
            .await
            .map_err(|e| fail("connection", e))?;
            self.qemu_tls = true;
        } else {
            super::qemu_tls::clear(qmp).await.map_err(q("connection"))?;
        }
        let plan = self.plan_ref();
        let tx_before = nic_tx(&agent.cfg.nics);
        let (uri, detail) = stream_target(plan, handoff.is_some(), multifd, qemu_zstd).await;
        // QEMU's one TCP stream (no post-copy, whose recovery dials anew):
        // dialled here and handed over, so that its unsent bytes can be cut
        // once the end is near (see `Watch::dialled`)
        let dialled = match plan {
            Plan::Tcp { multifd: false, .. } if !conv.postcopy => Some(
                tokio::task::spawn_blocking({
                    let uri = uri.clone();
                    move || dial_for_qemu(&uri)
                })
                .await
                .map_err(|e| fail("connection", e.to_string()))?
                .map_err(|e| fail("connection", format!("dialling {uri}: {e}")))?,
            ),
            _ => None,
        };
        let handoff = handoff.or_else(|| dialled.as_ref().map(std::os::fd::AsRawFd::as_raw_fd));
        let hold = match (self.chosen().switchover_hold, plan) {
            (
                true,
                Plan::Multichannel {
                    session: ferry_transport::Carriers::Ferry(s),
                    ..
                },
            ) => Some(Hold::start(s.clone(), qmp.passes_from_zero())),
            _ => None,
        };
        let t_migrate = Instant::now();
        let cpu_at_start = (
            crate::host::own_cpu(),
            crate::host::process_cpu(vm.pid).unwrap_or_default(),
        );
        match handoff {
            Some(fd) => {
                let monitor = vm.dir.join(crate::qemu::HANDOFF_SOCK);
                tokio::task::spawn_blocking(move || {
                    crate::qmp::hand_socket(&monitor, fd, crate::qmp::HandTo::Migrate)
                })
                .await
                .map_err(|e| fail("connection", e.to_string()))?
                .map_err(q("connection"))?
            }
            None => qmp.migrate(&uri).await.map_err(q("connection"))?,
        }
        self.ev.step("connection", detail).await;
        // the timeout measures convergence: it starts when the first pass
        // over memory is done (that pass is a plain copy at the path's rate,
        // watched by the stall watchdog), so a slow or shared path does not
        // fail a guest that would converge
        self.watch = Some(Watch::new(
            copy_loop::Policy {
                postcopy: conv.postcopy,
                throttle: conv.throttle,
                expiry: conv.expiry(),
                timeout: conv.timeout(self.spec.memory),
                max_downtime_ms: conv.max_downtime_ms,
            },
            qmp.migration_events(),
            dialled,
            hold,
        ));
        self.stream = Some(Streaming {
            qemu_zstd,
            dplan,
            tx_before,
            t_migrate,
            cpu_at_start,
        });
        Ok(Outcome::Done)
    }

    /// Steps 6-8, copy, iterate, blackout (or post-copy): QEMU watched until it
    /// completes (`Done`), or, before the commit, until the copy loop wants
    /// post-copy (`PostcopyWanted`).
    pub(super) async fn watch(&mut self) -> Result<Outcome, Failure> {
        loop {
            let info = self.poll_qemu().await?;
            let status = info.status.clone().unwrap_or_default();
            if status.starts_with("postcopy") {
                self.watching().copy.entered_postcopy();
            }
            self.report_path_changes().await;
            if status == "pre-switchover" {
                // the guest is paused: each local drive ends in step with its
                // copy, then QEMU sends the device state
                if let Some(m) = self.mirror.as_mut() {
                    let t0 = Instant::now();
                    m.complete(&self.vm.qmp)
                        .await
                        .map_err(|e| fail("blackout", e))?;
                    tracing::info!(
                        ms = t0.elapsed().as_millis() as u64,
                        "disk copies completed in step"
                    );
                }
                self.vm
                    .qmp
                    .migrate_continue()
                    .await
                    .map_err(q("blackout"))?;
                continue;
            }
            match status.as_str() {
                "completed" => {
                    self.watching().info = Some(info);
                    return Ok(Outcome::Done);
                }
                "failed" => {
                    let why = info.error_desc.unwrap_or_else(|| "failed".into());
                    return Err(self.broke(format!("QEMU: {why}")));
                }
                "cancelled" | "cancelling" => {
                    return Err(self.broke("QEMU cancelled the migration".into()))
                }
                _ => {}
            }
            if let Some(wanted) = self.decide(&info).await? {
                return Ok(wanted);
            }
            if self.watching().copy.in_postcopy() {
                self.postcopy_tick(&info).await?;
            } else {
                self.precopy_tick(&info).await?;
            }
        }
    }

    /// How much longer the source's guest may stay paused before the move
    /// is given up ([`crate::downtime::pause_deadline`]); `None` where no
    /// such bound applies: no maximum asked (`auto` aims low and completes,
    /// saying so if it overran), not paused yet, committed, post-copy
    /// allowed, a mirrored move's drives, or a pause-and-copy the policy
    /// chose.
    pub(super) fn pause_left(&self) -> Option<Duration> {
        let w = self.watch.as_ref()?;
        let since = self.paused_since()?;
        let plain = !self.chosen().conv.downtime_auto
            && !self.committed
            && !self.chosen().conv.postcopy
            && self.mirror.is_none()
            && !w.copy.pausing()
            && !w.copy.in_postcopy();
        if !plain {
            return None;
        }
        let deadline = crate::downtime::pause_deadline(self.chosen().conv.max_downtime_ms);
        Some(deadline.saturating_sub(since.elapsed()))
    }

    /// The source's pause for the blackout that completed, dated by QEMU's
    /// events (see [`crate::qmp::MigrationSeen::pause_of_completion`]).
    pub(super) fn qemu_dated_pause(
        &self,
        downtime_ms: u64,
        not_before: Instant,
    ) -> Option<Instant> {
        self.watch.as_ref()?.events.borrow().pause_of_completion(
            downtime_ms,
            not_before,
            Instant::now(),
            std::time::SystemTime::now(),
        )
    }

    /// When the source's guest was paused for the blackout, if it was.
    fn paused_since(&self) -> Option<Instant> {
        let w = self.watch.as_ref()?;
        let downtime = w.info.as_ref().and_then(|i| i.downtime);
        pause_start(
            w.paused_at,
            &w.events.borrow(),
            self.end.t_completed,
            downtime,
            Instant::now(),
        )
    }

    /// The switch-over would run past the maximum asked: the move is given
    /// up before the commit (the rollback resumes the guest here), and
    /// the next move to that target plans for QEMU's overshoot.
    pub(super) fn overrun(&mut self, what: &str) -> Failure {
        // QEMU's last pass ends now: its stream is shut under it (it holds
        // its big lock while it writes, so a cancel would wait for the
        // pass); it fails and resumes the guest itself
        if let Some(w) = self.watch.as_mut() {
            if let Some(s) = w.cut.take().or_else(|| w.dialled.take()) {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
        if let Plan::Multichannel { session, .. } = self.plan_ref() {
            session.close();
        }
        let max = self.chosen().conv.max_downtime_ms;
        let paused = self
            .paused_since()
            .map_or(0, |t| t.elapsed().as_millis() as u64);
        if let Some(st) = self.stream.as_ref() {
            let qemu_ms = self
                .watch
                .as_ref()
                .and_then(|w| w.info.as_ref())
                .and_then(|i| i.downtime)
                .unwrap_or(paused);
            self.agent.moves.switchovers.record(
                &self.req.target,
                paused.saturating_sub(qemu_ms),
                qemu_ms,
                st.dplan.limit_ms,
            );
        }
        fail(
            "blackout",
            format!(
                "{what} {paused} ms into the blackout, and the guest may be paused at most {max} ms \
                 (--max-downtime): the move is given up before the commit and the guest resumes on {}",
                self.agent.cfg.name
            ),
        )
    }

    /// A broken stream: before the commit a failed copy, after it (post-copy)
    /// a lost one.
    fn broke(&self, why: String) -> Failure {
        if self.committed {
            lost(why)
        } else {
            fail("copy", why)
        }
    }

    /// QEMU's `query-migrate`: every `POLL` (less often while the end is
    /// far, see [`next_look`]), and at once when QEMU sends a
    /// `MIGRATION` event (paused, completed, failed), so the commit follows
    /// its completion at once. Near the end nothing is polled faster: each
    /// state change the end brings is an event.
    async fn poll_qemu(&mut self) -> Result<MigrationInfo, Failure> {
        // a paused guest's deadline is looked at when it comes, not after it
        // one wait each: a look that is not pre-copy's sets none
        let next = std::mem::replace(&mut self.watching().next_look, POLL);
        let wait = self.pause_left().map_or(next, |left| left.min(POLL));
        crate::qmp::next_event_or(&mut self.watching().events, wait).await;
        // QEMU's event says when it paused the guest: its last pass runs
        // under QEMU's big lock, so `query-migrate` gets no answer until
        // that pass is over, however long it takes. The pause is dated by
        // the event's own time, so that an agent woken late (a busy host)
        // still counts the blackout from the guest's pause
        let w = self.watching();
        {
            let seen = w.events.borrow();
            if seen.status == "device" {
                w.paused_at
                    .get_or_insert_with(|| seen.sent_instant(Instant::now()));
            }
        }
        let asked_qemu = self.vm.qmp.query_migrate();
        let answer = match self.pause_left() {
            Some(left) => match tokio::time::timeout(left, asked_qemu).await {
                Ok(a) => a,
                Err(_) => return Err(self.overrun("QEMU was still sending the last pass")),
            },
            None => asked_qemu.await,
        };
        let info = match answer {
            Ok(i) => i,
            Err(e) if self.committed => return Err(lost(error_chain(&e))),
            Err(e) => return Err(fail("copy", error_chain(&e))),
        };
        if self.streaming().qemu_zstd.is_some() {
            self.follow_qemu_ratio(&info);
        }
        if info.status.as_deref() == Some("device") {
            self.watching().paused_at.get_or_insert_with(Instant::now);
            if self.pause_left() == Some(Duration::ZERO) {
                return Err(self.overrun("QEMU was still sending the last pass"));
            }
        }
        let near_end = match info.status.as_deref() {
            Some("device") => true,
            Some("active") => info
                .ram
                .as_ref()
                .is_some_and(|r| r.remaining <= END_NEAR_BYTES),
            _ => false,
        };
        if near_end && !self.watching().window_narrowed {
            if let Plan::Multichannel {
                session: ferry_transport::Carriers::Ferry(s),
                ..
            } = self.plan_ref()
            {
                s.set_stream_window(END_STREAM_WINDOW);
            }
            self.watching().window_narrowed = true;
        }
        let w = self.watching();
        let remaining = info.ram.as_ref().map_or(0, |r| r.remaining);
        if near_end && (remaining <= LOWAT_FROM || info.status.as_deref() == Some("device")) {
            if let Some(s) = w.dialled.take() {
                ferry_transport::session::set_notsent_lowat(
                    std::os::fd::AsRawFd::as_raw_fd(&s),
                    ferry_transport::session::NOTSENT_LOWAT,
                );
                w.cut = Some(s);
            }
        }
        // the last pass of a plain pre-copy: READY goes now (post-copy
        // commits before the target has everything; a mirrored move's
        // target waits for the mirrors' end)
        let plain = !self.committed && !self.chosen().conv.postcopy && self.mirror.is_none();
        if near_end && plain && self.watching().early_ready.is_none() {
            let early = EarlyReady::ask(&self.target, self.id);
            self.watching().early_ready = Some(early);
        }
        Ok(info)
    }

    /// QEMU compresses: its send threads' CPU, and the carriers' windows
    /// count what its bytes expand to (its ratio over the last MiB or more
    /// it wrote).
    fn follow_qemu_ratio(&mut self, info: &MigrationInfo) {
        let pid = self.vm.pid;
        let plan = self.plan.as_ref().expect("the Connect step ran");
        let w = self.watch.as_mut().expect("the Stream step ran");
        w.qemu_send_cpu = w
            .qemu_send_cpu
            .max(crate::host::threads_cpu(pid, "mig/src/send_"));
        if let (
            Some(r),
            Plan::Multichannel {
                session: ferry_transport::Carriers::Ferry(s),
                ..
            },
        ) = (&info.ram, plan)
        {
            let (normal, written) = (
                r.normal_bytes.saturating_sub(w.qemu_ratio_from.0),
                r.multifd_bytes.saturating_sub(w.qemu_ratio_from.1),
            );
            if written >= 1 << 20 {
                s.set_expansion(normal as f64 / written as f64);
                w.qemu_ratio_from = (r.normal_bytes, r.multifd_bytes);
            }
        }
    }

    /// Paths dropped or taken again since the last look, as they happened.
    async fn report_path_changes(&mut self) {
        let changes = match &self.plan {
            Some(Plan::Multichannel { session, .. }) => session.path_changes(),
            _ => return,
        };
        let from = self.watching().paths_seen;
        for c in changes.into_iter().skip(from) {
            self.watching().paths_seen += 1;
            self.ev.send(MigrationEvent::Path(c)).await;
        }
    }

    /// The copy loop's decision on QEMU's figures, carried out: a raised
    /// downtime limit, pause-and-copy, or the end of a copy that does not
    /// converge or moves nothing. `Some(PostcopyWanted)` hands over to the
    /// post-copy steps.
    async fn decide(&mut self, info: &MigrationInfo) -> Result<Option<Outcome>, Failure> {
        let status = info.status.clone().unwrap_or_default();
        let ram = info.ram.clone().unwrap_or_default();
        let page = if ram.page_size == 0 {
            4096
        } else {
            ram.page_size
        };
        let throttle = info.cpu_throttle_percentage.unwrap_or(0);
        let w = self.watching();
        w.max_throttle = w.max_throttle.max(throttle);
        let decided = w.copy.observe(
            &copy_loop::Sample {
                transferred: ram.transferred,
                dirty_sync_count: ram.dirty_sync_count,
                dirty_rate: (ram.dirty_pages_rate * page) as f64,
                expected_downtime_ms: info.expected_downtime,
                throttle_pct: throttle,
            },
            Instant::now(),
        );
        w.path_rate = decided.path_rate;
        w.rates = decided.rates();
        let (pausing, timeout, rates) = (w.copy.pausing(), w.timeout, w.rates.clone());
        let holding = w.hold.as_ref().is_some_and(Hold::holding);
        if status == "active" && !pausing && !holding {
            let raised = self
                .stream
                .as_mut()
                .expect("the Stream step ran")
                .dplan
                .on_round(ram.dirty_sync_count);
            if let Some(l) = raised {
                self.vm
                    .qmp
                    .set_parameters(MigrationParameters {
                        downtime_limit: Some(l),
                        ..Default::default()
                    })
                    .await
                    .map_err(q("copy"))?;
                tracing::info!(vm = %self.spec.name, round = ram.dirty_sync_count, limit_ms = l, "downtime limit raised");
            }
        }
        match decided.action {
            copy_loop::Action::Continue => Ok(None),
            copy_loop::Action::StartPostcopy => Ok(Some(Outcome::PostcopyWanted)),
            copy_loop::Action::PauseAndCopy => {
                // pause-and-copy: QEMU stops the guest at its next iteration and
                // copies what remains; the downtime is remaining ÷ path rate
                self.vm
                    .qmp
                    .set_parameters(MigrationParameters {
                        downtime_limit: Some(PAUSE_DOWNTIME_MS),
                        ..Default::default()
                    })
                    .await
                    .map_err(q("copy"))?;
                let pause = convergence::drain_time(ram.remaining, decided.path_rate)
                    .map(|d| format!("~{:.1} s", d.as_secs_f64()))
                    .unwrap_or_else(|| "unknown time".into());
                self.ev.step(
                    "pause-and-copy",
                    format!(
                        "pre-copy did not converge within {} s after the first pass ({rates}); the guest is paused while the remaining {} MB are copied ({pause})",
                        timeout.as_secs(),
                        ram.remaining / 1_000_000
                    ),
                )
                .await;
                Ok(None)
            }
            copy_loop::Action::NotConverging => {
                let advice = if self.chosen().conv.throttle {
                    "allow post-copy"
                } else {
                    "allow throttling or post-copy"
                };
                Err(fail(
                    "copy",
                    format!(
                        "pre-copy did not converge within {} s after the first pass: {rates}; {advice}",
                        timeout.as_secs()
                    ),
                ))
            }
            copy_loop::Action::Stalled => {
                let path = match self.plan_ref() {
                    Plan::Tcp { nic, .. } => format!("the data path over {nic} is down"),
                    Plan::Multichannel { session, .. } => session.stall_detail(),
                };
                Err(fail(
                    "copy",
                    format!(
                        "no bytes moved for {} s: {path}",
                        copy_loop::STALL_TIMEOUT.as_secs()
                    ),
                ))
            }
        }
    }

    /// One look in post-copy: RUN until the target answers, a stream that
    /// moves nothing for a minute is broken, a paused one is recovered;
    /// nothing rolls back now, whatever the path does.
    async fn postcopy_tick(&mut self, info: &MigrationInfo) -> Result<(), Failure> {
        let status = info.status.clone().unwrap_or_default();
        let ram = info.ram.clone().unwrap_or_default();
        let now = Instant::now();
        // RUN: the target has the device state (or soon will) and waits,
        // paused, for it; asked again every 2 s until it answers
        let w = self.watching();
        if w.run_answer.is_none() && w.last_run_try.elapsed() >= Duration::from_secs(2) {
            w.last_run_try = Instant::now();
            if let Ok(st) = self
                .agent
                .send_run_within(&self.target, self.id, Duration::from_secs(2))
                .await
            {
                if super::answer_of(&st) == TargetAnswer::Running {
                    self.watching().run_answer = Some(st);
                    crate::failpoint::hit("source-postcopy-running");
                }
            }
        }
        let target_name = self.req.target.clone();
        // post-copy pushes every remaining page in the background: a
        // stream that moves nothing for a minute is broken, not idle
        let w = self.watching();
        if ram.transferred != w.postcopy_moved.1 || status != "postcopy-active" {
            w.postcopy_moved = (now, ram.transferred);
        } else if now - w.postcopy_moved.0 > POSTCOPY_STALL_LIMIT {
            return Err(lost(format!(
                "post-copy moved no byte for {} s; the guest waits on {target_name} for \
                 its pages",
                POSTCOPY_STALL_LIMIT.as_secs()
            )));
        }
        if status == "postcopy-paused" {
            self.recover(now).await?;
        } else {
            self.watching().postcopy_paused = None;
        }
        let path_rate = self.watching().path_rate;
        let p = progress_event(
            info,
            &ram,
            self.started,
            path_rate,
            self.plan_ref(),
            &self.streaming().tx_before,
            "postcopy",
        );
        self.ev.send(p).await;
        Ok(())
    }

    /// Post-copy's stream broke: a new one over any path up, tried again
    /// as paths return; the source QEMU keeps every page. Past
    /// `POSTCOPY_PAUSED_LIMIT` the move ends lost, the settler going on.
    async fn recover(&mut self, now: Instant) -> Result<(), Failure> {
        let target_name = self.req.target.clone();
        let w = self.watching();
        let since = *w.postcopy_paused.get_or_insert(now);
        if now - w.last_recover >= RECOVER_EVERY {
            w.last_recover = now;
            // what a recovery needs to know of this move
            let rec = Record {
                migration_id: self.id.into(),
                vm: self.spec.name.clone(),
                peer: target_name.clone(),
                peer_url: String::new(),
                side: Side::Source(SourcePhase::Committed),
                updated: 0,
                sealed: matches!(self.plan_ref(), Plan::Multichannel { session, .. } if session.sealed()),
            };
            match self
                .agent
                .recover_postcopy(&rec, &self.target, self.vm)
                .await
            {
                Ok(how) => {
                    self.watching().recover_failed = None;
                    self.ev.step("postcopy-recover", how).await;
                }
                Err(why) if self.watching().recover_failed.as_deref() != Some(why.as_str()) => {
                    self.ev
                        .send(MigrationEvent::Warning {
                            message: format!(
                                "post-copy's stream broke; {} waits paused for its pages; \
                                 recovering: {why}",
                                self.spec.name
                            ),
                        })
                        .await;
                    self.watching().recover_failed = Some(why);
                }
                Err(_) => {}
            }
        }
        if now - since > POSTCOPY_PAUSED_LIMIT {
            return Err(lost(format!(
                "post-copy's stream broke and no new one held for {} s; the guest \
                 waits paused on {target_name}, and this host keeps trying to resume it",
                POSTCOPY_PAUSED_LIMIT.as_secs()
            )));
        }
        Ok(())
    }

    /// One look in pre-copy: the target polled, each phase said once, the
    /// carriers' health (a lost one tells QEMU the bandwidth left), and a
    /// progress event.
    async fn precopy_tick(&mut self, info: &MigrationInfo) -> Result<(), Failure> {
        let status = info.status.clone().unwrap_or_default();
        let ram = info.ram.clone().unwrap_or_default();
        let now = Instant::now();
        if now - self.watching().last_target_poll >= Duration::from_secs(1) {
            let w = self.watch.as_mut().expect("the Stream step ran");
            w.last_target_poll = now;
            poll_target(&self.target, self.id, &mut w.target_failures, "copy").await?;
        }
        self.say_phases(&status, &ram).await;
        let w = self.watching();
        let dt = (now - w.last_sample.0).as_secs_f64().max(1e-3);
        let throughput = ram.transferred.saturating_sub(w.last_sample.1) as f64 / dt;
        // the end nears faster than bytes go where pages are zero (a few
        // bytes each): the faster of the two rates
        let nearing = w.last_sample.2.saturating_sub(ram.remaining) as f64 / dt;
        w.last_sample = (now, ram.transferred, ram.remaining);
        let tcp = matches!(self.plan_ref(), Plan::Tcp { .. });
        self.watching().next_look = next_look(tcp, &status, ram.remaining, throughput.max(nearing));
        let w = self.watching();
        let due = w.last_progress.is_none_or(|t| now - t >= PROGRESS_EVERY);
        let (nic_tx_bytes, carriers_up) = match self.plan_ref() {
            Plan::Tcp { .. } if due => (self.tx_since_start(), None),
            Plan::Tcp { .. } => (BTreeMap::new(), None),
            Plan::Multichannel { session, .. } => {
                if let Some(why) = session.failure() {
                    return Err(fail("copy", format!("transport: {why}")));
                }
                let st = match session {
                    ferry_transport::Carriers::Mptcp(s) => {
                        let (st, due) = s.tick();
                        self.agent
                            .ask_rejoins(self.id, (&self.req.target, &self.target), due);
                        st
                    }
                    _ => session.stats(),
                };
                (carrier_bytes(&st), Some(st.healthy))
            }
        };
        self.carrier_loss(carriers_up, throughput).await;
        if !due {
            return Ok(());
        }
        self.watching().last_progress = Some(now);
        let mut p = self.precopy_progress(info, throughput);
        // the mirrors keep the copies in step meanwhile; one that fails
        // ends the move (the guest keeps its own disks)
        let disks = match self.mirror.as_mut() {
            Some(m) if status != "pre-switchover" && status != "device" => Some(
                m.progress(&self.vm.qmp)
                    .await
                    .map_err(|e| fail("copy", e))?,
            ),
            _ => None,
        };
        p.nic_tx_bytes = nic_tx_bytes;
        p.carriers_up = carriers_up;
        p.disks = disks;
        self.ev.send(MigrationEvent::Progress(p)).await;
        Ok(())
    }

    /// copy, iterate and blackout, each said once as QEMU reaches it.
    async fn say_phases(&mut self, status: &str, ram: &crate::qmp::RamStats) {
        let w = self.watching();
        let (copy, iterate, blackout) = w.seen;
        if !copy && status == "active" {
            w.seen.0 = true;
            self.ev
                .step(
                    "copy",
                    format!("dirty tracking on; first pass over {} bytes", ram.total),
                )
                .await;
        }
        if !iterate && ram.dirty_sync_count > 1 {
            self.watching().seen.1 = true;
            self.ev
                .step(
                    "iterate",
                    "re-sending pages dirtied during the first pass".into(),
                )
                .await;
        }
        if !blackout && (status == "device" || status == "pre-switchover") {
            self.watching().seen.2 = true;
            self.ev
                .step(
                    "blackout",
                    "source paused; sending the last dirty pages and device state".into(),
                )
                .await;
        }
    }

    /// Whether QEMU's blackout was said (the Tick step says it otherwise).
    pub(super) fn blackout_seen(&self) -> bool {
        self.watch.as_ref().is_some_and(|w| w.seen.2)
    }

    /// A lost NIC: QEMU told the bandwidth it really has now, so the
    /// switch-over it plans still fits the downtime target.
    async fn carrier_loss(&mut self, carriers_up: Option<usize>, throughput: f64) {
        let w = self.watching();
        let (before, path_rate) = (w.carriers_up_seen, w.path_rate);
        if carriers_up.is_some() {
            w.carriers_up_seen = carriers_up;
        }
        let (Some(up), Some(before)) = (carriers_up, before) else {
            return;
        };
        // the rate over the last 2 s: a cut NIC can stop everything for a moment
        let rate = path_rate.max(throughput);
        if up >= before || rate <= 0.0 {
            return;
        }
        let now_bw = (rate * up as f64 / before as f64) as u64;
        if let Err(e) = self
            .vm
            .qmp
            .set_parameters(MigrationParameters {
                avail_switchover_bandwidth: Some(now_bw.max(1 << 20)),
                ..Default::default()
            })
            .await
        {
            // the switch-over would be planned on the old bandwidth: say so
            self.ev
                .send(MigrationEvent::Warning {
                    message: format!(
                        "QEMU refused the bandwidth left after a carrier loss: {}",
                        error_chain(&e)
                    ),
                })
                .await;
        }
        self.ev
            .send(MigrationEvent::Warning {
                message: format!(
                    "a carrier went down: {up} of {before} up; QEMU told to plan switch-over at {} MB/s",
                    now_bw >> 20
                ),
            })
            .await;
    }

    /// Pre-copy's progress event (without the NICs' bytes and the disks).
    fn precopy_progress(&mut self, info: &MigrationInfo, throughput: f64) -> MigrationProgress {
        let ram = info.ram.clone().unwrap_or_default();
        let page = if ram.page_size == 0 {
            4096
        } else {
            ram.page_size
        };
        let max_downtime_ms = self.chosen().conv.max_downtime_ms;
        let started = self.started;
        let w = self.watching();
        let (eta, converging) = if w.copy.pausing() {
            (convergence::drain_time(ram.remaining, w.path_rate), None)
        } else {
            w.rounds.observe(ram.dirty_sync_count, ram.remaining);
            match convergence::predict(
                ram.remaining,
                w.path_rate,
                (ram.dirty_pages_rate * page) as f64,
                w.rounds.ratio(),
                Duration::from_millis(max_downtime_ms),
            ) {
                Some(p) => (p.eta, Some(p.converging)),
                None => (None, None),
            }
        };
        MigrationProgress {
            elapsed_ms: started.elapsed().as_millis() as u64,
            status: info.status.clone().unwrap_or_default(),
            transferred: ram.transferred,
            remaining: ram.remaining,
            total: ram.total,
            throughput,
            dirty_rate: ram.dirty_pages_rate * page,
            rounds: ram.dirty_sync_count,
            expected_downtime_ms: info.expected_downtime,
            eta_ms: eta.map(|d| d.as_millis() as u64),
            converging,
            nic_tx_bytes: BTreeMap::new(),
            carriers_up: None,
            phase: if info.status.as_deref() == Some("device") {
                "blackout".into()
            } else if w.copy.pausing() {
                "pause-and-copy".into()
            } else {
                "precopy".into()
            },
            throttle_pct: info.cpu_throttle_percentage.unwrap_or(0),
            disks: None,
        }
    }
}

/// The longest wait between two looks at QEMU while the end is far: one
/// look per progress event. A look is a `query-migrate` (QEMU's reply,
/// ~1 KiB of JSON, decoded twice by the QMP stream) and the copy loop's
/// decision on it; at 100 ms they and their wake-ups were a sixth of the
/// source agent's CPU over a move, and far from the end nothing they
/// decide is urgent.
const FAR_LOOK: Duration = PROGRESS_EVERY;

/// When to look at QEMU next, after a look in pre-copy: every [`POLL`],
/// except on QEMU's one TCP stream while the end is far, where the wait
/// grows to half the time the copy needs to come within
/// [`END_NEAR_BYTES`] at `rate` (bytes left per second: the faster of
/// what went and what the bytes left fell by), up to [`FAR_LOOK`]. The end
/// is then still seen within one `POLL` of its start (the low-water mark
/// and the early READY), and QEMU's events end any wait. Ferry's carriers
/// and the MPTCP socket keep `POLL`: each look also watches their paths.
fn next_look(tcp: bool, status: &str, remaining: u64, rate: f64) -> Duration {
    if !tcp || status != "active" || remaining <= END_NEAR_BYTES || rate <= 0.0 {
        return POLL;
    }
    let to_near = (remaining - END_NEAR_BYTES) as f64 / rate;
    Duration::from_secs_f64(to_near / 2.0).clamp(POLL, FAR_LOOK)
}

/// The least time between two pre-copy progress events: the watch looks
/// at QEMU every 100 ms (less often while a TCP stream's end is far, see
/// [`next_look`]) and on each of its events, and an event per look
/// (each one serialized, written over TLS to every listener and forwarded
/// by the control service) cost the agents more than the looks themselves.
/// Two a second keep a progress bar moving; four, each after its own look
/// at QEMU, were most of the source agent's work between a move's start and
/// its end, and halving both took a fifth off the agents' CPU per move
/// (BENCHMARKS.md, "Two progress events a second").
const PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// Each stream's window over Ferry's carriers in the last pass, counted
/// expanded: what the windows hold when QEMU completes is loaded on the
/// target while the guest is paused. Over the move they are 4 MiB each
/// (`STREAM_WINDOW`): with QEMU's zstd inside and four multifd channels,
/// up to ~16 MiB of pages to decompress and load, tens of milliseconds
/// whenever the target's core is busy with anything else.
const END_STREAM_WINDOW: u64 = 1 << 20;

/// Remaining bytes below which QEMU's dialled stream keeps few unsent bytes:
/// the autotuned queue (megabytes) has drained well before QEMU completes
/// (16 MiB is ~130 ms of a 1 Gbit/s link, ~13 ms of 10 Gbit/s).
const LOWAT_FROM: u64 = 16 << 20;

/// QEMU's one TCP stream to `uri` (`tcp:ADDR:PORT`), dialled by the agent,
/// which keeps its own handle on the socket (see `Watch::dialled`).
fn dial_for_qemu(uri: &str) -> std::io::Result<std::net::TcpStream> {
    let addr: std::net::SocketAddr = uri
        .strip_prefix("tcp:")
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "not tcp:ADDR:PORT")
        })?;
    std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))
}

/// The URI QEMU migrates to and the connection step's text.
async fn stream_target(
    plan: &Plan,
    handoff: bool,
    multifd: bool,
    qemu_zstd: Option<u8>,
) -> (String, String) {
    match plan {
        Plan::Tcp { uri, nic, multifd } => {
            (
                uri.clone(),
                if *multifd {
                    format!("QEMU's own {MULTIFD_CHANNELS} multifd channels straight to {uri} over {nic}")
                } else {
                    format!("QEMU's TCP stream to {uri} over {nic}")
                },
            )
        }
        Plan::Multichannel { session, sock, .. } => {
            // carriers come up in the background; give them a moment so the
            // first frames do not all go to whichever dialled first (MPTCP
            // connections open as QEMU connects)
            let framed = matches!(session, ferry_transport::Carriers::Ferry(_));
            for _ in 0..if framed { 20 } else { 0 } {
                let st = session.stats();
                if st.healthy == st.carriers.len() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            let names: Vec<String> = session
                .stats()
                .carriers
                .iter()
                .map(|c| c.nic.clone())
                .collect();
            let how = if handoff {
                "QEMU's one stream written straight into an MPTCP socket the agents opened"
                    .to_string()
            } else if let Some(level) = qemu_zstd {
                format!("{MULTIFD_CHANNELS} multifd channels compressed by QEMU (zstd {level})")
            } else if multifd {
                format!("{MULTIFD_CHANNELS} multifd channels")
            } else {
                "QEMU's one stream (post-copy allowed)".to_string()
            };
            (
                format!("unix:{}", sock.display()),
                format!(
                    "Ferry transport ({}) over {} ({} up), {how}",
                    data_path_of(session),
                    names.join(", "),
                    session.stats().healthy,
                ),
            )
        }
    }
}

/// When the source's guest paused: when the agent saw QEMU's `device`
/// state (dated by its event), or else, QEMU having paused and completed
/// between two looks, its completion less its own `downtime` figure. The
/// completion is dated by QEMU's `completed` event, not by when the agent
/// got to it (`t_completed`): an agent woken late on a busy host would
/// otherwise date the pause late by as much, and let a given-up switch-over
/// run past its maximum by that.
fn pause_start(
    paused_at: Option<Instant>,
    seen: &crate::qmp::MigrationSeen,
    t_completed: Option<Instant>,
    downtime_ms: Option<u64>,
    now: Instant,
) -> Option<Instant> {
    paused_at.or_else(|| {
        let mut done = t_completed?;
        if seen.status == "completed" {
            done = done.min(seen.sent_instant(now));
        }
        done.checked_sub(Duration::from_millis(downtime_ms?))
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a panic is the failure report
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_pause_seen_only_by_its_completion_is_dated_by_qemus_event_not_the_late_look() {
        let now = Instant::now();
        let ms = Duration::from_millis;
        let completed = |ago: Duration| crate::qmp::MigrationSeen {
            count: 2,
            status: "completed".into(),
            sent: Some(std::time::SystemTime::now() - ago),
            stopped: None,
            resumed: None,
        };
        // the agent got to QEMU's completion 60 ms after QEMU sent it; QEMU
        // says the guest was paused 15 ms
        let late_look = now - ms(10);
        let start = pause_start(None, &completed(ms(70)), Some(late_look), Some(15), now).unwrap();
        let want = now - ms(85);
        let off = if start > want {
            start - want
        } else {
            want - start
        };
        assert!(off < ms(5), "dated {off:?} off the event's time");
        // the `device` state seen is kept as it was dated
        let seen_device = now - ms(40);
        assert_eq!(
            pause_start(
                Some(seen_device),
                &completed(ms(70)),
                Some(late_look),
                Some(15),
                now
            ),
            Some(seen_device)
        );
        // no completion event last (a newer one): the look's own time
        let other = crate::qmp::MigrationSeen {
            status: "cancelled".into(),
            ..completed(ms(70))
        };
        assert_eq!(
            pause_start(None, &other, Some(late_look), Some(15), now),
            Some(late_look - ms(15))
        );
        // an event stamped after the look (a clock step) never dates it later
        assert_eq!(
            pause_start(
                None,
                &completed(Duration::ZERO),
                Some(late_look),
                Some(15),
                now
            ),
            Some(late_look - ms(15))
        );
    }

    #[test]
    fn looks_at_qemu_thin_out_only_on_one_tcp_stream_far_from_its_end() {
        // bytes per second
        let gbit = 125e6;
        // 400 MiB left at 1 Gbit/s: ~2.8 s to the end's start, one look a progress event
        assert_eq!(next_look(true, "active", 400 << 20, gbit), FAR_LOOK);
        // 80 MiB left: the end (64 MiB) is ~134 ms away, half of it is below POLL
        assert_eq!(next_look(true, "active", 80 << 20, gbit), POLL);
        // 100 MiB left: ~302 ms away, looked at again in half of that
        let w = next_look(true, "active", 100 << 20, gbit);
        assert!(w > POLL && w < FAR_LOOK, "{w:?}");
        assert_eq!(next_look(true, "active", END_NEAR_BYTES, gbit), POLL);
        // the carriers' paths, another state, no throughput yet: every POLL
        assert_eq!(next_look(false, "active", 400 << 20, gbit), POLL);
        assert_eq!(next_look(true, "setup", 400 << 20, gbit), POLL);
        assert_eq!(next_look(true, "device", 400 << 20, gbit), POLL);
        assert_eq!(next_look(true, "active", 400 << 20, 0.0), POLL);
    }

    #[test]
    fn only_a_tcp_uri_is_dialled_and_its_unsent_bytes_can_be_cut() {
        for bad in [
            "exec:cat /etc/shadow",
            "unix:/run/x.sock",
            "tcp:nowhere",
            "tcp:1.2.3.4",
        ] {
            let e = dial_for_qemu(bad).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{bad}: {e}");
        }
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = dial_for_qemu(&format!("tcp:{}", l.local_addr().unwrap())).unwrap();
        let (peer, _) = l.accept().unwrap();
        assert_eq!(peer.peer_addr().unwrap(), s.local_addr().unwrap());
        // what the watch sets near the end, as the kernel then has it
        let want = ferry_transport::session::NOTSENT_LOWAT;
        assert!(ferry_transport::session::set_notsent_lowat(
            s.as_raw_fd(),
            want
        ));
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: `s` is an open socket; `v` and `len` outlive the call.
        let rc = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_NOTSENT_LOWAT,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0);
        assert_eq!(v as usize, want);
    }
}
