//! `ferry bandwidth …`: traffic classes over the control API.

use std::time::Duration;

use clap::Subcommand;
use ferry_api::bandwidth::{BandwidthReport, BandwidthSetRequest, Cap, TrafficClass};
use ferry_api::ApiError;

use crate::output::{print_json, Table};
use crate::Cli;

const T: Duration = Duration::from_secs(30);

#[derive(Subcommand)]
pub enum BandwidthCmd {
    /// Set one class's hard cap and minimum share; every host re-plans its NICs.
    Set {
        /// live-migration, storage or default.
        #[arg(long)]
        class: String,
        /// Hard cap: percent of each NIC (60%) or a rate for the whole host
        /// (600mbit, 1gbit), split over the NICs that are up.
        #[arg(long)]
        max: Option<String>,
        /// Minimum share, percent of each NIC (30%); lent to others when unused.
        #[arg(long)]
        min: Option<String>,
        /// Remove the class's limits first.
        #[arg(long)]
        clear: bool,
        #[arg(long)]
        json: bool,
    },
    /// The policy, and per host and NIC each class's guarantee, cap and current rate.
    List {
        #[arg(long)]
        json: bool,
    },
}

fn percent(flag: &str, s: &str) -> Result<u32, ApiError> {
    match s.trim().trim_end_matches('%').trim().parse::<u32>() {
        Ok(v) if v <= 100 => Ok(v),
        _ => Err(ApiError::invalid(
            flag,
            format!("'{s}' is not a percentage 0%..100%"),
        )),
    }
}

pub async fn run(cli: &Cli, cmd: &BandwidthCmd) -> anyhow::Result<i32> {
    let (report, json): (BandwidthReport, bool) = match cmd {
        BandwidthCmd::Set {
            class,
            max,
            min,
            clear,
            json,
        } => {
            let req = BandwidthSetRequest {
                class: TrafficClass::parse("--class", class)?,
                max: max.as_deref().map(|m| Cap::parse("--max", m)).transpose()?,
                min_pct: min.as_deref().map(|m| percent("--min", m)).transpose()?,
                clear: *clear,
            };
            if req.max.is_none() && req.min_pct.is_none() && !req.clear {
                return Err(
                    ApiError::invalid("bandwidth set", "give --max, --min or --clear").into(),
                );
            }
            (cli.client()?.put("/bandwidth", &req, T).await?, *json)
        }
        BandwidthCmd::List { json } => (cli.client()?.get("/bandwidth", T).await?, *json),
    };
    if json {
        print_json(&report);
    } else {
        print_report(&report);
    }
    Ok(0)
}

fn mbit(bits: f64) -> String {
    format!("{:.0}", bits / 1e6)
}

fn print_report(r: &BandwidthReport) {
    if r.policy.classes.is_empty() {
        println!("no bandwidth classes set: every NIC is one queue");
    }
    for c in &r.policy.classes {
        println!(
            "{}: max {}, min {}%",
            c.class.name(),
            c.max.map(Cap::describe).unwrap_or_else(|| "none".into()),
            c.min_pct
        );
    }
    let mut t = Table::new(&[
        "HOST",
        "NIC",
        "LINK",
        "CLASS",
        "MIN Mbit/s",
        "MAX Mbit/s",
        "NOW Mbit/s",
    ]);
    for h in &r.hosts {
        for n in &h.nics {
            if !n.up {
                t.row(vec![
                    h.host.clone(),
                    n.nic.clone(),
                    "down".into(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                ]);
                continue;
            }
            for c in &n.classes {
                t.row(vec![
                    h.host.clone(),
                    n.nic.clone(),
                    mbit(n.link_rate as f64),
                    c.class.name().into(),
                    mbit(c.rate as f64),
                    mbit(c.ceil as f64),
                    mbit(c.tx_rate),
                ]);
            }
        }
        if let Some(e) = &h.error {
            eprintln!("warning: {}: {e}", h.host);
        }
    }
    if !r.policy.classes.is_empty() {
        print!("{}", t.render());
    }
    for (h, e) in &r.unreachable {
        eprintln!("warning: {h} did not answer: {e}");
    }
}
