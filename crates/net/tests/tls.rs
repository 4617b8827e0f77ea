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
