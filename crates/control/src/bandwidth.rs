//! Bandwidth classes across the cluster: one policy, kept in the control
//! state, handed to every agent (which plans and enforces it per NIC, see
//! `ferry_agent::classes`), re-handed whenever a heartbeat shows an agent
//! enforcing something else (an agent restarted, or was down when the
//! policy changed).

use std::time::Duration;

use ferry_api::bandwidth::{BandwidthPolicy, BandwidthReport, BandwidthSetRequest, HostBandwidth};
use ferry_api::{ApiError, HostEntry};

use crate::{lock, Control};

const KEY: &str = "bandwidth";
const AGENT_TIMEOUT: Duration = Duration::from_secs(5);

impl Control {
    pub(crate) fn bandwidth_policy(&self) -> BandwidthPolicy {
        lock(&self.bandwidth).clone()
    }

    /// Takes up the stored policy (another control instance may have set it).
    pub(crate) async fn reload_bandwidth(&self) -> Result<(), ApiError> {
        let p: Option<BandwidthPolicy> = self.store.cluster(KEY).await?;
        *lock(&self.bandwidth) = p.unwrap_or_default();
        Ok(())
    }

    pub(crate) async fn set_bandwidth(
        &self,
        req: BandwidthSetRequest,
    ) -> Result<BandwidthReport, ApiError> {
        let policy = self.bandwidth_policy().with(&req)?;
        self.store.put_cluster(KEY, &policy).await?;
        *lock(&self.bandwidth) = policy.clone();
        self.log(
            "bandwidth",
            req.class.name(),
            serde_json::to_value(&policy).unwrap_or_default(),
        );
        let names: Vec<String> = self.hosts.keys().cloned().collect();
        self.push_bandwidth(&names, &policy).await;
        self.list_bandwidth().await
    }

    /// Hands `policy` to each of `hosts`; an agent that does not answer gets
    /// it at a later heartbeat.
    async fn push_bandwidth(&self, hosts: &[String], policy: &BandwidthPolicy) {
        let calls = hosts
            .iter()
            .filter_map(|h| self.hosts.get(h))
            .map(|c| async move {
                if let Err(e) = c
                    .put::<_, HostBandwidth>("/bandwidth", policy, AGENT_TIMEOUT)
                    .await
                {
                    tracing::warn!(agent = %c.base(), "bandwidth policy not taken: {e}");
                }
            });
        futures::future::join_all(calls).await;
    }

    /// Heartbeat: re-hands the policy to agents enforcing another one.
    pub(crate) async fn align_bandwidth(&self, hosts: &[HostEntry]) {
        let policy = self.bandwidth_policy();
        let stale: Vec<String> = hosts
            .iter()
            .filter(|h| h.info.as_ref().is_some_and(|i| i.bandwidth != policy))
            .map(|h| h.name.clone())
            .collect();
        if !stale.is_empty() {
            self.push_bandwidth(&stale, &policy).await;
        }
    }

    pub(crate) async fn list_bandwidth(&self) -> Result<BandwidthReport, ApiError> {
        let calls = self.hosts.iter().map(|(name, c)| async move {
            (
                name.clone(),
                c.get::<HostBandwidth>("/bandwidth", AGENT_TIMEOUT).await,
            )
        });
        let mut hosts = Vec::new();
        let mut unreachable = Vec::new();
        for (name, r) in futures::future::join_all(calls).await {
            match r {
                Ok(h) => hosts.push(h),
                Err(e) => unreachable.push((name, e.to_string())),
            }
        }
        Ok(BandwidthReport {
            policy: self.bandwidth_policy(),
            hosts,
            unreachable,
        })
    }
}
