//! Fuzzes the notice message an owner receives from readers, alone and as
//! a stream into the owner's inbox. Both come from peers.
//!
//! Properties for every input:
//!
//! * decoding never panics, and whatever it accepts re-encodes to exactly
//!   the input;
//! * fed as a series of messages from a few connections, with closes in
//!   between, the inbox never holds more than its bounds, and every
//!   message is either queued, delivered or counted as dropped;
//! * per sender and connection, delivered numbers rise.

#![no_main]

use std::collections::HashMap;

use libfuzzer_sys::fuzz_target;
use rdmareg_engine::notices::{NoticeInbox, NoticeLimits, wire};

fuzz_target!(|bytes: &[u8]| {
    if let Ok(notice) = wire::decode(bytes) {
        let encoded = wire::encode(notice.sender, notice.sequence, notice.bytes)
            .expect("an accepted notice encodes");
        assert_eq!(encoded, bytes, "an accepted notice re-encodes to itself");
    }

    // The input as a stream: a control byte (top two bits: 0 close, 1 pop,
    // else send; low two bits: the connection), then for a send a length
    // byte and that many bytes of message.
    let limits = NoticeLimits {
        queued: 8,
        queued_per_sender: 3,
        queued_per_connection: 5,
        // Above what the stream can name (16 senders), so none is forgotten
        // and the order check holds.
        senders_remembered: 64,
    };
    let mut inbox = NoticeInbox::new(limits);
    let mut epoch = [0u32; 4];
    let mut last_delivered: HashMap<(u8, u64, u32), u64> = HashMap::new();
    let (mut received, mut delivered) = (0u64, 0u64);
    let mut rest = bytes;
    while let Some((&control, tail)) = rest.split_first() {
        let connection = control & 3;
        rest = tail;
        match control >> 6 {
            0 => {
                inbox.connection_closed(connection);
                epoch[connection as usize] += 1;
            }
            1 => {
                if let Some(notice) = inbox.pop() {
                    delivered += 1;
                    let key = (notice.from, notice.sender, epoch_of(&notice.bytes));
                    let previous = last_delivered.insert(key, notice.sequence);
                    assert!(
                        previous.is_none_or(|p| p < notice.sequence),
                        "delivered out of order"
                    );
                }
            }
            _ => {
                let Some((&length, tail)) = rest.split_first() else {
                    break;
                };
                let take = (length as usize).min(tail.len());
                let (message, tail) = tail.split_at(take);
                rest = tail;
                received += 1;
                // A well-formed message tags its notice with the connection
                // it was sent on, so delivery order can be checked per
                // connection; a malformed one is sent as it is.
                let tagged = wire::decode(message).ok().and_then(|notice| {
                    let mut body = epoch[connection as usize].to_le_bytes().to_vec();
                    body.extend_from_slice(notice.bytes.get(..64).unwrap_or(notice.bytes));
                    wire::encode(notice.sender & 3, notice.sequence, &body).ok()
                });
                let _ = inbox.receive(connection, tagged.as_deref().unwrap_or(message));
            }
        }
        assert!(
            inbox.queued() <= limits.queued,
            "the inbox holds more than its bound"
        );
        assert!(
            inbox.senders() <= 16,
            "the inbox keeps state for more senders than the stream can name"
        );
        assert_eq!(
            received,
            delivered + inbox.queued() as u64 + inbox.drops().total(),
            "a message was neither queued, delivered nor counted"
        );
    }
});

/// The connection a tagged notice was sent on.
fn epoch_of(bytes: &[u8]) -> u32 {
    bytes
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes)
        .unwrap_or(u32::MAX)
}
