//! Storage QoS, a layer of its own between the NBD connections and the disk
//! files: every request is admitted by the [`Scheduler`] before it touches a
//! file, and the scheduler alone decides the order.
//!
//! - [`mclock`]: the tag scheduler itself, pure and clock-free.
//! - [`Scheduler`]: the async wrapper — admission futures, the wake-up timer
//!   for limited pools, and per-flow counters for the status of flows.
//!
//! Allocations come from outside: the storage service binds each flow to a
//! pool from its disk's policy, and the cluster-wide policy manager can set
//! per-flow allocations that override it.

pub mod mclock;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tokio::sync::oneshot;

pub use mclock::{Config, FlowId, Params};
use mclock::{Core, Decision, ReqId};

/// Counters of one flow since it was registered; rates are taken by
/// differencing two samples.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counters {
    /// Normalized I/Os completed.
    pub ios: f64,
    pub bytes: u64,
    /// Sum of queue + service time of completed requests, seconds.
    pub latency: f64,
    pub completed: u64,
    /// Normalized I/Os that arrived.
    pub arrived: f64,
    /// Seconds during which the flow had requests waiting in the scheduler.
    pub backlogged: f64,
}

struct State {
    core: Core,
    waiters: HashMap<ReqId, oneshot::Sender<()>>,
    counters: HashMap<FlowId, Counters>,
    /// When each flow last changed between idle and backlogged, and whether
    /// it is backlogged now.
    backlog_since: HashMap<FlowId, Instant>,
    timer_at: Option<f64>,
}

/// The async front of the tag scheduler, shared by every connection of a
/// storage node.
pub struct Scheduler {
    state: Mutex<State>,
    origin: Instant,
}

/// A queued request: its permit once the scheduler dispatches it.
pub struct Ticket {
    rx: oneshot::Receiver<()>,
    /// Held back until dispatch (a permit frees a slot when dropped).
    permit: Option<Permit>,
}

impl Ticket {
    fn live(&mut self) -> Option<Permit> {
        self.permit.take().map(|mut p| {
            p.live = true;
            p
        })
    }

    /// The permit, if the request was dispatched already.
    pub fn ready(&mut self) -> Option<Permit> {
        match self.rx.try_recv() {
            Ok(()) => self.live(),
            Err(_) => None,
        }
    }

    /// Waits for dispatch; `None` if the flow was removed meanwhile.
    pub async fn wait(mut self) -> Option<Permit> {
        match (&mut self.rx).await {
            Ok(()) => self.live(),
            Err(_) => None,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // dispatched but never taken: free its slot (a request still queued
        // frees its own when the scheduler finds its waiter gone)
        if self.permit.is_some() && self.rx.try_recv().is_ok() {
            drop(self.live());
        }
    }
}

/// A dispatched request's slot at the device; dropping it frees the slot.
pub struct Permit {
    /// Dispatched: dropping it frees a slot and counts the I/O.
    live: bool,
    sched: Arc<Scheduler>,
    flow: FlowId,
    cost: f64,
    bytes: u64,
    arrived: Instant,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.live {
            return;
        }
        let mut st = self.sched.lock();
        st.core.complete();
        let c = st.counters.entry(self.flow).or_default();
        c.ios += self.cost;
        c.bytes += self.bytes;
        c.latency += self.arrived.elapsed().as_secs_f64();
        c.completed += 1;
        Scheduler::pump(&self.sched, &mut st);
    }
}

impl Scheduler {
    pub fn new(cfg: Config) -> Arc<Scheduler> {
        Arc::new(Scheduler {
            state: Mutex::new(State {
                core: Core::new(cfg),
                waiters: HashMap::new(),
                counters: HashMap::new(),
                backlog_since: HashMap::new(),
                timer_at: None,
            }),
            origin: Instant::now(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        ferry_api::util::lock(&self.state)
    }

    fn now(&self) -> f64 {
        self.origin.elapsed().as_secs_f64()
    }

    pub fn config(&self) -> Config {
        self.lock().core.cfg
    }

    /// Changes the configuration (normalization, capacity, slots).
    pub fn set_config(self: &Arc<Self>, cfg: Config) {
        let mut st = self.lock();
        st.core.cfg = cfg;
        Self::pump(self, &mut st);
    }

    /// Puts `flow` in `pool` with `params`; applies to queued requests at once.
    pub fn bind(self: &Arc<Self>, flow: FlowId, pool: &str, params: Params) {
        let mut st = self.lock();
        st.core.bind(flow, pool, params);
        st.counters.entry(flow).or_default();
        Self::pump(self, &mut st);
    }

    /// Forgets `flow`; its waiting requests fail their admission.
    pub fn remove(self: &Arc<Self>, flow: FlowId) {
        let mut st = self.lock();
        for r in st.core.remove(flow) {
            st.waiters.remove(&r);
        }
        st.counters.remove(&flow);
        st.backlog_since.remove(&flow);
        Self::pump(self, &mut st);
    }

    pub fn counters(&self, flow: FlowId) -> Counters {
        let st = self.lock();
        let mut c = st.counters.get(&flow).copied().unwrap_or_default();
        if let Some(since) = st.backlog_since.get(&flow) {
            c.backlogged += since.elapsed().as_secs_f64();
        }
        c
    }

    /// Queues a request of `bytes` for `flow`; the ticket says whether it was
    /// dispatched at once ([`Ticket::ready`]) or waits for it ([`Ticket::wait`]).
    pub fn request(self: &Arc<Self>, flow: FlowId, bytes: u64) -> Ticket {
        let arrived = Instant::now();
        let (tx, rx) = oneshot::channel();
        let mut st = self.lock();
        let now = self.now();
        let req = st.core.enqueue(flow, bytes, now);
        st.waiters.insert(req, tx);
        let cost = st.core.cost(bytes);
        st.counters.entry(flow).or_default().arrived += cost;
        if st.core.queued(flow) == 1 {
            st.backlog_since.insert(flow, arrived);
        }
        Self::pump(self, &mut st);
        Ticket {
            rx,
            permit: Some(Permit {
                live: false,
                sched: self.clone(),
                flow,
                cost,
                bytes,
                arrived,
            }),
        }
    }

    /// Waits until the scheduler dispatches a request of `bytes` for `flow`.
    /// `None` if the flow was removed meanwhile.
    pub async fn admit(self: &Arc<Self>, flow: FlowId, bytes: u64) -> Option<Permit> {
        self.request(flow, bytes).wait().await
    }

    /// Dispatches every eligible request; arms the timer when requests wait
    /// on limits.
    fn pump(this: &Arc<Self>, st: &mut State) {
        loop {
            let now = this.now();
            match st.core.next(now) {
                Decision::Dispatch { req, flow } => {
                    if st.core.queued(flow) == 0 {
                        if let Some(since) = st.backlog_since.remove(&flow) {
                            let c = st.counters.entry(flow).or_default();
                            c.backlogged += since.elapsed().as_secs_f64();
                        }
                    }
                    match st.waiters.remove(&req) {
                        Some(tx) => {
                            if tx.send(()).is_err() {
                                // the connection went away: free the slot
                                st.core.complete();
                            }
                        }
                        None => st.core.complete(),
                    }
                }
                Decision::WaitUntil(t) => {
                    if st.timer_at.is_none_or(|at| t < at) {
                        st.timer_at = Some(t);
                        let s = this.clone();
                        let delay = std::time::Duration::from_secs_f64((t - now).max(0.0));
                        tokio::spawn(async move {
                            tokio::time::sleep(delay).await;
                            let mut st = s.lock();
                            if st.timer_at == Some(t) {
                                st.timer_at = None;
                            }
                            Self::pump(&s, &mut st);
                        });
                    }
                    return;
                }
                Decision::Idle => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_capped_flow_runs_at_its_cap_in_real_time() {
        let s = Scheduler::new(Config::default());
        s.bind(
            1,
            "f1",
            Params {
                max_iops: 400.0,
                ..Default::default()
            },
        );
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                let mut n = 0u32;
                while t0.elapsed().as_secs_f64() < 1.0 {
                    let _p = s.admit(1, 4096).await.unwrap();
                    n += 1;
                }
                n
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += t.await.unwrap();
        }
        let rate = total as f64 / t0.elapsed().as_secs_f64();
        assert!((rate - 400.0).abs() < 40.0, "{rate}");
        let c = s.counters(1);
        assert_eq!(c.completed, total as u64);
        assert!(c.backlogged > 0.5, "{c:?}");
    }

    #[tokio::test]
    async fn removing_a_flow_fails_its_waiters() {
        let s = Scheduler::new(Config::default());
        s.bind(
            1,
            "f1",
            Params {
                max_iops: 1.0,
                ..Default::default()
            },
        );
        let first = s.admit(1, 4096).await;
        assert!(first.is_some());
        let s2 = s.clone();
        let waiter = tokio::spawn(async move { s2.admit(1, 4096).await.is_none() });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        s.remove(1);
        assert!(waiter.await.unwrap());
    }
}
