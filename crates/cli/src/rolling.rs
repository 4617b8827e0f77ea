//! `ferry cluster drain-rolling`: starts (or finds) the control service's
//! rolling drain and follows it, one line per change, until it ends. The
//! run lives in the control service, so this follows it across a restart
//! of either.

use std::time::{Duration, Instant};

use ferry_api::rolling::{Phase, RollingRequest, RollingState, RollingStatus};
use ferry_api::size::human_bytes;
use ferry_api::ApiError;
use ferry_net::client::Client;

use crate::output::{print_json, Table};

const T: Duration = Duration::from_secs(30);
/// How long the control service may not answer before this gives up
/// following (the run goes on without it).
const PATIENCE: Duration = Duration::from_secs(120);

pub async fn run(
    c: &Client,
    req: RollingRequest,
    status: bool,
    stop: bool,
    json: bool,
) -> anyhow::Result<i32> {
    if stop {
        let st: RollingStatus = c.delete("/cluster/rolling", T).await?;
        show(&st, json);
        return Ok(0);
    }
    if status {
        let st: Option<RollingStatus> = c.get("/cluster/rolling", T).await?;
        match st {
            Some(st) => show(&st, json),
            None if json => println!("null"),
            None => println!("no rolling drain has run"),
        }
        return Ok(0);
    }
    let first: RollingStatus = match c.post("/cluster/rolling", &req, T).await {
        Ok(st) => st,
        Err(ApiError::Conflict { .. }) => {
            let st: Option<RollingStatus> = c.get("/cluster/rolling", T).await?;
            let st = st.ok_or_else(|| anyhow::anyhow!("the rolling drain vanished"))?;
            if !json {
                println!(
                    "a rolling drain runs already (started with {}); following it",
                    describe(&st.request)
                );
            }
            st
        }
        Err(e) => return Err(e.into()),
    };
    if !json {
        println!(
            "rolling drain of {}: at most {} host(s) down at once",
            first
                .hosts
                .iter()
                .map(|h| h.host.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            first.request.max_hosts_down
        );
    }
    let mut prev: Option<RollingStatus> = None;
    let mut last_ok = Instant::now();
    let mut said_lost = false;
    loop {
        match c.get::<Option<RollingStatus>>("/cluster/rolling", T).await {
            Ok(Some(st)) => {
                last_ok = Instant::now();
                if said_lost && !json {
                    println!("  control service answers again");
                }
                said_lost = false;
                if !json {
                    print_changes(prev.as_ref(), &st);
                }
                if st.state != RollingState::Running {
                    if json {
                        print_json(&st);
                    } else {
                        summary(&st);
                    }
                    return Ok(if st.state == RollingState::Done { 0 } else { 1 });
                }
                prev = Some(st);
            }
            Ok(None) => anyhow::bail!("the control service has no rolling drain"),
            Err(e) => {
                if last_ok.elapsed() > PATIENCE {
                    anyhow::bail!(
                        "the control service has not answered for {}s ({e}); the rolling drain goes on \
                         there: `ferry cluster drain-rolling --status`",
                        PATIENCE.as_secs()
                    );
                }
                if !said_lost && !json {
                    println!("  control service does not answer ({e}); waiting");
                }
                said_lost = true;
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

fn describe(r: &RollingRequest) -> String {
    let mut out = format!("--max-hosts-down {}", r.max_hosts_down);
    if let Some(h) = &r.hook {
        out += &format!(" --hook '{h}'");
    }
    out
}

/// One line per host phase change, move done and new message.
fn print_changes(prev: Option<&RollingStatus>, st: &RollingStatus) {
    for h in &st.hosts {
        let before = prev.and_then(|p| p.hosts.iter().find(|x| x.host == h.host));
        let moved_before = before.map(|b| b.moved.len()).unwrap_or(0);
        for m in h.moved.iter().skip(moved_before) {
            println!(
                "  {} → {}: {:.1} s, downtime {} ms, {}",
                m.vm,
                m.to,
                m.total_ms as f64 / 1000.0,
                m.downtime_ms,
                human_bytes(m.bytes)
            );
        }
        if before.map(|b| b.phase) == Some(h.phase) {
            continue;
        }
        if before.is_none() && h.phase == Phase::Pending {
            continue;
        }
        let line = match h.phase {
            Phase::Pending => "pending".to_string(),
            Phase::Draining => "draining".to_string(),
            Phase::Maintenance => match &st.request.hook {
                Some(hook) => {
                    format!("in maintenance: empty; `{hook}` is asked until it says healthy")
                }
                None => format!(
                    "in maintenance: empty, takes no VMs; `ferry host resume {}` when it is back",
                    h.host
                ),
            },
            Phase::Done => format!("done ({})", h.reason.as_deref().unwrap_or("resumed")),
            Phase::Failed => format!("failed: {}", h.reason.as_deref().unwrap_or("?")),
        };
        println!("{}: {line}", h.host);
    }
    let msg = |s: &RollingStatus| s.message.clone();
    if prev.map(msg) != Some(msg(st)) {
        if let Some(m) = &st.message {
            if !m.starts_with("draining ") {
                println!("  … {m}");
            }
        }
    }
}

fn show(st: &RollingStatus, json: bool) {
    if json {
        print_json(st);
        return;
    }
    println!(
        "rolling drain: {:?}{}",
        st.state,
        st.message
            .as_deref()
            .map(|m| format!(" — {m}"))
            .unwrap_or_default()
    );
    summary(st);
}

fn summary(st: &RollingStatus) {
    let mut t = Table::new(&["HOST", "PHASE", "MOVED", "DRAIN", "MAINTENANCE", "NOTE"]);
    for h in &st.hosts {
        let secs = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) => format!("{:.1} s", b.saturating_sub(a) as f64 / 1000.0),
            _ => "-".into(),
        };
        t.row(vec![
            h.host.clone(),
            h.phase.to_string(),
            h.moved.len().to_string(),
            secs(h.draining_ms, h.maintenance_ms),
            secs(h.maintenance_ms, h.done_ms),
            h.reason.clone().unwrap_or_default(),
        ]);
    }
    t.print();
    if let (Some(end), RollingState::Done) = (st.ended_ms, st.state) {
        println!(
            "{} hosts in {:.1} s; at most {} down at once",
            st.hosts.len(),
            end.saturating_sub(st.started_ms) as f64 / 1000.0,
            st.most_down
        );
    }
}
