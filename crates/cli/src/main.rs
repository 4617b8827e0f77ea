//! `ferry`: the command line front end, and the agent and control service
//! daemons (`ferry agent`, `ferry control`) in one binary.
//!
//! Every VM and host verb goes through the control service's API
//! (`ferry_net::client`); `ferry lab` manages the local lab directly because
//! it creates the machines the control service runs on.

mod bandwidth_cmd;
mod certs_cmd;
mod cluster_cmd;
mod config;
mod daemons;
mod demo;
mod host_cmd;
mod lab_cmd;
mod output;
mod placement_cmd;
mod rolling;
mod storage_cmd;
mod token_cmd;
mod vm_cmd;
mod vm_spec;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ferry",
    version,
    about = "Live migration of QEMU VMs between Linux hosts"
)]
pub struct Cli {
    /// Control service URL (`http://` only for a control service run with
    /// --insecure-http).
    #[arg(
        long,
        global = true,
        env = "FERRY_CONTROL",
        default_value = "https://127.0.0.1:7700"
    )]
    control: String,
    /// API token file (default /etc/ferry/admin.token, else the lab's).
    #[arg(long, global = true, env = "FERRY_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// The cluster CA's certificate, to verify the control service's
    /// (default /etc/ferry/pki/ca-cert.pem, else the lab's).
    #[arg(long, global = true, env = "FERRY_CA")]
    ca: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Lab cluster on this machine: hosts as network namespaces.
    #[command(subcommand)]
    Lab(lab_cmd::LabCmd),
    /// Virtual machines.
    #[command(subcommand)]
    Vm(vm_cmd::VmCmd),
    /// Hosts of the cluster.
    #[command(subcommand)]
    Host(host_cmd::HostCmd),
    /// Disks served over NBD by the storage service.
    #[command(subcommand)]
    Disk(storage_cmd::DiskCmd),
    /// Storage QoS: policies, flows, settings.
    #[command(subcommand)]
    Qos(storage_cmd::QosCmd),
    /// Bandwidth per traffic class (live-migration, storage, default) on every NIC.
    #[command(subcommand)]
    Bandwidth(bandwidth_cmd::BandwidthCmd),
    /// Settings of the whole cluster (encryption of moves).
    #[command(subcommand)]
    Cluster(cluster_cmd::ClusterCmd),
    /// API tokens for the control service, each with a role (admin only).
    #[command(subcommand)]
    Token(token_cmd::TokenCmd),
    /// Placement rules: VMs together or apart, in or out of host groups.
    #[command(subcommand)]
    Rule(placement_cmd::RuleCmd),
    /// Host groups for placement rules: hosts by name or label.
    #[command(subcommand)]
    Group(placement_cmd::GroupCmd),
    /// The control service's event log: migrations, drains, hosts down and up, storage changes.
    Events {
        #[arg(long, default_value_t = 50)]
        limit: usize,
        #[arg(long)]
        json: bool,
    },
    /// Migrations and drains the control service runs or ran (the newest
    /// 64 since it started); with an ID, that one's events.
    Operations {
        id: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Main job: a lab, a few VMs, live migrations, a report.
    Demo(demo::DemoArgs),
    /// Run a host agent (started by `ferry lab up` inside each host).
    Agent(daemons::AgentArgs),
    /// Print, as a JSON array, the QEMU command line an agent would run for a
    /// VM (benchmarks run QEMU by hand with exactly the agent's arguments).
    #[command(hide = true)]
    QemuArgs(daemons::QemuArgsArgs),
    /// Run the control service (started by `ferry lab up`).
    Control(daemons::ControlArgs),
    /// Give a service that runs as its own user (control, storage) the files
    /// its configuration names: run as root by its systemd unit.
    ServiceFiles(daemons::ServiceFilesArgs),
    /// Storage service.
    #[command(subcommand)]
    Storage(StorageCmd),
}

// parsed once per process; boxing the daemon's arguments buys nothing
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum StorageCmd {
    /// Run a storage node: disks over NBD with storage QoS (started by `ferry lab up`).
    Serve(daemons::StorageArgs),
    /// Storage nodes the control service knows, and whether they answer.
    List {
        #[arg(long)]
        json: bool,
    },
}

impl Cli {
    /// The first of `flag`, the installed cluster's file, the lab's.
    fn default_file(flag: Option<&PathBuf>, installed: &str, lab: PathBuf) -> PathBuf {
        flag.cloned().unwrap_or_else(|| {
            let installed = PathBuf::from(installed);
            if installed.exists() {
                installed
            } else {
                lab
            }
        })
    }

    /// The API token: `--token-file`, else `/etc/ferry/admin.token`, else the lab's.
    fn token_file(&self) -> PathBuf {
        Self::default_file(
            self.token_file.as_ref(),
            config::DEFAULT_ADMIN_TOKEN,
            ferry_lab::net::LabDir::default_path().admin_token_path(),
        )
    }

    /// The cluster CA: `--ca`, else `/etc/ferry/pki/ca-cert.pem`, else the lab's.
    fn ca_file(&self) -> PathBuf {
        Self::default_file(
            self.ca.as_ref(),
            &format!("{}/{}", config::PKI, ferry_net::tls::CA_CERT),
            ferry_lab::net::LabDir::default_path().ca_cert_path(),
        )
    }

    /// An administrator's certificate for NBD: `flag`, else
    /// `/etc/ferry/admin-pki`, else the lab's, when there.
    pub fn admin_tls_dir(flag: Option<&PathBuf>) -> Option<PathBuf> {
        let dir = Self::default_file(
            flag,
            config::DEFAULT_ADMIN_TLS_DIR,
            ferry_lab::net::LabDir::default_path()
                .pki_path()
                .join("admin"),
        );
        dir.join(ferry_net::tls::CERT).exists().then_some(dir)
    }

    fn client(&self) -> anyhow::Result<ferry_net::client::Client> {
        self.client_at(&self.control)
    }

    /// A client of the control service at `url` (one of several instances).
    fn client_at(&self, url: &str) -> anyhow::Result<ferry_net::client::Client> {
        let path = self.token_file();
        let cred = ferry_api::auth::Credential::load(&path).map_err(|e| {
            anyhow::anyhow!(
                "cannot read the API token {} ({e}); is a lab up (`ferry lab up`)?",
                path.display()
            )
        })?;
        let tls = if url.starts_with("https://") {
            let ca = self.ca_file();
            Some(ferry_net::tls::anonymous_client_config(&ca).map_err(|e| {
                anyhow::anyhow!("cannot read the cluster CA to verify the control service: {e}")
            })?)
        } else {
            None
        };
        Ok(ferry_net::client::Client::new(
            "control service",
            url,
            ferry_net::client::ClientAuth {
                bearer: Some(cred),
                tls,
            },
        ))
    }
}

/// Migration frames are buffers of up to 256 KiB, allocated and freed by the
/// thousand per second. Above glibc's default threshold each would be its own
/// mmap, faulted in page by page and unmapped again; a fixed threshold of
/// 4 MiB keeps them on the heap, and a high trim threshold keeps the heap.
fn keep_frame_buffers_on_the_heap() {
    // SAFETY: mallopt only sets allocator parameters; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 4 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
    }
}

fn main() {
    let cli = Cli::parse();
    let daemon = matches!(
        cli.cmd,
        Cmd::Agent(_) | Cmd::Control(_) | Cmd::Storage(StorageCmd::Serve(_))
    );
    let filter = tracing_subscriber::EnvFilter::try_from_env("FERRY_LOG").unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(if daemon { "info" } else { "warn" })
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .init();
    if daemon {
        keep_frame_buffers_on_the_heap();
    } else if !matches!(cli.cmd, Cmd::Lab(_) | Cmd::Demo(_)) {
        // a client's output piped into `head` ends it quietly, as any Unix
        // tool, instead of panicking on the closed pipe (Rust ignores
        // SIGPIPE); its network I/O is TCP, sent with MSG_NOSIGNAL. Daemons
        // and the lab (QMP and other unix sockets) keep ignoring it.
        // SAFETY: signal(2) with SIG_DFL installs no handler; this runs
        // before any other thread exists.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let rt = match runtime_for(&cli.cmd) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = rt.block_on(async {
        match &cli.cmd {
            Cmd::Lab(c) => lab_cmd::run(&cli, c).await,
            Cmd::Vm(c) => vm_cmd::run_vm(&cli, c).await,
            Cmd::Host(c) => host_cmd::run_host(&cli, c).await,
            Cmd::Disk(c) => storage_cmd::run_disk(&cli, c).await,
            Cmd::Qos(c) => storage_cmd::run_qos(&cli, c).await,
            Cmd::Bandwidth(c) => bandwidth_cmd::run(&cli, c).await,
            Cmd::Cluster(c) => cluster_cmd::run(&cli, c).await,
            Cmd::Token(c) => token_cmd::run(&cli, c).await,
            Cmd::Rule(c) => placement_cmd::run_rule(&cli, c).await,
            Cmd::Group(c) => placement_cmd::run_group(&cli, c).await,
            Cmd::Events { limit, json } => vm_cmd::events(&cli, *limit, *json).await,
            Cmd::Operations { id, json } => vm_cmd::operations(&cli, id.as_deref(), *json).await,
            Cmd::Demo(a) => demo::run(&cli, a).await,
            Cmd::Agent(a) => daemons::agent(a).await,
            Cmd::QemuArgs(a) => daemons::qemu_args(a),
            Cmd::ServiceFiles(a) => daemons::own_service_files(a),
            Cmd::Control(a) => daemons::control(a).await,
            Cmd::Storage(StorageCmd::Serve(a)) => daemons::storage(a).await,
            Cmd::Storage(StorageCmd::List { json }) => storage_cmd::list_nodes(&cli, *json).await,
        }
    });
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}

/// The runtime a command runs on. An agent's control plane (its API,
/// heartbeats, the steps of each move) runs on one thread: it wakes a few
/// times a second, and a second worker only adds the wake-ups of handing its
/// tasks between threads. The carriers' relays, which wake for every frame,
/// get a runtime of their own with a worker per core
/// (`ferry_transport::relay`, set up in `daemons::agent`). Every other
/// command runs on the default multi-threaded runtime.
fn runtime_for(cmd: &Cmd) -> std::io::Result<tokio::runtime::Runtime> {
    match cmd {
        Cmd::Agent(_) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        _ => tokio::runtime::Runtime::new(),
    }
}
