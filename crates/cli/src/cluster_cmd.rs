//! `ferry cluster …`: settings that hold for the whole cluster.

use std::time::Duration;

use clap::{Subcommand, ValueEnum};
use ferry_api::drain::MigrationLimit;
use ferry_api::rolling::RollingRequest;
use ferry_api::{ClusterSettings, ClusterSettingsUpdate};

use crate::output::print_json;
use crate::Cli;

const T: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

#[derive(Subcommand)]
pub enum ClusterCmd {
    /// Start a cluster on this machine: a cluster CA, certificates for the
    /// control service and each host, the first admin API token, a new
    /// cluster credential, the control service's configuration for the
    /// hosts given, and a starting agent.toml per host (copy each host's
    /// files to its /etc/ferry).
    Init {
        /// A host as NAME=ADDRESS (its agent's address, port 7800 unless
        /// given); repeatable.
        #[arg(long = "host", required = true)]
        hosts: Vec<String>,
        /// Where to write the files.
        #[arg(long, default_value = crate::config::ETC)]
        dir: std::path::PathBuf,
        /// Address the control service listens on.
        #[arg(long, default_value = "0.0.0.0:7700")]
        listen: std::net::SocketAddr,
        /// Replace a credential already there (every host must then get the new one).
        #[arg(long)]
        force: bool,
        /// More names or addresses the control service is reached at (its
        /// certificate names them); repeatable.
        #[arg(long = "san")]
        san: Vec<String>,
        /// This is an administrator's machine, not a server: the CA (and
        /// its key) stays here in DIR/ca; the control host's files go to
        /// DIR/control and each host's to DIR/hosts/NAME, each a copy of
        /// what that server's /etc/ferry needs and nothing more. Renew
        /// later from here with `ferry cluster rotate-certs --ca-dir DIR/ca`.
        #[arg(long)]
        admin_machine: bool,
    },
    /// Sign a certificate with the cluster CA for a control service, an
    /// agent, a storage node or an administrator's tools, and write its
    /// directory (cert.pem, key.pem, ca-cert.pem, and the names QEMU,
    /// libnbd and nbdkit look for).
    IssueCert {
        /// control, agent, storage or admin.
        #[arg(long)]
        role: String,
        /// The holder's name: the host's name for an agent, the node's for
        /// a storage node.
        #[arg(long)]
        name: String,
        /// DNS names and IP addresses peers reach it at; repeatable.
        #[arg(long = "san")]
        san: Vec<String>,
        /// The cluster CA's directory (ca-cert.pem, ca-key.pem).
        #[arg(long, default_value = "/etc/ferry/ca")]
        ca: std::path::PathBuf,
        /// Where to write the certificate's directory.
        #[arg(long)]
        out: std::path::PathBuf,
        /// Days it is valid (default a year).
        #[arg(long, default_value_t = ferry_net::tls::CERT_DAYS)]
        days: u32,
    },
    /// Replace every component's certificate (control service, agents,
    /// storage nodes) with no VM stopped and no move failed: each makes a
    /// new key and sends a signing request through the control service;
    /// this command signs them with the CA's key, which stays on this
    /// machine; each component uses its new certificate from its next
    /// connection on. Exit status 1 names any component left with its old one.
    RotateCerts {
        /// The cluster CA's directory (ca-cert.pem, ca-key.pem).
        #[arg(long, default_value = "/etc/ferry/ca")]
        ca_dir: std::path::PathBuf,
        /// Days the new certificates are valid.
        #[arg(long, default_value_t = ferry_net::tls::CERT_DAYS)]
        days: u32,
        #[arg(long)]
        json: bool,
    },
    /// Revoke certificates: signs a new revocation list with the CA's key
    /// (on this machine) and hands it to the control service, which puts it
    /// in force on every agent and storage node and on itself. A revoked
    /// certificate is refused at its next TLS handshake.
    Revoke {
        /// A certificate file (PEM) to revoke; repeatable.
        #[arg(long = "cert")]
        certs: Vec<std::path::PathBuf>,
        /// A serial number (hex, as `ferry host list --json` shows
        /// `certificate_serial`) to revoke; repeatable.
        #[arg(long = "serial")]
        serials: Vec<String>,
        /// The cluster CA's directory (ca-cert.pem, ca-key.pem).
        #[arg(long, default_value = "/etc/ferry/ca")]
        ca_dir: std::path::PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// The revocation list in force: its number and the revoked serials.
    Crl {
        #[arg(long)]
        json: bool,
    },
    /// Change cluster settings; what is not given stays.
    Set {
        /// Every migration and disk copy encrypted and authenticated with a
        /// key of each move's own (on by default): Ferry's carriers sealed,
        /// QEMU's own streams in TLS. `off` lets memory go in clear, for
        /// fabrics the hosts trust; every move's report then says so.
        #[arg(long)]
        encryption: Option<OnOff>,
        /// The program in the control service's hooks directory that powers
        /// a failed host off (IPMI, Redfish; FERRY_HOST set, exit status 0 =
        /// off), so HA VMs on drives Ferry cannot fence restart too; "" to
        /// remove it. Takes the admin role.
        #[arg(long, value_name = "NAME")]
        fence_hook: Option<String>,
        /// `auto`: the balancer runs by itself (the leader checks every
        /// --balance-every seconds and moves once the spread stayed over
        /// the threshold three checks running; a VM it moved stays put 15
        /// minutes, then twice as long after each move, up to 6 hours).
        #[arg(long)]
        balance: Option<AutoOff>,
        /// The spread of host load the balancer leaves alone, percent (default 10).
        #[arg(long, value_name = "PCT")]
        balance_threshold: Option<u32>,
        /// Seconds between the automatic balancer's checks (default 60).
        #[arg(long, value_name = "S")]
        balance_every: Option<u64>,
        #[arg(long)]
        json: bool,
    },
    /// The cluster's settings.
    Show {
        #[arg(long)]
        json: bool,
    },
    /// Maintenance of every host in turn: drain a host, keep it in
    /// maintenance (it takes no VMs) until `ferry host resume HOST` or the
    /// hook says it is healthy, then the next. The control service runs it:
    /// interrupting this command (or restarting the control service) loses
    /// nothing; run it again to follow the run. Exit status 0 when every
    /// host is done.
    DrainRolling {
        /// Hosts in the order to drain them, comma separated (default: all).
        #[arg(long, value_delimiter = ',')]
        hosts: Vec<String>,
        /// Hosts draining or in maintenance at once (hosts down or drained
        /// by hand count too).
        #[arg(long, default_value_t = 1)]
        max_hosts_down: u32,
        /// Simultaneous migrations of each drain: auto or 1..16.
        #[arg(long)]
        max_parallel: Option<String>,
        #[arg(long, value_enum)]
        option: Option<crate::vm_cmd::OptionArg>,
        /// The name of a program in the control service's hooks_dir, run
        /// (no shell, FERRY_HOST set) while a host is in maintenance; exit
        /// status 0 resumes the host. Takes the admin role.
        #[arg(long, value_name = "NAME")]
        hook: Option<String>,
        /// Show the run (the last one if none runs) and exit.
        #[arg(long, conflicts_with = "stop")]
        status: bool,
        /// Stop the run: no further host starts draining.
        #[arg(long)]
        stop: bool,
        /// Print the run's status as JSON when it ends.
        #[arg(long)]
        json: bool,
    },
    /// The control instance that answers, and which instance leads (runs
    /// failovers, the storage access sync, the policy manager, rolling
    /// drains).
    Control {
        #[arg(long)]
        json: bool,
    },
    /// Even out the hosts' load (CPU and memory): the plan, each move with
    /// its predicted bytes, time and benefit, best benefit per byte first;
    /// then its moves, one at a time, unless --dry-run.
    Balance {
        /// Show the plan only.
        #[arg(long)]
        dry_run: bool,
        /// The spread of host load (standard deviation, 0-1) left alone
        /// (default 0.10).
        #[arg(long)]
        threshold: Option<f64>,
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(cli: &Cli, cmd: &ClusterCmd) -> anyhow::Result<i32> {
    match cmd {
        ClusterCmd::Init {
            hosts,
            dir,
            listen,
            force,
            san,
            admin_machine,
        } => return init(hosts, dir, *listen, *force, san, *admin_machine),
        ClusterCmd::IssueCert {
            role,
            name,
            san,
            ca,
            out,
            days,
        } => {
            let req = ferry_net::tls::CertRequest {
                role: role.parse()?,
                name: name.clone(),
                san: san.clone(),
                days: *days,
            };
            ferry_net::tls::Authority::load(ca)?.issue(&req, out)?;
            println!("wrote {} ({} {name})", out.display(), req.role);
            return Ok(0);
        }
        ClusterCmd::RotateCerts { ca_dir, days, json } => {
            return crate::certs_cmd::rotate(&cli.client()?, ca_dir, *days, *json).await
        }
        ClusterCmd::Revoke {
            certs,
            serials,
            ca_dir,
            json,
        } => return crate::certs_cmd::revoke(&cli.client()?, certs, serials, ca_dir, *json).await,
        ClusterCmd::Crl { json } => {
            let crl: ferry_api::certs::CrlInfo = cli.client()?.get("/cluster/crl", T).await?;
            if *json {
                print_json(&crl);
            } else if crl.number == 0 {
                println!("no certificate revoked");
            } else {
                println!(
                    "revocation list {}: {} serial(s)",
                    crl.number,
                    crl.serials.len()
                );
                for s in &crl.serials {
                    println!("  {s}");
                }
            }
            return Ok(0);
        }
        ClusterCmd::DrainRolling {
            hosts,
            max_hosts_down,
            max_parallel,
            option,
            hook,
            status,
            stop,
            json,
        } => {
            let req = RollingRequest {
                hosts: hosts.clone(),
                max_hosts_down: *max_hosts_down,
                max_parallel: max_parallel
                    .as_deref()
                    .map(|m| MigrationLimit::parse("--max-parallel", m))
                    .transpose()?,
                option: option.map(Into::into),
                hook: hook.clone(),
            };
            return crate::rolling::run(&cli.client()?, req, *status, *stop, *json).await;
        }
        ClusterCmd::Balance {
            dry_run,
            threshold,
            json,
        } => return crate::placement_cmd::balance(cli, *dry_run, *threshold, *json).await,
        ClusterCmd::Control { json } => {
            let st: ferry_api::ha::ControlStatus = cli.client()?.get("/cluster/control", T).await?;
            if *json {
                print_json(&st);
            } else {
                println!(
                    "this instance: {} ({}, {})\nleader: {}{}",
                    st.instance,
                    st.store,
                    if st.leading { "leading" } else { "following" },
                    st.leader
                        .as_deref()
                        .unwrap_or("none (an election is under way)"),
                    st.leading_since_ms
                        .map(|t| format!(
                            " for {} s",
                            ferry_api::util::now_ms().saturating_sub(t) / 1000
                        ))
                        .unwrap_or_default()
                );
            }
            return Ok(0);
        }
        _ => {}
    }
    let c = cli.client()?;
    let (s, json): (ClusterSettings, bool) = match cmd {
        ClusterCmd::Set {
            encryption,
            fence_hook,
            balance,
            balance_threshold,
            balance_every,
            json,
        } => {
            let u = ClusterSettingsUpdate {
                encryption: encryption.map(|v| matches!(v, OnOff::On)),
                fence_hook: fence_hook.clone(),
                balance_auto: balance.map(|b| matches!(b, AutoOff::Auto)),
                balance_threshold_pct: *balance_threshold,
                balance_every_s: *balance_every,
            };
            // a value out of range is named before the cluster is asked
            u.validate().map_err(|e| {
                rename_field(
                    e,
                    &[
                        ("balance_threshold_pct", "--balance-threshold"),
                        ("balance_every_s", "--balance-every"),
                    ],
                )
            })?;
            (c.put("/cluster", &u, T).await?, *json)
        }
        ClusterCmd::Show { json } => (c.get("/cluster", T).await?, *json),
        ClusterCmd::Init { .. }
        | ClusterCmd::IssueCert { .. }
        | ClusterCmd::RotateCerts { .. }
        | ClusterCmd::Revoke { .. }
        | ClusterCmd::Crl { .. }
        | ClusterCmd::Control { .. }
        | ClusterCmd::Balance { .. }
        | ClusterCmd::DrainRolling { .. } => {
            unreachable!("handled above")
        }
    };
    if json {
        print_json(&s);
    } else {
        println!(
            "encryption: {}",
            if s.encryption {
                "on (every move with its own key: carriers sealed, QEMU's streams in TLS)"
            } else {
                "OFF (guest memory crosses the migration network in clear)"
            }
        );
        println!(
            "fence hook: {}",
            s.fence_hook.as_deref().unwrap_or(
                "none (HA VMs on drives Ferry cannot fence wait for --confirm-powered-off)"
            )
        );
        println!(
            "balancer: {} (threshold {}%, every {} s)",
            if s.balance_auto {
                "auto"
            } else {
                "off (ferry cluster balance)"
            },
            s.balance_threshold_pct,
            s.balance_every_s
        );
    }
    Ok(0)
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum AutoOff {
    Auto,
    Off,
}

/// The error with the API's field name replaced by the flag's.
fn rename_field(e: ferry_api::ApiError, names: &[(&str, &str)]) -> ferry_api::ApiError {
    match e {
        ferry_api::ApiError::InvalidArgument { field, reason } => {
            let field = names
                .iter()
                .find(|(api, _)| *api == field)
                .map(|(_, flag)| flag.to_string())
                .unwrap_or(field);
            ferry_api::ApiError::InvalidArgument { field, reason }
        }
        e => e,
    }
}

/// One `--host NAME=ADDRESS`: the name and the agent's URL.
fn parse_host(h: &str) -> anyhow::Result<(String, String, std::net::SocketAddr)> {
    let (name, addr) = h
        .split_once('=')
        .ok_or_else(|| anyhow::anyhow!("--host '{h}' is not NAME=ADDRESS"))?;
    ferry_api::validate_name("host", name)?;
    let sock: std::net::SocketAddr = match addr.parse::<std::net::SocketAddr>() {
        Ok(s) => s,
        Err(_) => std::net::SocketAddr::new(
            addr.parse()
                .map_err(|_| anyhow::anyhow!("--host '{h}': '{addr}' is not an IP address"))?,
            7800,
        ),
    };
    Ok((name.to_string(), format!("https://{sock}"), sock))
}

fn init(
    hosts: &[String],
    dir: &std::path::Path,
    listen: std::net::SocketAddr,
    force: bool,
    san: &[String],
    admin_machine: bool,
) -> anyhow::Result<i32> {
    use anyhow::Context;
    let parsed = hosts
        .iter()
        .map(|h| parse_host(h))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // the control host's /etc/ferry: here, or a bundle to copy there
    let server = if admin_machine {
        dir.join("control")
    } else {
        dir.to_path_buf()
    };
    let token = server.join("cluster.token");
    if token.exists() && !force {
        anyhow::bail!(
            "{} exists: this machine already has a cluster credential (--force replaces it)",
            token.display()
        );
    }
    std::fs::create_dir_all(&server).with_context(|| format!("creating {}", server.display()))?;
    let ca_dir = dir.join("ca");
    if force {
        let _ = std::fs::remove_dir_all(&ca_dir);
    }
    let ca = ferry_net::tls::Authority::create(&ca_dir, &crate::config::system_hostname())?;
    let credential = ferry_api::auth::Credential::generate();
    credential
        .store(&token)
        .with_context(|| format!("writing {}", token.display()))?;
    let admin = ferry_api::auth::Credential::from_secret(&ferry_control::tokens::new_secret());
    let mut admin_files = vec![dir.join("admin.token")];
    if admin_machine {
        // the control service makes the first admin token from it
        admin_files.push(server.join("admin.token"));
    }
    for f in &admin_files {
        admin
            .store(f)
            .with_context(|| format!("writing {}", f.display()))?;
    }
    let mut control_san = vec![crate::config::system_hostname(), "127.0.0.1".to_string()];
    if !listen.ip().is_unspecified() {
        control_san.push(listen.ip().to_string());
    }
    control_san.extend(san.iter().cloned());
    let issue = |role, name: &str, san: Vec<String>, out: &std::path::Path| {
        ca.issue(
            &ferry_net::tls::CertRequest {
                role,
                name: name.into(),
                san,
                days: ferry_net::tls::CERT_DAYS,
            },
            out,
        )
    };
    let ca_cert = |pki: &std::path::Path| {
        std::fs::copy(
            ca_dir.join(ferry_net::tls::CA_CERT),
            pki.join(ferry_net::tls::CA_CERT),
        )
        .with_context(|| format!("copying the CA's certificate to {}", pki.display()))
    };
    let pki = server.join("pki").join("control");
    issue(ferry_net::tls::Role::Control, "control", control_san, &pki)?;
    ca_cert(&server.join("pki"))?;
    let admin_pki = dir.join("pki").join("admin");
    issue(ferry_net::tls::Role::Admin, "admin", vec![], &admin_pki)?;
    ca_cert(&dir.join("pki"))?;
    let control = crate::config::ControlFile {
        listen: Some(listen),
        credential: Some(crate::config::DEFAULT_CREDENTIAL.into()),
        admin_token: Some(crate::config::DEFAULT_ADMIN_TOKEN.into()),
        hosts: parsed
            .iter()
            .map(|(n, url, _)| (n.clone(), url.clone()))
            .collect(),
        ..Default::default()
    };
    let mut written = vec![ca_dir.display().to_string(), token.display().to_string()];
    written.extend(admin_files.iter().map(|f| f.display().to_string()));
    written.push(pki.display().to_string());
    written.push(admin_pki.display().to_string());
    let path = server.join("control.toml");
    std::fs::write(&path, toml::to_string(&control)?)
        .with_context(|| format!("writing {}", path.display()))?;
    written.push(path.display().to_string());
    for (name, url, sock) in &parsed {
        let agent = crate::config::AgentFile {
            name: Some(name.clone()),
            listen: Some(*sock),
            url: Some(url.clone()),
            credential: Some(crate::config::DEFAULT_CREDENTIAL.into()),
            ..Default::default()
        };
        let host_dir = dir.join("hosts").join(name);
        let host_pki = host_dir.join("pki").join("agent");
        issue(
            ferry_net::tls::Role::Agent,
            name,
            vec![sock.ip().to_string()],
            &host_pki,
        )?;
        ca_cert(&host_dir.join("pki"))?;
        written.push(host_pki.display().to_string());
        let path = if admin_machine {
            let t = host_dir.join("cluster.token");
            credential
                .store(&t)
                .with_context(|| format!("writing {}", t.display()))?;
            written.push(t.display().to_string());
            host_dir.join("agent.toml")
        } else {
            dir.join(format!("agent-{name}.toml"))
        };
        let text = format!(
            "# copy to {name}:/etc/ferry/agent.toml; list its migration NICs\n\
             # (nics = [\"ens1f0\", \"ens1f1\"] or networks = [\"10.10.0.0/24\"])\n{}",
            toml::to_string(&agent)?
        );
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        written.push(path.display().to_string());
    }
    for w in &written {
        println!("wrote {w}");
    }
    if admin_machine {
        println!(
            "next: copy {c}/ to the control host as /etc/ferry (then remove its admin.token once \
             the control service has started), and each hosts/NAME/ to its host as /etc/ferry \
             (list its migration NICs in agent.toml); ca/ never leaves this machine. This \
             machine's CLI uses admin.token and pki/ca-cert.pem here (--token-file, --ca). \
             `ferry cluster rotate-certs --ca-dir {ca}` gives every server a key made on it and \
             never sent; `ferry cluster revoke --ca-dir {ca}` revokes. A storage node's \
             certificate: `ferry cluster issue-cert --role storage --name NODE --san ADDR --ca \
             {ca} --out DIR`.",
            c = server.display(),
            ca = ca_dir.display()
        );
    } else {
        println!(
            "next: copy cluster.token to /etc/ferry/ on every host (mode 0600), each agent-NAME.toml \
             to its host as /etc/ferry/agent.toml and the contents of hosts/NAME/pki into its \
             /etc/ferry/pki; keep ca/ (the CA's key) on this machine only (or run init on an \
             admin's machine with --admin-machine); then `systemctl enable --now ferry-agent` on \
             the hosts and `systemctl enable --now ferry-control` here. admin.token is the first \
             admin API token (`ferry token create` makes more); a storage node's certificate: \
             `ferry cluster issue-cert --role storage --name NODE --san ADDR --ca /etc/ferry/ca \
             --out DIR`."
        );
    }
    Ok(0)
}
