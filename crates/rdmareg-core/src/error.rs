//! [`RdmaError`]: the one error enum of the backend seam and the registry.
//!
//! Callers switch on the variant; humans read the message. Backend detail
//! travels as a [`BackendError`]'s text and source, so nothing
//! backend-specific crosses the seam as a type. `#[non_exhaustive]`, so new
//! failure kinds are not breaking changes.

use crate::BackendError;

/// Why an rdmareg operation could not be performed.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RdmaError {
    /// The registry or its backend is shutting down; new work is refused.
    ///
    /// **Not a statement that memory was unmapped**: keep the allocation
    /// until the guard's `deregistered()` resolves.
    #[error(
        "rdma layer is shutting down: new work is refused; memory already registered stays pinned until deregistered() resolves"
    )]
    ShuttingDown,

    /// Registering this many bytes would pass the budget: a routine refusal
    /// to fall back from (stage in chunks, use another path).
    #[error(
        "registered-bytes budget exceeded: {requested} B requested, {registered} B already registered, budget {budget} B; free registrations or raise the budget"
    )]
    BudgetExceeded {
        /// Bytes the refused registration asked for (page-enclosing).
        requested: u64,
        /// Bytes already registered when the request was refused.
        registered: u64,
        /// The configured ceiling.
        budget: u64,
    },

    /// The named region is not registered: never was, or already deregistered.
    #[error("rdma region not found: it was never registered or has already been deregistered")]
    RegionNotFound,

    /// A range falls outside what it names, or is null, empty or overflowing.
    #[error("range is outside the registered region, or is empty, null or overflowing")]
    OutOfRange,

    /// A packed remote key was empty, oversized or malformed for its backend.
    #[error("malformed packed remote key: refused before the backend interpreted it")]
    InvalidKey,

    /// A peer's worker address is malformed for this backend (refused before
    /// parsing); retrying with it cannot succeed.
    #[error("malformed peer worker address, refused before the backend parsed it: {0}")]
    InvalidWorkerAddress(String),

    /// The backend failed; the message names the condition and the cause is
    /// its `source()`. May be transient.
    #[error(transparent)]
    Backend(BackendError),

    /// No backend is configured, or the peer is unknown to it.
    #[error("no rdma backend configured for this operation (or the peer is unknown to it)")]
    NotConfigured,

    /// Registered from a caller-owned pointer: there is no buffer to return.
    #[error("region owns no buffer: it was registered from a caller-owned pointer")]
    NotOwned,

    /// Bytes received as a descriptor could not be decoded, or a descriptor
    /// names a different backend than the one asked to use it.
    #[error("invalid descriptor: {0}")]
    InvalidDescriptor(crate::DescriptorError),

    /// The operation did not finish inside its deadline.
    #[error("rdma operation timed out")]
    Timeout,

    /// The destination buffer was allocated by another registry, whose
    /// backend alone knows its registration; read through that registry.
    #[error(
        "destination buffer belongs to another registry: read into it through the registry that allocated it"
    )]
    ForeignBuffer,

    /// The destination buffer holds `available` bytes and the read needs
    /// `needed` (offset included): a local mistake.
    #[error(
        "destination buffer too small: the read needs {needed} B (offset included), the buffer holds {available} B"
    )]
    DestinationTooSmall {
        /// Offset into the buffer plus the read's length.
        needed: u64,
        /// The buffer's length.
        available: u64,
    },

    /// The source buffer holds `available` bytes and the write needs
    /// `needed` (offset included): a local mistake.
    #[error(
        "source buffer too small: the write needs {needed} B (offset included), the buffer holds {available} B"
    )]
    SourceTooSmall {
        /// Offset into the buffer plus the write's length.
        needed: u64,
        /// The buffer's length.
        available: u64,
    },

    /// A transfer list's read and write share bytes of buffer `buffer`:
    /// the write would send bytes the read is still writing. A local
    /// mistake; give them separate ranges or buffers.
    #[error(
        "a transfer list's read and write share bytes of its buffer {buffer}; give them separate ranges"
    )]
    OverlappingEntries {
        /// The buffer's index in the list.
        buffer: usize,
    },

    /// A transfer list was posted with fewer buffers than its entries name:
    /// a local mistake.
    #[error("the transfer list's entries name {needed} buffers, but {given} were given")]
    MissingBuffers {
        /// How many buffers the entries name (the highest index plus one).
        needed: usize,
        /// How many were passed.
        given: usize,
    },

    /// The destination buffer was surrendered by a cancelled transfer and
    /// is empty for good; allocate another.
    #[error(
        "destination buffer was surrendered by a cancelled transfer and holds no memory; allocate another"
    )]
    BufferSurrendered,

    /// A notice longer than [`MAX_NOTICE_BYTES`](crate::MAX_NOTICE_BYTES):
    /// a local mistake; send less, or put the data in a read.
    #[error("notice of {length} B is over the bound of {max} B", max = crate::MAX_NOTICE_BYTES)]
    NoticeTooLarge {
        /// The notice's length.
        length: u64,
    },

    /// The backend does not offer this operation (a backend written
    /// before it existed, or one whose transport cannot carry it).
    #[error("this rdma backend does not support {operation}")]
    Unsupported {
        /// What was asked for, such as `"notices"`.
        operation: &'static str,
    },

    /// The descriptor was handed out under a lease that has ended: it
    /// expired, or as many readers as it allowed released it. Ask its
    /// owner for a new one.
    #[error("the descriptor's lease has ended (expired or released by its readers)")]
    LeaseExpired,

    /// The registration does not allow the operation: a write to memory
    /// its owner registered for reading only, or a read of memory
    /// registered for writing only. A fact about the descriptor; ask its
    /// owner for one that grants the access.
    #[error("the registration does not allow this {operation}")]
    AccessDenied {
        /// `"read"` or `"write"`.
        operation: &'static str,
    },
}

/// The variant of an [`RdmaError`] without its data, for counting by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum ErrorKind {
    /// [`RdmaError::ShuttingDown`].
    ShuttingDown,
    /// [`RdmaError::BudgetExceeded`].
    BudgetExceeded,
    /// [`RdmaError::RegionNotFound`].
    RegionNotFound,
    /// [`RdmaError::OutOfRange`].
    OutOfRange,
    /// [`RdmaError::InvalidKey`].
    InvalidKey,
    /// [`RdmaError::InvalidWorkerAddress`].
    InvalidWorkerAddress,
    /// [`RdmaError::Backend`].
    Backend,
    /// [`RdmaError::NotConfigured`].
    NotConfigured,
    /// [`RdmaError::NotOwned`].
    NotOwned,
    /// [`RdmaError::InvalidDescriptor`].
    InvalidDescriptor,
    /// [`RdmaError::Timeout`].
    Timeout,
    /// [`RdmaError::ForeignBuffer`].
    ForeignBuffer,
    /// [`RdmaError::DestinationTooSmall`].
    DestinationTooSmall,
    /// [`RdmaError::BufferSurrendered`].
    BufferSurrendered,
    /// [`RdmaError::NoticeTooLarge`].
    NoticeTooLarge,
    /// [`RdmaError::Unsupported`].
    Unsupported,
    /// [`RdmaError::LeaseExpired`].
    LeaseExpired,
    /// [`RdmaError::AccessDenied`].
    AccessDenied,
    /// [`RdmaError::SourceTooSmall`].
    SourceTooSmall,
    /// [`RdmaError::OverlappingEntries`].
    OverlappingEntries,
    /// [`RdmaError::MissingBuffers`].
    MissingBuffers,
}

impl ErrorKind {
    /// Every kind, in declaration order.
    pub const ALL: [ErrorKind; 21] = [
        ErrorKind::ShuttingDown,
        ErrorKind::BudgetExceeded,
        ErrorKind::RegionNotFound,
        ErrorKind::OutOfRange,
        ErrorKind::InvalidKey,
        ErrorKind::InvalidWorkerAddress,
        ErrorKind::Backend,
        ErrorKind::NotConfigured,
        ErrorKind::NotOwned,
        ErrorKind::InvalidDescriptor,
        ErrorKind::Timeout,
        ErrorKind::ForeignBuffer,
        ErrorKind::DestinationTooSmall,
        ErrorKind::BufferSurrendered,
        ErrorKind::NoticeTooLarge,
        ErrorKind::Unsupported,
        ErrorKind::LeaseExpired,
        ErrorKind::AccessDenied,
        ErrorKind::SourceTooSmall,
        ErrorKind::OverlappingEntries,
        ErrorKind::MissingBuffers,
    ];

    /// A stable snake-case name, fit for a metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorKind::ShuttingDown => "shutting_down",
            ErrorKind::BudgetExceeded => "budget_exceeded",
            ErrorKind::RegionNotFound => "region_not_found",
            ErrorKind::OutOfRange => "out_of_range",
            ErrorKind::InvalidKey => "invalid_key",
            ErrorKind::InvalidWorkerAddress => "invalid_worker_address",
            ErrorKind::Backend => "backend",
            ErrorKind::NotConfigured => "not_configured",
            ErrorKind::NotOwned => "not_owned",
            ErrorKind::InvalidDescriptor => "invalid_descriptor",
            ErrorKind::Timeout => "timeout",
            ErrorKind::ForeignBuffer => "foreign_buffer",
            ErrorKind::DestinationTooSmall => "destination_too_small",
            ErrorKind::BufferSurrendered => "buffer_surrendered",
            ErrorKind::NoticeTooLarge => "notice_too_large",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::LeaseExpired => "lease_expired",
            ErrorKind::AccessDenied => "access_denied",
            ErrorKind::SourceTooSmall => "source_too_small",
            ErrorKind::OverlappingEntries => "overlapping_entries",
            ErrorKind::MissingBuffers => "missing_buffers",
        }
    }

    /// Position in [`ALL`](Self::ALL).
    pub const fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl RdmaError {
    /// A backend failure known by its message ([`RdmaError::Backend`]).
    pub fn backend(message: impl Into<String>) -> RdmaError {
        RdmaError::Backend(BackendError::new(message))
    }

    /// A backend failure caused by `source` (kept as its `source()`).
    pub fn backend_caused_by(
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> RdmaError {
        RdmaError::Backend(BackendError::caused_by(message, source))
    }

    /// The variant, without its data.
    pub fn kind(&self) -> ErrorKind {
        match self {
            RdmaError::ShuttingDown => ErrorKind::ShuttingDown,
            RdmaError::BudgetExceeded { .. } => ErrorKind::BudgetExceeded,
            RdmaError::RegionNotFound => ErrorKind::RegionNotFound,
            RdmaError::OutOfRange => ErrorKind::OutOfRange,
            RdmaError::InvalidKey => ErrorKind::InvalidKey,
            RdmaError::InvalidWorkerAddress(_) => ErrorKind::InvalidWorkerAddress,
            RdmaError::Backend(_) => ErrorKind::Backend,
            RdmaError::NotConfigured => ErrorKind::NotConfigured,
            RdmaError::NotOwned => ErrorKind::NotOwned,
            RdmaError::InvalidDescriptor(_) => ErrorKind::InvalidDescriptor,
            RdmaError::Timeout => ErrorKind::Timeout,
            RdmaError::ForeignBuffer => ErrorKind::ForeignBuffer,
            RdmaError::DestinationTooSmall { .. } => ErrorKind::DestinationTooSmall,
            RdmaError::BufferSurrendered => ErrorKind::BufferSurrendered,
            RdmaError::NoticeTooLarge { .. } => ErrorKind::NoticeTooLarge,
            RdmaError::Unsupported { .. } => ErrorKind::Unsupported,
            RdmaError::LeaseExpired => ErrorKind::LeaseExpired,
            RdmaError::AccessDenied { .. } => ErrorKind::AccessDenied,
            RdmaError::SourceTooSmall { .. } => ErrorKind::SourceTooSmall,
            RdmaError::OverlappingEntries { .. } => ErrorKind::OverlappingEntries,
            RdmaError::MissingBuffers { .. } => ErrorKind::MissingBuffers,
        }
    }

    /// Whether retrying later could succeed: `Backend`, `Timeout` and
    /// `BudgetExceeded` may clear; the others are facts.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            RdmaError::Backend(_) | RdmaError::Timeout | RdmaError::BudgetExceeded { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend failure's cause stays reachable from the `RdmaError`, and
    /// its message is printed once, not once per link of the chain.
    #[test]
    fn a_backend_failure_keeps_its_source() {
        use std::error::Error;
        let e = RdmaError::backend_caused_by(
            "ucx: creating the doorbell eventfd",
            std::io::Error::other("too many open files"),
        );
        assert_eq!(
            e.to_string(),
            "rdma backend: ucx: creating the doorbell eventfd"
        );
        let source = e.source().expect("the io error");
        assert_eq!(source.to_string(), "too many open files");
        assert!(source.source().is_none());
        assert_eq!(e.kind(), ErrorKind::Backend);
    }

    #[test]
    fn budget_exceeded_message_carries_all_three_figures() {
        let e = RdmaError::BudgetExceeded {
            requested: 4096,
            registered: 8192,
            budget: 10000,
        };
        let text = e.to_string();
        assert!(text.contains("4096"), "{text}");
        assert!(text.contains("8192"), "{text}");
        assert!(text.contains("10000"), "{text}");
    }

    #[test]
    fn a_small_destination_says_both_sizes() {
        let text = RdmaError::DestinationTooSmall {
            needed: 4160,
            available: 4096,
        }
        .to_string();
        assert!(
            text.contains("destination") && text.contains("4160") && text.contains("4096"),
            "{text}"
        );
    }

    #[test]
    fn backend_message_keeps_the_backend_text() {
        let e = RdmaError::backend("ucx: UCS_ERR_NO_MEMORY");
        assert!(e.to_string().contains("UCS_ERR_NO_MEMORY"));
    }

    #[test]
    fn every_kind_sits_at_its_index_with_a_distinct_name() {
        for (i, kind) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(kind.index(), i);
        }
        let mut names: Vec<_> = ErrorKind::ALL.iter().map(|k| k.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ErrorKind::ALL.len());
        assert_eq!(RdmaError::Timeout.kind(), ErrorKind::Timeout);
        assert_eq!(RdmaError::backend("x").kind().as_str(), "backend");
        assert_eq!(
            RdmaError::BudgetExceeded {
                requested: 1,
                registered: 2,
                budget: 3
            }
            .kind(),
            ErrorKind::BudgetExceeded
        );
    }

    #[test]
    fn only_environmental_failures_are_transient() {
        assert!(RdmaError::Timeout.is_transient());
        assert!(RdmaError::backend(String::new()).is_transient());
        assert!(!RdmaError::OutOfRange.is_transient());
        assert!(!RdmaError::NotOwned.is_transient());
        assert!(!RdmaError::ShuttingDown.is_transient());
        assert!(!RdmaError::InvalidWorkerAddress(String::new()).is_transient());
    }
}
