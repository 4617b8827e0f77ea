//! One leader among the control instances sharing a store.
//!
//! Any instance serves the API; one, the leader, also does what must not
//! be done twice at once: judging lapsed leases and failing hosts over,
//! syncing the storage nodes' grants, the storage policy manager, rolling
//! drains, revocation lists. With SQLite there is one instance and it
//! leads. With etcd the leader holds `/ferry/leader` under an etcd lease of
//! [`LEADER_TTL_S`]:
//!
//! ```text
//! every second:
//!   not leading → txn { if create_revision(/ferry/leader) == 0
//!                       then put(/ferry/leader, me, lease) else get }
//!   leading     → keep the lease alive, and check the key is still ours
//!                 (lease and create revision); on any failure or after
//!                 1.5 s without an answer, stop leading at once
//! ```
//!
//! A leader cut off from etcd stops within 1.5 s, before its key can pass
//! to another (at [`LEADER_TTL_S`]), so two instances never lead at once as
//! far as their clocks agree. A failover checks again at etcd before each
//! boot (`Control::still_leading`). Every instance renews the agents'
//! leases (renewals are idempotent), so the leader's death never lapses a
//! lease, and the next leader knows every host's last renewal.
//!
//! Taking the lead, an instance reads what is in force rather than what it
//! remembers: the grants from the storage nodes, the pairs a failover
//! revoked from the store.

use std::sync::Arc;
use std::time::Duration;

use ferry_api::ha::{ControlStatus, LEADER_TTL_S};
use ferry_api::ApiError;

use crate::store::Claim;
use crate::{lock, Control};

/// How long a keep-alive may take before the leader steps down.
const KEEP_WITHIN: Duration = Duration::from_millis(1_500);

#[derive(Default)]
pub struct Leadership {
    /// This instance's name in the leader key and in events.
    pub(crate) me: String,
    /// The claim held, and since when (Unix ms).
    held: std::sync::Mutex<Option<(Claim, u64)>>,
}

impl Leadership {
    pub fn new(me: &str) -> Leadership {
        Leadership {
            me: me.into(),
            ..Default::default()
        }
    }
}

impl Control {
    /// Whether this instance leads now.
    pub fn leading(&self) -> bool {
        !self.store.shared() || lock(&self.leader.held).is_some()
    }

    /// Whether this instance still leads, asked of etcd itself (before an
    /// act that two leaders must not both do).
    pub(crate) async fn still_leading(&self) -> bool {
        if !self.store.shared() {
            return true;
        }
        let Some((claim, _)) = *lock(&self.leader.held) else {
            return false;
        };
        matches!(
            tokio::time::timeout(KEEP_WITHIN, self.store.holds(claim)).await,
            Ok(Ok(true))
        )
    }

    /// Runs for leadership, and keeps it, once a second until the process ends.
    pub async fn run_leadership(self: Arc<Self>) {
        let mut t = tokio::time::interval(Duration::from_secs(1));
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let held = *lock(&self.leader.held);
            match held {
                Some((claim, _)) => {
                    let kept =
                        tokio::time::timeout(KEEP_WITHIN, self.store.keep_claim(claim)).await;
                    if !matches!(kept, Ok(Ok(true))) {
                        let why = match kept {
                            Err(_) => "etcd did not answer in time".to_string(),
                            Ok(Err(e)) => e.to_string(),
                            Ok(Ok(_)) => "the leader key is another's".to_string(),
                        };
                        *lock(&self.leader.held) = None;
                        tracing::warn!(%why, "no longer the leader");
                        self.log(
                            "leader_lost",
                            &self.leader.me,
                            serde_json::json!({ "reason": why }),
                        );
                    }
                }
                None => {
                    let ttl = LEADER_TTL_S as i64;
                    match tokio::time::timeout(
                        KEEP_WITHIN * 2,
                        self.store.campaign(&self.leader.me, ttl),
                    )
                    .await
                    {
                        Ok(Ok(Ok(claim))) => self.take_lead(claim).await,
                        Ok(Ok(Err(holder))) => tracing::debug!(%holder, "another instance leads"),
                        Ok(Err(e)) => tracing::warn!("leader election: {e}"),
                        Err(_) => tracing::warn!("leader election: etcd did not answer in time"),
                    }
                }
            }
            t.tick().await;
        }
    }

    async fn take_lead(&self, claim: Claim) {
        if let Err(e) = self.adopt_grants().await {
            // without the nodes' grants the sync would take away what an
            // unreachable host holds: lead once they can be read
            tracing::warn!("taking the lead: {e}");
            self.store.resign(claim).await;
            return;
        }
        self.load_revoked().await;
        // a host that failed before this instance started is probed where
        // the leader before it saw it
        self.load_probe_addrs().await;
        let since = ferry_api::util::now_ms();
        *lock(&self.leader.held) = Some((claim, since));
        if self.store.shared() {
            tracing::info!(instance = %self.leader.me, "leading the control instances");
            self.log(
                "leader",
                &self.leader.me,
                serde_json::json!({ "since_ms": since }),
            );
        }
    }

    /// `GET /cluster/control`.
    pub(crate) async fn control_status(&self) -> Result<ControlStatus, ApiError> {
        let held = *lock(&self.leader.held);
        let leader = if self.store.shared() {
            self.store.leader().await?
        } else {
            Some(self.leader.me.clone())
        };
        Ok(ControlStatus {
            instance: self.leader.me.clone(),
            leading: self.leading(),
            leader,
            store: if self.store.shared() {
                "etcd"
            } else {
                "sqlite"
            }
            .into(),
            leading_since_ms: held.map(|(_, since)| since),
        })
    }
}
