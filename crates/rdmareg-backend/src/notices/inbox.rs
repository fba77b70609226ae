//! The owner's side: a bounded queue of the notices readers sent.
//!
//! A driver feeds every notice message that arrives to
//! [`NoticeInbox::receive`], naming the connection it came on, and hands
//! [`NoticeInbox::pop`]'s notices to the application. The rules:
//!
//! - **At most once, in order.** A reading engine draws a random `sender`
//!   number when it starts and numbers the notices it sends from 1. The
//!   inbox remembers the highest number it took from each sender on each
//!   connection and drops any that is not higher (a duplicate, a replay,
//!   or one overtaken by a later one), so no notice is delivered twice and
//!   none after one sent later. A notice lost on the way leaves a gap,
//!   which is allowed: the transports are reliable, and what waits on a
//!   notice also ends by expiry. The key includes the connection so a
//!   peer cannot spend another reader's numbers by naming its `sender`,
//!   and the `sender` so a connection name the transport reuses for a new
//!   reader starts afresh.
//! - **Bounded.** At most [`NoticeLimits::queued`] notices wait in all and
//!   [`NoticeLimits::queued_per_sender`] from one sender, each at most
//!   [`MAX_NOTICE_BYTES`](super::MAX_NOTICE_BYTES), and at most
//!   [`NoticeLimits::queued_per_connection`] from one connection whatever
//!   sender numbers it names: a reader that floods the owner fills its own
//!   share and then loses its notices, counted in [`NoticeDrops`], while
//!   the others still get in. The inbox remembers
//!   at most [`NoticeLimits::senders_remembered`] senders with nothing
//!   queued; past that it forgets them all at once, which costs only their
//!   replay check (a forgotten sender's next number is taken whatever it
//!   is).
//! - **Connections end.** [`NoticeInbox::connection_closed`] forgets what
//!   the inbox kept of a connection's senders; notices they sent stay
//!   queued.

use std::collections::VecDeque;
use std::hash::Hash;

use bytes::Bytes;
use rdmareg_core::NoticeDrops;
use std::collections::HashMap;

use super::wire::{self, NoticeFormatError};

/// A notice as the owner receives it, with the connection it came on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedNotice<E> {
    /// The connection it came on.
    pub from: E,
    /// The reading engine's random number.
    pub sender: u64,
    /// The sender's number for it.
    pub sequence: u64,
    /// What the sender wrote.
    pub bytes: Bytes,
}

/// How many notices may wait for the application, and how many senders the
/// inbox remembers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoticeLimits {
    /// Waiting notices in all (at least 1).
    pub queued: usize,
    /// Waiting notices from one sender (at least 1).
    pub queued_per_sender: usize,
    /// Waiting notices from one connection, whatever sender numbers it
    /// names (at least 1): a peer cannot multiply its share by naming new
    /// senders.
    pub queued_per_connection: usize,
    /// Senders with nothing queued remembered before they are forgotten
    /// at once (at least 1).
    pub senders_remembered: usize,
}

impl Default for NoticeLimits {
    /// 1,024 in all (at most 4 MiB of notices), 256 from one sender or
    /// one connection, 4,096 idle senders remembered.
    fn default() -> Self {
        NoticeLimits {
            queued: 1024,
            queued_per_sender: 256,
            queued_per_connection: 256,
            senders_remembered: 4096,
        }
    }
}

/// Why the inbox dropped a notice message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NoticeDrop {
    /// The bytes are not a notice message.
    #[error("malformed notice: {0}")]
    Malformed(#[from] NoticeFormatError),
    /// Its number is not above the highest taken from its sender.
    #[error("notice {sequence} is not above {last}, the highest taken from its sender")]
    Replayed {
        /// Its number.
        sequence: u64,
        /// The highest number taken from the sender.
        last: u64,
    },
    /// The inbox holds [`NoticeLimits::queued`] notices.
    #[error("the owner's notice queue is full")]
    QueueFull,
    /// Its sender's share, [`NoticeLimits::queued_per_sender`], is full.
    #[error("the sender's share of the owner's notice queue is full")]
    SenderQueueFull,
    /// Its connection's share, [`NoticeLimits::queued_per_connection`], is
    /// full.
    #[error("the connection's share of the owner's notice queue is full")]
    ConnectionQueueFull,
}

/// Counts `drop` under its reason.
fn count(drops: &mut NoticeDrops, drop: NoticeDrop) {
    let counter = match drop {
        NoticeDrop::Malformed(_) => &mut drops.malformed,
        NoticeDrop::Replayed { .. } => &mut drops.replayed,
        NoticeDrop::QueueFull => &mut drops.queue_full,
        NoticeDrop::SenderQueueFull => &mut drops.sender_queue_full,
        NoticeDrop::ConnectionQueueFull => &mut drops.connection_queue_full,
    };
    *counter += 1;
}

/// What the inbox keeps of one sender on one connection.
#[derive(Debug, Default)]
struct Sender {
    /// The highest number taken (0: none since it was last forgotten).
    last: u64,
    /// Its notices in the queue.
    queued: usize,
}

/// The owner's bounded queue of notices; see the [module](self) for its
/// rules.
#[derive(Debug)]
pub struct NoticeInbox<E> {
    limits: NoticeLimits,
    queue: VecDeque<ReceivedNotice<E>>,
    senders: HashMap<(E, u64), Sender>,
    /// Notices queued per connection (no entry: none).
    connections: HashMap<E, usize>,
    drops: NoticeDrops,
}

impl<E: Copy + Eq + Hash> NoticeInbox<E> {
    /// An empty inbox; limits of 0 count as 1.
    pub fn new(limits: NoticeLimits) -> Self {
        NoticeInbox {
            limits: NoticeLimits {
                queued: limits.queued.max(1),
                queued_per_sender: limits.queued_per_sender.max(1),
                queued_per_connection: limits.queued_per_connection.max(1),
                senders_remembered: limits.senders_remembered.max(1),
            },
            queue: VecDeque::new(),
            senders: HashMap::new(),
            connections: HashMap::new(),
            drops: NoticeDrops::default(),
        }
    }

    /// Takes a notice message that arrived on `from`.
    ///
    /// # Errors
    /// Why it was dropped; the drop is counted in [`drops`](Self::drops).
    pub fn receive(&mut self, from: E, message: &[u8]) -> Result<(), NoticeDrop> {
        let result = self.admit(from, message);
        if let Err(drop) = result {
            count(&mut self.drops, drop);
            tracing::debug!(%drop, "notice dropped");
        }
        result
    }

    fn admit(&mut self, from: E, message: &[u8]) -> Result<(), NoticeDrop> {
        let notice = wire::decode(message)?;
        let key = (from, notice.sender);
        let last = self.senders.get(&key).map_or(0, |sender| sender.last);
        if notice.sequence <= last {
            return Err(NoticeDrop::Replayed {
                sequence: notice.sequence,
                last,
            });
        }
        if !self.senders.contains_key(&key) {
            self.make_room_for_a_sender();
        }
        let sender = self.senders.entry(key).or_default();
        // Taken, queued or not: the same number never gets in later.
        sender.last = notice.sequence;
        if sender.queued >= self.limits.queued_per_sender {
            return Err(NoticeDrop::SenderQueueFull);
        }
        let connection = self.connections.get(&from).copied().unwrap_or(0);
        if connection >= self.limits.queued_per_connection {
            return Err(NoticeDrop::ConnectionQueueFull);
        }
        if self.queue.len() >= self.limits.queued {
            return Err(NoticeDrop::QueueFull);
        }
        sender.queued += 1;
        self.connections.insert(from, connection + 1);
        self.queue.push_back(ReceivedNotice {
            from,
            sender: notice.sender,
            sequence: notice.sequence,
            bytes: Bytes::copy_from_slice(notice.bytes),
        });
        Ok(())
    }

    /// Forgets every idle sender once the remembered ones reach the limit.
    ///
    /// At most `queued` senders have something queued, so each sweep
    /// forgets all but those, and sweeps are rare next to the insertions
    /// that fill the table again.
    fn make_room_for_a_sender(&mut self) {
        if self.senders.len() < self.limits.senders_remembered + self.limits.queued {
            return;
        }
        let before = self.senders.len();
        self.senders.retain(|_, sender| sender.queued > 0);
        tracing::debug!(
            forgotten = before - self.senders.len(),
            "notice inbox forgot its idle senders"
        );
    }

    /// The oldest waiting notice.
    pub fn pop(&mut self) -> Option<ReceivedNotice<E>> {
        let notice = self.queue.pop_front()?;
        match self.connections.get_mut(&notice.from) {
            Some(count) if *count > 1 => *count -= 1,
            _ => {
                self.connections.remove(&notice.from);
            }
        }
        let key = (notice.from, notice.sender);
        if let Some(sender) = self.senders.get_mut(&key) {
            sender.queued -= 1;
            // Number 0 with nothing queued: its connection closed, and
            // nothing of it is worth keeping.
            if sender.queued == 0 && sender.last == 0 {
                self.senders.remove(&key);
            }
        }
        Some(notice)
    }

    /// The connection `from` is gone: what the inbox kept of its senders
    /// is forgotten, and their queued notices stay.
    pub fn connection_closed(&mut self, from: E) {
        self.senders.retain(|&(connection, _), sender| {
            if connection != from {
                return true;
            }
            // Queued notices keep counting against the share until popped.
            sender.last = 0;
            sender.queued > 0
        });
    }

    /// Notices waiting.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Senders the inbox keeps a number or a share for.
    pub fn senders(&self) -> usize {
        self.senders.len()
    }

    /// Drops since the inbox was made.
    pub fn drops(&self) -> NoticeDrops {
        self.drops
    }
}

#[cfg(test)]
mod tests;
