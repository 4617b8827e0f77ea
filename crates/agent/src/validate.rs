//! The agent's side of `ferry host validate`: facts read from this host
//! (sysfs, `tc`, `ethtool`) and probes run from it (don't-fragment pings,
//! a throughput sink and sender bound to one NIC). Judging them is the
//! control service's job (it sees every host); this module only observes,
//! and says why whenever something cannot be observed.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ferry_api::validation::*;
use ferry_api::ApiError;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Longest throughput test an agent runs.
pub const MAX_SEND: Duration = Duration::from_secs(10);

fn cmd(prog: &str, args: &[&str]) -> Result<String, String> {
    ferry_api::util::run_command(prog, args)
}

fn read(p: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// The numbers of an `ethtool -l`/`-g` report by (section, key): section
/// `false` is "Pre-set maximums", `true` is "Current hardware settings".
fn ethtool_fields(text: &str) -> BTreeMap<(bool, String), u32> {
    let mut current = false;
    let mut out = BTreeMap::new();
    for line in text.lines() {
        if line.starts_with("Current hardware settings") {
            current = true;
        }
        if let Some((k, v)) = line.split_once(':') {
            if let Ok(v) = v.trim().parse::<u32>() {
                out.insert((current, k.trim().to_string()), v);
            }
        }
    }
    out
}

/// Parses `ethtool -l` output (channels: RX, TX, Combined).
pub fn parse_channels(text: &str) -> Channels {
    let f = ethtool_fields(text);
    let get = |current: bool, k: &str| f.get(&(current, k.to_string())).copied();
    Channels {
        max_rx: get(false, "RX"),
        max_tx: get(false, "TX"),
        max_combined: get(false, "Combined"),
        rx: get(true, "RX"),
        tx: get(true, "TX"),
        combined: get(true, "Combined"),
    }
}

/// Parses `ethtool -g` output (ring sizes: RX, TX).
pub fn parse_rings(text: &str) -> Rings {
    let f = ethtool_fields(text);
    let get = |current: bool, k: &str| f.get(&(current, k.to_string())).copied();
    Rings {
        max_rx: get(false, "RX"),
        max_tx: get(false, "TX"),
        rx: get(true, "RX"),
        tx: get(true, "TX"),
    }
}

/// Reads a `tbf` rate (bit/s) from `tc -j qdisc show dev NIC`.
fn shaped_rate(nic: &str) -> Option<u64> {
    let out = cmd("tc", &["-j", "qdisc", "show", "dev", nic]).ok()?;
    let v: Vec<serde_json::Value> = serde_json::from_str(&out).ok()?;
    v.iter()
        .find(|q| q["kind"] == "tbf")
        .and_then(|q| q["options"]["rate"].as_u64())
        .map(|bytes_per_sec| bytes_per_sec * 8)
}

fn ethtool<T>(flag: &str, nic: &str, parse: fn(&str) -> T) -> Probe<T> {
    match cmd("ethtool", &[flag, nic]) {
        Ok(text) => Probe::ok(parse(&text)),
        Err(e) => Probe::unavailable(format!("ethtool {flag} {nic}: {e}")),
    }
}

fn cpu_facts() -> CpuFacts {
    let cpus: Vec<_> = std::fs::read_dir("/sys/devices/system/cpu")
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    let n = p
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    n.starts_with("cpu") && n[3..].parse::<u32>().is_ok()
                })
                .collect()
        })
        .unwrap_or_default();
    let governors: Vec<String> = cpus
        .iter()
        .filter_map(|c| read(c.join("cpufreq/scaling_governor")))
        .collect();
    let governors = if governors.is_empty() {
        Probe::unavailable("no cpufreq in /sys (a virtual machine, or no frequency-scaling driver): the hypervisor or firmware sets CPU speed")
    } else {
        Probe::ok(governors)
    };
    let mut states: BTreeMap<String, IdleState> = BTreeMap::new();
    for c in &cpus {
        let Ok(dir) = std::fs::read_dir(c.join("cpuidle")) else {
            continue;
        };
        for s in dir.flatten() {
            let p = s.path();
            let Some(name) = read(p.join("name")) else {
                continue;
            };
            let latency_us = read(p.join("latency"))
                .and_then(|l| l.parse().ok())
                .unwrap_or(0);
            let disabled = read(p.join("disable")).is_some_and(|d| d == "1");
            let e = states.entry(name.clone()).or_insert(IdleState {
                name,
                latency_us,
                enabled_on: 0,
                cpus: 0,
            });
            e.cpus += 1;
            if !disabled {
                e.enabled_on += 1;
            }
        }
    }
    let idle_states = if states.is_empty() {
        Probe::unavailable("no cpuidle in /sys: the kernel exposes no idle states here")
    } else {
        let mut v: Vec<_> = states.into_values().collect();
        v.sort_by_key(|s| s.latency_us);
        Probe::ok(v)
    };
    CpuFacts {
        governors,
        idle_driver: read("/sys/devices/system/cpu/cpuidle/current_driver"),
        idle_states,
    }
}

/// Everything validation needs to know about this host.
pub fn facts(host: &str, nominal_rate: Option<u64>, nics: Vec<ferry_api::NicInfo>) -> HostFacts {
    let nics = nics
        .into_iter()
        .map(|n| {
            let sys = Path::new("/sys/class/net").join(&n.name);
            let speed = read(sys.join("speed"))
                .and_then(|s| s.parse::<i64>().ok())
                .filter(|s| *s > 0);
            NicFacts {
                oper_state: read(sys.join("operstate")).unwrap_or_else(|| "unknown".into()),
                nominal_rate: nominal_rate.or(speed.map(|mbit| mbit as u64 * 1_000_000)),
                shaped_rate: shaped_rate(&n.name),
                channels: ethtool("-l", &n.name, parse_channels),
                rings: ethtool("-g", &n.name, parse_rings),
                name: n.name,
                address: n.address,
                fabric: n.fabric,
                network: n.network,
                mtu: n.mtu,
                up: n.up,
            }
        })
        .collect();
    let rdma = match std::fs::read_dir("/sys/class/infiniband") {
        Ok(d) => Probe::ok(
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect(),
        ),
        Err(_) => Probe::unavailable("no RDMA device (no /sys/class/infiniband)"),
    };
    HostFacts {
        host: host.into(),
        nics,
        cpu: cpu_facts(),
        rdma,
    }
}

fn nic_address(nic: &str) -> Result<String, ApiError> {
    crate::facts::interface_address(nic)
        .map(|a| a.to_string())
        .ok_or_else(|| ApiError::not_found("nic", nic))
}

/// One don't-fragment ping of `size` bytes (IP packet) out of `nic`.
async fn df_ping(nic: &str, peer: &str, size: u32) -> bool {
    let payload = size.saturating_sub(28).to_string();
    tokio::process::Command::new("ping")
        .args([
            "-n", "-q", "-M", "do", "-s", &payload, "-c", "1", "-W", "1", "-I", nic, peer,
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .await
        .is_ok_and(|s| s.success())
}

/// The largest DF packet that passes from `nic` to `peer_addr`, by bisection
/// between 576 and `size`.
pub async fn probe_path(req: PathProbeRequest) -> Result<PathProbeResult, ApiError> {
    nic_address(&req.nic)?;
    if !(MIN_PACKET..=65535).contains(&req.size) {
        return Err(ApiError::invalid(
            "size",
            format!("{} is outside 576..65535", req.size),
        ));
    }
    let largest = if df_ping(&req.nic, &req.peer_addr, req.size).await {
        req.size
    } else if !df_ping(&req.nic, &req.peer_addr, MIN_PACKET).await {
        0
    } else {
        let (mut ok, mut bad) = (MIN_PACKET, req.size);
        while bad - ok > 1 {
            let mid = ok + (bad - ok) / 2;
            if df_ping(&req.nic, &req.peer_addr, mid).await {
                ok = mid;
            } else {
                bad = mid;
            }
        }
        ok
    };
    Ok(PathProbeResult {
        nic: req.nic,
        peer_addr: req.peer_addr,
        size: req.size,
        largest,
    })
}

/// Throughput sinks by port. Each is a transport session with one carrier
/// listener on the NIC under test; the stream it carries ends in a local
/// socket that counts the bytes and times them from first to last.
#[derive(Default)]
pub struct Sinks(Mutex<BTreeMap<u16, Sink>>);

struct Sink {
    result: tokio::sync::oneshot::Receiver<SinkResult>,
    session: ferry_transport::Session,
    dir: std::path::PathBuf,
}

impl Sinks {
    pub async fn open(&self, req: SinkRequest, secret: &[u8]) -> Result<SinkReply, ApiError> {
        let address = nic_address(&req.nic)?;
        let ip: std::net::IpAddr = address.parse().map_err(ApiError::internal)?;
        let session: [u8; 16] = rand::random();
        let dir = std::env::temp_dir().join(format!(
            "ferry-sink-{}",
            ferry_transport::session_to_hex(&session)
        ));
        std::fs::create_dir_all(&dir).map_err(ApiError::internal)?;
        let sock = dir.join("sink.sock");
        let local = tokio::net::UnixListener::bind(&sock).map_err(ApiError::internal)?;
        let (session_handle, bound) = ferry_transport::Session::target(
            session,
            &unsealed(secret),
            vec![(req.nic.clone(), ip)],
            sock,
        )
        .await
        .map_err(|e| ApiError::internal(ferry_api::util::error_chain(&e)))?;
        let port = bound
            .first()
            .map(|(_, a)| a.port())
            .ok_or_else(|| ApiError::internal("no carrier listener"))?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let accepted = tokio::time::timeout(Duration::from_secs(10), local.accept()).await;
            let Ok(Ok((mut s, _))) = accepted else {
                let _ = tx.send(SinkResult {
                    bytes: 0,
                    duration_ms: 0,
                });
                return;
            };
            let mut buf = vec![0u8; 256 << 10];
            let (mut bytes, mut first, mut last) = (0u64, None, Instant::now());
            let deadline = Instant::now() + MAX_SEND + Duration::from_secs(2);
            while Instant::now() < deadline {
                match tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf)).await {
                    Ok(Ok(n)) if n > 0 => {
                        let now = Instant::now();
                        first.get_or_insert(now);
                        last = now;
                        bytes += n as u64;
                    }
                    _ => break,
                }
            }
            let duration_ms = first.map(|f| (last - f).as_millis() as u64).unwrap_or(0);
            let _ = tx.send(SinkResult { bytes, duration_ms });
        });
        self.0.lock().unwrap_or_else(|p| p.into_inner()).insert(
            port,
            Sink {
                result: rx,
                session: session_handle,
                dir,
            },
        );
        Ok(SinkReply {
            address,
            port,
            session: ferry_transport::session_to_hex(&session),
        })
    }

    pub async fn result(&self, port: u16) -> Result<SinkResult, ApiError> {
        let sink = self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&port)
            .ok_or_else(|| ApiError::not_found("throughput sink", &port.to_string()))?;
        let r = tokio::time::timeout(MAX_SEND + Duration::from_secs(5), sink.result).await;
        sink.session.close();
        let _ = std::fs::remove_dir_all(&sink.dir);
        r.map_err(|_| ApiError::internal("the sink did not finish"))?
            .map_err(ApiError::internal)
    }
}

/// Sends as fast as the transport allows over one carrier from `nic` to a
/// peer's sink for `duration_ms`: the same frames, checksums and
/// acknowledgements a migration's bytes get.
pub async fn send(req: SendRequest, secret: &[u8]) -> Result<SendResult, ApiError> {
    let local: std::net::IpAddr = nic_address(&req.nic)?.parse().map_err(ApiError::internal)?;
    let duration = Duration::from_millis(req.duration_ms).min(MAX_SEND);
    let session = ferry_transport::session_from_hex(&req.session)
        .ok_or_else(|| ApiError::invalid("session", "not 32 hex digits"))?;
    let peer: std::net::SocketAddr =
        format!("{}:{}", req.peer_addr, req.port)
            .parse()
            .map_err(|_| {
                ApiError::invalid(
                    "peer_addr",
                    format!("'{}' is not an IPv4 address", req.peer_addr),
                )
            })?;
    let dir = std::env::temp_dir().join(format!("ferry-send-{}", req.session));
    std::fs::create_dir_all(&dir).map_err(ApiError::internal)?;
    let sock = dir.join("send.sock");
    let path = format!("path {} → {peer}", req.nic);
    let s = ferry_transport::Session::source(
        session,
        &unsealed(secret),
        sock.clone(),
        vec![(req.nic.clone(), local, peer)],
    )
    .await
    .map_err(|e| ApiError::unavailable(path.clone(), ferry_api::util::error_chain(&e)))?;
    let result = async {
        for _ in 0..100 {
            if s.stats().healthy == 1 {
                break;
            }
            if let Some(why) = s.failure() {
                return Err(ApiError::unavailable(path.clone(), why));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if s.stats().healthy != 1 {
            return Err(ApiError::unavailable(
                path.clone(),
                "the carrier did not come up",
            ));
        }
        let mut u = tokio::net::UnixStream::connect(&sock)
            .await
            .map_err(ApiError::internal)?;
        let buf = vec![0x5au8; 256 << 10];
        let end = Instant::now() + duration;
        let mut bytes = 0u64;
        while Instant::now() < end {
            match tokio::time::timeout(Duration::from_secs(2), u.write(&buf)).await {
                Ok(Ok(n)) => bytes += n as u64,
                _ => break,
            }
        }
        let _ = u.shutdown().await;
        // let the last frames and the end of the stream arrive before the carrier goes
        for _ in 0..100 {
            let st = s.stats();
            if st.carriers.iter().all(|c| c.tx_bytes >= bytes) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        Ok(SendResult { bytes })
    }
    .await;
    s.close();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Path measurements carry filler, not guest memory: never sealed, so they
/// measure the path alone.
fn unsealed(secret: &[u8]) -> ferry_transport::Keys<'_> {
    ferry_transport::Keys {
        secret,
        sealed: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VETH_L: &str = "Channel parameters for va:\nPre-set maximums:\nRX:\t\t2\nTX:\t\t2\nOther:\t\tn/a\nCombined:\tn/a\nCurrent hardware settings:\nRX:\t\t1\nTX:\t\t1\nOther:\t\tn/a\nCombined:\tn/a\n";

    #[test]
    fn parses_ethtool_channels() {
        let c = parse_channels(VETH_L);
        assert_eq!(
            (c.max_rx, c.max_tx, c.rx, c.tx),
            (Some(2), Some(2), Some(1), Some(1))
        );
        assert_eq!((c.max_combined, c.combined), (None, None));
    }

    #[test]
    fn parses_ethtool_rings() {
        let t = "Ring parameters for eth0:\nPre-set maximums:\nRX:\t\t4096\nRX Mini:\tn/a\nTX:\t\t4096\nCurrent hardware settings:\nRX:\t\t256\nTX:\t\t256\n";
        let r = parse_rings(t);
        assert_eq!(
            (r.max_rx, r.rx, r.max_tx, r.tx),
            (Some(4096), Some(256), Some(4096), Some(256))
        );
    }
}
