//! Migrations and drains as operations.
//!
//! Each runs in its own task, from the agent's (or the scheduler's) event
//! stream to its end, and keeps every event it sent. Any client follows one
//! by its id: the one that started it (its response streams the events), and
//! any other — the web console's migration and drain pages
//! (`GET /watch/operations/{id}`), a second terminal, a page reloaded halfway.
//! A client that hangs up stops following, never the work. The newest
//! [`KEEP`] operations are kept in memory by the instance that runs them,
//! and in the control state (cluster keys `operation/ID`, each with its
//! last [`STORED_EVENTS`] events, written when its state changes and at most
//! once a second while it runs): any control instance lists and shows them,
//! a restarted one too. An operation another instance runs is shown as it
//! was last written; following it streams what was written and ends.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use ferry_api::util::lock;

use crate::store::Store;
use ferry_api::{Operation, OperationKind, OperationState};
use futures::stream::{BoxStream, StreamExt};

/// How many operations are kept, running or ended.
pub const KEEP: usize = 64;
/// Events of an operation the store keeps (its last ones; the result is last).
pub const STORED_EVENTS: usize = 64;
/// The store's keys of operations start so.
const PREFIX: &str = "operation/";
/// A running operation is written to the store at most this often.
const SAVE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Events an operation keeps whole; past them, a progress event replaces
/// the progress event before it (a drain of many guests over slow links
/// sends one every half second per move), so a kept operation stays small.
pub const MAX_EVENTS: usize = 4096;

fn is_progress(ev: &serde_json::Value) -> bool {
    ev.get("event").and_then(|e| e.as_str()) == Some("progress")
}

/// One operation and a signal for its followers.
pub struct Op {
    data: Mutex<Operation>,
    /// Sent after every event and at the end.
    changed: tokio::sync::watch::Sender<()>,
    /// Read from the store: run by another instance (or before a restart).
    stored: bool,
}

/// Reads an event: whether it ends the operation, and how.
pub type EndOf = fn(&serde_json::Value) -> Option<OperationState>;

impl Op {
    pub fn id(&self) -> String {
        lock(&self.data).id.clone()
    }

    /// The operation with its events so far.
    pub fn snapshot(&self) -> Operation {
        lock(&self.data).clone()
    }

    fn summary(&self) -> Operation {
        let d = lock(&self.data);
        Operation {
            events: Vec::new(),
            ..d.clone()
        }
    }

    fn push(&self, ev: serde_json::Value, end_of: EndOf) {
        let mut d = lock(&self.data);
        if d.state == OperationState::Running {
            if let Some(end) = end_of(&ev) {
                d.state = end;
                d.ended_ms = Some(ferry_api::util::now_ms());
            }
        }
        let thin = d.events.len() >= MAX_EVENTS
            && is_progress(&ev)
            && d.events.last().is_some_and(is_progress);
        if thin {
            if let Some(last) = d.events.last_mut() {
                *last = ev;
            }
        } else {
            d.events.push(ev);
        }
        d.event_count = d.events.len();
        self.changed.send_replace(());
    }

    /// The stream ended: an operation that sent no result failed.
    fn finish(&self) {
        let mut d = lock(&self.data);
        if d.state == OperationState::Running {
            d.state = OperationState::Failed;
            d.ended_ms = Some(ferry_api::util::now_ms());
        }
        self.changed.send_replace(());
    }

    /// Its events from the `from`-th on, waiting for each, until it ends.
    pub fn follow(self: Arc<Self>, from: usize) -> BoxStream<'static, serde_json::Value> {
        futures::stream::unfold((self, from), |(op, i)| async move {
            loop {
                // subscribed under the lock an event is pushed under: either
                // the event is seen here or its signal reaches `rx`
                let mut rx = {
                    let d = lock(&op.data);
                    if let Some(ev) = d.events.get(i) {
                        return Some((ev.clone(), (op.clone(), i + 1)));
                    }
                    if d.state != OperationState::Running || op.stored {
                        return None;
                    }
                    op.changed.subscribe()
                };
                if rx.changed().await.is_err() {
                    return None;
                }
            }
        })
        .boxed()
    }
}

/// The operations kept, newest last.
#[derive(Default)]
pub struct Operations {
    ops: Mutex<VecDeque<Arc<Op>>>,
    next: std::sync::atomic::AtomicU64,
    /// Where they are written for every instance (see the module's text).
    store: std::sync::OnceLock<Arc<Store>>,
}

/// What the store keeps of `op`: its last [`STORED_EVENTS`] events.
fn stored(op: &Op) -> Operation {
    let mut o = op.snapshot();
    let cut = o.events.len().saturating_sub(STORED_EVENTS);
    o.events.drain(..cut);
    o
}

async fn save(store: &Store, op: &Op) {
    let o = stored(op);
    if let Err(e) = store.put_cluster(&format!("{PREFIX}{}", o.id), &o).await {
        tracing::warn!("operation {}: {e}", o.id);
    }
}

/// Drops the oldest ended operations from the store past [`KEEP`].
async fn prune(store: &Store) -> Result<(), ferry_api::ApiError> {
    let mut all: Vec<(String, Operation)> = store
        .cluster_under(PREFIX)
        .await?
        .into_iter()
        .filter_map(|(k, v)| Some((k, serde_json::from_str(&v).ok()?)))
        .collect();
    if all.len() <= KEEP {
        return Ok(());
    }
    all.sort_by_key(|(_, o)| o.started_ms);
    let mut extra = all.len() - KEEP;
    for (k, o) in &all {
        if extra == 0 {
            break;
        }
        if o.state != OperationState::Running {
            store.delete_cluster(k).await?;
            extra -= 1;
        }
    }
    Ok(())
}

/// What an operation is, before it starts.
pub struct Start {
    pub kind: OperationKind,
    pub subject: String,
    pub source: String,
    pub target: Option<String>,
    pub by: String,
}

impl Operations {
    /// Writes the operations to `store` as well, and reads there those this
    /// instance does not run.
    pub fn keep_in(&self, store: Arc<Store>) {
        let _ = self.store.set(store);
    }

    /// Runs `events` to its end in its own task, keeping each (after
    /// `each` has seen it: metrics, the event log).
    pub fn start(
        &self,
        s: Start,
        mut events: BoxStream<'static, serde_json::Value>,
        end_of: EndOf,
    ) -> Arc<Op> {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let started_ms = ferry_api::util::now_ms();
        let kind = match s.kind {
            OperationKind::Migration => "migration",
            OperationKind::Drain => "drain",
        };
        let op = Arc::new(Op {
            data: Mutex::new(Operation {
                // unique across restarts of the control service (its start
                // time) and across instances (a random tail)
                id: format!("{kind}-{started_ms}-{n}-{:04x}", rand::random::<u16>()),
                kind: s.kind,
                subject: s.subject,
                source: s.source,
                target: s.target,
                by: s.by,
                started_ms,
                ended_ms: None,
                state: OperationState::Running,
                event_count: 0,
                events: Vec::new(),
            }),
            changed: tokio::sync::watch::channel(()).0,
            stored: false,
        });
        {
            let mut ops = lock(&self.ops);
            ops.push_back(op.clone());
            // the oldest ended ones make room; running ones are never dropped
            while ops.len() > KEEP {
                let Some(i) = ops
                    .iter()
                    .position(|o| lock(&o.data).state != OperationState::Running)
                else {
                    break;
                };
                ops.remove(i);
            }
        }
        let runner = op.clone();
        let store = self.store.get().cloned();
        tokio::spawn(async move {
            let mut saved: Option<(std::time::Instant, OperationState)> = None;
            if let Some(st) = &store {
                save(st, &runner).await;
                saved = Some((std::time::Instant::now(), OperationState::Running));
            }
            while let Some(ev) = events.next().await {
                runner.push(ev, end_of);
                if let (Some(st), Some((at, state))) = (&store, saved) {
                    let now = lock(&runner.data).state;
                    if now != state || at.elapsed() >= SAVE_EVERY {
                        save(st, &runner).await;
                        saved = Some((std::time::Instant::now(), now));
                    }
                }
            }
            runner.finish();
            if let Some(st) = &store {
                save(st, &runner).await;
                if let Err(e) = prune(st).await {
                    tracing::warn!("operations: {e}");
                }
            }
        });
        op
    }

    /// Every operation kept here or in the store, newest first, without
    /// their events.
    pub async fn list(&self) -> Vec<Operation> {
        let mut out: Vec<Operation> = lock(&self.ops).iter().rev().map(|o| o.summary()).collect();
        if let Some(st) = self.store.get() {
            match st.cluster_under(PREFIX).await {
                Ok(kv) => {
                    for (_, v) in kv {
                        let Ok(mut o) = serde_json::from_str::<Operation>(&v) else {
                            continue;
                        };
                        if !out.iter().any(|x| x.id == o.id) {
                            o.events.clear();
                            out.push(o);
                        }
                    }
                }
                Err(e) => tracing::warn!("operations: {e}"),
            }
        }
        // stable: this instance's own in the order they started
        out.sort_by_key(|o| std::cmp::Reverse(o.started_ms));
        out.truncate(KEEP.max(lock(&self.ops).len()));
        out
    }

    pub async fn get(&self, id: &str) -> Result<Arc<Op>, ferry_api::ApiError> {
        let here = lock(&self.ops)
            .iter()
            .find(|o| lock(&o.data).id == id)
            .cloned();
        if let Some(op) = here {
            return Ok(op);
        }
        let missing = || ferry_api::ApiError::not_found("operation", id);
        let st = self.store.get().ok_or_else(missing)?;
        let key = format!("{PREFIX}{id}");
        let o: Operation = st.cluster(&key).await?.ok_or_else(missing)?;
        Ok(Arc::new(Op {
            data: Mutex::new(o),
            changed: tokio::sync::watch::channel(()).0,
            stored: true,
        }))
    }
}

/// A migration ends with `completed` or `failed`.
pub fn migration_end(ev: &serde_json::Value) -> Option<OperationState> {
    match ev.get("event").and_then(|e| e.as_str()) {
        Some("completed") => Some(OperationState::Completed),
        Some("failed") => Some(OperationState::Failed),
        _ => None,
    }
}

/// A drain ends with `done`.
pub fn drain_end(ev: &serde_json::Value) -> Option<OperationState> {
    (ev.get("event").and_then(|e| e.as_str()) == Some("done")).then_some(OperationState::Completed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn start(ops: &Operations, events: Vec<serde_json::Value>) -> Arc<Op> {
        ops.start(
            Start {
                kind: OperationKind::Migration,
                subject: "vm1".into(),
                source: "h1".into(),
                target: Some("h2".into()),
                by: "admin".into(),
            },
            futures::stream::iter(events).boxed(),
            migration_end,
        )
    }

    #[tokio::test]
    async fn a_follower_that_joins_late_gets_every_event_and_the_end() {
        let ops = Operations::default();
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let op = ops.start(
            Start {
                kind: OperationKind::Drain,
                subject: "h1".into(),
                source: "h1".into(),
                target: None,
                by: "op".into(),
            },
            rx.boxed(),
            drain_end,
        );
        tx.unbounded_send(json!({"event": "plan"})).unwrap();
        let first = op.clone().follow(0);
        tx.unbounded_send(json!({"event": "started"})).unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        // a second follower joins halfway: it reads from the start all the same
        let second = op.clone().follow(0);
        tx.unbounded_send(json!({"event": "done"})).unwrap();
        let a: Vec<_> = first.collect().await;
        let b: Vec<_> = second.collect().await;
        assert_eq!(a.len(), 3);
        assert_eq!(a, b);
        let s = op.snapshot();
        assert_eq!(s.state, OperationState::Completed);
        assert_eq!(s.event_count, 3);
        assert!(s.ended_ms.is_some());
        // events after the end are kept, the state stays
        drop(tx);
        assert_eq!(
            ops.list().await[0].events.len(),
            0,
            "the list leaves events out"
        );
    }

    #[tokio::test]
    async fn a_stream_that_ends_without_a_result_failed() {
        let ops = Operations::default();
        let op = start(&ops, vec![json!({"event": "progress"})]);
        let evs: Vec<_> = op.clone().follow(0).collect().await;
        assert_eq!(evs.len(), 1);
        assert_eq!(op.snapshot().state, OperationState::Failed);
        let op = start(&ops, vec![json!({"event": "failed", "error": {}})]);
        let _: Vec<_> = op.clone().follow(0).collect().await;
        assert_eq!(op.snapshot().state, OperationState::Failed);
        let op = start(&ops, vec![json!({"event": "completed"})]);
        let _: Vec<_> = op.clone().follow(0).collect().await;
        assert_eq!(op.snapshot().state, OperationState::Completed);
        assert!(matches!(
            ops.get("nothing").await,
            Err(ferry_api::ApiError::NotFound { .. })
        ));
    }

    #[tokio::test]
    async fn a_long_operation_keeps_its_steps_and_thins_its_progress() {
        let ops = Operations::default();
        let mut evs: Vec<_> = (0..MAX_EVENTS)
            .map(|i| json!({"event": "progress", "n": i}))
            .collect();
        for i in 0..1000 {
            evs.push(json!({"event": "progress", "n": MAX_EVENTS + i}));
            if i % 100 == 0 {
                evs.push(json!({"event": "step", "n": i}));
            }
        }
        evs.push(json!({"event": "completed"}));
        let op = start(&ops, evs);
        let seen: Vec<_> = op.clone().follow(0).collect().await;
        let s = op.snapshot();
        assert_eq!(s.state, OperationState::Completed);
        // every step and the end kept, progress between them one each
        assert_eq!(seen.iter().filter(|e| e["event"] == "step").count(), 10);
        assert!(s.events.len() <= MAX_EVENTS + 21, "{}", s.events.len());
        assert_eq!(s.events.last().unwrap()["event"], "completed");
        assert_eq!(s.events[s.events.len() - 2]["n"], MAX_EVENTS + 999);
    }

    #[tokio::test]
    async fn the_oldest_ended_operations_make_room() {
        let ops = Operations::default();
        let mut ids = Vec::new();
        for _ in 0..KEEP + 5 {
            let op = start(&ops, vec![json!({"event": "completed"})]);
            let _: Vec<_> = op.clone().follow(0).collect().await;
            ids.push(op.id());
        }
        let kept = ops.list().await;
        assert_eq!(kept.len(), KEEP);
        assert_eq!(kept[0].id, *ids.last().unwrap(), "newest first");
        assert!(ops.get(&ids[0]).await.is_err());
        assert!(ops.get(&ids[5]).await.is_ok());
    }

    #[tokio::test]
    async fn another_instance_on_the_store_lists_and_shows_an_operation() {
        let store = Arc::new(Store::in_memory());
        let (a, b) = (Operations::default(), Operations::default());
        a.keep_in(store.clone());
        b.keep_in(store.clone());
        let evs: Vec<_> = (0..STORED_EVENTS + 10)
            .map(|i| json!({"event": "progress", "n": i}))
            .chain([json!({"event": "completed"})])
            .collect();
        let op = start(&a, evs);
        let _: Vec<_> = op.clone().follow(0).collect().await;
        // written once it ended
        let t0 = std::time::Instant::now();
        let seen = loop {
            if let Ok(o) = b.get(&op.id()).await {
                if o.snapshot().state == OperationState::Completed {
                    break o;
                }
            }
            assert!(t0.elapsed() < std::time::Duration::from_secs(5));
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        };
        let s = seen.snapshot();
        assert_eq!(s.events.len(), STORED_EVENTS, "the last events are kept");
        assert_eq!(s.events.last().unwrap()["event"], "completed");
        assert_eq!(s.event_count, STORED_EVENTS + 11);
        // followed from another instance: what was written, then the end
        let streamed: Vec<_> = seen.follow(0).collect().await;
        assert_eq!(streamed.len(), STORED_EVENTS);
        assert_eq!(b.list().await[0].id, op.id());
    }
}
