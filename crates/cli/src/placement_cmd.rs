//! `ferry rule …`, `ferry group …`, `ferry host label` and `ferry cluster
//! balance`: the placement rules and the balancer at the control service
//! (see `ferry_api::placement`).

use std::time::Duration;

use clap::{ArgGroup, Subcommand};
use ferry_api::placement::{
    parse_label, BalancePlan, BalanceRequest, HostGroup, LabelUpdate, PlacementConfig,
    PlacementStatus, Rule, RuleKind,
};
use ferry_api::size::human_bytes;
use ferry_api::ApiError;

use crate::output::print_json;
use crate::Cli;

const T: Duration = Duration::from_secs(30);

#[derive(Subcommand)]
pub enum RuleCmd {
    /// Make a rule: VMs together or apart, in or out of a host group, or
    /// left alone by the balancer. Refused, naming the conflict, when it
    /// contradicts another rule or leaves a VM no host.
    #[command(group(ArgGroup::new("kind").required(true).args(
        ["affinity", "anti_affinity", "host_affinity", "host_anti_affinity", "exclude"])))]
    Create {
        name: String,
        /// The VMs it ties, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        vms: Vec<String>,
        /// Keep the VMs on one host.
        #[arg(long)]
        affinity: bool,
        /// Keep the VMs on different hosts.
        #[arg(long)]
        anti_affinity: bool,
        /// Run the VMs only on hosts of this group.
        #[arg(long, value_name = "GROUP")]
        host_affinity: Option<String>,
        /// Never run the VMs on hosts of this group.
        #[arg(long, value_name = "GROUP")]
        host_anti_affinity: Option<String>,
        /// The balancer never moves these VMs (drains still do).
        #[arg(long)]
        exclude: bool,
        /// A preference: broken only when nothing else fits, and said
        /// (default: strict, never broken).
        #[arg(long)]
        soft: bool,
        #[arg(long)]
        json: bool,
    },
    /// The rules, host groups and labels, and the strict rules broken now.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Remove a rule.
    Rm { name: String },
}

#[derive(Subcommand)]
pub enum GroupCmd {
    /// Define (or redefine) a host group: hosts by name, by label, or both.
    Create {
        name: String,
        /// Member hosts, comma-separated.
        #[arg(long, value_delimiter = ',')]
        hosts: Vec<String>,
        /// Every host carrying this label (key=value; repeat for all of several).
        #[arg(long = "label")]
        labels: Vec<String>,
        #[arg(long)]
        json: bool,
    },
    /// Remove a host group no rule uses.
    Rm { name: String },
}

fn labels_of(list: &[String]) -> Result<std::collections::BTreeMap<String, String>, ApiError> {
    list.iter().map(|l| parse_label(l)).collect()
}

pub async fn run_rule(cli: &Cli, cmd: &RuleCmd) -> anyhow::Result<i32> {
    match cmd {
        RuleCmd::Create {
            name,
            vms,
            affinity,
            anti_affinity,
            host_affinity,
            host_anti_affinity,
            exclude,
            soft,
            json,
        } => {
            let (kind, group) = if *affinity {
                (RuleKind::Affinity, None)
            } else if *anti_affinity {
                (RuleKind::AntiAffinity, None)
            } else if let Some(g) = host_affinity {
                (RuleKind::HostAffinity, Some(g.clone()))
            } else if let Some(g) = host_anti_affinity {
                (RuleKind::HostAntiAffinity, Some(g.clone()))
            } else {
                debug_assert!(*exclude);
                (RuleKind::Exclude, None)
            };
            let rule = Rule {
                name: name.clone(),
                kind,
                vms: vms.clone(),
                group,
                strict: !soft,
            };
            // named here, before any cluster is asked
            rule.validate()?;
            let c: PlacementConfig = cli.client()?.post("/placement/rules", &rule, T).await?;
            if *json {
                print_json(&c);
            } else {
                println!("rule {name} made: {}", rule.describe());
            }
        }
        RuleCmd::List { json } => {
            let s: PlacementStatus = cli.client()?.get("/placement", T).await?;
            if *json {
                print_json(&s);
            } else {
                print_status(&s);
            }
        }
        RuleCmd::Rm { name } => {
            let _: PlacementConfig = cli
                .client()?
                .delete(&format!("/placement/rules/{name}"), T)
                .await?;
            println!("rule {name} removed");
        }
    }
    Ok(0)
}

fn print_status(s: &PlacementStatus) {
    println!(
        "{:<20} {:<20} {:<7} {:<12} VMS",
        "RULE", "KIND", "STRICT", "GROUP"
    );
    for r in &s.config.rules {
        println!(
            "{:<20} {:<20} {:<7} {:<12} {}",
            r.name,
            r.kind.as_str(),
            if r.strict { "strict" } else { "soft" },
            r.group.as_deref().unwrap_or("-"),
            r.vms.join(",")
        );
    }
    if !s.config.groups.is_empty() {
        println!();
        println!("{:<20} MEMBERS", "GROUP");
        for g in &s.config.groups {
            let mut m: Vec<String> = g.hosts.clone();
            m.extend(g.labels.iter().map(|(k, v)| format!("label {k}={v}")));
            println!("{:<20} {}", g.name, m.join(", "));
        }
    }
    if !s.config.labels.is_empty() {
        println!();
        println!("{:<20} LABELS", "HOST");
        for (h, l) in &s.config.labels {
            let l: Vec<String> = l.iter().map(|(k, v)| format!("{k}={v}")).collect();
            println!("{:<20} {}", h, l.join(", "));
        }
    }
    for b in &s.broken {
        println!("broken now: {b}");
    }
}

pub async fn run_group(cli: &Cli, cmd: &GroupCmd) -> anyhow::Result<i32> {
    match cmd {
        GroupCmd::Create {
            name,
            hosts,
            labels,
            json,
        } => {
            let g = HostGroup {
                name: name.clone(),
                hosts: hosts.clone(),
                labels: labels_of(labels)?,
            };
            g.validate()?;
            let c: PlacementConfig = cli.client()?.post("/placement/groups", &g, T).await?;
            if *json {
                print_json(&c);
            } else {
                println!("group {name} set");
            }
        }
        GroupCmd::Rm { name } => {
            let _: PlacementConfig = cli
                .client()?
                .delete(&format!("/placement/groups/{name}"), T)
                .await?;
            println!("group {name} removed");
        }
    }
    Ok(0)
}

/// `ferry host label HOST key=value… [--unset KEY…]`.
pub async fn label(cli: &Cli, host: &str, set: &[String], unset: &[String]) -> anyhow::Result<i32> {
    let u = LabelUpdate {
        set: labels_of(set)?,
        unset: unset.to_vec(),
    };
    let now: std::collections::BTreeMap<String, String> = cli
        .client()?
        .put(&format!("/hosts/{host}/labels"), &u, T)
        .await?;
    let l: Vec<String> = now.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!(
        "host {host} labels: {}",
        if l.is_empty() {
            "-".into()
        } else {
            l.join(", ")
        }
    );
    Ok(0)
}

/// `ferry cluster balance [--dry-run] [--threshold N] [--json]`.
pub async fn balance(
    cli: &Cli,
    dry_run: bool,
    threshold: Option<f64>,
    json: bool,
) -> anyhow::Result<i32> {
    if let Some(t) = threshold {
        if !(0.0..=1.0).contains(&t) {
            return Err(
                ApiError::invalid("--threshold", "must be 0..1 (a spread of host load)").into(),
            );
        }
    }
    let p: BalancePlan = cli
        .client()?
        .post(
            "/cluster/balance",
            &BalanceRequest { dry_run, threshold },
            T,
        )
        .await?;
    if json {
        print_json(&p);
        return Ok(0);
    }
    println!("{:<12} {:>6} {:>8} {:>6}", "HOST", "CPU", "MEMORY", "LOAD");
    for h in &p.before {
        println!(
            "{:<12} {:>5.0}% {:>7.0}% {:>5.0}%",
            h.host,
            h.cpu * 100.0,
            h.memory * 100.0,
            h.load * 100.0
        );
    }
    println!(
        "spread {:.3} (threshold {:.3}) → {:.3} after {} move(s)",
        p.spread_before,
        p.threshold,
        p.spread_after,
        p.moves.len()
    );
    for m in &p.moves {
        println!(
            "  {} {} → {}: ~{} in ~{:.0} s, spread -{:.3}{}",
            m.vm,
            m.from,
            m.to,
            human_bytes(m.bytes),
            m.seconds,
            m.benefit,
            m.mends
                .as_deref()
                .map(|r| format!(", mends {r}"))
                .unwrap_or_default()
        );
    }
    println!("{}", p.why);
    if p.started {
        println!("moves started, one at a time (ferry events shows each)");
    } else if !p.moves.is_empty() {
        println!("dry run: nothing moved");
    }
    Ok(0)
}
