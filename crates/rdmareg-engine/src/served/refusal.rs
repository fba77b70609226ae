//! Why an owner refused a read or a write, and the error the caller gets
//! for it.
//!
//! The mapping is the same on every backend, so a caller handles a refused
//! request alike whatever the transport: `OutOfRange` for a range the
//! registration does not cover, `RegionNotFound` for a registration that is
//! gone, going, or was never given to the consumer (a wrong capability says
//! no more than "not yours"), `LeaseExpired` for a descriptor whose lease
//! ended, `AccessDenied` for a registration that does not allow the
//! operation, `InvalidKey` for a request the owner could not parse, and a
//! transient [`RdmaError::Backend`] for the rest (a busy owner, a sender it
//! could not confirm, a write whose bytes the owner failed to receive, a
//! code this build does not know), with a text saying which.
//!
//! [`Refusal::error_for`] gives the error of a refused [`Operation`];
//! `From<Refusal> for RdmaError` is the error of a refused read.

use std::fmt;

use rdmareg_core::RdmaError;

/// Why an owner refused a read or a write.
///
/// Each backend's wire format gives these its own codes
/// ([`wire`](super::wire) has the UCX engine's); at the consumer a refusal
/// becomes the seam's error through `From<Refusal> for RdmaError`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// No registration has that id: it was unmapped, or the descriptor is
    /// of an earlier registration.
    RegionUnknown,
    /// The registration exists but the capability does not match it.
    CapabilityMismatch,
    /// The range is empty or not inside the registration.
    OutOfRange,
    /// The registration is being unmapped; it serves no new reads.
    Deregistering,
    /// The request could not be parsed.
    Malformed,
    /// The endpoint already has as many unfinished replies as the owner
    /// allows; nothing is wrong with the read itself.
    Busy,
    /// The transport could not confirm that the request came from the
    /// endpoint the reply would go to; the consumer may ask again. Decided
    /// by a driver whose transport names senders (libfabric's `FI_SOURCE`)
    /// and passed to [`Owner::refuse_request`](super::Owner::refuse_request); never by the owner itself.
    Unverified,
    /// The request came from another endpoint than the one the reply
    /// would go to. Decided by a driver, as [`Refusal::Unverified`].
    NotTheRequester,
    /// The read names a descriptor lease that has ended: it expired, or
    /// as many readers as it allowed released it (`served::leases`).
    LeaseExpired,
    /// The registration does not allow the operation: a read of memory
    /// registered for writing only, or a write to memory registered for
    /// reading only. Judged after the capability, so only a holder of the
    /// descriptor learns it.
    AccessDenied,
    /// A write was accepted, but the owner's receive of its bytes failed
    /// (the transport ended it in error): some of the range may hold some
    /// of the bytes. Never a refusal of a read.
    ReceiveFailed,
    /// A refusal code this build does not know (decoded from a peer of a
    /// later release; never produced by [`Owner`](super::Owner)).
    Unrecognized(u8),
}

/// What a refused request asked for: the error of a refusal names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    /// A read of the owner's registration.
    Read,
    /// A write into the owner's registration.
    Write,
}

impl Operation {
    /// `"read"` or `"write"`, as [`RdmaError::AccessDenied`] names it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Operation::Read => "read",
            Operation::Write => "write",
        }
    }
}

impl Refusal {
    /// The error the caller of a refused `operation` gets (module docs).
    pub fn error_for(self, operation: Operation) -> RdmaError {
        match self {
            Refusal::OutOfRange => RdmaError::OutOfRange,
            Refusal::RegionUnknown | Refusal::CapabilityMismatch | Refusal::Deregistering => {
                RdmaError::RegionNotFound
            }
            Refusal::Malformed => RdmaError::InvalidKey,
            Refusal::LeaseExpired => RdmaError::LeaseExpired,
            Refusal::AccessDenied => RdmaError::AccessDenied {
                operation: operation.as_str(),
            },
            Refusal::Busy => RdmaError::backend(BUSY_TEXT),
            Refusal::Unverified => RdmaError::backend(UNVERIFIED_TEXT),
            Refusal::NotTheRequester => RdmaError::backend(NOT_THE_REQUESTER_TEXT),
            Refusal::ReceiveFailed => RdmaError::backend(RECEIVE_FAILED_TEXT),
            Refusal::Unrecognized(code) => RdmaError::backend(format!(
                "the owner refused the {} with code {code}, unknown to this build (the owner runs a later release)",
                operation.as_str()
            )),
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::RegionUnknown => f.write_str("the region is not registered"),
            Refusal::CapabilityMismatch => {
                f.write_str("the capability does not match the registration")
            }
            Refusal::OutOfRange => f.write_str("the range lies outside the registration"),
            Refusal::Deregistering => f.write_str("the region is being deregistered"),
            Refusal::Malformed => f.write_str("the request could not be parsed"),
            Refusal::Busy => f.write_str("the owner is busy with this consumer's replies"),
            Refusal::Unverified => f.write_str("the owner could not confirm the request's sender"),
            Refusal::NotTheRequester => {
                f.write_str("the request came from another endpoint than its reply address")
            }
            Refusal::LeaseExpired => f.write_str("the descriptor's lease has ended"),
            Refusal::AccessDenied => f.write_str("the registration does not allow the operation"),
            Refusal::ReceiveFailed => {
                f.write_str("the owner's receive of the written bytes failed")
            }
            Refusal::Unrecognized(code) => write!(f, "refused with unknown code {code}"),
        }
    }
}

/// A refusal is an error of its own: the request was refused, for this
/// reason.
impl std::error::Error for Refusal {}

/// The error of a refused read: [`Refusal::error_for`] of
/// [`Operation::Read`].
impl From<Refusal> for RdmaError {
    fn from(refusal: Refusal) -> RdmaError {
        refusal.error_for(Operation::Read)
    }
}

/// The text of the error a read refused as [`Refusal::Busy`] gets.
pub const BUSY_TEXT: &str = "owner busy: too many of this consumer's reads are in flight at the owner (its bound of unfinished replies per consumer); retry once earlier reads have completed";

/// The text of the error a read refused as [`Refusal::Unverified`] gets,
/// once asking again did not help.
pub const UNVERIFIED_TEXT: &str = "the owner could not confirm that this engine sent the read request (its transport did not name the sender, however often it asked again)";

/// The text of the error a write refused as [`Refusal::ReceiveFailed`]
/// gets.
pub const RECEIVE_FAILED_TEXT: &str = "the owner accepted the write but its receive of the bytes failed; the range may hold part of them, write it again";

/// The text of the error a read refused as [`Refusal::NotTheRequester`]
/// gets.
pub const NOT_THE_REQUESTER_TEXT: &str =
    "the owner refused the read: its reply address is not the address of the endpoint that sent it";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_become_the_seams_typed_errors() {
        assert_eq!(RdmaError::from(Refusal::OutOfRange), RdmaError::OutOfRange);
        for gone in [
            Refusal::RegionUnknown,
            Refusal::CapabilityMismatch,
            Refusal::Deregistering,
        ] {
            assert_eq!(RdmaError::from(gone), RdmaError::RegionNotFound, "{gone}");
        }
        assert_eq!(RdmaError::from(Refusal::Malformed), RdmaError::InvalidKey);
        assert_eq!(
            RdmaError::from(Refusal::LeaseExpired),
            RdmaError::LeaseExpired
        );
    }

    /// A registration that does not allow an operation says which one
    /// was denied; the other mappings do not depend on the operation.
    #[test]
    fn access_denied_names_the_operation() {
        assert_eq!(
            RdmaError::from(Refusal::AccessDenied),
            RdmaError::AccessDenied { operation: "read" }
        );
        assert_eq!(
            Refusal::AccessDenied.error_for(Operation::Write),
            RdmaError::AccessDenied { operation: "write" }
        );
        assert_eq!(
            Refusal::OutOfRange.error_for(Operation::Write),
            RdmaError::OutOfRange
        );
        let failed = Refusal::ReceiveFailed.error_for(Operation::Write);
        assert!(failed.is_transient(), "{failed}");
        assert!(
            Refusal::Unrecognized(200)
                .error_for(Operation::Write)
                .to_string()
                .contains("write")
        );
    }

    /// UCX's public refusal type was an `std::error::Error` before it
    /// became the kit's; callers that box it or `?` it keep compiling.
    #[test]
    fn a_refusal_is_an_std_error() {
        let err: Box<dyn std::error::Error> = Box::new(Refusal::Busy);
        assert_eq!(err.to_string(), Refusal::Busy.to_string());
        assert!(err.source().is_none());
    }

    #[test]
    fn refusals_a_retry_may_clear_are_transient() {
        for refusal in [
            Refusal::Busy,
            Refusal::Unverified,
            Refusal::NotTheRequester,
            Refusal::Unrecognized(200),
        ] {
            let err = RdmaError::from(refusal);
            assert!(matches!(err, RdmaError::Backend(_)), "{refusal}: {err}");
            assert!(err.is_transient(), "{refusal}: {err}");
        }
        assert_eq!(
            RdmaError::from(Refusal::Busy),
            RdmaError::backend(BUSY_TEXT)
        );
        assert!(
            RdmaError::from(Refusal::Unrecognized(200))
                .to_string()
                .contains("200")
        );
    }
}
