//! The served-read protocol: an owner checks each read a peer asks for
//! against its live registrations and sends the bytes itself.
//!
//! Owner-served reads exist because on the lanes without remote-read
//! hardware (tcp, shared-memory messaging, the software libfabric
//! providers) the transports serve one-sided reads from whatever address
//! a peer names, and keep reading a region after it was deregistered. The
//! rules that make serving safe — admission, read leases, the bound of
//! unfinished replies per endpoint, unmaps that wait for leases — are
//! kept here once, in [`owner::Owner`], a state machine with no I/O and
//! no clock; each backend drives it with its transport's sends and
//! completions.
//!
//! - [`owner`]: the owner side.
//! - [`wire`]: the UCX engine's request and reply formats, one way to
//!   feed and answer the owner.

pub mod owner;
pub mod wire;

#[cfg(test)]
mod sim;

pub use owner::{
    Action, EndpointLoad, ListAnswer, ListLimits, Owner, OwnerConfig, Payload, Read, Refusal,
    SendId, UnmapStatus,
};
