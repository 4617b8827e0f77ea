//! Ferry's storage service: VM disks served over NBD, with storage QoS.
//!
//! ```text
//!   QEMU / libnbd / fio ──NBD──▶ nbd::server ──admit──▶ qos::Scheduler ──▶ export (file)
//!                                     │                      ▲
//!                                  node::Node ── binds flows to pools from policies
//!                                     ▲                      (or allocations from the cluster)
//!   ferry CLI ──▶ control ──REST──▶ http (disks, policies, flows, settings)
//! ```
//!
//! - [`nbd`]: the protocol (pure) and the server (connections, replies).
//! - [`qos`]: the mClock tag scheduler and its async front.
//! - [`export`]: one raw file, with the durability the spec asks of FUA/flush.
//! - [`node`]: disks, policies, flows and their status; state on disk.
//! - [`tracking`]: dirty maps and point-in-time copies of disks in use;
//!   [`backup`]: backups and checkpoints made of them.
//! - [`remote`]: copies of a disk on another node that this node writes
//!   (`ferry disk move`, replicas).
//! - [`http`]: the node's REST API under `/api/v1`.

pub mod backup;
pub mod export;
pub mod http;
pub mod jobs;
pub mod nbd;
pub mod node;
pub mod qos;
pub mod remote;
pub mod tracking;

use std::sync::Arc;

/// Runs a storage node: NBD on `nbd_listen`, REST on `api_listen`, and the
/// one-second flow sampler, until one of them fails.
pub async fn serve(
    node: Arc<node::Node>,
    nbd_listen: std::net::SocketAddr,
    api_listen: std::net::SocketAddr,
    auth: ferry_net::server::PeerAuth,
    pki: Option<&ferry_net::tls::Pki>,
    nbd_tls: Option<Arc<ferry_net::tls::ServerConfig>>,
    limits: (ferry_net::server::Limits, nbd::server::NbdLimits),
) -> std::io::Result<()> {
    let nbd = tokio::net::TcpListener::bind(nbd_listen).await?;
    let api = tokio::net::TcpListener::bind(api_listen).await?;
    tracing::info!(%nbd_listen, %api_listen, "storage node {} serving", node.cfg.name);
    node.resume_replicas();
    let sampler = {
        let node = node.clone();
        tokio::spawn(async move {
            let mut t = tokio::time::interval(node::SAMPLE_PERIOD);
            loop {
                t.tick().await;
                node.sample();
            }
        })
    };
    let cat: Arc<dyn nbd::server::Catalog> = Arc::new(node::NodeCatalog(node.clone()));
    let nbd_tls = nbd_tls.map(|c| nbd::server::Tls {
        acceptor: tokio_rustls::TlsAcceptor::from(c),
        pki: pki.cloned(),
    });
    let nbd_task = tokio::spawn(nbd::server::serve(nbd, cat, nbd_tls, limits.1));
    let (extra, tls) = match pki {
        Some(p) => (
            ferry_net::server::pki_routes(p.clone()),
            Some(p.server_tls(true).map_err(std::io::Error::other)?),
        ),
        None => (axum::Router::new(), None),
    };
    let router = http::router(node, auth, extra);
    let r = ferry_net::server::serve_with(api, router, tls, limits.0).await;
    nbd_task.abort();
    sampler.abort();
    r
}
