//! Shared vocabulary of rdmareg: the error every layer speaks, the values that
//! cross the backend seam, the wire descriptor an owner hands a consumer,
//! the page arithmetic registrations are charged by, and the log of the
//! ranges served writes filled.
//!
//! No async runtime, no I/O, no `unsafe`: every crate can depend on it.

#![forbid(unsafe_code)]

pub mod access;
pub mod backend_error;
pub mod descriptor;
pub mod error;
pub mod lease;
pub mod notice;
pub mod page;
pub mod region;
pub mod written;

pub use access::Access;
pub use backend_error::BackendError;
pub use descriptor::{Descriptor, DescriptorError, MAX_BACKEND_KEY_LEN, MAX_PACKED_KEY_LEN};
pub use error::{ErrorKind, RdmaError};
pub use lease::{LeaseEnd, LeaseTerms, MAX_LEASE_READERS};
pub use notice::{MAX_NOTICE_BYTES, Notice, NoticeDrops, NoticeSender};
pub use page::{PageRange, page_enclosing_len, page_enclosing_range, round_up};
pub use region::{BackendGet, BackendPut, BackendRegion, PeerId};
pub use written::{MAX_WRITTEN_RANGES, WrittenLog, WrittenRanges};
