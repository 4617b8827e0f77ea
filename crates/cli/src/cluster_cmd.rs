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
