//! Ferry's HTTP and TLS stack, kept out of the types crate ([`ferry_api`])
//! so a crate that needs a type does not take axum, reqwest, hyper, rustls
//! and rcgen with it.
//!
//! - [`client`]: the one authenticated HTTP client every caller shares, with
//!   NDJSON event streams.
//! - [`server`]: serving a router: connection and body limits, peer
//!   authentication (certificate role or cluster credential), JSON bodies
//!   that name what was wrong.
//! - [`tls`]: the cluster CA, certificates by role, rustls configurations.
//! - [`ticket`]: move tickets signed by the control service.

pub mod client;
pub mod server;
pub mod ticket;
pub mod tls;
