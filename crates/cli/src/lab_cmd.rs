//! `ferry lab …`: bring a lab cluster up and down, cut links, build the image.

use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use ferry_lab::net::{self, LabDir};
use ferry_lab::topology::{self, LabSpec};

use crate::output::{print_json, Table};
use crate::Cli;

#[derive(Subcommand)]
pub enum LabCmd {
    /// Create hosts, NICs, fabrics; start an agent per host and the control service.
    Up(UpArgs),
    /// Remove everything a lab made (also a half-made or crashed lab).
    Down,
    /// Show hosts, NICs, link states and counters.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Cut or restore one host NIC's link (`mgmt0`: its management link,
    /// to the control service and the storage node).
    Link {
        host: String,
        nic: String,
        state: LinkState,
    },
    /// Set one host NIC's MTU (host side only, as a misconfigured host would).
    Mtu { host: String, nic: String, mtu: u32 },
    /// Reshape one host NIC's link to another rate (both directions).
    Rate {
        host: String,
        nic: String,
        rate: String,
    },
    /// Give every host an alternative to Ferry's transport over the same NICs,
    /// for running the same QEMU migration over it: an ECMP "team" hashing
    /// connections on layer 4 (no bonding driver here), an active-backup team
    /// (one fabric at a time, moved by a probing monitor per host), kernel
    /// MPTCP with one subflow per NIC, or none.
    Team { kind: TeamArg },
    /// Run one host's active-backup monitor (started by `ferry lab team
    /// active-backup`, inside the host's namespace).
    #[command(hide = true)]
    TeamMonitor { host: String },
    /// Start a host's agent again (after it was killed).
    RestartAgent { host: String },
    /// Fail a whole host: `off` (every process killed, QEMU included, and
    /// its links down: a pulled power cord), `on` (links up, isolation
    /// removed, its agent started), `isolate --network …` (one network cut
    /// while it runs on).
    Host {
        host: String,
        #[command(subcommand)]
        action: HostPower,
    },
    /// Start the control service, or a storage node, again (killed with
    /// SIGKILL first if it runs), on the same configuration and state;
    /// done when it takes connections again.
    Restart {
        service: LabService,
        /// Which storage node (storage1 by default).
        #[arg(long, default_value_t = 1)]
        node: u32,
        /// Which control instance (after `lab control up --instances N`).
        #[arg(long, default_value_t = 1)]
        instance: u32,
    },
    /// Run the control service as several instances on the lab's etcd.
    Control {
        #[command(subcommand)]
        action: ControlAction,
    },
    /// Build (or show) the cached guest image.
    Image {
        #[arg(long)]
        rebuild: bool,
        /// Also build the Debian guest (systemd, qemu-guest-agent, a TCP echo
        /// service) from Debian packages with mmdebstrap.
        #[arg(long)]
        debian: bool,
    },
}

#[derive(Subcommand, Clone)]
pub enum ControlAction {
    /// Start etcd (TLS, client certificates, on loopback) and replace the
    /// control service with N instances sharing it (127.0.0.1:7700, :7701,
    /// …), one of which leads. The state starts empty: the VMs' records are
    /// taken up from the hosts' listings.
    Up {
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=MAX_CONTROL_INSTANCES as i64))]
        instances: u32,
    },
}

/// Control instances a lab may run.
const MAX_CONTROL_INSTANCES: u32 = 5;
/// The lab's etcd, on loopback in the root namespace.
const ETCD_CLIENT: &str = "127.0.0.1:2379";
const ETCD_PEER: &str = "127.0.0.1:2380";

/// Instance `i`'s pid and configuration name (`control`, `control2`, …).
fn control_name(i: u32) -> String {
    if i == 1 {
        "control".into()
    } else {
        format!("control{i}")
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub enum LabService {
    Control,
    Storage,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum TeamArg {
    Ecmp,
    ActiveBackup,
    Mptcp,
    None,
}

#[derive(Subcommand, Clone)]
pub enum HostPower {
    Off,
    On,
    Isolate {
        #[arg(long, value_enum)]
        network: IsolateNet,
    },
}

#[derive(Clone, Copy, ValueEnum)]
pub enum IsolateNet {
    /// The control service's calls to its agent.
    Management,
    /// Its migration fabrics.
    Migration,
    /// Its NBD and storage traffic.
    Storage,
    All,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum LinkState {
    Up,
    Down,
    /// The switch stops forwarding the port; both ends keep their carrier.
    Silent,
}

#[derive(Args, Clone)]
pub struct UpArgs {
    #[arg(long, default_value_t = 3)]
    pub hosts: u32,
    #[arg(long, default_value_t = 2)]
    pub nics: u32,
    /// Link rate of every NIC (tc syntax: 1gbit, 500mbit).
    #[arg(long, default_value = "1gbit")]
    pub rate: String,
    #[arg(long, default_value_t = 1500)]
    pub mtu: u32,
    /// Memory each host offers to VMs.
    #[arg(long, default_value = "6G")]
    pub host_memory: String,
    /// Storage nodes (storage1, storage2, …) on the management bridge.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4))]
    pub storage_nodes: u32,
    /// Give each host CPUs of its own: `split` shares the machine's out
    /// evenly, or `host1=0,host2=1` names them. A host's agent, its QEMUs and
    /// their threads run only there (a cpuset cgroup, v1 or v2).
    #[arg(long)]
    pub cpus: Option<String>,
    /// Remove a lab that is already up first.
    #[arg(long)]
    pub replace: bool,
    #[arg(long)]
    pub json: bool,
}

pub async fn run(cli: &Cli, cmd: &LabCmd) -> anyhow::Result<i32> {
    require_root()?;
    match cmd {
        LabCmd::Up(a) => up(cli, a).await,
        LabCmd::Down => {
            let removed = down();
            println!("lab removed ({} objects)", removed.len());
            Ok(0)
        }
        LabCmd::Status { json } => status(*json),
        LabCmd::Control {
            action: ControlAction::Up { instances },
        } => control_up(cli, *instances).await,
        LabCmd::Restart {
            service,
            node,
            instance,
        } => {
            let dir = LabDir::default_path();
            dir.load_spec()?;
            let cd = dir.control_dir();
            let name = match service {
                LabService::Control => control_name(*instance),
                LabService::Storage => topology::storage_pid_name(*node),
            };
            let conf = cd.join(format!("{name}.toml"));
            if !conf.exists() {
                anyhow::bail!("the lab has no {name} ({} missing)", conf.display());
            }
            stop_pidfile(&cd.join(format!("{name}.pid")));
            let conf = conf.display().to_string();
            match service {
                LabService::Control => {
                    start_root_daemon(&cd, &name, &["control", "--config", &conf])?
                }
                LabService::Storage => {
                    start_root_daemon(&cd, &name, &["storage", "serve", "--config", &conf])?
                }
            }
            wait_listening(&cd, &name, &conf).await?;
            println!("{name} restarted");
            Ok(0)
        }
        LabCmd::Link { host, nic, state } => {
            let spec = LabDir::default_path().load_spec()?;
            let said = match state {
                LinkState::Up => net::set_link(&spec, host, nic, true).map(|_| "up"),
                LinkState::Down => net::set_link(&spec, host, nic, false).map(|_| "down"),
                LinkState::Silent => net::set_link_silent(&spec, host, nic)
                    .map(|_| "cut beyond the NIC (carrier kept)"),
            }?;
            println!("{host} {nic}: link {said}");
            Ok(0)
        }
        LabCmd::Mtu { host, nic, mtu } => {
            let spec = LabDir::default_path().load_spec()?;
            net::set_mtu(&spec, host, nic, *mtu)?;
            println!("{host} {nic}: MTU {mtu}");
            Ok(0)
        }
        LabCmd::Rate { host, nic, rate } => {
            let spec = LabDir::default_path().load_spec()?;
            net::set_rate(&spec, host, nic, rate)?;
            println!("{host} {nic}: link shaped to {rate}");
            Ok(0)
        }
        LabCmd::Team { kind } => {
            let spec = LabDir::default_path().load_spec()?;
            let k = match kind {
                TeamArg::Ecmp => ferry_lab::team::TeamKind::Ecmp,
                TeamArg::ActiveBackup => ferry_lab::team::TeamKind::ActiveBackup,
                TeamArg::Mptcp => ferry_lab::team::TeamKind::Mptcp,
                TeamArg::None => ferry_lab::team::TeamKind::None,
            };
            let dir = LabDir::default_path();
            for h in spec.host_names() {
                stop_pidfile(&dir.host_dir(&h).join(MONITOR_PID));
            }
            for (host, addr) in ferry_lab::team::set(&spec, k)? {
                println!("{host}: migrate to {addr}");
            }
            if matches!(kind, TeamArg::ActiveBackup) {
                let exe = std::env::current_exe()?;
                for h in spec.host_names() {
                    let hd = dir.host_dir(&h);
                    let args = ["lab".to_string(), "team-monitor".into(), h.clone()];
                    let pid = net::spawn_daemon(
                        Some(&h),
                        &exe,
                        &args,
                        &hd.join("team-monitor.log"),
                        None,
                    )?;
                    std::fs::write(hd.join(MONITOR_PID), pid.to_string())?;
                }
                println!(
                    "active-backup monitors started (probing every {} ms, moving after {} ms of silence)",
                    ferry_lab::monitor::PROBE_EVERY.as_millis(),
                    ferry_lab::monitor::DOWN_AFTER.as_millis()
                );
            }
            Ok(0)
        }
        LabCmd::TeamMonitor { host } => {
            let spec = LabDir::default_path().load_spec()?;
            let i = topology::host_index(host)
                .filter(|i| *i <= spec.hosts)
                .ok_or_else(|| anyhow::anyhow!("no lab host named '{host}'"))?;
            ferry_lab::monitor::run_monitor(&spec, i)?;
            Ok(0)
        }
        LabCmd::Host { host, action } => {
            let dir = LabDir::default_path();
            let spec = dir.load_spec()?;
            match action {
                HostPower::Off => {
                    let n = net::power_off(&spec, host)?;
                    println!("{host}: powered off ({n} processes killed, links down)");
                }
                HostPower::On => {
                    net::power_on(&spec, host)?;
                    let i = topology::host_index(host).unwrap_or(0);
                    let alive = pidfile_runs(&dir.host_dir(host).join("agent.pid"));
                    if !alive {
                        start_agent(&dir, &spec, i)?;
                    }
                    println!(
                        "{host}: on (links up, no isolation, agent {})",
                        if alive { "running" } else { "started" }
                    );
                }
                HostPower::Isolate { network } => {
                    let n = match network {
                        IsolateNet::Management => net::Network::Management,
                        IsolateNet::Migration => net::Network::Migration,
                        IsolateNet::Storage => net::Network::Storage,
                        IsolateNet::All => net::Network::All,
                    };
                    net::isolate(&spec, host, n)?;
                    println!(
                        "{host}: isolated ({} cut; `ferry lab host {host} on` restores it)",
                        match network {
                            IsolateNet::Management => "management",
                            IsolateNet::Migration => "migration fabrics",
                            IsolateNet::Storage => "storage",
                            IsolateNet::All => "every network",
                        }
                    );
                }
            }
            Ok(0)
        }
        LabCmd::RestartAgent { host } => {
            let dir = LabDir::default_path();
            let spec = dir.load_spec()?;
            let i = topology::host_index(host)
                .filter(|i| *i <= spec.hosts)
                .ok_or_else(|| {
                    anyhow::anyhow!("no lab host named '{host}' (host1..host{})", spec.hosts)
                })?;
            start_agent(&dir, &spec, i)?;
            let c = cli.client()?;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            loop {
                let hosts: Vec<ferry_api::HostEntry> =
                    c.get("/hosts", Duration::from_secs(5)).await?;
                if hosts.iter().any(|h2| h2.name == *host && h2.reachable) {
                    break;
                }
                if tokio::time::Instant::now() > deadline {
                    anyhow::bail!("the agent of {host} did not answer within 10 s");
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            println!("agent of {host} restarted");
            Ok(0)
        }
        LabCmd::Image { rebuild, debian } => {
            let img = ferry_lab::image::ensure(*rebuild)?;
            println!(
                "guest image: {} ({})",
                img.dir.display(),
                img.kernel_package
            );
            if *debian {
                let t = std::time::Instant::now();
                let was = ferry_lab::debian::cached().is_some();
                let d = ferry_lab::debian::ensure(*rebuild)?;
                println!(
                    "debian guest: {} ({})",
                    d.dir.display(),
                    if was && !*rebuild {
                        "cached".to_string()
                    } else {
                        format!("built in {:.0} s", t.elapsed().as_secs_f64())
                    }
                );
            }
            Ok(0)
        }
    }
}

fn require_root() -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        anyhow::bail!("`ferry lab` needs root (network namespaces, tc, QEMU)");
    }
    Ok(())
}

/// Stops the control service and removes the lab network and state.
pub fn down() -> Vec<String> {
    let dir = LabDir::default_path();
    for i in 1..=MAX_CONTROL_INSTANCES {
        stop_pidfile(&dir.control_dir().join(format!("{}.pid", control_name(i))));
    }
    stop_pidfile(&dir.control_dir().join("etcd.pid"));
    for i in 1..=4 {
        stop_pidfile(
            &dir.control_dir()
                .join(format!("{}.pid", topology::storage_pid_name(i))),
        );
    }
    // a service whose pidfile a second `lab up` overwrote still holds its
    // port: any ferry or etcd process started on this lab's files goes too
    stop_strays(&dir.0);
    let mut removed = net::destroy();
    removed.extend(ferry_lab::cpuset::remove_all());
    let _ = std::fs::remove_dir_all(&dir.0);
    removed
}

/// SIGKILLs every `ferry` or `etcd` process whose command line names a
/// file under `root` (the lab's control services, storage nodes, agents
/// and etcd, whatever their pidfiles say).
fn stop_strays(root: &std::path::Path) {
    let root = root.to_string_lossy().to_string();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    let me = std::process::id() as i32;
    for p in procs.flatten() {
        let Ok(pid) = p.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(p.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmd
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).to_string())
            .collect();
        let prog = args
            .first()
            .map(|a| a.rsplit('/').next().unwrap_or(""))
            .unwrap_or("");
        let ours =
            (prog == "ferry" || prog == "etcd") && args.iter().skip(1).any(|a| a.contains(&root));
        if ours && pid != me {
            stop_pid(pid);
        }
    }
}

pub async fn up(cli: &Cli, a: &UpArgs) -> anyhow::Result<i32> {
    let dir = LabDir::default_path();
    let mut spec = LabSpec {
        hosts: a.hosts,
        nics: a.nics,
        rate: a.rate.clone(),
        mtu: a.mtu,
        host_memory: ferry_api::size::parse_size("--host-memory", &a.host_memory)?,
        cpus: Default::default(),
    };
    spec.validate()?;
    if let Some(c) = &a.cpus {
        spec.cpus = ferry_lab::cpuset::plan(c, &spec.host_names(), &ferry_lab::cpuset::online()?)?;
    }
    if dir.spec_path().exists() {
        if !a.replace {
            return Err(ferry_lab::LabError::AlreadyUp.into());
        }
        down();
    } else if !net::lab_namespaces().is_empty() {
        // remains of a crashed lab
        down();
    }
    ferry_lab::image::ensure(false).context("building the guest image")?;
    std::fs::create_dir_all(dir.control_dir())
        .with_context(|| format!("creating {}", dir.0.display()))?;
    let cred = ferry_api::auth::Credential::generate();
    cred.store(&dir.token_path())?;
    make_pki(&dir, &spec)?;
    dir.store_spec(&spec)?;
    if let Err(e) = net::create(&spec) {
        down();
        return Err(e).context("creating the lab network");
    }
    for i in 1..=spec.hosts {
        start_agent(&dir, &spec, i)?;
    }
    let cd = dir.control_dir();
    std::fs::create_dir_all(&cd)?;
    // the storage nodes, on the management bridge; every address a host
    // connects from is named, so flows show per host
    let mut storage_nodes = Vec::new();
    for i in 1..=a.storage_nodes {
        let name = topology::storage_node(i);
        let (nbd, api) = topology::storage_ports(i);
        let at = |port: u16| format!("{}:{port}", topology::CONTROL_MGMT_ADDR).parse();
        let storage = crate::config::StorageFile {
            name: Some(name.clone()),
            dir: Some(dir.0.join(&name)),
            nbd_listen: Some(at(nbd)?),
            api_listen: Some(at(api)?),
            credential: Some(dir.token_path()),
            tls_dir: Some(dir.pki_path().join(&name)),
            peers: topology::peer_addresses(&spec)
                .into_iter()
                .map(|(ip, host)| (ip.to_string(), host))
                .collect(),
            ..Default::default()
        };
        let pid = topology::storage_pid_name(i);
        let conf = write_config(&cd, &format!("{pid}.toml"), &storage)?;
        start_root_daemon(&cd, &pid, &["storage", "serve", "--config", &conf])?;
        storage_nodes.push((name, topology::storage_node_url(i)));
    }
    let hooks = cd.join("hooks");
    std::fs::create_dir_all(&hooks)?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&hooks, std::fs::Permissions::from_mode(0o755))?;
    }
    let control = crate::config::ControlFile {
        listen: Some(
            cli.control
                .trim_start_matches("https://")
                .trim_start_matches("http://")
                .parse()?,
        ),
        credential: Some(dir.token_path()),
        tls_dir: Some(dir.pki_path().join("control")),
        admin_token: Some(dir.admin_token_path()),
        state: Some(cd.join("state.db")),
        // root's, empty: a test or an admin puts hooks (fence, rolling) here
        hooks_dir: Some(hooks),
        hosts: (1..=spec.hosts)
            .map(|i| (topology::host_name(i), topology::agent_url(i)))
            .collect(),
        storage: storage_nodes.into_iter().collect(),
        ..Default::default()
    };
    let control_conf = write_config(&cd, "control.toml", &control)?;
    let control_args = ["control", "--config", control_conf.as_str()];
    start_root_daemon(&cd, "control", &control_args)?;

    // wait for the control service and every agent to answer
    let client = cli.client()?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let hosts = loop {
        match client
            .get::<Vec<ferry_api::HostEntry>>("/hosts", Duration::from_secs(5))
            .await
        {
            Ok(h) if h.len() == spec.hosts as usize && h.iter().all(|h| h.reachable) => break h,
            r if tokio::time::Instant::now() > deadline => {
                let why = match r {
                    Ok(h) => h
                        .iter()
                        .filter(|h| !h.reachable)
                        .map(|h| format!("{}: {}", h.name, h.error.clone().unwrap_or_default()))
                        .collect::<Vec<_>>()
                        .join("; "),
                    Err(e) => e.to_string(),
                };
                anyhow::bail!(
                    "the lab did not come up within 20 s: {why} (logs in {})",
                    dir.0.display()
                );
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    if a.json {
        print_json(&serde_json::json!({ "spec": spec, "hosts": hosts }));
    } else {
        println!(
            "lab up: {} hosts × {} NICs at {} (MTU {}), {} per host for VMs; control at {}",
            spec.hosts,
            spec.nics,
            spec.rate,
            spec.mtu,
            ferry_api::size::human_bytes(spec.host_memory),
            cli.control
        );
        println!(
            "TLS everywhere: CA {}, admin API token {}",
            dir.ca_cert_path().display(),
            dir.admin_token_path().display()
        );
    }
    Ok(0)
}

/// `ferry lab control up --instances N`.
async fn control_up(cli: &Cli, instances: u32) -> anyhow::Result<i32> {
    let dir = LabDir::default_path();
    dir.load_spec()?;
    let cd = dir.control_dir();
    let etcd_pid = cd.join("etcd.pid");
    let etcd_runs = pidfile_runs(&etcd_pid);
    if !etcd_runs {
        let e = |f: &str| dir.pki_path().join("etcd").join(f).display().to_string();
        anyhow::ensure!(
            std::path::Path::new(&e("cert.pem")).exists(),
            "this lab has no certificate for etcd: bring it up again (`ferry lab up --replace`)"
        );
        let args: Vec<String> = [
            "--name",
            "ferry-lab",
            "--data-dir",
            &cd.join("etcd").display().to_string(),
            "--cert-file",
            &e("cert.pem"),
            "--key-file",
            &e("key.pem"),
            "--trusted-ca-file",
            &e("ca-cert.pem"),
            "--client-cert-auth",
            "--listen-client-urls",
            &format!("https://{ETCD_CLIENT}"),
            "--advertise-client-urls",
            &format!("https://{ETCD_CLIENT}"),
            "--listen-peer-urls",
            &format!("http://{ETCD_PEER}"),
            "--initial-advertise-peer-urls",
            &format!("http://{ETCD_PEER}"),
            "--initial-cluster",
            &format!("ferry-lab=http://{ETCD_PEER}"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let etcd = which_etcd()?;
        let pid = net::spawn_daemon(None, &etcd, &args, &cd.join("etcd.log"), None)?;
        std::fs::write(&etcd_pid, pid.to_string())?;
        let t0 = std::time::Instant::now();
        while std::net::TcpStream::connect(ETCD_CLIENT).is_err() {
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(15),
                "etcd did not start (log: {})",
                cd.join("etcd.log").display()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let base: crate::config::ControlFile = toml::from_str(
        &std::fs::read_to_string(cd.join("control.toml")).context("the lab's control.toml")?,
    )?;
    let first = base
        .listen
        .ok_or_else(|| anyhow::anyhow!("the lab's control.toml has no listen address"))?;
    for i in 1..=MAX_CONTROL_INSTANCES {
        stop_pidfile(&cd.join(format!("{}.pid", control_name(i))));
    }
    let mut urls = Vec::new();
    for i in 1..=instances {
        let name = control_name(i);
        let mut listen = first;
        listen.set_port(first.port() + (i - 1) as u16);
        let conf = crate::config::ControlFile {
            listen: Some(listen),
            store: Some(format!("etcds://{ETCD_CLIENT}")),
            state: None,
            instance: Some(format!("control{i}")),
            ..base.clone()
        };
        let path = write_config(&cd, &format!("{name}.toml"), &conf)?;
        start_root_daemon(&cd, &name, &["control", "--config", &path])?;
        urls.push(format!("https://{listen}"));
    }
    // every instance answers, and one leads
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut leaders = Vec::new();
        let mut answered = 0;
        for u in &urls {
            let c = cli.client_at(u)?;
            if let Ok(st) = c
                .get::<ferry_api::ha::ControlStatus>("/cluster/control", Duration::from_secs(2))
                .await
            {
                answered += 1;
                leaders.extend(st.leader);
            }
        }
        if answered == urls.len() && leaders.len() == urls.len() {
            println!(
                "{instances} control instances on etcd ({}), leader {}",
                urls.join(", "),
                leaders[0]
            );
            return Ok(0);
        }
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!(
                "the control instances did not all answer with a leader within 30 s (logs in {})",
                cd.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn which_etcd() -> anyhow::Result<std::path::PathBuf> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join("etcd"))
        .find(|p| p.exists())
        .ok_or_else(|| anyhow::anyhow!("etcd is not installed (package etcd-server)"))
}

/// Writes a service's configuration file in `dir`; returns its path.
fn write_config(
    dir: &std::path::Path,
    name: &str,
    file: &impl serde::Serialize,
) -> anyhow::Result<String> {
    let path = dir.join(name);
    std::fs::write(&path, toml::to_string(file)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path.display().to_string())
}

/// Starts `ferry ARGS…` in the root namespace, logging to `DIR/NAME.log`,
/// its pid in `DIR/NAME.pid` (for `lab down`).
fn start_root_daemon(dir: &std::path::Path, name: &str, args: &[&str]) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let pid = net::spawn_daemon(None, &exe, &args, &dir.join(format!("{name}.log")), None)?;
    std::fs::write(dir.join(format!("{name}.pid")), pid.to_string())?;
    Ok(())
}

/// Waits (at most 15 s) until every address a service's configuration file
/// tells it to listen on (`listen`, `api_listen`, `nbd_listen`) takes
/// connections: a restart is done when the service answers, and a
/// successor that could not start says so here, naming its log.
async fn wait_listening(dir: &std::path::Path, name: &str, conf: &str) -> anyhow::Result<()> {
    let file: toml::Table = toml::from_str(&std::fs::read_to_string(conf)?)?;
    let addrs: Vec<std::net::SocketAddr> = ["listen", "api_listen", "nbd_listen"]
        .iter()
        .filter_map(|k| file.get(*k)?.as_str()?.parse().ok())
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    for a in addrs {
        while tokio::net::TcpStream::connect(a).await.is_err() {
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{name} does not take connections on {a} after its restart (log: {})",
                dir.join(format!("{name}.log")).display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

/// A host's active-backup monitor's pid file, in its host directory.
const MONITOR_PID: &str = "team-monitor.pid";

/// Kills the daemon a pid file names, if any, and waits (up to 10 s) until
/// it is gone (or a zombie); removes the file.
fn stop_pidfile(path: &std::path::Path) {
    let Some(pid) = read_pidfile(path) else {
        return;
    };
    stop_pid(pid);
    let _ = std::fs::remove_file(path);
}

/// SIGKILLs `pid` and waits (at most 10 s) until it is gone: exited, or a
/// zombie whose threads have all exited. A multi-threaded daemon's leader
/// is a zombie as soon as its own thread exits, while the others may still
/// be tearing down, holding the process's files (its listening sockets):
/// a successor started then fails to bind them.
fn stop_pid(pid: i32) {
    // SAFETY: kill(2) with a pid and a signal has no memory effects.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let alive = || match proc_state(pid) {
        None => false,
        Some('Z') => std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count()) > 1,
        Some(_) => true,
    };
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while alive() && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The state letter `/proc/<pid>/stat` gives (`R`, `S`, `Z`, …), or `None`
/// when there is no such process.
fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    ferry_agent::facts::stat_fields(&stat)?
        .first()?
        .chars()
        .next()
}

/// Whether `pid` runs: it exists and is neither a zombie nor dead (`X`).
/// A daemon killed after its parent exited stays a zombie until init
/// reaps it, which some inits do late; signal 0 and `/proc/<pid>` both
/// still find it then.
fn running(pid: i32) -> bool {
    proc_state(pid).is_some_and(|s| !matches!(s, 'Z' | 'X'))
}

/// The pid a pid file names, if it names one.
fn read_pidfile(path: &std::path::Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Whether the pid a pid file names runs ([`running`]).
fn pidfile_runs(path: &std::path::Path) -> bool {
    read_pidfile(path).is_some_and(running)
}

/// The lab's certificates, as `ferry cluster init` and `issue-cert` make
/// them for any cluster: a CA, one certificate per service and host, one
/// for the administrator's tools (`pki/admin`: NBD clients), and the first
/// admin API token.
fn make_pki(dir: &LabDir, spec: &LabSpec) -> anyhow::Result<()> {
    use ferry_net::tls::{Authority, CertRequest, Role};
    let pki = dir.pki_path();
    let _ = std::fs::remove_dir_all(&pki);
    let ca = Authority::create(&pki.join("ca"), "lab")?;
    let mgmt = topology::CONTROL_MGMT_ADDR.to_string();
    let mut certs = vec![
        (
            Role::Control,
            "control".to_string(),
            vec!["127.0.0.1".into(), "localhost".into(), mgmt.clone()],
        ),
        (Role::Admin, "admin".to_string(), vec![]),
        // the server certificate of `lab control up`'s etcd
        (
            Role::Storage,
            "etcd".to_string(),
            vec!["127.0.0.1".into(), "localhost".into()],
        ),
    ];
    // every node the lab may start gets its certificate
    for i in 1..=4 {
        certs.push((
            Role::Storage,
            topology::storage_node(i),
            vec![mgmt.clone(), "127.0.0.1".into()],
        ));
    }
    for i in 1..=spec.hosts {
        certs.push((
            Role::Agent,
            topology::host_name(i),
            vec![topology::mgmt_addr(i)],
        ));
    }
    for (role, name, san) in certs {
        ca.issue(
            &CertRequest {
                role,
                name: name.clone(),
                san,
                days: ferry_net::tls::CERT_DAYS,
            },
            &pki.join(&name),
        )?;
    }
    ferry_api::auth::Credential::from_secret(&ferry_control::tokens::new_secret())
        .store(&dir.admin_token_path())?;
    Ok(())
}

/// Starts (or restarts) host `i`'s agent inside its namespace.
fn start_agent(dir: &LabDir, spec: &LabSpec, i: u32) -> anyhow::Result<()> {
    let img = ferry_lab::image::ensure(false)?;
    let exe = std::env::current_exe()?;
    let h = topology::host_name(i);
    let hd = dir.host_dir(&h);
    std::fs::create_dir_all(&hd)?;
    // its listening socket is free only once the old agent is gone
    stop_pidfile(&hd.join("agent.pid"));
    // configured like any host: an agent.toml in the host's directory
    let shared = dir.shared_path();
    std::fs::create_dir_all(&shared)?;
    let listen = format!("{}:{}", topology::mgmt_addr(i), topology::AGENT_PORT);
    let file = crate::config::AgentFile {
        name: Some(h.clone()),
        listen: Some(listen.parse()?),
        url: Some(topology::agent_url(i)),
        credential: Some(dir.token_path()),
        tls_dir: Some(dir.pki_path().join(&h)),
        state_dir: Some(hd.clone()),
        memory: Some(spec.host_memory.to_string()),
        nics: (1..=spec.nics).map(|k| topology::nic_name(i, k)).collect(),
        nic_rate: Some(spec.rate.clone()),
        kernel: Some(img.kernel),
        initrd: Some(img.initrd),
        // what guests may use here: the shared directory and the guests' bridge
        drive_dirs: vec![shared.clone()],
        kernel_dirs: vec![shared],
        bridges: vec![topology::GUEST_BRIDGE.to_string()],
        // the lab's hosts share one kernel: each its own uids, as two
        // machines would have
        qemu_uid_base: Some(
            ferry_agent::confine::UID_BASE + (i - 1) * ferry_agent::confine::UID_RANGE,
        ),
        ..Default::default()
    };
    // settings an administrator keeps for this host (agent.local.toml in
    // its directory) override the lab's, across restarts
    let mut merged = toml::Table::try_from(&file)?;
    let local = hd.join("agent.local.toml");
    if let Ok(text) = std::fs::read_to_string(&local) {
        let t: toml::Table =
            toml::from_str(&text).with_context(|| format!("reading {}", local.display()))?;
        merged.extend(t);
    }
    let conf = write_config(&hd, "agent.toml", &merged)?;
    let args = vec!["agent".to_string(), "--config".to_string(), conf];
    // its own CPUs, when the lab was asked for them: QEMUs it starts are born there
    let join = match spec.cpus.get(&h) {
        Some(cpus) => Some(
            ferry_lab::cpuset::group(&h, cpus)
                .with_context(|| format!("confining {h} to CPUs {cpus}"))?,
        ),
        None => None,
    };
    let pid = net::spawn_daemon(
        Some(&h),
        &exe,
        &args,
        &hd.join("agent.log"),
        join.as_deref(),
    )?;
    std::fs::write(hd.join("agent.pid"), pid.to_string())?;
    Ok(())
}

fn status(json: bool) -> anyhow::Result<i32> {
    let dir = LabDir::default_path();
    let spec = dir.load_spec()?;
    let links = net::status(&spec);
    // per host: whether its agent runs, and the CPUs it may run on
    let agents: Vec<(String, bool, Option<String>)> = spec
        .host_names()
        .into_iter()
        .map(|h| {
            let pid = read_pidfile(&dir.host_dir(&h).join("agent.pid"));
            let alive = pid.is_some_and(running);
            let cpus = pid
                .and_then(|p| u32::try_from(p).ok())
                .and_then(ferry_lab::cpuset::allowed);
            (h, alive, cpus)
        })
        .collect();
    if json {
        print_json(&serde_json::json!({
            "spec": spec,
            "links": links,
            "agents": agents.iter().map(|(h, a, c)| serde_json::json!({
                "host": h, "running": a, "cpus": spec.cpus.get(h), "cpus_allowed": c,
            })).collect::<Vec<_>>(),
        }));
        return Ok(0);
    }
    println!(
        "lab: {} hosts × {} NICs, {} per NIC, MTU {}",
        spec.hosts, spec.nics, spec.rate, spec.mtu
    );
    for (h, cpus) in &spec.cpus {
        println!("{h}: CPUs {cpus} (its agent, its QEMUs and their threads)");
    }
    let mut t = Table::new(&[
        "HOST", "AGENT", "NIC", "FABRIC", "ADDRESS", "MTU", "STATE", "TX", "RX",
    ]);
    for l in &links {
        let agent = agents
            .iter()
            .find(|(h, _, _)| *h == l.host)
            .map(|(_, a, _)| if *a { "running" } else { "DOWN" });
        t.row(vec![
            l.host.clone(),
            agent.unwrap_or("?").into(),
            l.nic.clone(),
            l.fabric.to_string(),
            l.address.clone(),
            l.mtu.to_string(),
            l.state.clone(),
            ferry_api::size::human_bytes(l.tx_bytes),
            ferry_api::size::human_bytes(l.rx_bytes),
        ]);
    }
    t.print();
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zombie_does_not_run_though_signal_zero_still_finds_it() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        // exited and not yet reaped: a zombie
        let t0 = std::time::Instant::now();
        while proc_state(pid) != Some('Z') {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "`true` did not exit"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        // SAFETY: signal 0 only asks whether the pid exists.
        assert_eq!(unsafe { libc::kill(pid, 0) }, 0);
        assert!(!running(pid));
        child.wait().unwrap();
        assert_eq!(proc_state(pid), None);
        assert!(!running(pid));
        assert!(running(i32::try_from(std::process::id()).unwrap()));
    }
}
