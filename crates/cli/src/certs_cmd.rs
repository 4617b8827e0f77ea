//! `ferry cluster rotate-certs` and `ferry cluster revoke`: the CA's key
//! is used here, on the administrator's machine, and nowhere else (see
//! `ferry_api::certs` for the exchange with the control service).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use ferry_api::certs::{CrlInfo, CrlInstall, InstallResult, RenewalItem, SignedCert};
use ferry_net::client::Client;
use ferry_net::tls::Authority;

use crate::output::print_json;

const T: Duration = Duration::from_secs(60);

fn authority(ca: &Path) -> anyhow::Result<Authority> {
    Authority::load(ca).with_context(|| {
        format!(
            "loading the cluster CA from {} (--ca-dir: the directory `ferry cluster init` wrote, kept on the admin's machine)",
            ca.display()
        )
    })
}

fn report(results: &[InstallResult], what: &str, json: bool) -> i32 {
    if json {
        print_json(&results);
    } else {
        for r in results {
            match (&r.status, &r.error) {
                (Some(s), _) => println!(
                    "{:<20} {what}: serial {} revocation list {}",
                    r.component,
                    s.serial,
                    s.crl_number.map_or("none".into(), |n| n.to_string())
                ),
                (None, e) => println!(
                    "{:<20} NOT {what}: {}",
                    r.component,
                    e.as_deref().unwrap_or("no answer")
                ),
            }
        }
    }
    i32::from(results.iter().any(|r| r.error.is_some()))
}

pub async fn rotate(c: &Client, ca: &Path, days: u32, json: bool) -> anyhow::Result<i32> {
    let ca = authority(ca)?;
    let asked: Vec<RenewalItem> = c
        .post("/cluster/certificates/requests", &serde_json::json!({}), T)
        .await?;
    let mut signed = vec![];
    let mut failed = vec![];
    for item in asked {
        let made = match (&item.renewal, &item.error) {
            (Some(r), _) => ca
                .renew(&r.certificate, &r.request, days)
                .map_err(|e| e.to_string()),
            (None, e) => Err(e.clone().unwrap_or_else(|| "no signing request".into())),
        };
        match made {
            Ok(certificate) => signed.push(SignedCert {
                component: item.component,
                certificate,
            }),
            Err(e) => failed.push(InstallResult {
                component: item.component,
                status: None,
                error: Some(e),
            }),
        }
    }
    let mut results: Vec<InstallResult> = if signed.is_empty() {
        vec![]
    } else {
        c.post("/cluster/certificates", &signed, T).await?
    };
    results.extend(failed);
    Ok(report(&results, "renewed", json))
}

/// A serial number given in hex (colons allowed, as openssl prints them), as bytes.
fn serial_hex(s: &str) -> anyhow::Result<Vec<u8>> {
    let mut clean: String = s.chars().filter(|c| *c != ':').collect();
    if !clean.len().is_multiple_of(2) {
        clean.insert(0, '0');
    }
    anyhow::ensure!(
        !clean.is_empty() && clean.len() <= 40,
        "--serial '{s}': not a serial number (hex, at most 20 bytes)"
    );
    ferry_api::util::unhex(&clean).ok_or_else(|| anyhow::anyhow!("--serial '{s}': not hex"))
}

pub async fn revoke(
    c: &Client,
    certs: &[PathBuf],
    serials: &[String],
    ca: &Path,
    json: bool,
) -> anyhow::Result<i32> {
    anyhow::ensure!(
        !certs.is_empty() || !serials.is_empty(),
        "nothing to revoke: give --cert FILE or --serial HEX"
    );
    let authority = authority(ca)?;
    let mut add = vec![];
    for path in certs {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let serial = ferry_net::tls::serial_of_pem(&text)
            .with_context(|| format!("{}: no certificate in it", path.display()))?;
        add.push(serial_hex(&serial)?);
    }
    for s in serials {
        add.push(serial_hex(s)?);
    }
    let kept: CrlInfo = c.get("/cluster/crl", T).await?;
    let mut all = kept
        .serials
        .iter()
        .map(|s| serial_hex(s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    for s in add {
        if !all.contains(&s) {
            all.push(s);
        }
    }
    let crl = authority.revocation_list(kept.number + 1, &all)?;
    let results: Vec<InstallResult> = c.put("/cluster/crl", &CrlInstall { crl }, T).await?;
    Ok(report(&results, "revocation list in force", json))
}

#[cfg(test)]
mod tests {
    use super::serial_hex;

    #[test]
    fn serials_are_read_as_openssl_prints_them_and_anything_else_is_refused() {
        assert_eq!(serial_hex("01:AB:cd").unwrap(), [0x01, 0xab, 0xcd]);
        assert_eq!(serial_hex("abc").unwrap(), [0x0a, 0xbc]);
        // a sign, a character of several bytes, nothing, too long
        for bad in ["+f", "-1", "€a", "", ":", &"a".repeat(41)] {
            let e = serial_hex(bad).unwrap_err().to_string();
            assert!(e.contains("--serial"), "{bad}: {e}");
        }
    }
}
