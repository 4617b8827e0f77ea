//! Which NIC here reaches which NIC of a peer, as the agent keeps it: probed
//! on demand, cached while no link changes (the probes themselves are
//! `crate::probe`).

use std::time::Duration;

use ferry_api::{HostInfo, NicInfo};

use crate::host::Agent;

impl Agent {
    /// The NIC pairs a move to `info` uses: as [`Agent::paths_to`], but
    /// pairs past their age whose links have not changed are used at once
    /// and probed again behind the move (probing an unreachable pair waits
    /// out its tries, about a second).
    pub async fn paths_for_move(&self, info: &HostInfo) -> Vec<ferry_api::NicPath> {
        let mine = self.nics();
        match self.facts.paths.get(&info.name) {
            Some(p) if !p.fresh(&mine, &info.nics) && p.same_links(&mine, &info.nics) => {
                let (cache, me, secret) = (
                    self.facts.paths.clone(),
                    self.cfg.name.clone(),
                    self.cred.secret().to_vec(),
                );
                let (peer, peer_nics, port) =
                    (info.name.clone(), info.nics.clone(), info.probe_port);
                tokio::spawn(async move {
                    crate::probe::refresh(&cache, (&me, &secret), &mine, &peer, &peer_nics, port)
                        .await;
                });
                p.pairs
            }
            _ => self.paths_to(info).await,
        }
    }

    /// The NIC pairs to `peer` (whose host info is `info`): probed again
    /// when older than [`crate::probe::PROBE_TTL`] or when a link on
    /// either side changed.
    pub async fn paths_to(&self, info: &HostInfo) -> Vec<ferry_api::NicPath> {
        let mine = self.nics();
        if let Some(p) = self.facts.paths.get(&info.name) {
            if p.fresh(&mine, &info.nics) {
                return p.pairs;
            }
        }
        self.probe_now(info, mine).await
    }

    /// The NIC pairs to `peer` from this host's NICs `mine`, probed now
    /// whatever the cache holds.
    pub(crate) async fn probe_now(
        &self,
        info: &HostInfo,
        mine: Vec<NicInfo>,
    ) -> Vec<ferry_api::NicPath> {
        crate::probe::refresh(
            &self.facts.paths,
            (&self.cfg.name, self.cred.secret()),
            &mine,
            &info.name,
            &info.nics,
            info.probe_port,
        )
        .await
    }

    /// Probes every peer given (each asked for its NICs first) now, not
    /// from the cache: validation asks what reaches what at this moment,
    /// and a pair probed in a link's first moments back up (its neighbour
    /// entries still failed) would otherwise stand unreachable for
    /// [`crate::probe::PROBE_TTL`]. Returns every pair known.
    pub async fn probe_peers(&self, peers: Vec<ferry_api::PeerRef>) -> Vec<ferry_api::NicPath> {
        let jobs = peers
            .into_iter()
            .filter(|p| p.name != self.cfg.name)
            .map(|p| async move {
                let c = self.peer(&p.name, &p.url);
                match c.get::<HostInfo>("/host", Duration::from_secs(5)).await {
                    Ok(info) => {
                        self.probe_now(&info, self.nics()).await;
                    }
                    Err(e) => {
                        tracing::warn!(peer = %p.name, error = %e, "cannot ask a peer for its NICs")
                    }
                }
            });
        futures::future::join_all(jobs).await;
        self.facts.paths.all()
    }
}
