//! Renewing the cluster's certificates and keeping its revocation list
//! everywhere (the protocol is `ferry_api::certs`'s).
//!
//! The control service never holds the CA's key: it relays signing
//! requests to the administrator and signed certificates back, and keeps
//! the revocation list the administrator signed. Each heartbeat pushes that
//! list to every agent and storage node that has an older one (a host that
//! was down when it was made gets it when it answers again).

use std::time::Duration;

use ferry_api::certs::{
    CertInstall, CertRenewal, CrlInfo, CrlInstall, InstallResult, PkiStatus, RenewalItem,
    SignedCert,
};
use ferry_api::ApiError;
use ferry_net::client::Client;

use crate::Control;

/// The store's key of the revocation list.
const CRL_KEY: &str = "crl";
const T: Duration = Duration::from_secs(15);
pub(crate) const CONTROL: &str = "control";

impl Control {
    fn own_pki(&self) -> Result<&ferry_net::tls::Pki, ApiError> {
        self.pki.as_ref().ok_or_else(|| ApiError::Conflict {
            reason: "the control service runs without certificates (--insecure-http)".into(),
        })
    }

    /// Every component but this service: `host:NAME`, `storage:NAME`.
    fn components(&self) -> Vec<(String, &Client)> {
        let hosts = self.hosts.iter().map(|(n, c)| (format!("host:{n}"), c));
        let nodes = self
            .storage
            .iter()
            .map(|(n, c)| (format!("storage:{n}"), c));
        hosts.chain(nodes).collect()
    }

    fn component(&self, name: &str) -> Result<&Client, ApiError> {
        let found = match name.split_once(':') {
            Some(("host", h)) => self.hosts.get(h),
            Some(("storage", n)) => self.storage.get(n),
            _ => None,
        };
        found.ok_or_else(|| ApiError::not_found("component", name))
    }

    /// A new key and its signing request from every component, this
    /// service included; one that does not answer is named with its error.
    pub(crate) async fn cert_requests(&self) -> Result<Vec<RenewalItem>, ApiError> {
        let own = self.own_pki()?;
        let mut out = vec![RenewalItem {
            component: CONTROL.into(),
            renewal: Some(CertRenewal {
                certificate: own.certificate_pem(),
                request: own
                    .signing_request()
                    .map_err(|e| ApiError::internal(format!("own key: {e}")))?,
            }),
            error: None,
        }];
        let asks = self.components().into_iter().map(|(name, c)| async move {
            match c
                .post::<_, CertRenewal>("/pki/request", &serde_json::json!({}), T)
                .await
            {
                Ok(r) => RenewalItem {
                    component: name,
                    renewal: Some(r),
                    error: None,
                },
                Err(e) => RenewalItem {
                    component: name,
                    renewal: None,
                    error: Some(e.to_string()),
                },
            }
        });
        out.extend(futures::future::join_all(asks).await);
        let failed: Vec<_> = out.iter().filter(|i| i.error.is_some()).collect();
        self.log(
            "certificate_renewal",
            "cluster",
            serde_json::json!({ "asked": out.len(), "failed": failed.len() }),
        );
        Ok(out)
    }

    /// Hands each signed certificate to its component (this service's
    /// last); each takes it only for the key it waits with.
    pub(crate) async fn install_certs(
        &self,
        signed: Vec<SignedCert>,
    ) -> Result<Vec<InstallResult>, ApiError> {
        let own = self.own_pki()?;
        let mut seen = std::collections::BTreeSet::new();
        for s in &signed {
            if !seen.insert(s.component.as_str()) {
                return Err(ApiError::invalid(
                    "certificates",
                    format!("{} is named twice", s.component),
                ));
            }
            if s.component != CONTROL {
                self.component(&s.component)?;
            }
        }
        let pushes = signed
            .iter()
            .filter(|s| s.component != CONTROL)
            .map(|s| async move {
                let r = match self.component(&s.component) {
                    Ok(c) => {
                        let body = CertInstall {
                            certificate: s.certificate.clone(),
                        };
                        c.put::<_, PkiStatus>("/pki/certificate", &body, T).await
                    }
                    Err(e) => Err(e),
                };
                result(&s.component, r)
            });
        let mut out = futures::future::join_all(pushes).await;
        if let Some(s) = signed.iter().find(|s| s.component == CONTROL) {
            let r = own
                .install(&s.certificate)
                .map(|()| ferry_net::server::pki_status(own))
                .map_err(|e| ApiError::invalid("certificate", e.to_string()));
            out.push(result(CONTROL, r));
        }
        for r in &out {
            self.log(
                if r.error.is_none() {
                    "certificate_renewed"
                } else {
                    "certificate_not_renewed"
                },
                &r.component,
                serde_json::to_value(r).unwrap_or_default(),
            );
        }
        Ok(out)
    }

    /// The revocation list in force (number 0: none).
    pub(crate) async fn crl(&self) -> Result<CrlInfo, ApiError> {
        Ok(self.store.cluster(CRL_KEY).await?.unwrap_or_default())
    }

    /// Takes a revocation list signed by the cluster CA, newer than the one
    /// kept, and puts it in force here and on every component.
    pub(crate) async fn set_crl(&self, pem: String) -> Result<Vec<InstallResult>, ApiError> {
        let own = self.own_pki()?;
        let kept = self.crl().await?;
        let number = own
            .install_crl(&pem)
            .map_err(|e| ApiError::invalid("crl", e.to_string()))?;
        if number <= kept.number && pem != kept.crl {
            return Err(ApiError::invalid(
                "crl",
                format!(
                    "number {number} is not newer than the list kept ({})",
                    kept.number
                ),
            ));
        }
        let (_, serials) =
            ferry_net::tls::crl_facts_pem(&pem).map_err(|e| ApiError::invalid("crl", e))?;
        let info = CrlInfo {
            number,
            serials,
            crl: pem,
        };
        self.store.put_cluster(CRL_KEY, &info).await?;
        self.log(
            "crl",
            "cluster",
            serde_json::json!({ "number": number, "serials": info.serials }),
        );
        let mut out = vec![result(CONTROL, Ok(ferry_net::server::pki_status(own)))];
        out.extend(self.push_crl(&info, None).await);
        Ok(out)
    }

    /// Pushes `info` to every component, or to those named in `only`.
    async fn push_crl(&self, info: &CrlInfo, only: Option<&[String]>) -> Vec<InstallResult> {
        let body = CrlInstall {
            crl: info.crl.clone(),
        };
        let pushes = self
            .components()
            .into_iter()
            .filter(|(name, _)| only.is_none_or(|o| o.contains(name)))
            .map(|(name, c)| {
                let body = &body;
                async move {
                    let r = c.put::<_, PkiStatus>("/pki/crl", body, T).await;
                    result(&name, r)
                }
            });
        let out = futures::future::join_all(pushes).await;
        let mut pushed = ferry_api::util::lock(&self.crl_pushed);
        for r in &out {
            if let Some(n) = r.status.as_ref().and_then(|s| s.crl_number) {
                pushed.insert(r.component.clone(), n);
            }
        }
        out
    }

    /// A heartbeat's part: the kept list in force here, and pushed to the
    /// components that answered this round and are behind it — a host by
    /// the list its agent reports, a storage node by the last push it took.
    /// One that does not answer is not waited for.
    pub(crate) async fn sync_crl(
        &self,
        hosts: &[ferry_api::HostEntry],
        nodes: &[ferry_api::storage::StorageNodeEntry],
    ) {
        let Some(own) = &self.pki else { return };
        let info = match self.crl().await {
            Ok(i) if i.number > 0 => i,
            Ok(_) => return,
            Err(e) => {
                tracing::warn!("revocation list: {e}");
                return;
            }
        };
        if own.crl_number().unwrap_or(0) < info.number {
            if let Err(e) = own.install_crl(&info.crl) {
                tracing::warn!("revocation list {} not in force here: {e}", info.number);
            }
        }
        let pushed = ferry_api::util::lock(&self.crl_pushed).clone();
        let behind: Vec<String> = hosts
            .iter()
            .filter(|h| {
                h.reachable
                    && h.info.as_ref().map_or(0, |i| i.crl_number.unwrap_or(0)) < info.number
            })
            .map(|h| format!("host:{}", h.name))
            .chain(
                nodes
                    .iter()
                    .map(|n| (n, format!("storage:{}", n.name)))
                    .filter(|(n, c)| {
                        n.reachable && pushed.get(c).copied().unwrap_or(0) < info.number
                    })
                    .map(|(_, c)| c),
            )
            .collect();
        if behind.is_empty() {
            return;
        }
        for r in self.push_crl(&info, Some(&behind)).await {
            if let Some(e) = r.error {
                tracing::debug!(component = %r.component, "revocation list not pushed: {e}");
            } else {
                tracing::info!(component = %r.component, number = info.number, "revocation list pushed");
            }
        }
    }
}

fn result(component: &str, r: Result<PkiStatus, ApiError>) -> InstallResult {
    match r {
        Ok(s) => InstallResult {
            component: component.into(),
            status: Some(s),
            error: None,
        },
        Err(e) => InstallResult {
            component: component.into(),
            status: None,
            error: Some(e.to_string()),
        },
    }
}
