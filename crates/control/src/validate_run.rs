//! Running `ferry host validate`: gathering every host's facts and having
//! agents probe every path, then judging it all with [`crate::validate`].

use std::time::Duration;

use ferry_api::validation::{
    CheckOutcome, CheckStatus, HostFacts, NicFacts, PathProbeRequest, PathProbeResult, SendRequest,
    SendResult, SinkReply, SinkRequest, SinkResult, ValidationReport,
};
use ferry_api::{ApiError, ValidateRequest};

use crate::*;

impl Control {
    /// Validates hosts and the paths between them (see [`validate`]).
    pub(crate) async fn validate(
        &self,
        req: ValidateRequest,
    ) -> Result<ValidationReport, ApiError> {
        for h in &req.hosts {
            self.host(h)?;
        }
        let selected = |h: &str| req.hosts.is_empty() || req.hosts.iter().any(|s| s == h);
        let t = Duration::from_secs(30);
        // facts from every host: consistency needs the whole cluster
        let calls = self.hosts.iter().map(|(n, c)| async move {
            (n.clone(), c.get::<HostFacts>("/validate/facts", t).await)
        });
        let mut facts = Vec::new();
        let mut rows = Vec::new();
        for (name, r) in futures::future::join_all(calls).await {
            match r {
                Ok(f) => facts.push(f),
                Err(e) => rows.push(CheckOutcome {
                    check: "agent".into(),
                    host: name.clone(),
                    nic: None,
                    peer: None,
                    status: CheckStatus::Fail,
                    observed: format!("agent unreachable: {e}"),
                    fix: Some(format!(
                        "start the agent of {name} (lab: `ferry lab restart-agent {name}`)"
                    )),
                }),
            }
        }
        // which NIC reaches which: every agent probes every other host's NICs
        let peers: Vec<ferry_api::PeerRef> = self
            .hosts
            .iter()
            .map(|(n, c)| ferry_api::PeerRef {
                name: n.clone(),
                url: c.base().to_string(),
            })
            .collect();
        let probes = facts.iter().map(|f| {
            let peers = peers.clone();
            async move {
                let r = match self.host(&f.host) {
                    Ok(c) => c
                        .post::<_, Vec<ferry_api::NicPath>>("/paths/probe", &peers, t)
                        .await
                        .unwrap_or_default(),
                    Err(_) => Vec::new(),
                };
                (f.host.clone(), r)
            }
        });
        let probed: Vec<(String, ferry_api::NicPath)> = futures::future::join_all(probes)
            .await
            .into_iter()
            .flat_map(|(h, v)| v.into_iter().map(move |p| (h.clone(), p)))
            .collect();
        rows.extend(validate::assign_fabrics(&mut facts, &probed));
        // every ordered pair on every fabric that touches a selected host
        let mut pairs: Vec<(String, String, NicFacts, NicFacts)> = Vec::new();
        for a in &facts {
            for b in &facts {
                if a.host == b.host || !(selected(&a.host) || selected(&b.host)) {
                    continue;
                }
                for na in &a.nics {
                    if let Some(nb) = b.nics.iter().find(|n| n.fabric == na.fabric) {
                        pairs.push((a.host.clone(), b.host.clone(), na.clone(), nb.clone()));
                    }
                }
            }
        }
        let probes = pairs.iter().map(|(a, b, na, nb)| async move {
            let req = PathProbeRequest {
                nic: na.name.clone(),
                peer_addr: nb.address.clone(),
                size: na.mtu,
            };
            let r = self
                .host(a)?
                .post::<_, PathProbeResult>("/validate/path", &req, Duration::from_secs(60))
                .await;
            Ok::<_, ApiError>(validate::PathResult {
                host: a.clone(),
                peer: b.clone(),
                nic: na.name.clone(),
                peer_addr: nb.address.clone(),
                result: r.map_err(|e| e.to_string()),
            })
        });
        let paths: Vec<validate::PathResult> = futures::future::join_all(probes)
            .await
            .into_iter()
            .collect::<Result<_, _>>()?;
        // throughput one path at a time, each unordered pair once, so tests do not share a link
        let mut tputs = Vec::new();
        if req.throughput_ms > 0 {
            for (a, b, na, nb) in pairs.iter().filter(|(a, b, ..)| a < b) {
                if !(na.up && nb.up) {
                    continue;
                }
                let result = self.throughput(a, b, na, nb, req.throughput_ms).await;
                tputs.push(validate::ThroughputResult {
                    host: a.clone(),
                    peer: b.clone(),
                    nic: na.name.clone(),
                    fabric: na.fabric,
                    result: result.map_err(|e| e.to_string()),
                });
            }
        }
        rows.extend(validate::evaluate(&facts, &paths, &tputs));
        rows.retain(|r| selected(&r.host) || r.peer.as_deref().is_some_and(selected));
        let names = if req.hosts.is_empty() {
            self.hosts.keys().cloned().collect()
        } else {
            req.hosts.clone()
        };
        let report = ValidationReport::new(names, rows);
        *self.last_validation.lock().await = Some(report.clone());
        Ok(report)
    }

    /// Bits per second from `a`'s NIC to `b`'s, as `b`'s sink measured them.
    pub(crate) async fn throughput(
        &self,
        a: &str,
        b: &str,
        na: &NicFacts,
        nb: &NicFacts,
        ms: u64,
    ) -> Result<f64, ApiError> {
        let t = Duration::from_secs(30);
        let sink: SinkReply = self
            .host(b)?
            .post(
                "/validate/sink",
                &SinkRequest {
                    nic: nb.name.clone(),
                },
                t,
            )
            .await?;
        let send = SendRequest {
            nic: na.name.clone(),
            peer_addr: sink.address.clone(),
            port: sink.port,
            session: sink.session.clone(),
            duration_ms: ms,
        };
        let _: SendResult = self.host(a)?.post("/validate/send", &send, t).await?;
        let got: SinkResult = self
            .host(b)?
            .get(&format!("/validate/sink/{}", sink.port), t)
            .await?;
        if got.duration_ms == 0 {
            return Err(ApiError::unavailable(
                format!("path {a} {} → {b}", na.name),
                "no data arrived",
            ));
        }
        Ok(got.bytes as f64 * 8.0 * 1000.0 / got.duration_ms as f64)
    }
}
