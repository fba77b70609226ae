//! The served-read protocol, and served writes: an owner checks each read
//! or write a peer asks for against its live registrations and moves the
//! bytes itself.
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
//! - [`consumer`]: the consumer side: which reply may write a read's
//!   destination, and when a read completes.
//! - [`leases`]: descriptor leases, a descriptor handed out with an expiry
//!   and a number of readers.
//! - [`owner::writes`]: served writes at the owner: access, holds on the
//!   region while the bytes are received, the reply once they are in.
//! - [`owner::write_lists`]: several writes in one message, answered by
//!   one reply once every accepted entry's bytes are in.
//! - [`writer`]: the consumer side of a served write: when it completes.
//! - [`refusal`]: why an owner refused a read or a write, and the
//!   caller's error.
//! - [`wire`]: the UCX engine's request and reply formats, one way to
//!   feed the owner and send its replies.
//!
//! # A driver's part
//!
//! What a UCX driver's request handler and region table do around the
//! owner (a libfabric driver does the same with tagged sends, its own
//! request format, [`Owner::refuse_request`] for senders it cannot
//! confirm and [`Owner::check_read`] for list entries it copies at once):
//!
//! - after `ucp_mem_map` and drawing 16 random bytes,
//!   [`Owner::register`]; the driver keeps the region's memory handle;
//! - on an unmap, [`Owner::unmap`]: `NotRegistered` completes the caller
//!   now, `Waiting` parks the caller under the region's id;
//! - in the request handler, [`Owner::handle_request`] with the reply
//!   endpoint's address as the endpoint, then every action at once, while
//!   that endpoint is valid: [`Action::Serve`] and [`Action::Refuse`]
//!   become an active-message send of [`Action::reply_header`] (and the
//!   payload, from the region's memory handle), whose completion callback
//!   reports [`Owner::send_completed`] or [`Owner::send_failed`] with the
//!   action's [`SendId`] — at once when the send ended inside the call;
//! - [`Action::Unmapped`]: `ucp_mem_unmap`, and every parked caller
//!   completed;
//! - for a write request (its own active-message id),
//!   [`Owner::handle_write_request`] with the header and the payload's
//!   length; [`Action::Receive`] copies an eager payload into the
//!   registration (or posts a rendezvous receive straight into it) and
//!   reports [`Owner::receive_completed`] or [`Owner::receive_failed`];
//!   [`Action::Acknowledge`] is a header-only send of
//!   [`Action::reply_header`];
//! - at teardown [`Owner::shutdown`], and once the worker is destroyed
//!   [`Owner::transport_closed`].

pub mod consumer;
pub mod leases;
pub mod owner;
pub mod refusal;
pub mod wire;
pub mod writer;

#[cfg(test)]
mod scenarios;
#[cfg(test)]
mod sim;

pub use leases::{
    IgnoredRelease, LeaseEnd, LeaseReleased, LeaseTerms, MAX_LEASE_READERS, ReleaseOutcome,
};
pub use owner::{
    Action, EndpointLoad, ListEntryReply, ListLimits, Owner, OwnerConfig, Payload, Read, ReceiveId,
    SendId, UnmapStatus, Write, WriteListLimits,
};
pub use refusal::{
    BUSY_TEXT, NOT_THE_REQUESTER_TEXT, Operation, RECEIVE_FAILED_TEXT, Refusal, UNVERIFIED_TEXT,
};
pub use writer::{PostedWrite, WriteCompletion, WriteId, WriteTarget, WriteTimeout, Writer};
