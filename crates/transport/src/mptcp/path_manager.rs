//! The kernel's MPTCP path manager: endpoints per NIC, announcing an
//! address again for a subflow to re-join, link state.

use std::net::IpAddr;

pub(super) fn ip(args: &[&str]) -> Result<String, String> {
    ferry_api::util::run_command("ip", args)
}

/// `(id, address)` of every endpoint of this host's path manager.
pub(super) fn endpoints() -> Result<Vec<(String, String)>, String> {
    let out = ip(&["mptcp", "endpoint", "show"])?;
    Ok(out
        .lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            let id = w.iter().position(|x| *x == "id")?;
            Some((w.get(id + 1)?.to_string(), w.first()?.to_string()))
        })
        .collect())
}

/// Makes this host's path manager announce every NIC and accept a subflow
/// per NIC and connection: limits, and a `signal` endpoint per NIC (added
/// where missing; endpoints of other addresses are left alone).
pub fn prepare_host(nics: &[(String, IpAddr)]) -> Result<(), String> {
    let n = (nics.len() as u32).clamp(2, 8).to_string();
    ip(&[
        "mptcp",
        "limits",
        "set",
        "subflows",
        &n,
        "add_addr_accepted",
        &n,
    ])?;
    let have = endpoints()?;
    for (nic, addr) in nics {
        if !have.iter().any(|(_, x)| *x == addr.to_string()) {
            add_endpoint(nic, *addr)?;
        }
    }
    Ok(())
}

/// Adds a `signal` endpoint; one that another migration added meanwhile is fine.
pub(super) fn add_endpoint(nic: &str, addr: IpAddr) -> Result<(), String> {
    let a = addr.to_string();
    match ip(&["mptcp", "endpoint", "add", &a, "dev", nic, "signal"]) {
        Ok(_) => Ok(()),
        Err(_) if endpoints()?.iter().any(|(_, x)| *x == a) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Announces `addr` (on `nic`) again to every MPTCP peer of this host:
/// its endpoint is removed and added back, which sends RM_ADDR then
/// ADD_ADDR, and a peer lacking a subflow to it joins.
pub fn announce(nic: &str, addr: IpAddr) -> Result<(), String> {
    let a = addr.to_string();
    if let Some((id, _)) = endpoints()?.into_iter().find(|(_, x)| *x == a) {
        // gone already if another migration is announcing it too
        let _ = ip(&["mptcp", "endpoint", "delete", "id", &id]);
    }
    add_endpoint(nic, addr)
}

/// Whether a NIC's link is up: administratively up with a carrier (the
/// kernel's `IFF_UP` and `carrier`; `operstate` says `unknown` for some
/// drivers and for loopback).
pub(super) fn link_up(nic: &str) -> bool {
    let read = |what: &str| std::fs::read_to_string(format!("/sys/class/net/{nic}/{what}"));
    let up = read("flags")
        .ok()
        .and_then(|f| u32::from_str_radix(f.trim().trim_start_matches("0x"), 16).ok())
        .is_some_and(|f| f & super::paths::IFF_UP != 0);
    // reading `carrier` fails while the NIC is administratively down
    up && read("carrier").is_ok_and(|c| c.trim() == "1")
}
