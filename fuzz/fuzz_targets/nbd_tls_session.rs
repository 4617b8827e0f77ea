//! Fuzzes the TLS-required NBD handshake: arbitrary client bytes into the
//! options before STARTTLS and, after a valid STARTTLS, into the server's
//! TLS handshake (rustls parsing a hostile ClientHello and what follows).
//! The server must answer or hang up — never panic, never serve an export
//! before a client certificate of the cluster was verified.
#![no_main]

use std::sync::{Arc, OnceLock};

use ferry_storage::nbd::server::{serve_tls_connection, Attachment, Catalog, Peer, Refusal, Tls};
use libfuzzer_sys::fuzz_target;
use tokio::io::AsyncWriteExt;

/// A catalog that must never be asked: no client gets that far without a
/// certificate, and the fuzzer has none.
struct Never;

impl Catalog for Never {
    fn list(&self, _peer: &Peer) -> Vec<String> {
        panic!("LIST served before TLS")
    }
    fn describe(&self, _name: &str, _peer: &Peer) -> Result<(u64, bool), Refusal> {
        panic!("INFO served before TLS")
    }
    fn attach(&self, _name: &str, _peer: &Peer) -> Result<Box<dyn Attachment>, Refusal> {
        panic!("an export attached before TLS")
    }
}

fn acceptor() -> tokio_rustls::TlsAcceptor {
    static A: OnceLock<tokio_rustls::TlsAcceptor> = OnceLock::new();
    A.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("ferry-fuzz-tls-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let ca = ferry_net::tls::Authority::create(&d.join("ca"), "fuzz").expect("CA");
        ca.issue(
            &ferry_net::tls::CertRequest {
                role: ferry_net::tls::Role::Storage,
                name: "storage1".into(),
                san: vec!["127.0.0.1".into()],
                days: 1,
            },
            &d.join("storage1"),
        )
        .expect("certificate");
        let pki = ferry_net::tls::Pki::load(&d.join("storage1")).expect("load");
        let config = pki.server_config(true).expect("config");
        // everything is in memory now: nothing is left in /tmp when the fuzzer exits
        let _ = std::fs::remove_dir_all(&d);
        tokio_rustls::TlsAcceptor::from(config)
    })
    .clone()
}

fuzz_target!(|data: &[u8]| {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let peer = "127.0.0.1:1".parse().expect("addr");
        let cat: Arc<dyn Catalog> = Arc::new(Never);
        let task = tokio::spawn(serve_tls_connection(server, peer, cat, Tls { acceptor: acceptor(), pki: None }, Default::default()));
        // an odd first byte fuzzes from the client's flags on; an even one
        // sends the flags and STARTTLS first, so the rest is a TLS handshake
        if let Some((&mode, rest)) = data.split_first() {
            if mode % 2 == 0 {
                let mut v = 3u32.to_be_bytes().to_vec();
                v.extend_from_slice(b"IHAVEOPT");
                v.extend_from_slice(&5u32.to_be_bytes());
                v.extend_from_slice(&0u32.to_be_bytes());
                let _ = client.write_all(&v).await;
            }
            let _ = client.write_all(rest).await;
        }
        drop(client);
        let r = tokio::time::timeout(std::time::Duration::from_secs(5), task).await;
        if let Ok(Err(e)) = r {
            if e.is_panic() {
                std::panic::resume_unwind(e.into_panic());
            }
        }
    });
});
