//! NBD: the wire format ([`proto`]), the server ([`server`]), and the
//! client a node writes another node's export with ([`client`]).

pub mod client;
pub mod proto;
pub mod server;
