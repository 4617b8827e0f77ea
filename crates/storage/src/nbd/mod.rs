//! NBD: the wire format ([`proto`]) and the server ([`server`]).

pub mod proto;
pub mod server;
