//! Notices: small messages a reader sends an owner, delivered only after
//! the reads they accompany completed.
//!
//! An owner learns from a notice that a reader is done with its memory
//! (a "done" message after a GET, the release of a read lease), so it can
//! free a range without guessing. The promise, on every lane:
//!
//! - a notice holds at most [`MAX_NOTICE_BYTES`] bytes;
//! - a notice attached to reads leaves the reader only after every one of
//!   them completed, that is after the transport released its destination;
//!   if any failed, the notice is withheld, never sent (the engine kit's
//!   `notices::gate` keeps this rule for a driver that attaches notices on
//!   its own completion path);
//! - the owner delivers each notice at most once and, per reader and
//!   connection, in the order it was sent: a sequence number that does not
//!   rise is dropped as a replay ([`inbox`]);
//! - the owner's queue is bounded overall and per reader, so a reader that
//!   floods it cannot take the room of the others; what does not fit is
//!   dropped and counted by reason, never buffered without bound.
//!
//! Notices are fire-and-forget, as the transports' own notifications are:
//! a dropped notice is counted at the owner, not reported to the reader.
//! What waits on a notice (a read lease, say) must therefore also end by
//! itself, by expiry.
//!
//! This module has no I/O: a backend encodes with [`wire`], sends on its
//! transport, and feeds what arrives to a [`board::NoticeBoard`], whose
//! [`inbox::NoticeInbox`] applies the rules and whose streams hand the
//! notices to the application. It lives beside the seam, not in the engine
//! kit, so every backend (the loopback one too) keeps the same rules.

pub mod board;
pub mod inbox;
pub mod wire;

pub use board::{NoticeBoard, NoticeSource, NoticeStream};
pub use inbox::{NoticeDrop, NoticeInbox, NoticeLimits, ReceivedNotice};
pub use wire::{MAX_NOTICE_BYTES, NoticeFormatError, NoticeMessage, ReleaseMessage};
