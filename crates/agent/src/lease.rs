//! The agent's HA lease (see `ferry_api::ha`), and self-fencing.
//!
//! The control service renews the lease every second (`PUT /lease`), naming
//! the VMs it would restart elsewhere. When no renewal came for the
//! self-fence deadline, this agent stops those VMs' QEMUs itself: a host
//! cut off from the control service is empty of HA guests before the
//! cluster restarts them anywhere else, and says so to peers that probe it
//! over the migration fabrics (`FERRY-ALIVE`, see [`crate::probe`]).
//!
//! The fencing itself is [`crate::fence`]'s.
//!
//! The lease survives an agent restart: a renewal writes its deadline (wall
//! clock) and VMs to `STATE_DIR/lease.json`, and a restarted agent takes
//! them up, so a restart neither forgets a deadline nor fences early. A
//! renewal that changes nothing but the deadline sets the file's
//! modification time to its own instant instead (one `utimensat`, no new
//! file); the deadline taken up is the later of the one written and that
//! instant plus the self-fence time.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_api::ha::{LeaseRenewal, LeaseState};
use ferry_api::util::{lock, now_ms};
use serde::{Deserialize, Serialize};

/// What the probe responder says of this host (see [`crate::probe`]).
pub const UNLEASED: u8 = 0;
pub const LEASED: u8 = 1;
pub const FENCED: u8 = 2;

pub fn state_name(s: u8) -> &'static str {
    match s {
        LEASED => "leased",
        FENCED => "fenced",
        _ => "unleased",
    }
}

/// How long a lapse that peers held (the cluster still renews without
/// this host) waits before they are asked again.
const HELD_FOR: Duration = Duration::from_secs(2);

/// The lease as written to `lease.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct Persisted {
    /// When the agent fences itself (Unix ms).
    fence_at_ms: u64,
    self_fence_ms: u64,
    ha_vms: Vec<String>,
    #[serde(default)]
    peers: Vec<ferry_api::ha::PeerAddresses>,
}

struct Inner {
    renewed: Option<Instant>,
    self_fence: Duration,
    ha_vms: Vec<String>,
    fenced_vms: Vec<String>,
    peers: Vec<ferry_api::ha::PeerAddresses>,
    /// When peers were last asked at a lapse that was held.
    held: Option<Instant>,
    /// What `lease.json` holds, as last written or taken up.
    persisted: Option<Persisted>,
}

impl Persisted {
    /// The same lease but for its deadline.
    fn same_but_deadline(&self, other: &Persisted) -> bool {
        (self.self_fence_ms, &self.ha_vms, &self.peers)
            == (other.self_fence_ms, &other.ha_vms, &other.peers)
    }
}

/// Sets `file`'s modification time to `at_ms` (Unix ms), the file itself
/// untouched.
fn set_mtime(file: &std::path::Path, at_ms: u64) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt as _;
    let path = std::ffi::CString::new(file.as_os_str().as_bytes())?;
    let at = libc::timespec {
        tv_sec: (at_ms / 1000) as libc::time_t,
        tv_nsec: ((at_ms % 1000) * 1_000_000) as libc::c_long,
    };
    let omit = libc::timespec {
        tv_sec: 0,
        tv_nsec: libc::UTIME_OMIT,
    };
    // SAFETY: `path` is NUL-terminated and both timespecs live across the call.
    let r = unsafe { libc::utimensat(libc::AT_FDCWD, path.as_ptr(), [omit, at].as_ptr(), 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// `file`'s modification time, Unix ms.
fn mtime_ms(file: &std::path::Path) -> Option<u64> {
    let t = std::fs::metadata(file).ok()?.modified().ok()?;
    Some(t.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis() as u64)
}

pub struct Lease {
    inner: Mutex<Inner>,
    /// Shared with the probe responder's thread.
    pub state: Arc<AtomicU8>,
    file: PathBuf,
    /// Woken by each renewal, so the fence watch sleeps on a deadline that
    /// is never older than the last renewal (see [`Lease::until_due`]).
    pub(crate) renewed: tokio::sync::Notify,
}

impl Lease {
    /// The lease left by an earlier agent in `state_dir`, if any.
    pub fn load(state_dir: &std::path::Path) -> Lease {
        let file = state_dir.join("lease.json");
        let found: Option<Persisted> = std::fs::read(&file)
            .ok()
            .and_then(|b| serde_json::from_slice::<Persisted>(&b).ok())
            .map(|mut p| {
                // renewals that changed nothing else set the file's time
                if let Some(m) = mtime_ms(&file) {
                    p.fence_at_ms = p.fence_at_ms.max(m + p.self_fence_ms);
                }
                p
            });
        let mut inner = Inner {
            renewed: None,
            self_fence: Duration::from_millis(ferry_api::ha::SELF_FENCE_MS),
            ha_vms: Vec::new(),
            fenced_vms: Vec::new(),
            peers: Vec::new(),
            held: None,
            persisted: None,
        };
        let state = Arc::new(AtomicU8::new(UNLEASED));
        if let Some(p) = found {
            // the deadline carried over: as if renewed that long before it
            let left = p.fence_at_ms.saturating_sub(now_ms());
            let elapsed = p.self_fence_ms.saturating_sub(left);
            inner.renewed = Instant::now().checked_sub(Duration::from_millis(elapsed));
            inner.self_fence = Duration::from_millis(p.self_fence_ms);
            inner.ha_vms = p.ha_vms.clone();
            inner.peers = p.peers.clone();
            inner.persisted = Some(p);
            state.store(LEASED, Ordering::SeqCst);
            tracing::info!(left_ms = left, "HA lease taken up from the last agent");
        }
        Lease {
            inner: Mutex::new(inner),
            state,
            file,
            renewed: tokio::sync::Notify::new(),
        }
    }

    pub fn renew(&self, r: &LeaseRenewal) {
        let mut g = lock(&self.inner);
        g.renewed = Some(Instant::now());
        g.self_fence = Duration::from_millis(r.self_fence_ms);
        g.ha_vms = r.ha_vms.clone();
        g.peers = r.peers.clone();
        g.held = None;
        let was = self.state.swap(LEASED, Ordering::SeqCst);
        if was == FENCED {
            tracing::info!("HA lease renewed again after a self-fence");
        }
        let p = Persisted {
            fence_at_ms: now_ms() + r.self_fence_ms,
            self_fence_ms: r.self_fence_ms,
            ha_vms: r.ha_vms.clone(),
            peers: r.peers.clone(),
        };
        let unchanged = g
            .persisted
            .as_ref()
            .is_some_and(|old| old.same_but_deadline(&p));
        g.persisted = Some(p.clone());
        drop(g);
        self.renewed.notify_one();
        // the file's time is the renewal's instant; a missing file is written
        if unchanged && set_mtime(&self.file, p.fence_at_ms - p.self_fence_ms).is_ok() {
            return;
        }
        if let Ok(b) = serde_json::to_vec(&p) {
            let tmp = self.file.with_extension("json.tmp");
            if std::fs::write(&tmp, b)
                .and_then(|_| std::fs::rename(&tmp, &self.file))
                .is_err()
            {
                tracing::warn!(file = %self.file.display(), "cannot write the HA lease");
            }
        }
    }

    pub fn view(&self) -> LeaseState {
        let g = lock(&self.inner);
        LeaseState {
            state: state_name(self.state.load(Ordering::SeqCst)).into(),
            since_renewal_ms: g.renewed.map(|t| t.elapsed().as_millis() as u64),
            fenced_vms: g.fenced_vms.clone(),
        }
    }

    /// The HA VMs to stop and the peers to ask first, when the deadline
    /// has passed (once per lapse; a held lapse is asked again every 2 s).
    pub(crate) fn due(&self) -> Option<(Vec<String>, Vec<ferry_api::ha::PeerAddresses>)> {
        let mut g = lock(&self.inner);
        if self.state.load(Ordering::SeqCst) != LEASED {
            return None;
        }
        let renewed = g.renewed?;
        if renewed.elapsed() < g.self_fence {
            return None;
        }
        if g.held.is_some_and(|t| t.elapsed() < HELD_FOR) {
            return None;
        }
        g.held = Some(Instant::now());
        Some((g.ha_vms.clone(), g.peers.clone()))
    }

    /// How long until [`Lease::due`] may next say yes: the self-fence
    /// deadline (or the end of a held lapse's pause), at most `most` away.
    /// A renewal meanwhile wakes the watch through [`Lease::renewed`].
    pub(crate) fn until_due(&self, most: Duration) -> Duration {
        let g = lock(&self.inner);
        if self.state.load(Ordering::SeqCst) != LEASED {
            return most;
        }
        let Some(renewed) = g.renewed else {
            return most;
        };
        let mut at = renewed + g.self_fence;
        if let Some(held) = g.held {
            at = at.max(held + HELD_FOR);
        }
        at.saturating_duration_since(Instant::now()).min(most)
    }

    pub(crate) fn fenced(&self, vms: Vec<String>) {
        let mut g = lock(&self.inner);
        g.fenced_vms = vms;
        self.state.store(FENCED, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn renewal(ms: u64) -> LeaseRenewal {
        LeaseRenewal {
            ttl_ms: ms,
            self_fence_ms: ms,
            ha_vms: vec!["a".into()],
            peers: Vec::new(),
        }
    }

    #[test]
    fn a_lease_falls_due_at_its_deadline_once_and_carries_over_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let l = Lease::load(dir.path());
        assert_eq!(l.view().state, "unleased");
        assert!(l.due().is_none(), "never leased: nothing to fence");
        l.renew(&renewal(300));
        assert!(l.due().is_none());
        // a restarted agent takes the deadline up
        let again = Lease::load(dir.path());
        assert_eq!(again.view().state, "leased");
        assert!(again.due().is_none());
        std::thread::sleep(Duration::from_millis(350));
        assert_eq!(l.due().unwrap().0, vec!["a".to_string()]);
        assert_eq!(again.due().unwrap().0, vec!["a".to_string()]);
        assert!(
            l.due().is_none(),
            "a lapse held is asked again only after 2 s"
        );
        l.fenced(vec!["a".into()]);
        assert!(l.due().is_none(), "fenced once per lapse");
        assert_eq!(l.view().state, "fenced");
        l.renew(&renewal(300));
        assert_eq!(l.view().state, "leased");
    }

    #[test]
    fn a_renewal_of_the_same_lease_moves_the_file_time_and_a_restart_takes_it_up() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("lease.json");
        let l = Lease::load(dir.path());
        l.renew(&renewal(3000));
        let written = std::fs::read(&file).unwrap();
        std::thread::sleep(Duration::from_millis(1000));
        l.renew(&renewal(3000));
        assert_eq!(
            std::fs::read(&file).unwrap(),
            written,
            "only the deadline changed: the file is not written again"
        );
        // past the first renewal's deadline, well before the second's
        std::thread::sleep(Duration::from_millis(2300));
        let again = Lease::load(dir.path());
        assert_eq!(again.view().state, "leased");
        assert!(
            again.due().is_none(),
            "a restarted agent takes up the last renewal's deadline, not the first's"
        );
        let mut changed = renewal(3000);
        changed.ha_vms.push("b".into());
        l.renew(&changed);
        let now = String::from_utf8(std::fs::read(&file).unwrap()).unwrap();
        assert!(now.contains("\"b\""), "a changed lease is written: {now}");
    }

    #[test]
    fn the_fence_watch_sleeps_until_the_deadline_and_no_longer() {
        let dir = tempfile::tempdir().unwrap();
        let l = Lease::load(dir.path());
        let most = Duration::from_secs(1);
        assert_eq!(l.until_due(most), most, "never leased: nothing falls due");
        l.renew(&renewal(300));
        let d = l.until_due(most);
        // the deadline, not the most (a loaded machine may take a while
        // between the renewal and the look)
        assert!(
            d > Duration::from_millis(100) && d <= Duration::from_millis(300),
            "{d:?}"
        );
        assert_eq!(
            l.until_due(Duration::from_millis(100)),
            Duration::from_millis(100)
        );
        std::thread::sleep(Duration::from_millis(320));
        assert_eq!(l.until_due(most), Duration::ZERO, "due now");
        assert!(l.due().is_some());
        // a lapse held: asked again 2 s later, not before
        let d = l.until_due(Duration::from_secs(5));
        assert!(
            d > Duration::from_millis(1500) && d <= Duration::from_secs(2),
            "{d:?}"
        );
    }
}
