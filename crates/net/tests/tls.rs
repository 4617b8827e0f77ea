//! The cluster CA, certificates and mutual TLS, end to end over loopback:
//! who may call an agent-like endpoint, and who cannot even connect.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use axum::routing::get;
use ferry_net::client::{Client, ClientAuth};
use ferry_net::server::{require_peer, PeerAuth, PeerCert};
use ferry_net::tls::{Authority, CertRequest, Pki, Role};

fn issue(ca: &Authority, dir: &std::path::Path, role: Role, name: &str) -> Pki {
    let out = dir.join(name);
    ca.issue(
        &CertRequest {
            role,
            name: name.into(),
            san: vec!["127.0.0.1".into()],
            days: 1,
        },
        &out,
    )
    .unwrap();
    Pki::load(&out).unwrap()
}

/// Serves `/api/v1/who` (answering the caller's identity) for `roles`.
async fn server(pki: &Pki, roles: &'static [Role]) -> String {
    let app = axum::Router::new()
        .route(
            "/api/v1/who",
            get(
                |axum::Extension(PeerCert(id)): axum::Extension<PeerCert>| async move {
                    axum::Json(id.to_string())
                },
            ),
        )
        .layer(axum::middleware::from_fn_with_state(
            PeerAuth::Certificates(roles),
            require_peer,
        ));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://127.0.0.1:{}", l.local_addr().unwrap().port());
    let tls = pki.server_config(true).unwrap();
    tokio::spawn(ferry_net::server::serve(l, app, Some(tls)));
    url
}

async fn who(url: &str, auth: ClientAuth) -> Result<String, ferry_api::ApiError> {
    Client::new("agent", url, auth)
        .get::<String>("/who", Duration::from_secs(5))
        .await
}

#[tokio::test]
async fn only_certificates_of_the_cluster_with_a_served_role_get_in() {
    let d = std::env::temp_dir().join(format!("ferry-tls-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    let ca = Authority::create(&d.join("ca"), "test").unwrap();
    // the CA refuses to be made twice over itself
    assert!(Authority::create(&d.join("ca"), "test").is_err());
    let agent1 = issue(&ca, &d, Role::Agent, "host1");
    let control = issue(&ca, &d, Role::Control, "control");
    let storage = issue(&ca, &d, Role::Storage, "storage1");
    assert_eq!(agent1.identity.to_string(), "agent host1");
    // the key is the owner's only; QEMU's and libnbd's names are there
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(d.join("host1/key.pem"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    for f in [
        "ca-cert.pem",
        "client-cert.pem",
        "client-key.pem",
        "server-cert.pem",
        "server-key.pem",
    ] {
        assert!(d.join("host1").join(f).exists(), "{f}");
    }

    let url = server(&agent1, &[Role::Control, Role::Agent]).await;
    let as_ = |p: &Pki| {
        ClientAuth::component(Some(p), &ferry_api::auth::Credential::from_secret("x")).unwrap()
    };
    assert_eq!(who(&url, as_(&control)).await.unwrap(), "control control");
    // a role not served here: 403 naming the roles that are
    let e = who(&url, as_(&storage)).await.unwrap_err();
    assert_eq!(e.http_status(), 403, "{e}");
    assert!(e.to_string().contains("control or agent"), "{e}");
    // no client certificate: the handshake fails, nothing is served
    let anon = ClientAuth {
        bearer: Some(ferry_api::auth::Credential::from_secret("ferry_guess")),
        tls: Some(ferry_net::tls::anonymous_client_config(&d.join("ca/ca-cert.pem")).unwrap()),
    };
    let e = who(&url, anon).await.unwrap_err();
    assert!(matches!(e, ferry_api::ApiError::Unavailable { .. }), "{e}");
    // a certificate of another cluster's CA: refused too, both ways
    let other = Authority::create(&d.join("other-ca"), "other").unwrap();
    let stranger = issue(&other, &d, Role::Control, "intruder");
    let e = who(&url, as_(&stranger)).await.unwrap_err();
    assert!(matches!(e, ferry_api::ApiError::Unavailable { .. }), "{e}");
    // plain HTTP to a TLS port gets nothing
    let plain = ClientAuth {
        bearer: None,
        tls: None,
    };
    assert!(who(&url.replace("https", "http"), plain).await.is_err());

    // the CA loaded back signs certificates the same servers accept
    let ca2 = Authority::load(&d.join("ca")).unwrap();
    let host2 = issue(&ca2, &d, Role::Agent, "host2");
    assert_eq!(who(&url, as_(&host2)).await.unwrap(), "agent host2");
    let _ = std::fs::remove_dir_all(&d);
}

/// The serial number of the certificate the server at `port` presents.
async fn served_serial(port: u16, client: std::sync::Arc<rustls::ClientConfig>) -> String {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let s = tokio_rustls::TlsConnector::from(client)
        .connect(name, tcp)
        .await
        .unwrap();
    let cert = s.get_ref().1.peer_certificates().unwrap()[0].clone();
    ferry_net::tls::serial_of(&cert).unwrap()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[tokio::test]
async fn a_renewed_certificate_takes_over_at_once_and_a_revoked_one_is_refused() {
    let d = std::env::temp_dir().join(format!("ferry-tls-rotate-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    let ca = Authority::create(&d.join("ca"), "test").unwrap();
    let agent1 = issue(&ca, &d, Role::Agent, "host1");
    let control = issue(&ca, &d, Role::Control, "control");
    let admin = issue(&ca, &d, Role::Admin, "admin");
    let url = server(&agent1, &[Role::Control, Role::Agent, Role::Admin]).await;
    let port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
    let as_ = |p: &Pki| {
        ClientAuth::component(Some(p), &ferry_api::auth::Credential::from_secret("x")).unwrap()
    };
    // a client made before the renewal, kept across it
    let before = as_(&control);

    // renewal: a new key on the holder, the CA's signature on the admin's side
    let old = agent1.serial().unwrap();
    assert_eq!(
        served_serial(port, control.client_config().unwrap()).await,
        old
    );
    // nothing is taken without a request first
    let stray = ca
        .renew(
            &agent1.certificate_pem(),
            &control.signing_request().unwrap(),
            30,
        )
        .unwrap();
    let e = agent1.install(&stray).unwrap_err().to_string();
    assert!(e.contains("ask for a signing request first"), "{e}");
    let csr = agent1.signing_request().unwrap();
    // a certificate for another key, or for another holder, is refused
    let e = agent1.install(&stray).unwrap_err().to_string();
    assert!(e.contains("not for the key"), "{e}");
    let other_holder = ca.renew(&control.certificate_pem(), &csr, 30).unwrap();
    let e = agent1.install(&other_holder).unwrap_err().to_string();
    assert!(e.contains("names control control"), "{e}");
    // a CA that is not the cluster's cannot renew
    let other = Authority::create(&d.join("other-ca"), "other").unwrap();
    assert!(other.renew(&agent1.certificate_pem(), &csr, 30).is_err());
    let renewed = ca.renew(&agent1.certificate_pem(), &csr, 30).unwrap();
    agent1.install(&renewed).unwrap();
    let new = agent1.serial().unwrap();
    assert_ne!(new, old);
    assert_eq!(agent1.identity.to_string(), "agent host1");
    // the running server presents it from the next connection on, and the
    // files on disk are the new ones (a restart keeps it)
    assert_eq!(
        served_serial(port, control.client_config().unwrap()).await,
        new
    );
    assert_eq!(Pki::load(&d.join("host1")).unwrap().serial().unwrap(), new);
    assert_eq!(who(&url, before.clone()).await.unwrap(), "control control");

    // the client side renews the same way; the server sees the new one
    let csr = control.signing_request().unwrap();
    control
        .install(&ca.renew(&control.certificate_pem(), &csr, 30).unwrap())
        .unwrap();
    assert_eq!(who(&url, before.clone()).await.unwrap(), "control control");

    // revocation: the admin's certificate is refused at the handshake
    assert_eq!(who(&url, as_(&admin)).await.unwrap(), "admin admin");
    let crl1 = ca
        .revocation_list(1, &[unhex(&admin.serial().unwrap())])
        .unwrap();
    assert_eq!(agent1.install_crl(&crl1).unwrap(), 1);
    assert_eq!(agent1.crl_number(), Some(1));
    let e = who(&url, as_(&admin)).await.unwrap_err();
    assert!(matches!(e, ferry_api::ApiError::Unavailable { .. }), "{e}");
    assert_eq!(who(&url, as_(&control)).await.unwrap(), "control control");
    // an older list, or one another CA signed, is not taken
    let crl0 = ca.revocation_list(0, &[]).unwrap();
    let e = agent1.install_crl(&crl0).unwrap_err().to_string();
    assert!(e.contains("older"), "{e}");
    let forged = other.revocation_list(2, &[]).unwrap();
    let e = agent1.install_crl(&forged).unwrap_err().to_string();
    assert!(e.contains("not signed by this cluster's CA"), "{e}");
    assert_eq!(agent1.crl_number(), Some(1));
    // clients check servers against the list too: the agent's old
    // certificate, revoked, would no longer be trusted by the control service
    let crl2 = ca
        .revocation_list(2, &[unhex(&admin.serial().unwrap()), unhex(&new)])
        .unwrap();
    control.install_crl(&crl2).unwrap();
    let e = who(&url, as_(&control)).await.unwrap_err();
    assert!(matches!(e, ferry_api::ApiError::Unavailable { .. }), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}
