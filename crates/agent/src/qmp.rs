//! QMP, QEMU's control protocol, through the `qapi` crate's tokio client.
//!
//! The commands Ferry uses are declared here as small typed structs
//! implementing `qapi::Command`, with reply types that accept every field
//! QEMU 9/10 may add (unknown fields are ignored, statuses are strings), so a
//! newer QEMU cannot break decoding. Every call has a deadline: a QEMU whose
//! monitor is stuck must never stall an agent.

use std::path::Path;
use std::time::Duration;

use qapi::futures::{QapiService, QmpStreamTokio};
use serde::{Deserialize, Serialize};
use tokio::io::WriteHalf;
use tokio::net::UnixStream;

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("Cannot connect to QMP socket {path}")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("QMP command {command} failed: {reason}")]
    Command {
        command: &'static str,
        reason: String,
    },
    #[error("QMP command {command} got no reply within {secs} s")]
    Timeout { command: &'static str, secs: u64 },
}

type Service = QapiService<QmpStreamTokio<WriteHalf<UnixStream>>>;

macro_rules! qmp_command {
    ($ty:ident, $name:literal, $ok:ty) => {
        impl qapi::Command for $ty {
            type Ok = $ok;
            const NAME: &'static str = $name;
            const ALLOW_OOB: bool = false;
        }
        impl qapi::qmp::QmpCommand for $ty {}
    };
}

#[derive(Serialize)]
struct QueryStatus {}
#[derive(Debug, Clone, Deserialize)]
pub struct StatusInfo {
    pub status: String,
    pub running: bool,
}
qmp_command!(QueryStatus, "query-status", StatusInfo);

#[derive(Serialize)]
struct QueryMigrate {}
qmp_command!(QueryMigrate, "query-migrate", MigrationInfo);

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct RamStats {
    #[serde(default)]
    pub transferred: u64,
    #[serde(default)]
    pub remaining: u64,
    #[serde(default)]
    pub total: u64,
    #[serde(default)]
    pub dirty_pages_rate: u64,
    #[serde(default)]
    pub mbps: f64,
    #[serde(default)]
    pub dirty_sync_count: u64,
    #[serde(default)]
    pub page_size: u64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct SocketAddr {
    #[serde(default)]
    pub host: Option<String>,
    #[serde(default)]
    pub port: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct MigrationInfo {
    #[serde(default)]
    pub status: Option<String>,
    #[serde(default)]
    pub ram: Option<RamStats>,
    #[serde(default)]
    pub total_time: Option<u64>,
    #[serde(default)]
    pub expected_downtime: Option<u64>,
    #[serde(default)]
    pub downtime: Option<u64>,
    #[serde(default)]
    pub setup_time: Option<u64>,
    #[serde(default)]
    pub error_desc: Option<String>,
    #[serde(default)]
    pub socket_address: Option<Vec<SocketAddr>>,
    #[serde(default)]
    pub cpu_throttle_percentage: Option<u64>,
}

#[derive(Serialize)]
struct Migrate {
    uri: String,
}
qmp_command!(Migrate, "migrate", qapi::Empty);

#[derive(Serialize)]
struct MigrateIncoming {
    uri: String,
}
qmp_command!(MigrateIncoming, "migrate-incoming", qapi::Empty);

#[derive(Serialize)]
struct MigrateCancel {}
qmp_command!(MigrateCancel, "migrate_cancel", qapi::Empty);

/// The subset of `migrate-set-parameters` Ferry sets.
#[derive(Serialize, Default)]
#[serde(rename_all = "kebab-case")]
pub struct MigrationParameters {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_bandwidth: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub downtime_limit: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub multifd_channels: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_throttle_initial: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_throttle_increment: Option<u64>,
    /// Bytes per second QEMU may assume for the switch-over (QEMU ≥ 8.2).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub avail_switchover_bandwidth: Option<u64>,
}
qmp_command!(MigrationParameters, "migrate-set-parameters", qapi::Empty);

#[derive(Serialize)]
struct Capability {
    capability: &'static str,
    state: bool,
}
#[derive(Serialize)]
struct SetCapabilities {
    capabilities: Vec<Capability>,
}
qmp_command!(SetCapabilities, "migrate-set-capabilities", qapi::Empty);

#[derive(Serialize)]
struct StartPostcopy {}
qmp_command!(StartPostcopy, "migrate-start-postcopy", qapi::Empty);

#[derive(Serialize)]
struct Cont {}
qmp_command!(Cont, "cont", qapi::Empty);

/// `blockdev-add` of a raw disk over NBD.
#[derive(Serialize)]
struct BlockdevAdd {
    driver: &'static str,
    #[serde(rename = "node-name")]
    node_name: String,
    file: NbdFile,
}
#[derive(Serialize)]
struct NbdFile {
    driver: &'static str,
    server: InetServer,
    export: String,
}
#[derive(Serialize)]
struct InetServer {
    #[serde(rename = "type")]
    kind: &'static str,
    host: String,
    port: String,
}
qmp_command!(BlockdevAdd, "blockdev-add", qapi::Empty);

#[derive(Serialize)]
struct DeviceAdd {
    driver: &'static str,
    id: String,
    drive: String,
    bus: String,
}
qmp_command!(DeviceAdd, "device_add", qapi::Empty);

#[derive(Serialize)]
struct Quit {}
qmp_command!(Quit, "quit", qapi::Empty);

/// A negotiated QMP session with one QEMU.
pub struct Qmp {
    svc: Service,
    events: tokio::task::JoinHandle<()>,
}

impl Drop for Qmp {
    fn drop(&mut self) {
        self.events.abort();
    }
}

const DEFAULT_DEADLINE: Duration = Duration::from_secs(10);

impl Qmp {
    /// Connects to QEMU's QMP socket, retrying until `wait` has passed (QEMU
    /// creates the socket shortly after it starts).
    pub async fn connect(path: &Path, wait: Duration) -> Result<Qmp, QmpError> {
        let deadline = tokio::time::Instant::now() + wait;
        let shown = path.display().to_string();
        loop {
            let attempt = async {
                let neg = QmpStreamTokio::open_uds(path).await?;
                neg.negotiate().await
            };
            match tokio::time::timeout(Duration::from_secs(5), attempt).await {
                Ok(Ok(stream)) => {
                    let (svc, events) = stream.spawn_tokio();
                    return Ok(Qmp { svc, events });
                }
                Ok(Err(e)) if tokio::time::Instant::now() >= deadline => {
                    return Err(QmpError::Connect {
                        path: shown,
                        source: e,
                    });
                }
                Err(_) if tokio::time::Instant::now() >= deadline => {
                    let e = std::io::Error::new(std::io::ErrorKind::TimedOut, "no QMP greeting");
                    return Err(QmpError::Connect {
                        path: shown,
                        source: e,
                    });
                }
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    async fn call<C>(&self, cmd: C, deadline: Duration) -> Result<C::Ok, QmpError>
    where
        C: qapi::Command + qapi::qmp::QmpCommand + Send + 'static,
        C::Ok: Send,
    {
        let name = C::NAME;
        // run to its reply on its own: a command dropped while it waits
        // (a deadline, a caller that gave up) would leave its id pending
        // in the QMP service, and the next command with that id panics
        let running = tokio::spawn(self.svc.execute(cmd));
        match tokio::time::timeout(deadline, running).await {
            Ok(Ok(Ok(v))) => Ok(v),
            Ok(Ok(Err(e))) => Err(QmpError::Command {
                command: name,
                reason: e.to_string(),
            }),
            Ok(Err(e)) => Err(QmpError::Command {
                command: name,
                reason: format!("the command's task ended: {e}"),
            }),
            Err(_) => Err(QmpError::Timeout {
                command: name,
                secs: deadline.as_secs(),
            }),
        }
    }

    pub async fn status(&self) -> Result<StatusInfo, QmpError> {
        self.call(QueryStatus {}, DEFAULT_DEADLINE).await
    }

    pub async fn query_migrate(&self) -> Result<MigrationInfo, QmpError> {
        self.call(QueryMigrate {}, DEFAULT_DEADLINE).await
    }

    pub async fn migrate(&self, uri: &str) -> Result<(), QmpError> {
        self.call(Migrate { uri: uri.into() }, DEFAULT_DEADLINE)
            .await
            .map(drop)
    }

    pub async fn migrate_incoming(&self, uri: &str) -> Result<(), QmpError> {
        self.call(MigrateIncoming { uri: uri.into() }, DEFAULT_DEADLINE)
            .await
            .map(drop)
    }

    pub async fn migrate_cancel(&self) -> Result<(), QmpError> {
        self.call(MigrateCancel {}, Duration::from_secs(5))
            .await
            .map(drop)
    }

    pub async fn set_parameters(&self, p: MigrationParameters) -> Result<(), QmpError> {
        self.call(p, DEFAULT_DEADLINE).await.map(drop)
    }

    pub async fn set_capabilities(&self, caps: &[(&'static str, bool)]) -> Result<(), QmpError> {
        let capabilities = caps
            .iter()
            .map(|(c, s)| Capability {
                capability: c,
                state: *s,
            })
            .collect();
        self.call(SetCapabilities { capabilities }, DEFAULT_DEADLINE)
            .await
            .map(drop)
    }

    pub async fn start_postcopy(&self) -> Result<(), QmpError> {
        self.call(StartPostcopy {}, DEFAULT_DEADLINE)
            .await
            .map(drop)
    }

    pub async fn cont(&self) -> Result<(), QmpError> {
        self.call(Cont {}, DEFAULT_DEADLINE).await.map(drop)
    }

    /// Hot-plugs disk number `index` (a virtio-blk on root port `rp{index}`)
    /// reading NBD export `export` at `host:port`.
    pub async fn plug_disk(
        &self,
        index: usize,
        host: &str,
        port: u16,
        export: &str,
    ) -> Result<(), QmpError> {
        let node = format!("disk{index}");
        self.call(
            BlockdevAdd {
                driver: "raw",
                node_name: node.clone(),
                file: NbdFile {
                    driver: "nbd",
                    server: InetServer {
                        kind: "inet",
                        host: host.to_string(),
                        port: port.to_string(),
                    },
                    export: export.to_string(),
                },
            },
            Duration::from_secs(20),
        )
        .await?;
        self.call(
            DeviceAdd {
                driver: "virtio-blk-pci",
                id: format!("vd{index}"),
                drive: node,
                bus: format!("rp{index}"),
            },
            DEFAULT_DEADLINE,
        )
        .await
        .map(|_| ())
    }

    pub async fn quit(&self) -> Result<(), QmpError> {
        self.call(Quit {}, Duration::from_secs(3)).await.map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

    /// A QMP server that answers every command in order, the first
    /// `query-status` only after `late`.
    async fn slow_qemu(path: std::path::PathBuf, late: Duration) {
        let l = tokio::net::UnixListener::bind(&path).unwrap();
        let (s, _) = l.accept().await.unwrap();
        let (r, mut w) = s.into_split();
        let mut lines = BufReader::new(r).lines();
        w.write_all(b"{\"QMP\": {\"version\": {\"qemu\": {\"micro\": 0, \"minor\": 0, \"major\": 10}, \"package\": \"\"}, \"capabilities\": []}}\n")
            .await
            .unwrap();
        let mut first = true;
        while let Ok(Some(line)) = lines.next_line().await {
            let reply = if line.contains("query-status") {
                if first {
                    first = false;
                    tokio::time::sleep(late).await;
                }
                "{\"return\": {\"status\": \"running\", \"running\": true}}\n"
            } else {
                "{\"return\": {}}\n"
            };
            w.write_all(reply.as_bytes()).await.unwrap();
        }
    }

    #[tokio::test]
    async fn a_command_past_its_deadline_does_not_break_the_next() {
        let dir = std::env::temp_dir().join(format!("ferry-qmp-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("qmp.sock");
        tokio::spawn(slow_qemu(path.clone(), Duration::from_millis(600)));
        let q = Qmp::connect(&path, Duration::from_secs(5)).await.unwrap();
        let r = q.call(QueryStatus {}, Duration::from_millis(100)).await;
        assert!(matches!(r, Err(QmpError::Timeout { .. })), "{r:?}");
        // the late reply still belongs to the first command; the next gets its own
        let s = q
            .call(QueryStatus {}, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(s.running);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
