//! Where a session's tasks run.
//!
//! A session's carriers, streams and their relays wake for every frame; an
//! agent's control plane (its API, heartbeats, the steps of a move) wakes a
//! few times a second. An agent gives the relays a runtime of their own
//! ([`set_runtime`]) with a worker per core, and keeps its control plane on
//! one thread, so that the control plane's wake-ups are not handed between
//! cores and the relays keep every core. Without a runtime set (tests, the
//! CLI), sessions run on the caller's.

use std::future::Future;
use std::sync::OnceLock;

use tokio::runtime::Handle;

static RELAYS: OnceLock<Handle> = OnceLock::new();

/// Every session started from now on runs its tasks (and registers its
/// sockets) on `handle`'s runtime. Once per process: `false` if a runtime
/// was already set (the first one stays).
pub fn set_runtime(handle: Handle) -> bool {
    RELAYS.set(handle).is_ok()
}

/// Runs `fut` on the relays' runtime (the caller's where none was set) and
/// waits for its output; an error only if that runtime is shutting down. A
/// panic in `fut` goes on in the caller.
pub(crate) async fn run<T, F>(fut: F) -> std::io::Result<T>
where
    T: Send + 'static,
    F: Future<Output = T> + Send + 'static,
{
    let Some(h) = RELAYS.get() else {
        return Ok(fut.await);
    };
    match h.spawn(fut).await {
        Ok(v) => Ok(v),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(std::io::Error::other(e.to_string())),
    }
}
