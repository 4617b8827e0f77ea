//! `ferry cluster …`: settings that hold for the whole cluster.

use std::time::Duration;

use clap::{Subcommand, ValueEnum};
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
    /// Start a cluster on this machine: write a new cluster credential, the
    /// control service's configuration for the hosts given, and a starting
    /// agent.toml per host (copy each to its host's /etc/ferry/agent.toml).
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
    },
    /// Change cluster settings; what is not given stays.
    Set {
        /// Live migrations only over Ferry's transport, every frame encrypted
        /// and authenticated (AES-256-GCM): for fabrics the hosts do not
        /// trust. `--option tcp` is then refused and `auto` uses the
        /// transport even over one NIC.
        #[arg(long)]
        encrypt_carriers: Option<OnOff>,
        #[arg(long)]
        json: bool,
    },
    /// The cluster's settings.
    Show {
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(cli: &Cli, cmd: &ClusterCmd) -> anyhow::Result<i32> {
    if let ClusterCmd::Init {
        hosts,
        dir,
        listen,
        force,
    } = cmd
    {
        return init(hosts, dir, *listen, *force);
    }
    let c = cli.client()?;
    let (s, json): (ClusterSettings, bool) = match cmd {
        ClusterCmd::Set {
            encrypt_carriers,
            json,
        } => {
            let u = ClusterSettingsUpdate {
                encrypt_carriers: encrypt_carriers.map(|v| matches!(v, OnOff::On)),
            };
            (c.put("/cluster", &u, T).await?, *json)
        }
        ClusterCmd::Show { json } => (c.get("/cluster", T).await?, *json),
        ClusterCmd::Init { .. } => unreachable!("handled above"),
    };
    if json {
        print_json(&s);
    } else {
        println!(
            "encrypt carriers: {}",
            if s.encrypt_carriers {
                "on (AES-256-GCM on every carrier frame; tcp refused)"
            } else {
                "off"
            }
        );
    }
    Ok(0)
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
    Ok((name.to_string(), format!("http://{sock}"), sock))
}

fn init(
    hosts: &[String],
    dir: &std::path::Path,
    listen: std::net::SocketAddr,
    force: bool,
) -> anyhow::Result<i32> {
    use anyhow::Context;
    let parsed = hosts
        .iter()
        .map(|h| parse_host(h))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let token = dir.join("cluster.token");
    if token.exists() && !force {
        anyhow::bail!(
            "{} exists: this machine already has a cluster credential (--force replaces it)",
            token.display()
        );
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    ferry_api::auth::Credential::generate()
        .store(&token)
        .with_context(|| format!("writing {}", token.display()))?;
    let control = crate::config::ControlFile {
        listen: Some(listen),
        credential: Some(crate::config::DEFAULT_CREDENTIAL.into()),
        hosts: parsed
            .iter()
            .map(|(n, url, _)| (n.clone(), url.clone()))
            .collect(),
        ..Default::default()
    };
    let mut written = vec![token.display().to_string()];
    let path = dir.join("control.toml");
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
        let path = dir.join(format!("agent-{name}.toml"));
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
    println!(
        "next: copy cluster.token to /etc/ferry/ on every host (mode 0600) and each agent-NAME.toml \
         to its host as /etc/ferry/agent.toml; then `systemctl enable --now ferry-agent` on the \
         hosts and `systemctl enable --now ferry-control` here"
    );
    Ok(0)
}
