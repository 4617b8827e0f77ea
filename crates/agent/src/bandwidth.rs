//! The bandwidth classes room as the API sees it: each class's minimum and
//! cap on this host's NICs (the kernel side is `crate::classes`).

use ferry_api::ApiError;

use crate::host::Agent;

impl Agent {
    /// Sets the bandwidth policy and applies it at once.
    pub async fn set_bandwidth(
        &self,
        p: ferry_api::bandwidth::BandwidthPolicy,
    ) -> Result<ferry_api::bandwidth::HostBandwidth, ApiError> {
        p.check()?;
        let classes = self.classes.clone();
        let host = self.cfg.name.clone();
        tokio::task::spawn_blocking(move || {
            let mut c = ferry_api::util::lock(&classes);
            c.set_policy(p);
            c.reconcile();
            c.status(&host)
        })
        .await
        .map_err(ApiError::internal)
    }

    pub async fn bandwidth(&self) -> Result<ferry_api::bandwidth::HostBandwidth, ApiError> {
        let classes = self.classes.clone();
        let host = self.cfg.name.clone();
        let mut b =
            tokio::task::spawn_blocking(move || ferry_api::util::lock(&classes).status(&host))
                .await
                .map_err(ApiError::internal)?;
        b.cpu_busy = self.facts.idle.idle_now().map(|i| 1.0 - i);
        Ok(b)
    }
}
