//! `ferry token …`: users' API tokens at the control service.

use std::time::Duration;

use clap::Subcommand;
use ferry_api::auth::{TokenCreateRequest, TokenCreated, TokenInfo, TokenRole};

use crate::output::print_json;
use crate::Cli;

const T: Duration = Duration::from_secs(10);

#[derive(Subcommand)]
pub enum TokenCmd {
    /// Make a token; its secret is printed this once.
    Create {
        name: String,
        /// admin, operator or read-only.
        #[arg(long)]
        role: String,
        #[arg(long)]
        json: bool,
    },
    /// Every token, revoked ones too (never their secrets).
    List {
        #[arg(long)]
        json: bool,
    },
    /// Refuse a token from now on; its name stays taken.
    Revoke {
        name: String,
        #[arg(long)]
        json: bool,
    },
}

fn print_info(t: &TokenInfo) {
    println!(
        "{:<20} {:<10} {}",
        t.name,
        t.role,
        if t.revoked_ms.is_some() {
            "revoked"
        } else {
            "active"
        }
    );
}

pub async fn run(cli: &Cli, cmd: &TokenCmd) -> anyhow::Result<i32> {
    let c = cli.client()?;
    match cmd {
        TokenCmd::Create { name, role, json } => {
            let role: TokenRole = role.parse()?;
            let t: TokenCreated = c
                .post(
                    "/tokens",
                    &TokenCreateRequest {
                        name: name.clone(),
                        role,
                    },
                    T,
                )
                .await?;
            if *json {
                print_json(&t);
            } else {
                println!("token {} ({}): {}", t.info.name, t.info.role, t.token);
                println!("(shown this once; keep it in a file readable by its user only)");
            }
        }
        TokenCmd::List { json } => {
            let list: Vec<TokenInfo> = c.get("/tokens", T).await?;
            if *json {
                print_json(&list);
            } else {
                println!("{:<20} {:<10} STATE", "NAME", "ROLE");
                list.iter().for_each(print_info);
            }
        }
        TokenCmd::Revoke { name, json } => {
            let t: TokenInfo = c.delete(&format!("/tokens/{name}"), T).await?;
            if *json {
                print_json(&t);
            } else {
                print_info(&t);
            }
        }
    }
    Ok(0)
}
