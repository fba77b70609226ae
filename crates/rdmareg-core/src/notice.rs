//! Notices as the backend seam and the registry name them: small messages
//! a reader sends an owner once the reads they accompany completed.
//!
//! The rules of delivery are the engine kit's (`rdmareg-engine`'s
//! `notices` module): a notice is sent only after its reads succeeded,
//! delivered at most once and in send order per reader, into a bounded
//! queue whose overflow is counted in [`NoticeDrops`].

use bytes::Bytes;

/// The most bytes one notice carries.
///
/// Enough for a few descriptors or a small record; a notice is a signal,
/// and bulk data belongs in a read.
pub const MAX_NOTICE_BYTES: usize = 4096;

/// The reading engine a notice came from: a number the engine drew at
/// random when it started, the same for every notice it sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NoticeSender(pub u64);

impl std::fmt::Display for NoticeSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// A notice as its owner receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// The engine that sent it.
    pub from: NoticeSender,
    /// What it wrote, at most [`MAX_NOTICE_BYTES`].
    pub bytes: Bytes,
}

/// Notices an owner dropped, by reason, since its engine started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct NoticeDrops {
    /// Bytes that were not a notice message.
    pub malformed: u64,
    /// Numbers not above the highest taken from their sender: duplicates
    /// and replays.
    pub replayed: u64,
    /// No room left in the owner's whole queue.
    pub queue_full: u64,
    /// No room left in the sender's share of the queue.
    pub sender_queue_full: u64,
    /// No room left in the connection's share of the queue.
    pub connection_queue_full: u64,
}

impl NoticeDrops {
    /// Every drop, whatever the reason.
    pub fn total(&self) -> u64 {
        self.malformed
            + self.replayed
            + self.queue_full
            + self.sender_queue_full
            + self.connection_queue_full
    }
}
