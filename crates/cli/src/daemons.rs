//! `ferry agent` and `ferry control`: the long-running services.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use crate::config;

/// TLS of a service (see `ferry_net::tls`), shared by `ferry agent`,
/// `ferry control` and `ferry storage serve`.
#[derive(Args, Clone, Default)]
pub struct TlsArgs {
    /// This service's certificate directory, from `ferry cluster
    /// issue-cert` (default: the file's `tls_dir`, else
    /// /etc/ferry/pki/agent, …/control or …/storage).
    #[arg(long)]
    tls_dir: Option<PathBuf>,
    /// Serve and call plain HTTP, authenticated by the cluster credential
    /// instead of certificates. For debugging only: credentials and data
    /// cross the network in clear.
    #[arg(long)]
    insecure_http: bool,
}

impl TlsArgs {
    /// The service's certificate, or `None` under `--insecure-http` (flag
    /// or the file's `insecure_http`).
    fn load(
        &self,
        service: &str,
        file_dir: Option<&PathBuf>,
        file_insecure: Option<bool>,
    ) -> anyhow::Result<Option<ferry_net::tls::Pki>> {
        if self.insecure_http || file_insecure == Some(true) {
            tracing::warn!("--insecure-http: plain HTTP, credentials and data in clear");
            return Ok(None);
        }
        let dir = self
            .tls_dir
            .clone()
            .or(file_dir.cloned())
            .unwrap_or_else(|| PathBuf::from(config::PKI).join(service));
        let pki = ferry_net::tls::Pki::load(&dir).with_context(|| {
            format!(
                "loading this service's certificate from {} (make one with `ferry cluster issue-cert`, or run with --insecure-http)",
                dir.display()
            )
        })?;
        // files an admin replaces by hand take effect without a restart
        pki.watch(std::time::Duration::from_secs(5));
        Ok(Some(pki))
    }
}

#[derive(Args)]
pub struct AgentArgs {
    /// Configuration file (default /etc/ferry/agent.toml, if present); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Host name (default: the file's `name`, else the system host name).
    #[arg(long)]
    name: Option<String>,
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// URL peers reach this agent at (default: https://LISTEN).
    #[arg(long)]
    url: Option<String>,
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// The cluster credential (default: the file's `credential`, else /etc/ferry/cluster.token).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Memory this host offers to VMs (e.g. 6G).
    #[arg(long)]
    memory: Option<String>,
    /// Guest kernel and initramfs (default: the cached lab image).
    #[arg(long)]
    kernel: Option<PathBuf>,
    #[arg(long)]
    initrd: Option<PathBuf>,
    #[arg(long)]
    qemu: Option<String>,
    /// Rate the NICs are rated at (e.g. 1gbit), when sysfs cannot tell.
    #[arg(long)]
    nic_rate: Option<String>,
    /// QEMU accelerator: auto (KVM when it runs guests here, else TCG), kvm or tcg.
    #[arg(long)]
    accel: Option<String>,
    /// Check the configuration and print it resolved, then exit.
    #[arg(long)]
    check_config: bool,
    #[command(flatten)]
    tls: TlsArgs,
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
        ovmf: Default::default(),
        tls_dir: None,
        storage_pause_after: ferry_agent::qemu::STORAGE_PAUSE_AFTER,
        local_disks: a.dir.join("disks"),
        confine: None,
    };
    let mut args = vec![a.qemu.clone()];
    args.extend(ferry_agent::qemu::qemu_args(
        &cfg, &spec, &a.dir, a.incoming,
    ));
    println!("{}", serde_json::to_string(&args)?);
    Ok(0)
}

/// The workload guest's console, read for the guest check.
struct WorkloadConsole;

impl ferry_agent::guest::GuestCheck for WorkloadConsole {
    fn has_progress(&self) -> bool {
        true
    }
    fn read(&self, console_tail: &str) -> ferry_agent::guest::Reading {
        let s = ferry_lab::console::parse_log(console_tail);
        ferry_agent::guest::Reading {
            last: s.last.map(|t| ferry_agent::guest::Progress {
                tick: t.tick,
                sweeps: t.sweeps,
                errors: t.errors,
            }),
            problems: s.problems,
        }
    }
}

/// The agent's settings: flags over `agent.toml` over defaults, checked
/// against this host.
fn agent_config(a: &AgentArgs) -> anyhow::Result<(ferry_agent::AgentConfig, PathBuf)> {
    let (f, file) = config::load::<config::AgentFile>(
        a.config.as_deref(),
        &format!("{}/agent.toml", config::ETC),
    )?;
    let key = |key: &'static str, why: String| config::ConfigError::Key {
        file: file.clone(),
        key,
        why,
    };
    let name = a
        .name
        .clone()
        .or(f.name.clone())
        .unwrap_or_else(config::system_hostname);
    let listen = a
        .listen
        .or(f.listen)
        .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 7800)));
    let scheme = if a.tls.insecure_http || f.insecure_http == Some(true) {
        "http"
    } else {
        "https"
    };
    let url = a.url.clone().or(f.url.clone()).unwrap_or_else(|| {
        if listen.ip().is_unspecified() {
            format!("{scheme}://{name}:{}", listen.port())
        } else {
            format!("{scheme}://{listen}")
        }
    });
    let reserved = ferry_api::size::parse_size(
        "reserved_memory",
        f.reserved_memory.as_deref().unwrap_or("2G"),
    )
    .map_err(|e| key("reserved_memory", e.to_string()))?;
    let memory = match a.memory.as_ref().or(f.memory.as_ref()) {
        Some(m) => {
            ferry_api::size::parse_size("memory", m).map_err(|e| key("memory", e.to_string()))?
        }
        None => {
            let total = config::host_memory().context("reading /proc/meminfo")?;
            if total <= reserved {
                return Err(key(
                    "reserved_memory",
                    format!("{reserved} bytes is all of this host's {total}"),
                )
                .into());
            }
            total - reserved
        }
    };
    let nic_rate = match a.nic_rate.as_ref().or(f.nic_rate.as_ref()) {
        Some(r) => {
            Some(ferry_lab::topology::parse_rate(r).map_err(|e| key("nic_rate", e.to_string()))?)
        }
        None => None,
    };
    let binary = a
        .qemu
        .clone()
        .or(f.qemu.clone())
        .unwrap_or_else(|| "qemu-system-x86_64".into());
    let accel = match a
        .accel
        .clone()
        .or(f.accel.clone())
        .unwrap_or_else(|| "auto".into())
        .as_str()
    {
        "auto" => ferry_agent::hardware::detect_accel(&binary),
        a @ ("kvm" | "tcg") => a.to_string(),
        other => return Err(key("accel", format!("'{other}' is none of auto, kvm or tcg")).into()),
    };
    if let Some(models) = &f.cpu_models {
        for m in models {
            ferry_api::hardware::validate_cpu_model(m)
                .map_err(|e| key("cpu_models", e.to_string()))?;
        }
    }
    for (k, dirs) in [
        ("drive_dirs", &f.drive_dirs),
        ("kernel_dirs", &f.kernel_dirs),
    ] {
        for d in dirs.iter() {
            if !d.is_absolute() || d == std::path::Path::new("/") {
                return Err(key(
                    k,
                    format!("{} is not an absolute directory other than /", d.display()),
                )
                .into());
            }
            if !d.is_dir() {
                return Err(key(
                    k,
                    format!("{} is not a directory on this host", d.display()),
                )
                .into());
            }
        }
    }
    for b in &f.bridges {
        ferry_api::hardware::validate_ifname("bridges", b)
            .map_err(|e| key("bridges", e.to_string()))?;
    }
    let duration = |k: &'static str, v: &Option<String>, default: std::time::Duration| match v {
        Some(s) => ferry_api::size::parse_duration(k, s).map_err(|e| key(k, e.to_string())),
        None => Ok(default),
    };
    let storage_pause_after = duration(
        "storage_pause_after",
        &f.storage_pause_after,
        ferry_agent::qemu::STORAGE_PAUSE_AFTER,
    )?;
    if storage_pause_after < std::time::Duration::from_secs(1) {
        return Err(key("storage_pause_after", "must be at least 1s".into()).into());
    }
    let storage_pause_max = duration(
        "storage_pause_max",
        &f.storage_pause_max,
        ferry_agent::resilience::STORAGE_PAUSE_MAX,
    )?;
    // a size key: its default when absent, never below its least
    let size_at_least = |k: &'static str, v: &Option<String>, default: u64, min: u64| {
        let n = match v {
            Some(v) => ferry_api::size::parse_size(k, v).map_err(|e| key(k, e.to_string()))?,
            None => default,
        };
        if n < min {
            return Err(key(k, format!("must be at least {}K", min >> 10)));
        }
        Ok(n)
    };
    let console_log_max = size_at_least(
        "console_log_max",
        &f.console_log_max,
        ferry_agent::guest::CONSOLE_LOG_MAX,
        64 << 10,
    )?;
    // what a guest agent's answer (process-wide) and a transport stream out
    // of order may hold
    let max_reply = size_at_least(
        "guest_agent_max_reply",
        &f.guest_agent_max_reply,
        ferry_agent::qga::MAX_REPLY as u64,
        64 << 10,
    )?;
    ferry_agent::qga::set_max_reply(max_reply as usize);
    let reorder_window = size_at_least(
        "reorder_window",
        &f.reorder_window,
        ferry_transport::session::REORDER_LIMIT,
        ferry_transport::session::MIN_REORDER_WINDOW,
    )?;
    let mut ovmf = ferry_agent::hardware::Ovmf::default();
    if let Some(c) = &f.ovmf_code {
        ovmf.code = c.clone();
    }
    if let Some(v) = &f.ovmf_vars {
        ovmf.vars = v.clone();
    }
    let (kernel, initrd) = match (
        a.kernel.as_ref().or(f.kernel.as_ref()),
        a.initrd.as_ref().or(f.initrd.as_ref()),
    ) {
        (Some(k), Some(i)) => (k.clone(), i.clone()),
        _ => match ferry_lab::image::cached()? {
            Some(img) => (img.kernel, img.initrd),
            // no workload guest can start until one is given; VMs already
            // running are still taken back
            None => (PathBuf::new(), PathBuf::new()),
        },
    };
    let nics = config::nic_selection(&file, &f.nics, &f.networks)?;
    if let Some(s) = &f.storage_nic {
        config::nic_selection(&file, std::slice::from_ref(s), &[]).map_err(|_| {
            key(
                "storage_nic",
                format!("no interface named '{s}' with an IPv4 address"),
            )
        })?;
    }
    let state_dir = a
        .state_dir
        .clone()
        .or(f.state_dir.clone())
        .unwrap_or_else(|| PathBuf::from("/var/lib/ferry/agent"));
    let confine = f.confine_qemu.unwrap_or(true).then(|| {
        ferry_agent::confine::Confinement::for_host(
            &name,
            f.qemu_uid_base.unwrap_or(ferry_agent::confine::UID_BASE),
        )
    });
    let cfg = ferry_agent::AgentConfig {
        name,
        listen,
        url,
        state_dir: state_dir.clone(),
        memory,
        nic_rate,
        qemu: ferry_agent::qemu::QemuConfig {
            binary,
            accel,
            kernel,
            initrd,
            ovmf,
            tls_dir: None,
            storage_pause_after,
            local_disks: state_dir.join("disks"),
            confine,
        },
        nics,
        probe_port: f.probe_port.unwrap_or(ferry_api::DEFAULT_PROBE_PORT),
        storage_nic: f.storage_nic.clone(),
        cpu_models: f.cpu_models.clone(),
        grants: ferry_agent::grants::Grants {
            drive_dirs: f.drive_dirs.clone(),
            kernel_dirs: f.kernel_dirs.clone(),
            bridges: f.bridges.clone(),
        },
        storage_pause_max,
        console_log_max,
        limits: limits_in(&file, f.limits)?,
        reorder_window,
    };
    Ok((
        cfg,
        config::credential(a.token_file.as_ref(), f.credential.as_ref()),
    ))
}

/// Everything a daemon (and the QEMUs it starts) creates — disks, backups,
/// seeds, VM records, console logs, keys — is its owner's alone: 0600
/// files in 0700 directories, whatever umask it was started with.
pub fn private_files() {
    // SAFETY: umask only sets the process's file mode creation mask
    unsafe { libc::umask(0o077) };
}

pub async fn agent(a: &AgentArgs) -> anyhow::Result<i32> {
    private_files();
    let (cfg, token_file) = agent_config(a)?;
    if a.check_config {
        println!("{cfg:#?}\ncredential: {}", token_file.display());
        return Ok(0);
    }
    let cred = ferry_api::auth::Credential::load(&token_file)
        .with_context(|| format!("reading the cluster credential {}", token_file.display()))?;
    let (f, _) = config::load::<config::AgentFile>(
        a.config.as_deref(),
        &format!("{}/agent.toml", config::ETC),
    )?;
    let pki = a.tls.load("agent", f.tls_dir.as_ref(), f.insecure_http)?;
    let mut cfg = cfg;
    cfg.qemu.tls_dir = pki.as_ref().map(|p| p.dir.clone());
    std::fs::create_dir_all(cfg.state_dir.join("vms"))
        .with_context(|| format!("creating {}", cfg.state_dir.display()))?;
    if cfg.qemu.confine.is_some() {
        ferry_agent::confine::ensure_cgroupfs()
            .context("mounting the cgroup controllers each VM's QEMU is confined in")?;
    }
    // the carriers' relays on a runtime of their own, a worker per core (see
    // `runtime_for` in main.rs); it lives as long as the process
    let relays = tokio::runtime::Builder::new_multi_thread()
        .thread_name("ferry-relay")
        .enable_all()
        .build()
        .context("starting the relays' runtime")?;
    ferry_transport::relay::set_runtime(relays.handle().clone());
    std::mem::forget(relays);
    let agent = ferry_agent::Agent::new(cfg, cred, pki, std::sync::Arc::new(WorkloadConsole))?;
    ferry_agent::api::serve(agent).await?;
    Ok(0)
}

#[derive(Args)]
pub struct ControlArgs {
    /// Configuration file (default /etc/ferry/control.toml, if present); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// API address (default: the file's `listen`, else 127.0.0.1:7700).
    #[arg(long)]
    listen: Option<SocketAddr>,
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Hosts as NAME=AGENT_URL; repeatable.
    #[arg(long = "host")]
    hosts: Vec<String>,
    /// SQLite file for the control service's state (draining marks, host
    /// settings, event log); default: the file's `state`, else /var/lib/ferry/control/state.db.
    #[arg(long, conflicts_with = "store")]
    state: Option<PathBuf>,
    /// Keep the state in etcd instead, shared by every control instance
    /// pointed at it: `etcds://HOST:PORT[,…]` over TLS with a client
    /// certificate, or `etcd://` in clear to a loopback address only.
    #[arg(long)]
    store: Option<String>,
    /// Certificate directory for `etcds://` (ca-cert.pem, cert.pem, key.pem);
    /// default: the control service's own.
    #[arg(long)]
    store_tls: Option<PathBuf>,
    /// Storage nodes as NAME=API_URL; repeatable.
    #[arg(long = "storage")]
    storage: Vec<String>,
    /// The first admin API token (default: the file's `admin_token`, else
    /// /etc/ferry/admin.token): made into the token `admin` unless one of
    /// that name was ever made.
    #[arg(long)]
    admin_token: Option<PathBuf>,
    #[command(flatten)]
    tls: TlsArgs,
}

pub async fn control(a: &ControlArgs) -> anyhow::Result<i32> {
    private_files();
    let (f, file) = config::load::<config::ControlFile>(
        a.config.as_deref(),
        &format!("{}/control.toml", config::ETC),
    )?;
    let cred = config::load_credential(a.token_file.as_ref(), f.credential.as_ref())?;
    let mut hosts: Vec<(String, String)> = f.hosts.clone().into_iter().collect();
    for h in &a.hosts {
        let (n, u) = h
            .split_once('=')
            .with_context(|| format!("--host '{h}' is not NAME=URL"))?;
        hosts.push((n.to_string(), u.to_string()));
    }
    let mut storage: Vec<(String, String)> = f.storage.clone().into_iter().collect();
    for s in &a.storage {
        let (n, u) = s
            .split_once('=')
            .with_context(|| format!("--storage '{s}' is not NAME=URL"))?;
        storage.push((n.to_string(), u.to_string()));
    }
    let pki = a.tls.load("control", f.tls_dir.as_ref(), f.insecure_http)?;
    let auth = ferry_net::client::ClientAuth::component(pki.as_ref(), &cred)?;
    let mut control = ferry_control::Control::with_storage(hosts, storage, auth);
    if let Some(d) = &f.hooks_dir {
        control = control.with_hooks_dir(d.clone());
    }
    if let Some(p) = &pki {
        warn_ca_key_here(p);
        control = control.with_pki(p.clone())?;
    }
    let limits = limits_in(&file, f.limits)?;
    if let Some(n) = f.max_streams_per_token {
        anyhow::ensure!(
            n >= 1,
            "{}: max_streams_per_token must be at least 1",
            file.display()
        );
        control = control.with_max_streams_per_token(n);
    }
    // SQLite by default
    let state = a
        .state
        .clone()
        .or(f.state.clone())
        .unwrap_or_else(|| PathBuf::from("/var/lib/ferry/control/state.db"));
    let store_tls = a
        .store_tls
        .clone()
        .or(f.store_tls.clone())
        .or_else(|| pki.as_ref().map(|p| p.dir.clone()));
    if let Some(url) = a.store.as_ref().or(f.store.as_ref()) {
        control = control
            .with_store(ferry_control::store::Store::etcd(url, store_tls.as_deref()).await?)
            .await?;
    } else {
        control = control
            .with_store(ferry_control::store::Store::open(&state)?)
            .await?;
    }
    let admin = a
        .admin_token
        .clone()
        .or(f.admin_token.clone())
        .unwrap_or_else(|| PathBuf::from(config::DEFAULT_ADMIN_TOKEN));
    match std::fs::read_to_string(&admin) {
        Ok(secret) => {
            if control.bootstrap_admin(&secret).await? {
                tracing::info!(file = %admin.display(), "made the admin API token from the file");
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => anyhow::bail!("reading the admin token {}: {e}", admin.display()),
    }
    let listen = a
        .listen
        .or(f.listen)
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 7700)));
    let instance = f.instance.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}:{}", host.trim(), listen.port())
    });
    let control = std::sync::Arc::new(control.with_instance(instance));
    let tls = match &pki {
        Some(p) => Some(p.server_tls(false)?),
        None => None,
    };
    ferry_control::http::serve(listen, control, tls, limits).await?;
    Ok(0)
}

/// Logs when the cluster CA's key sits on this server, where a break-in
/// would take the power to sign any certificate with it.
fn warn_ca_key_here(pki: &ferry_net::tls::Pki) {
    let near = [
        pki.dir.parent().map(|d| d.join("ca")),
        pki.dir
            .parent()
            .and_then(|d| d.parent())
            .map(|d| d.join("ca")),
        Some(PathBuf::from(config::ETC).join("ca")),
    ];
    for ca in near.into_iter().flatten() {
        let key = ca.join(ferry_net::tls::CA_KEY);
        if key.exists() {
            tracing::warn!(
                event = "ca_key_on_server",
                file = %key.display(),
                "the cluster CA's key is on this server: keep it on an admin's machine \
                 (`ferry cluster init --admin-machine`, then `ferry cluster rotate-certs --ca-dir`)"
            );
            return;
        }
    }
}

#[derive(Args)]
pub struct StorageArgs {
    /// Configuration file (default /etc/ferry/storage.toml, if present); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Storage node name (default storage1).
    #[arg(long)]
    name: Option<String>,
    /// Directory of the node's disks and state (default /var/lib/ferry/storage).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// NBD listen address (default 127.0.0.1:10809).
    #[arg(long)]
    nbd_listen: Option<SocketAddr>,
    /// REST API listen address (default 127.0.0.1:7900).
    #[arg(long)]
    api_listen: Option<SocketAddr>,
    /// Address clients reach NBD at, for disk URIs (default: --nbd-listen).
    #[arg(long)]
    nbd_address: Option<String>,
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Normalized IOPS the backing store sustains (0: no limit here). The
    /// scheduler never dispatches faster, so minimums are kept against it.
    #[arg(long)]
    capacity_iops: Option<u64>,
    /// Client address → host name, as ADDR=HOST; repeatable.
    #[arg(long = "peer")]
    peers: Vec<String>,
    #[command(flatten)]
    tls: TlsArgs,
}

pub async fn storage(a: &StorageArgs) -> anyhow::Result<i32> {
    private_files();
    let (f, file) = config::load::<config::StorageFile>(
        a.config.as_deref(),
        &format!("{}/storage.toml", config::ETC),
    )?;
    let cred = config::load_credential(a.token_file.as_ref(), f.credential.as_ref())?;
    let mut peers = std::collections::BTreeMap::new();
    for (ip, host) in &f.peers {
        let addr: std::net::IpAddr = ip.parse().map_err(|_| config::ConfigError::Key {
            file: file.clone(),
            key: "peers",
            why: format!("'{ip}' is not an address"),
        })?;
        peers.insert(addr, host.clone());
    }
    for p in &a.peers {
        let (ip, host) = p
            .split_once('=')
            .with_context(|| format!("--peer '{p}' is not ADDR=HOST"))?;
        let ip: std::net::IpAddr = ip
            .parse()
            .with_context(|| format!("--peer '{p}': '{ip}' is not an address"))?;
        peers.insert(ip, host.to_string());
    }
    let nbd_listen = a
        .nbd_listen
        .or(f.nbd_listen)
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 10809)));
    let api_listen = a
        .api_listen
        .or(f.api_listen)
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 7900)));
    let pki = a.tls.load("storage", f.tls_dir.as_ref(), f.insecure_http)?;
    let auth = match &pki {
        Some(_) => ferry_net::server::PeerAuth::Certificates(&[ferry_net::tls::Role::Control]),
        None => ferry_net::server::PeerAuth::Credential(cred),
    };
    // NBD: TLS required whenever the node has a certificate, unless turned off
    let nbd_tls = match (f.nbd_tls.as_deref(), &pki) {
        // the cluster's certificates and VMs' certificates their agents signed
        (None | Some("require"), Some(p)) => Some(p.nbd_server_config()?),
        (Some("require"), None) => anyhow::bail!(
            "{}: key `nbd_tls`: \"require\" needs the node's certificate (not --insecure-http)",
            file.display()
        ),
        (None | Some("off"), _) => None,
        (Some(other), _) => anyhow::bail!(
            "{}: key `nbd_tls`: '{other}' is not \"require\" or \"off\"",
            file.display()
        ),
    };
    let node = ferry_storage::node::Node::open(ferry_storage::node::NodeConfig {
        name: a
            .name
            .clone()
            .or(f.name.clone())
            .unwrap_or_else(|| "storage1".into()),
        dir: a
            .dir
            .clone()
            .or(f.dir.clone())
            .unwrap_or_else(|| PathBuf::from("/var/lib/ferry/storage")),
        nbd_address: a
            .nbd_address
            .clone()
            .or(f.nbd_address.clone())
            .unwrap_or_else(|| nbd_listen.to_string()),
        capacity_iops: a.capacity_iops.or(f.capacity_iops).unwrap_or(0),
        peers,
        // other nodes' exports are opened as this node's exports are served
        client_tls: match (&nbd_tls, &pki) {
            (Some(_), Some(p)) => Some(p.client_config()?),
            _ => None,
        },
    })?;
    if nbd_tls.is_none() {
        tracing::warn!("NBD without TLS: disk contents cross the network in clear");
    }
    in_file(&file, f.nbd_limits.validate())?;
    let limits = (limits_in(&file, f.limits)?, f.nbd_limits);
    ferry_storage::serve(
        node,
        nbd_listen,
        api_listen,
        auth,
        pki.as_ref(),
        nbd_tls,
        limits,
    )
    .await?;
    Ok(0)
}

/// A `[limits]` table checked; an error names the file and the key.
fn limits_in(
    file: &std::path::Path,
    l: ferry_net::server::Limits,
) -> anyhow::Result<ferry_net::server::Limits> {
    in_file(file, l.validate())?;
    Ok(l)
}

/// A check of a configuration file's table; its error names the file.
fn in_file(file: &std::path::Path, r: Result<(), ferry_api::ApiError>) -> anyhow::Result<()> {
    r.map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))
}

#[derive(Args)]
pub struct ServiceFilesArgs {
    /// `control` or `storage`.
    service: String,
    /// The user the service runs as (default `ferry-SERVICE`).
    #[arg(long)]
    user: Option<String>,
    #[arg(long)]
    config: Option<PathBuf>,
}

/// The files a service that runs as its own user reads or writes, as its
/// configuration names them.
fn service_files(service: &str, config: Option<&std::path::Path>) -> anyhow::Result<Vec<PathBuf>> {
    let etc = |f: &str| PathBuf::from(config::ETC).join(f);
    let pki = |dir: Option<&PathBuf>| {
        dir.cloned()
            .unwrap_or_else(|| std::path::Path::new(config::PKI).join(service))
    };
    let cred = |c: Option<&PathBuf>| c.cloned().unwrap_or_else(|| etc("cluster.token"));
    Ok(match service {
        "control" => {
            let (f, _) = config::load::<config::ControlFile>(
                config,
                &format!("{}/control.toml", config::ETC),
            )?;
            let state = f
                .state
                .clone()
                .unwrap_or_else(|| "/var/lib/ferry/control/state.db".into());
            vec![
                pki(f.tls_dir.as_ref()),
                cred(f.credential.as_ref()),
                f.admin_token
                    .clone()
                    .unwrap_or_else(|| config::DEFAULT_ADMIN_TOKEN.into()),
                state.parent().unwrap_or(&state).to_path_buf(),
            ]
        }
        "storage" => {
            let (f, _) = config::load::<config::StorageFile>(
                config,
                &format!("{}/storage.toml", config::ETC),
            )?;
            vec![
                pki(f.tls_dir.as_ref()),
                cred(f.credential.as_ref()),
                f.dir
                    .clone()
                    .unwrap_or_else(|| "/var/lib/ferry/storage".into()),
            ]
        }
        other => anyhow::bail!("service: '{other}' runs as root (give control or storage)"),
    })
}

/// `ferry service-files SERVICE`: gives the service's user its own files
/// (certificate directory, credential, state), run as root by the unit
/// before the service starts as that user. Files it does not find are
/// skipped; nothing else changes owner.
pub fn own_service_files(a: &ServiceFilesArgs) -> anyhow::Result<i32> {
    let user = a
        .user
        .clone()
        .unwrap_or_else(|| format!("ferry-{}", a.service));
    let files = service_files(&a.service, a.config.as_deref())?;
    let (uid, gid) = user_ids(&user)?;
    for path in files {
        if !path.exists() {
            continue;
        }
        let mut stack = vec![path.clone()];
        while let Some(p) = stack.pop() {
            std::os::unix::fs::lchown(&p, Some(uid), Some(gid))
                .with_context(|| format!("giving {} to {user}", p.display()))?;
            if p.is_dir() && !p.is_symlink() {
                for e in std::fs::read_dir(&p).with_context(|| format!("{}", p.display()))? {
                    stack.push(e?.path());
                }
            }
        }
        println!("{}: {user}'s", path.display());
    }
    Ok(0)
}

/// A user's uid and primary gid, from the user database.
fn user_ids(user: &str) -> anyhow::Result<(u32, u32)> {
    let name = std::ffi::CString::new(user).context("--user")?;
    // SAFETY: getpwnam reads the user database; its result is copied out at once.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    anyhow::ensure!(
        !pw.is_null(),
        "no user {user} (the package makes it: systemd-sysusers ferry.conf)"
    );
    // SAFETY: pw is non-null and points at getpwnam's static record.
    Ok(unsafe { ((*pw).pw_uid, (*pw).pw_gid) })
}
