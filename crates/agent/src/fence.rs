//! Self-fencing: an agent whose HA lease lapsed (see [`crate::lease`])
//! stops its HA guests, unless every peer it can hear over the migration
//! fabrics lapsed too (then the control service is down for all, and
//! nothing will be restarted elsewhere).

use std::sync::Arc;
use std::time::Duration;

impl crate::host::Agent {
    /// Looks at the lease at its deadline, after each renewal and at least
    /// once a second; past its deadline, stops the HA VMs
    /// (QEMU killed: what the cluster restarts elsewhere must not run here).
    pub async fn watch_lease(self: Arc<Self>) {
        loop {
            // woken at the deadline itself, not by polling for it; a renewal
            // (which may set a nearer self-fence) wakes it to look again
            let most = Duration::from_secs(1);
            let wait = self.lease.until_due(most);
            // the once-a-second look wakes with the agent's other periodic work
            let look = async {
                if wait >= most {
                    crate::facts::tick(most).await
                } else {
                    tokio::time::sleep(wait).await
                }
            };
            tokio::select! {
                _ = look => {}
                _ = self.lease.renewed.notified() => continue,
            }
            let Some((vms, peers)) = self.lease.due() else {
                continue;
            };
            if vms.is_empty() {
                self.lease.fenced(Vec::new());
                continue;
            }
            if !self.cluster_renews_without_us(&peers).await {
                continue;
            }
            let mut stopped = Vec::new();
            for vm in vms {
                let q = {
                    let mut st = self.state.lock().await;
                    match st.vms.get(&vm) {
                        Some(s) if s.role == crate::host::Role::Running => {
                            st.vms.remove(&vm).and_then(|s| s.qemu)
                        }
                        _ => None,
                    }
                };
                if let Some(q) = q {
                    q.kill().await;
                    self.remove_vm_dir(&q.dir, &format!("{vm}.fenced"));
                    stopped.push(vm);
                }
            }
            tracing::warn!(
                stopped = ?stopped,
                "no HA lease renewal within the self-fence deadline: HA guests stopped"
            );
            self.lease.fenced(stopped);
        }
    }
}

/// What peers said at a lapse (see `Agent::cluster_renews_without_us`).
#[derive(Debug, PartialEq, Eq)]
pub enum PeersSay {
    /// One of them was renewed recently: the cluster goes on without us.
    Renewed,
    /// They answered, none renewed recently: the control service is down
    /// for everyone, and nothing will be restarted elsewhere.
    AllLapsed,
    /// Nobody answered (or no peers): we are cut off.
    Nothing,
}

pub fn judge(heard: &[crate::probe::alive::Heard]) -> PeersSay {
    use crate::probe::alive::Heard;
    let mut answered = false;
    for h in heard {
        if let Heard::Agent { since_ms, .. } = h {
            answered = true;
            if since_ms.is_some_and(|s| s < ferry_api::ha::PEER_FRESH_MS) {
                return PeersSay::Renewed;
            }
        }
    }
    if answered {
        PeersSay::AllLapsed
    } else {
        PeersSay::Nothing
    }
}

impl crate::host::Agent {
    /// At a lapse: fence unless every peer that answers lapsed too.
    async fn cluster_renews_without_us(&self, peers: &[ferry_api::ha::PeerAddresses]) -> bool {
        let me = self.cfg.name.clone();
        let secret = self.cred.secret().to_vec();
        let heard = futures::future::join_all(peers.iter().map(|p| {
            let addrs: Vec<std::net::SocketAddr> =
                p.addresses.iter().filter_map(|a| a.parse().ok()).collect();
            let (me, secret) = (me.clone(), secret.clone());
            async move {
                crate::probe::alive::probe_any(&me, &secret, &p.host, &addrs)
                    .await
                    .0
            }
        }))
        .await;
        match judge(&heard) {
            PeersSay::AllLapsed => {
                tracing::warn!(
                    "HA lease lapsed, and every peer's too: the control service is down for \
                     all, so HA guests are kept"
                );
                false
            }
            PeersSay::Renewed | PeersSay::Nothing => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lapsed_agent_fences_unless_every_peer_lapsed_too() {
        use crate::probe::alive::Heard;
        let fresh = Heard::Agent {
            state: "leased".into(),
            since_ms: Some(800),
        };
        let stale = Heard::Agent {
            state: "leased".into(),
            since_ms: Some(6_000),
        };
        assert_eq!(judge(&[Heard::Silent, fresh.clone()]), PeersSay::Renewed);
        assert_eq!(
            judge(&[stale.clone(), Heard::AgentDown]),
            PeersSay::AllLapsed
        );
        assert_eq!(judge(&[Heard::Silent, Heard::AgentDown]), PeersSay::Nothing);
        assert_eq!(judge(&[]), PeersSay::Nothing);
    }
}
