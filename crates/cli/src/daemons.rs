//! `ferry agent` and `ferry control`: the long-running services.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

#[derive(Args)]
pub struct AgentArgs {
    /// Host name (`host1` …).
    #[arg(long)]
    name: String,
    #[arg(long)]
    listen: SocketAddr,
    /// URL peers reach this agent at (default: http://LISTEN).
    #[arg(long)]
    url: Option<String>,
    #[arg(long)]
    state_dir: PathBuf,
    #[arg(long)]
    token_file: PathBuf,
    /// Memory this host offers to VMs (e.g. 6G).
    #[arg(long)]
    memory: String,
    /// Guest kernel and initramfs (default: the cached lab image).
    #[arg(long)]
    kernel: Option<PathBuf>,
    #[arg(long)]
    initrd: Option<PathBuf>,
    #[arg(long, default_value = "qemu-system-x86_64")]
    qemu: String,
    /// Rate the NICs are rated at (e.g. 1gbit), when sysfs cannot tell.
    #[arg(long)]
    nic_rate: Option<String>,
    /// QEMU accelerator: tcg or kvm.
    #[arg(long, default_value = "tcg")]
    accel: String,
}

#[derive(Args)]
pub struct QemuArgsArgs {
    /// The VM (a `VmSpec` as JSON).
    #[arg(long)]
    spec: String,
    /// The VM's directory (sockets, console, log).
    #[arg(long)]
    dir: PathBuf,
    /// A migration target's skeleton (`-S -incoming defer`).
    #[arg(long)]
    incoming: bool,
    #[arg(long, default_value = "qemu-system-x86_64")]
    qemu: String,
    #[arg(long, default_value = "tcg")]
    accel: String,
}

pub fn qemu_args(a: &QemuArgsArgs) -> anyhow::Result<i32> {
    let spec: ferry_api::VmSpec = serde_json::from_str(&a.spec).context("--spec")?;
    spec.validate()?;
    let img =
        ferry_lab::image::cached()?.context("no guest image is built (run `ferry lab image`)")?;
    let cfg = ferry_agent::qemu::QemuConfig {
        binary: a.qemu.clone(),
        accel: a.accel.clone(),
        kernel: img.kernel,
        initrd: img.initrd,
    };
    let mut args = vec![a.qemu.clone()];
    args.extend(ferry_agent::qemu::qemu_args(
        &cfg, &spec, &a.dir, a.incoming,
    ));
    println!("{}", serde_json::to_string(&args)?);
    Ok(0)
}

pub async fn agent(a: &AgentArgs) -> anyhow::Result<i32> {
    let cred = ferry_api::auth::Credential::load(&a.token_file)
        .with_context(|| format!("reading {}", a.token_file.display()))?;
    let memory = ferry_api::size::parse_size("--memory", &a.memory)?;
    let (kernel, initrd) = match (&a.kernel, &a.initrd) {
        (Some(k), Some(i)) => (k.clone(), i.clone()),
        _ => {
            let img = ferry_lab::image::cached()?
                .context("no guest image is built (run `ferry lab image`) and --kernel/--initrd are not given")?;
            (img.kernel, img.initrd)
        }
    };
    std::fs::create_dir_all(a.state_dir.join("vms"))
        .with_context(|| format!("creating {}", a.state_dir.display()))?;
    let cfg = ferry_agent::AgentConfig {
        name: a.name.clone(),
        listen: a.listen,
        url: a
            .url
            .clone()
            .unwrap_or_else(|| format!("http://{}", a.listen)),
        state_dir: a.state_dir.clone(),
        memory,
        nic_rate: a
            .nic_rate
            .as_deref()
            .map(ferry_lab::topology::parse_rate)
            .transpose()?,
        qemu: ferry_agent::qemu::QemuConfig {
            binary: a.qemu.clone(),
            accel: a.accel.clone(),
            kernel,
            initrd,
        },
    };
    ferry_agent::api::serve(ferry_agent::Agent::new(cfg, cred)).await?;
    Ok(0)
}

#[derive(Args)]
pub struct ControlArgs {
    #[arg(long, default_value = "127.0.0.1:7700")]
    listen: SocketAddr,
    #[arg(long)]
    token_file: PathBuf,
    /// Hosts as NAME=AGENT_URL; repeatable.
    #[arg(long = "host")]
    hosts: Vec<String>,
    /// SQLite file for the control service's state (draining marks, host
    /// settings, event log); default: the lab's, else /var/lib/ferry/control/state.db.
    #[arg(long, conflicts_with = "store")]
    state: Option<PathBuf>,
    /// Keep the state in etcd instead (`etcd://HOST:PORT`), shared by every
    /// control instance pointed at it.
    #[arg(long)]
    store: Option<String>,
    /// Storage nodes as NAME=API_URL; repeatable.
    #[arg(long = "storage")]
    storage: Vec<String>,
    /// Take the hosts (and the lab's storage node) from a lab directory's lab.json instead.
    #[arg(long)]
    lab_dir: Option<PathBuf>,
}

pub async fn control(a: &ControlArgs) -> anyhow::Result<i32> {
    let cred = ferry_api::auth::Credential::load(&a.token_file)
        .with_context(|| format!("reading {}", a.token_file.display()))?;
    let mut hosts = Vec::new();
    for h in &a.hosts {
        let (n, u) = h
            .split_once('=')
            .with_context(|| format!("--host '{h}' is not NAME=URL"))?;
        hosts.push((n.to_string(), u.to_string()));
    }
    let mut storage = Vec::new();
    for s in &a.storage {
        let (n, u) = s
            .split_once('=')
            .with_context(|| format!("--storage '{s}' is not NAME=URL"))?;
        storage.push((n.to_string(), u.to_string()));
    }
    if let Some(dir) = &a.lab_dir {
        storage.push((
            ferry_lab::topology::STORAGE_NODE.to_string(),
            ferry_lab::topology::storage_url(),
        ));
        let spec = ferry_lab::net::LabDir(dir.clone()).load_spec()?;
        for i in 1..=spec.hosts {
            hosts.push((
                ferry_lab::topology::host_name(i),
                ferry_lab::topology::agent_url(i),
            ));
        }
    }
    let mut control = ferry_control::Control::with_storage(hosts, storage, cred.clone());
    // SQLite by default: the lab's file, else one under /var/lib/ferry
    let state = a.state.clone().unwrap_or_else(|| match &a.lab_dir {
        Some(d) => d.join("control").join("state.db"),
        None => PathBuf::from("/var/lib/ferry/control/state.db"),
    });
    if let Some(url) = &a.store {
        control = control
            .with_store(ferry_control::store::Store::etcd(url).await?)
            .await?;
    } else {
        control = control
            .with_store(ferry_control::store::Store::open(&state)?)
            .await?;
    }
    let control = std::sync::Arc::new(control);
    ferry_control::http::serve(a.listen, control, cred).await?;
    Ok(0)
}

#[derive(Args)]
pub struct StorageArgs {
    /// Storage node name.
    #[arg(long, default_value = "storage1")]
    name: String,
    /// Directory of the node's disks and state.
    #[arg(long)]
    dir: PathBuf,
    /// NBD listen address.
    #[arg(long, default_value = "127.0.0.1:10809")]
    nbd_listen: SocketAddr,
    /// REST API listen address.
    #[arg(long, default_value = "127.0.0.1:7900")]
    api_listen: SocketAddr,
    /// Address clients reach NBD at, for disk URIs (default: --nbd-listen).
    #[arg(long)]
    nbd_address: Option<String>,
    #[arg(long)]
    token_file: PathBuf,
    /// Normalized IOPS the backing store sustains (0: no limit here). The
    /// scheduler never dispatches faster, so minimums are kept against it.
    #[arg(long, default_value_t = 0)]
    capacity_iops: u64,
    /// Client address → host name, as ADDR=HOST; repeatable.
    #[arg(long = "peer")]
    peers: Vec<String>,
    /// Take peer addresses from a lab directory's lab.json.
    #[arg(long)]
    lab_dir: Option<PathBuf>,
}

pub async fn storage(a: &StorageArgs) -> anyhow::Result<i32> {
    let cred = ferry_api::auth::Credential::load(&a.token_file)
        .with_context(|| format!("reading {}", a.token_file.display()))?;
    let mut peers = std::collections::BTreeMap::new();
    for p in &a.peers {
        let (ip, host) = p
            .split_once('=')
            .with_context(|| format!("--peer '{p}' is not ADDR=HOST"))?;
        let ip: std::net::IpAddr = ip
            .parse()
            .with_context(|| format!("--peer '{p}': '{ip}' is not an address"))?;
        peers.insert(ip, host.to_string());
    }
    if let Some(dir) = &a.lab_dir {
        let spec = ferry_lab::net::LabDir(dir.clone()).load_spec()?;
        for (ip, host) in ferry_lab::topology::peer_addresses(&spec) {
            peers.insert(ip, host);
        }
    }
    let node = ferry_storage::node::Node::open(ferry_storage::node::NodeConfig {
        name: a.name.clone(),
        dir: a.dir.clone(),
        nbd_address: a
            .nbd_address
            .clone()
            .unwrap_or_else(|| a.nbd_listen.to_string()),
        capacity_iops: a.capacity_iops,
        peers,
    })?;
    ferry_storage::serve(node, a.nbd_listen, a.api_listen, cred).await?;
    Ok(0)
}
