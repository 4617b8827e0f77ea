//! `ferry`: the command line front end, and the agent and control service
//! daemons (`ferry agent`, `ferry control`) in one binary.
//!
//! Every VM and host verb goes through the control service's API
//! (`ferry_api::client`); `ferry lab` manages the local lab directly because
//! it creates the machines the control service runs on.

mod bandwidth_cmd;
mod cluster_cmd;
mod config;
mod daemons;
mod demo;
mod host_cmd;
mod lab_cmd;
mod output;
mod storage_cmd;
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
    /// Control service URL.
    #[arg(
        long,
        global = true,
        env = "FERRY_CONTROL",
        default_value = "http://127.0.0.1:7700"
    )]
    control: String,
    /// Cluster credential file (default /etc/ferry/cluster.token, else the lab's).
    #[arg(long, global = true, env = "FERRY_TOKEN_FILE")]
    token_file: Option<PathBuf>,
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
    /// Settings of the whole cluster (encrypted carriers).
    #[command(subcommand)]
    Cluster(cluster_cmd::ClusterCmd),
    /// The control service's event log: migrations, drains, hosts down and up, storage changes.
    Events {
        #[arg(long, default_value_t = 50)]
        limit: usize,
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
    /// The credential: `--token-file`, else the installed cluster's
    /// (`/etc/ferry/cluster.token`), else the lab's.
    fn token_file(&self) -> PathBuf {
        self.token_file.clone().unwrap_or_else(|| {
            let installed = PathBuf::from(config::DEFAULT_CREDENTIAL);
            if installed.exists() {
                installed
            } else {
                ferry_lab::net::LabDir::default_path().token_path()
            }
        })
    }

    fn client(&self) -> anyhow::Result<ferry_api::client::Client> {
        let path = self.token_file();
        let cred = ferry_api::auth::Credential::load(&path).map_err(|e| {
            anyhow::anyhow!(
                "cannot read the cluster credential {} ({e}); is a lab up (`ferry lab up`)?",
                path.display()
            )
        })?;
        Ok(ferry_api::client::Client::new(
            "control service",
            &self.control,
            cred,
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
    }
    let rt = match tokio::runtime::Runtime::new() {
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
            Cmd::Events { limit, json } => vm_cmd::events(&cli, *limit, *json).await,
            Cmd::Demo(a) => demo::run(&cli, a).await,
            Cmd::Agent(a) => daemons::agent(a).await,
            Cmd::QemuArgs(a) => daemons::qemu_args(a),
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
