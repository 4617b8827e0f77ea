//! Ferry's one command API.
//!
//! Every front end (the `ferry` CLI today, the REST API and the web page as they
//! grow) speaks the types in this crate, and the control service and the agents
//! serve them. Nothing here does I/O except [`auth`], which reads the cluster
//! credential; the HTTP and TLS stack (the one client, the server helpers,
//! the PKI, move tickets) is `ferry-net`'s.
//!
//! Layout:
//! - [`size`]: byte sizes and rates as users write them (`1G`, `768M`, `20M`).
//! - [`types`]: hosts, NICs, VMs, migration events and reports.
//! - [`hardware`]: a VM's machine, CPU model, firmware, drives and NICs.
//! - [`error`]: [`ApiError`], the one error enum that crosses the wire, and its
//!   HTTP status mapping.
//! - [`certs`]: renewing and revoking certificates across the cluster.
//! - [`auth`]: the cluster credential made at lab/cluster creation.
//! - [`util`]: error chains, poison-tolerant locks, commands, rates: written once.

pub mod auth;
pub mod bandwidth;
pub mod certs;
pub mod drain;
pub mod error;
pub mod grants;
pub mod ha;
pub mod hardware;
pub mod placement;
pub mod rolling;
pub mod size;
pub mod storage;
pub mod types;
pub mod util;
pub mod validation;

pub use error::ApiError;
pub use types::*;

/// Prefix of every route, on the control service and on agents.
pub const API_PREFIX: &str = "/api/v1";
