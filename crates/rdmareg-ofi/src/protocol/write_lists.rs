//! Write lists: a batch's small writes to one owner in one tagged message,
//! answered by one reply (see "Write lists" in the parent module's docs).
//!
//! The header is a read list's with its own version byte, so an owner
//! never takes one for the other; the writes' bytes follow the writer's
//! address back to back. Decoding checks only the message's shape: each
//! entry's length, and whether the lengths add up to the payload, are the
//! engine kit owner's to judge (`rdmareg_engine::served::owner`), entry by
//! entry, so that a bad entry is refused with its reason rather than the
//! whole message dropped unanswered.

use super::{
    LIST_ENTRY_LEN, LIST_HEADER_LEN, ListEntry, ListHeader, Refusal, WRITE_RECEIVE_MAX,
    refusal_code, refusal_of_code,
};

/// The write list layout version (its first byte).
pub const WRITE_LIST_VERSION: u8 = 4;
/// The longest write a writer puts in a list; a longer one goes alone.
pub const WRITE_LIST_ENTRY_MAX: u64 = 64 << 10;
/// The most bytes one write list carries: as many as one write message.
pub const WRITE_LIST_TOTAL_MAX: u64 = super::WRITE_CHUNK_MAX;
/// The length of a write list message of `entries` entries, a writer's
/// address of `reply_len` bytes and `payload` bytes to write: a writer
/// keeps it within [`WRITE_RECEIVE_MAX`].
pub const fn write_list_message_len(entries: usize, reply_len: usize, payload: u64) -> u64 {
    (LIST_HEADER_LEN + entries * LIST_ENTRY_LEN + reply_len) as u64 + payload
}

/// A write list's header: the writes, and where the reply goes. The bytes
/// to write follow it on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteListRequest {
    /// The writer's id of this list (the reply's tag).
    pub request_id: u64,
    /// 1 to [`MAX_LIST_ENTRIES`](super::MAX_LIST_ENTRIES) writes, in payload order.
    pub entries: Vec<ListEntry>,
    /// The writer's fabric address.
    pub reply_to: Vec<u8>,
}

impl WriteListRequest {
    /// The wire form with `payload` (the entries' bytes back to back)
    /// appended.
    pub fn encode_with(&self, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            LIST_HEADER_LEN
                + self.entries.len() * LIST_ENTRY_LEN
                + self.reply_to.len()
                + payload.len(),
        );
        self.encode_header_into(&mut out);
        out.extend_from_slice(payload);
        out
    }

    /// Appends the wire form without the payload to `out`, so that a
    /// writer can gather the payload after it.
    pub fn encode_header_into(&self, out: &mut Vec<u8>) {
        ListHeader::encode_into(
            out,
            WRITE_LIST_VERSION,
            self.request_id,
            &self.entries,
            &self.reply_to,
        );
    }

    /// Decodes an untrusted write list message into its header and the
    /// bytes after it (the payload, of any length); `None` for a malformed
    /// header: a wrong version, a non-zero reserved byte, no entries or
    /// more than [`MAX_LIST_ENTRIES`](super::MAX_LIST_ENTRIES), a request id of zero or past 48
    /// bits, a reply address out of bounds, fewer bytes than the header
    /// announces, or more than [`WRITE_RECEIVE_MAX`] in all.
    pub fn decode(bytes: &[u8]) -> Option<(WriteListRequest, &[u8])> {
        if bytes.len() > WRITE_RECEIVE_MAX {
            return None;
        }
        let header = ListHeader::decode(bytes, WRITE_LIST_VERSION)?;
        Some((
            WriteListRequest {
                request_id: header.request_id,
                entries: header.entries(bytes).collect(),
                reply_to: bytes[header.entries_end..header.reply_end].to_vec(),
            },
            &bytes[header.reply_end..],
        ))
    }
}

/// A write list's reply: one status byte per entry, in order, `0` when
/// the entry's bytes are in, else its refusal's code.
pub fn encode_write_list_reply(outcomes: impl Iterator<Item = Result<(), Refusal>>) -> Vec<u8> {
    outcomes
        .map(|outcome| match outcome {
            Ok(()) => 0,
            Err(refusal) => refusal_code(refusal),
        })
        .collect()
}

/// Reads the reply to a write list of `count` entries: each entry's
/// outcome, or `None` when the reply is not exactly one status byte per
/// entry (then nothing in it may be trusted).
pub fn parse_write_list_reply(reply: &[u8], count: usize) -> Option<Vec<Result<(), Refusal>>> {
    if reply.len() != count {
        return None;
    }
    Some(
        reply
            .iter()
            .map(|&status| match status {
                0 => Ok(()),
                code => Err(refusal_of_code(code)),
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::super::MAX_LIST_ENTRIES;
    use super::*;
    use crate::key::CAPABILITY_LEN;

    fn list() -> WriteListRequest {
        WriteListRequest {
            request_id: 77,
            entries: vec![
                ListEntry {
                    region_id: 3,
                    capability: [7; CAPABILITY_LEN],
                    address: 0x1000,
                    length: 5,
                },
                ListEntry {
                    region_id: 4,
                    capability: [9; CAPABILITY_LEN],
                    address: 0x2000,
                    length: 2,
                },
            ],
            reply_to: vec![1, 2, 3],
        }
    }

    #[test]
    fn a_write_list_round_trips_with_its_payload() {
        let wire = list().encode_with(b"helloab");
        let (decoded, payload) = WriteListRequest::decode(&wire).expect("decodes");
        assert_eq!(decoded, list());
        assert_eq!(payload, b"helloab");
    }

    #[test]
    fn every_cut_into_the_header_is_refused() {
        let wire = list().encode_with(b"");
        for cut in 0..wire.len() {
            assert_eq!(WriteListRequest::decode(&wire[..cut]), None, "cut at {cut}");
        }
    }

    #[test]
    fn a_bad_count_id_version_or_address_is_refused() {
        let good = list().encode_with(b"helloab");
        let mut cases = Vec::new();
        let mut zero_count = good.clone();
        zero_count[1] = 0;
        cases.push(zero_count);
        let mut read_list = good.clone();
        read_list[0] = super::super::LIST_VERSION;
        cases.push(read_list);
        let mut reserved = good.clone();
        reserved[3] = 1;
        cases.push(reserved);
        let mut id_zero = list();
        id_zero.request_id = 0;
        cases.push(id_zero.encode_with(b""));
        let mut id_wide = list();
        id_wide.request_id = 1 << 48;
        cases.push(id_wide.encode_with(b""));
        let mut no_address = list();
        no_address.reply_to.clear();
        cases.push(no_address.encode_with(b"helloab"));
        let mut too_many = list();
        too_many.entries = vec![too_many.entries[0].clone(); MAX_LIST_ENTRIES + 1];
        cases.push(too_many.encode_with(b""));
        for (index, wire) in cases.iter().enumerate() {
            assert_eq!(WriteListRequest::decode(wire), None, "case {index}");
        }
    }

    #[test]
    fn entry_lengths_are_left_to_the_owner_to_judge() {
        let mut odd = list();
        odd.entries[0].length = 0;
        odd.entries[1].length = u64::MAX;
        let wire = odd.encode_with(b"xyz");
        let (decoded, payload) = WriteListRequest::decode(&wire).expect("decodes");
        assert_eq!(decoded, odd);
        assert_eq!(payload, b"xyz");
    }

    #[test]
    fn a_write_list_is_neither_a_write_nor_a_read_list() {
        let wire = list().encode_with(b"helloab");
        assert_eq!(super::super::WriteRequest::decode(&wire), None);
        assert_eq!(super::super::ListRequest::decode(&wire), None);
    }

    #[test]
    fn a_reply_is_read_only_at_one_status_per_entry() {
        let outcomes = [Ok(()), Err(Refusal::AccessDenied), Err(Refusal::Busy)];
        let reply = encode_write_list_reply(outcomes.iter().copied());
        assert_eq!(reply, vec![0, 9, 5]);
        assert_eq!(parse_write_list_reply(&reply, 3), Some(outcomes.to_vec()));
        assert_eq!(parse_write_list_reply(&reply, 2), None);
        assert_eq!(parse_write_list_reply(&reply, 4), None);
        assert_eq!(
            parse_write_list_reply(&[200], 1),
            Some(vec![Err(Refusal::Unrecognized(200))])
        );
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_decode_to_a_canonical_list_or_nothing(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..600),
        ) {
            if let Some((list, payload)) = WriteListRequest::decode(&bytes) {
                let again = list.encode_with(payload);
                proptest::prop_assert_eq!(again, bytes);
            }
        }
    }
}
