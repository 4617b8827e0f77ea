//! The cluster CA, certificates and mutual TLS, end to end over loopback:
//! who may call an agent-like endpoint, and who cannot even connect.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use axum::routing::get;
use ferry_net::client::{Client, ClientAuth};
use ferry_net::server::{require_peer, PeerAuth, PeerCert};
use ferry_net::tls::{Authority, CertRequest, Pki, Role};

/// A fresh directory for test `tag` (removed first) with a CA in `ca/`.
fn fresh_ca(tag: &str) -> (std::path::PathBuf, Authority) {
    let d = std::env::temp_dir().join(format!("ferry-tls-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    let ca = Authority::create(&d.join("ca"), "test").unwrap();
    (d, ca)
}

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
    let (d, ca) = fresh_ca("roles");
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
    ferry_api::util::unhex(s).unwrap()
}

#[tokio::test]
async fn a_renewed_certificate_takes_over_at_once_and_a_revoked_one_is_refused() {
    let (d, ca) = fresh_ca("rotate");
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

/// Connects to `port` with `client` and reports what the server made of
/// the chain (`vm_identity`), or the handshake's error.
async fn nbd_peer(
    port: u16,
    client: std::sync::Arc<rustls::ClientConfig>,
) -> Result<(String, Option<String>), String> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let mut s = tokio_rustls::TlsConnector::from(client)
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    use tokio::io::AsyncReadExt as _;
    let mut line = String::new();
    s.read_to_string(&mut line)
        .await
        .map_err(|e| e.to_string())?;
    let (id, host) = line.rsplit_once(' ').ok_or(line.clone())?;
    Ok((id.to_string(), (host != "-").then(|| host.to_string())))
}

/// A client config presenting the credentials `vm_credentials` wrote.
fn vm_client(dir: &std::path::Path) -> std::sync::Arc<rustls::ClientConfig> {
    ferry_net::tls::client_config_from_dir(dir).unwrap()
}

#[tokio::test]
async fn a_vms_nbd_certificate_names_the_vm_and_the_host_whose_agent_signed_it() {
    let (d, ca) = fresh_ca("vm");
    let storage = issue(&ca, &d, Role::Storage, "storage1");
    let host1 = issue(&ca, &d, Role::Agent, "host1");
    let control = issue(&ca, &d, Role::Control, "control");
    // an NBD-like server answering who the chain is
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let acceptor = tokio_rustls::TlsAcceptor::from(storage.nbd_server_config().unwrap());
    tokio::spawn(async move {
        loop {
            let (tcp, _) = l.accept().await.unwrap();
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut s) = acceptor.accept(tcp).await else {
                    return;
                };
                let who = s
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(ferry_net::tls::vm_identity)
                    .map(|(id, h)| format!("{id} {}", h.unwrap_or("-".into())))
                    .unwrap_or_default();
                use tokio::io::AsyncWriteExt as _;
                let _ = s.write_all(who.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    host1.vm_credentials("web1", &d.join("web1")).unwrap();
    // the VM holds no key of its host's
    let vm_key = std::fs::read(d.join("web1/client-key.pem")).unwrap();
    assert_ne!(vm_key, std::fs::read(d.join("host1/key.pem")).unwrap());
    use std::os::unix::fs::PermissionsExt;
    for f in ["client-key.pem", "client-cert.pem", "ca-cert.pem"] {
        let m = std::fs::metadata(d.join("web1").join(f)).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o600, "{f}");
    }
    assert_eq!(
        nbd_peer(port, vm_client(&d.join("web1"))).await.unwrap(),
        ("vm web1".to_string(), Some("host1".to_string()))
    );
    // the cluster's own certificates are taken as before
    assert_eq!(
        nbd_peer(port, control.client_config().unwrap())
            .await
            .unwrap(),
        ("control control".to_string(), None)
    );
    // only an agent signs VM certificates
    assert!(control.vm_credentials("web1", &d.join("x")).is_err());
    // a VM certificate signed by a host of another cluster is refused
    let other = Authority::create(&d.join("other-ca"), "other").unwrap();
    let stranger = issue(&other, &d, Role::Agent, "host9");
    stranger.vm_credentials("web1", &d.join("stray")).unwrap();
    std::fs::copy(d.join("ca/ca-cert.pem"), d.join("stray/ca-cert.pem")).unwrap();
    assert!(nbd_peer(port, vm_client(&d.join("stray"))).await.is_err());
    // a VM certificate with another agent's certificate put after it
    let host2 = issue(&ca, &d, Role::Agent, "host2");
    let web1 = std::fs::read_to_string(d.join("web1/client-cert.pem")).unwrap();
    let leaf_end = web1.find("-----END CERTIFICATE-----").unwrap() + 26;
    std::fs::create_dir_all(d.join("forged")).unwrap();
    std::fs::write(
        d.join("forged/client-cert.pem"),
        format!(
            "{}{}",
            &web1[..leaf_end],
            std::fs::read_to_string(d.join("host2/cert.pem")).unwrap()
        ),
    )
    .unwrap();
    std::fs::copy(
        d.join("web1/client-key.pem"),
        d.join("forged/client-key.pem"),
    )
    .unwrap();
    std::fs::copy(d.join("ca/ca-cert.pem"), d.join("forged/ca-cert.pem")).unwrap();
    assert!(nbd_peer(port, vm_client(&d.join("forged"))).await.is_err());
    // revoking the agent's certificate revokes the VMs' it signed
    let crl = ca
        .revocation_list(
            1,
            &[(0..host1.serial().unwrap().len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&host1.serial().unwrap()[i..i + 2], 16).unwrap())
                .collect()],
        )
        .unwrap();
    storage.install_crl(&crl).unwrap();
    assert!(nbd_peer(port, vm_client(&d.join("web1"))).await.is_err());
    // a VM certificate is no use at any other server of the cluster, even
    // one that would serve the role: it is not the CA's
    host2.vm_credentials("web2", &d.join("web2")).unwrap();
    assert_eq!(
        nbd_peer(port, vm_client(&d.join("web2"))).await.unwrap(),
        ("vm web2".to_string(), Some("host2".to_string()))
    );
    let url = server(&host2, &[Role::Control, Role::Agent, Role::Vm]).await;
    let e = who(
        &url,
        ClientAuth {
            bearer: None,
            tls: Some(vm_client(&d.join("web2"))),
        },
    )
    .await
    .unwrap_err();
    assert!(matches!(e, ferry_api::ApiError::Unavailable { .. }), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

/// Serves `GET /api/v1/version` (the request's HTTP version) to the
/// control role with `tls` and `limits`.
async fn version_server(
    tls: ferry_net::server::ServerTls,
    limits: ferry_net::server::Limits,
) -> String {
    let app =
        axum::Router::new()
            .route(
                "/api/v1/version",
                get(|req: axum::extract::Request| async move {
                    axum::Json(format!("{:?}", req.version()))
                }),
            )
            .layer(axum::middleware::from_fn_with_state(
                PeerAuth::Certificates(&[Role::Control]),
                require_peer,
            ));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://127.0.0.1:{}", l.local_addr().unwrap().port());
    tokio::spawn(ferry_net::server::serve_with(l, app, Some(tls), limits));
    url
}

/// A client kept by component `p`, asking `url` for its HTTP version.
fn kept(p: &Pki, url: &str) -> Client {
    let auth =
        ClientAuth::component(Some(p), &ferry_api::auth::Credential::from_secret("x")).unwrap();
    Client::new("agent host1", url, auth)
}

async fn version(c: &Client) -> Result<String, ferry_api::ApiError> {
    c.get::<String>("/version", Duration::from_secs(5)).await
}

/// Components speak HTTP/2 to one another over one kept connection; a
/// connection takes no new request past `max_connection_age`, so the
/// client's next one is a new handshake, and a certificate revoked in the
/// meantime loses the connection it had (here with no word of the change).
#[tokio::test]
async fn a_kept_connection_is_http2_and_a_revoked_certificate_loses_it_with_age() {
    let (d, ca) = fresh_ca("age");
    let agent1 = issue(&ca, &d, Role::Agent, "host1");
    let control = issue(&ca, &d, Role::Control, "control");
    let limits = ferry_net::server::Limits {
        max_connection_age: Duration::from_secs(1),
        ..Default::default()
    };
    let url = version_server(agent1.server_config(true).unwrap().into(), limits).await;
    let c = kept(&control, &url);
    assert_eq!(version(&c).await.unwrap(), "HTTP/2.0");
    // past its age the connection is replaced without the caller noticing
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(version(&c).await.unwrap(), "HTTP/2.0");
    // revoked: the kept client is refused once its connection has aged
    let crl = ca
        .revocation_list(1, &[unhex(&control.serial().unwrap())])
        .unwrap();
    agent1.install_crl(&crl).unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let e = version(&c).await.unwrap_err();
    assert!(matches!(e, ferry_api::ApiError::Unavailable { .. }), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

/// A server told of a new revocation list ends its open connections at
/// once: a revoked client's next request is refused, long before the
/// connection's age; another client is served on.
#[tokio::test]
async fn a_revocation_ends_the_kept_connections_at_once() {
    let (d, ca) = fresh_ca("crl");
    let agent1 = issue(&ca, &d, Role::Agent, "host1");
    let revoked = issue(&ca, &d, Role::Control, "control");
    let other = issue(&ca, &d, Role::Control, "control2");
    let url = version_server(agent1.server_tls(true).unwrap(), Default::default()).await;
    let (a, b) = (kept(&revoked, &url), kept(&other, &url));
    assert_eq!(version(&a).await.unwrap(), "HTTP/2.0");
    assert_eq!(version(&b).await.unwrap(), "HTTP/2.0");
    let crl = ca
        .revocation_list(1, &[unhex(&revoked.serial().unwrap())])
        .unwrap();
    agent1.install_crl(&crl).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let e = version(&a).await.unwrap_err();
    assert!(matches!(e, ferry_api::ApiError::Unavailable { .. }), "{e}");
    assert_eq!(version(&b).await.unwrap(), "HTTP/2.0");
    let _ = std::fs::remove_dir_all(&d);
}

/// One HTTP/2 connection carries many requests at once. A client's
/// requests under way count against `max_connections_per_client` as its
/// connections do, so one connection holds no more of a server than that
/// many connections could: one more request is refused with 429, naming
/// the limit, and the client is served again once one ends.
#[tokio::test]
async fn one_http2_connection_holds_no_more_requests_than_the_clients_connections_may() {
    let (d, ca) = fresh_ca("streams");
    let agent1 = issue(&ca, &d, Role::Agent, "host1");
    let control = issue(&ca, &d, Role::Control, "control");
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let under_way = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (g, u) = (gate.clone(), under_way.clone());
    let app =
        axum::Router::new()
            .route(
                "/api/v1/hold",
                get(move || {
                    let (g, u) = (g.clone(), u.clone());
                    async move {
                        u.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let _permit = g.acquire().await;
                        axum::Json("held".to_string())
                    }
                }),
            )
            .route(
                "/api/v1/version",
                get(|req: axum::extract::Request| async move {
                    axum::Json(format!("{:?}", req.version()))
                }),
            );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://127.0.0.1:{}", l.local_addr().unwrap().port());
    let limits = ferry_net::server::Limits {
        per_client: 4,
        ..Default::default()
    };
    let tls = agent1.server_config(true).unwrap().into();
    tokio::spawn(ferry_net::server::serve_with(l, app, Some(tls), limits));
    let c = kept(&control, &url);
    assert_eq!(version(&c).await.unwrap(), "HTTP/2.0");
    let held: Vec<_> = (0..4)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move { c.get::<String>("/hold", Duration::from_secs(10)).await })
        })
        .collect();
    let t0 = std::time::Instant::now();
    while under_way.load(std::sync::atomic::Ordering::SeqCst) < 4 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the 4 requests never got under way"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    match version(&c).await {
        Err(ferry_api::ApiError::TooMany { limit, setting, .. }) => {
            assert_eq!((limit, setting.as_str()), (4, "max_connections_per_client"))
        }
        other => panic!("a fifth request under way was not refused: {other:?}"),
    }
    gate.add_permits(4);
    for h in held {
        assert_eq!(h.await.unwrap().unwrap(), "held");
    }
    assert_eq!(version(&c).await.unwrap(), "HTTP/2.0");
    let _ = std::fs::remove_dir_all(&d);
}

/// A request refused before its body is read (here a role not served,
/// whose body is still on its way) still gets its answer over HTTP/2: the
/// server keeps the body until the answer has gone, so the stream is not
/// cancelled under it, which curl reports as a stream error in place of
/// the 403. Needs `curl` (as the lab tests do).
#[tokio::test]
async fn a_request_refused_before_its_body_arrives_gets_its_answer() {
    let (d, ca) = fresh_ca("early");
    let agent1 = issue(&ca, &d, Role::Agent, "host1");
    issue(&ca, &d, Role::Storage, "storage1");
    let url = server(&agent1, &[Role::Control]).await;
    let f = |p: &str| d.join(p).to_string_lossy().into_owned();
    let (ca_cert, cert, key) = (
        f("ca/ca-cert.pem"),
        f("storage1/cert.pem"),
        f("storage1/key.pem"),
    );
    let url = format!("{url}/api/v1/who");
    let out = tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut curl = std::process::Command::new("curl")
            .args([
                "-sS",
                "-m",
                "10",
                "-o",
                "-",
                "-w",
                "\n%{http_version} %{http_code}",
            ])
            .args(["--cacert", &ca_cert, "--cert", &cert, "--key", &key])
            .args(["-X", "POST", "-T", "-", &url])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("this test needs curl");
        std::thread::sleep(Duration::from_millis(300));
        let _ = curl.stdin.take().unwrap().write_all(b"{}");
        curl.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let why = String::from_utf8_lossy(&out.stderr);
    assert!(text.ends_with("\n2 403"), "{text} {why}");
    assert!(text.contains("storage1"), "{text}");
    let _ = std::fs::remove_dir_all(&d);
}
