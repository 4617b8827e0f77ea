//! Ferry's transport: one live migration over every NIC.
//!
//! QEMU's migration connections (the main channel and each multifd channel)
//! end at a unix socket of the source agent and start again at the target
//! agent, which connects them to the target QEMU. In between, each is a
//! *stream*, cut into frames and carried over *carriers* — TCP connections
//! bound to each NIC — in proportion to what each carrier drains now, put
//! back in order by the receiver, kept in a replay buffer until acknowledged
//! and resent on the others when a carrier dies.
//!
//! - [`protocol`]: the wire format, versioned and authenticated, every field checked.
//! - [`session`]: carriers, streams, scheduling, replay and failover.

pub mod protocol;
pub mod session;

pub use session::{CarrierStats, Session, SessionStats, TransportError};
