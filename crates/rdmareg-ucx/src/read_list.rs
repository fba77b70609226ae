//! Batched lists: several small reads of one owner asked in one request and
//! returned in one reply, or a few in order.
//!
//! A consumer asks for up to [`MAX_LIST_ENTRIES`] reads of one owner at once
//! instead of a request and a reply per read; the owner checks every entry
//! exactly as a single read (`progress::serve`), leases each admitted region,
//! and replies with the admitted entries' bytes back to back, in request
//! order.
//!
//! - Every entry has its own result: a refused entry gets its own typed
//!   refusal and contributes no bytes.
//! - Only entries of at most [`MAX_GATHERED_ENTRY`] bytes, and lists of at
//!   most [`MAX_GATHERED_BYTES`] in all, are batched, and the reply is always
//!   eager: the consumer's handler copies each entry there and then, so no
//!   receive outlives it and deadlines, endpoint failures and teardown end
//!   an entry as they end a single read waiting for its reply. Larger reads
//!   go alone (over tcp a list's reads of up to twice the bound go in two
//!   chunks, `progress::chunks`).
//! - The owner sends several replies, in order, when one reply's header
//!   would not fit its worker ([`MAX_LIST_ENTRIES`]), and over a tcp-only
//!   connection, where each carries at most 60 KiB of payload so it arrives
//!   in one fragment (as chunked reads do). The consumer matches each entry
//!   by its request id.
//! - The owner refuses an entry beyond those bounds as
//!   [`Refusal::Malformed`](crate::read_protocol::Refusal::Malformed).
//! - The consumer writes an entry only into a read it sent on the endpoint
//!   the reply arrived on, and only if the lengths add up to the payload.
//!
//! # Formats
//!
//! The list request and the list reply (whose payload is the served
//! entries' bytes) are the engine kit's (`rdmareg_engine::served::wire`).
//! Statuses are those of single replies (`read_protocol`); an unknown code
//! decodes as a refusal of that entry.

use rdmareg_engine::served::wire;

use crate::read_protocol::{ProtocolError, ReadRequest, ReplyStatus};

/// Active-message id of a list request (consumer → owner).
pub const READ_LIST_REQUEST_AM_ID: u32 = 0x5253;
/// Active-message id of a list reply (owner → consumer).
pub const READ_LIST_REPLY_AM_ID: u32 = 0x5254;

/// Most entries one list request carries. UCX requires an active-message
/// header to fit in one fragment, and the UCX built here does not check it
/// (a longer header is written past the fragment buffer), so each side also
/// keeps its headers within its worker's bound ([`entries_within`]): a full
/// request is 8 + 64 × 48 = 3080 bytes, a full reply 8 + 64 × 24 = 1544,
/// inside the default tcp and shared-memory segments; a worker with smaller
/// ones batches fewer reads per list and replies to a list in several.
pub const MAX_LIST_ENTRIES: usize = wire::MAX_LIST_ENTRIES;
/// Largest entry that is batched; larger reads are sent alone.
pub const MAX_GATHERED_ENTRY: u64 = 16 * 1024;
/// Most payload bytes one list reply carries.
pub const MAX_GATHERED_BYTES: u64 = 256 * 1024;

const FIXED_LEN: usize = 8;
/// Length of one list-request entry.
pub const REQUEST_ENTRY_LEN: usize = wire::LIST_REQUEST_ENTRY_LEN;
/// Length of one list-reply entry.
pub const REPLY_ENTRY_LEN: usize = wire::LIST_REPLY_ENTRY_LEN;

/// Most entries a list header of at most `max_header` bytes carries, with
/// entries of `entry_len` bytes ([`REQUEST_ENTRY_LEN`] or
/// [`REPLY_ENTRY_LEN`]), and never more than [`MAX_LIST_ENTRIES`]. A worker
/// whose largest active-message header is below the full list's (small
/// transport segments, a small network MTU) batches fewer reads per list.
pub fn entries_within(max_header: usize, entry_len: usize) -> usize {
    (max_header.saturating_sub(FIXED_LEN) / entry_len.max(1)).min(MAX_LIST_ENTRIES)
}

/// Several reads of one owner, each with its own request id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListRequest {
    /// The reads, in the order their bytes come back.
    pub entries: Vec<ReadRequest>,
}

impl ListRequest {
    /// The encoded header, or `None` for an empty list or one longer than
    /// [`MAX_LIST_ENTRIES`].
    pub fn encode(&self) -> Option<Vec<u8>> {
        wire::encode_list_request_of(self.entries.iter().map(|entry| entry.to_read()))
    }

    /// Decodes a list request; never panics.
    ///
    /// # Errors
    /// A wrong length, version, count or non-zero reserved byte.
    pub fn decode(bytes: &[u8]) -> Result<ListRequest, ProtocolError> {
        let entries = wire::decode_list_request(bytes)?
            .into_iter()
            .map(ReadRequest::from_read)
            .collect();
        Ok(ListRequest { entries })
    }
}

/// The owner's reply to one entry of a list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListReplyEntry {
    /// The entry's request id, echoed.
    pub request_id: u64,
    /// Served, or why not.
    pub status: ReplyStatus,
    /// Bytes of the payload that are this entry's (0 unless served).
    pub length: u64,
}

/// The owner's reply to a list request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListReply {
    /// One result per request entry, in request order.
    pub entries: Vec<ListReplyEntry>,
}

impl ListReply {
    /// The encoded header, or `None` for an empty list or one longer than
    /// [`MAX_LIST_ENTRIES`].
    pub fn encode(&self) -> Option<Vec<u8>> {
        wire::encode_list_reply_fields(
            self.entries
                .iter()
                .map(|entry| (entry.request_id, entry.status.code(), entry.length)),
        )
    }

    /// Decodes a list reply; never panics.
    ///
    /// # Errors
    /// A wrong length, version, count or non-zero reserved byte,
    /// and a refused entry that claims bytes.
    pub fn decode(bytes: &[u8]) -> Result<ListReply, ProtocolError> {
        let entries = wire::decode_list_reply(bytes)?
            .into_iter()
            .map(|reply| {
                let (status, length) = ReplyStatus::of(reply.outcome);
                ListReplyEntry {
                    request_id: reply.request_id,
                    status,
                    length,
                }
            })
            .collect();
        Ok(ListReply { entries })
    }

    /// Payload bytes the served entries claim, or `None` on overflow.
    pub fn payload_len(&self) -> Option<u64> {
        self.entries
            .iter()
            .try_fold(0u64, |sum, entry| sum.checked_add(entry.length))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::read_protocol::{Refusal, ServedKey};

    fn read(request_id: u64, length: u64) -> ReadRequest {
        ReadRequest {
            request_id,
            key: ServedKey {
                region_id: request_id + 100,
                capability: [request_id as u8; 16],
            },
            address: 0x1000 * request_id,
            length,
        }
    }

    #[test]
    fn a_list_request_round_trips_in_order() {
        let request = ListRequest {
            entries: (1..=MAX_LIST_ENTRIES as u64)
                .map(|i| read(i, i * 8))
                .collect(),
        };
        let bytes = request.encode().unwrap();
        assert_eq!(bytes.len(), 8 + MAX_LIST_ENTRIES * REQUEST_ENTRY_LEN);
        assert_eq!(ListRequest::decode(&bytes), Ok(request));
    }

    #[test]
    fn empty_and_overlong_lists_are_neither_encoded_nor_decoded() {
        assert_eq!(ListRequest { entries: vec![] }.encode(), None);
        let overlong = ListRequest {
            entries: (0..=MAX_LIST_ENTRIES as u64).map(|i| read(i, 8)).collect(),
        };
        assert_eq!(overlong.encode(), None);
        let mut bytes = ListRequest {
            entries: vec![read(1, 8)],
        }
        .encode()
        .unwrap();
        bytes[4..6].copy_from_slice(&0u16.to_le_bytes());
        assert!(ListRequest::decode(&bytes).is_err(), "a count of zero");
        bytes[4..6].copy_from_slice(&(MAX_LIST_ENTRIES as u16 + 1).to_le_bytes());
        assert!(
            ListRequest::decode(&bytes).is_err(),
            "a count over the bound"
        );
    }

    #[test]
    fn truncated_padded_and_reserved_bytes_are_refused() {
        let bytes = ListRequest {
            entries: vec![read(1, 8), read(2, 8)],
        }
        .encode()
        .unwrap();
        for cut in 0..bytes.len() {
            assert!(ListRequest::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut padded = bytes.clone();
        padded.push(0);
        assert!(ListRequest::decode(&padded).is_err());
        for at in [1, 2, 3, 6, 7] {
            let mut reserved = bytes.clone();
            reserved[at] = 1;
            assert_eq!(ListRequest::decode(&reserved), Err(ProtocolError::Reserved));
        }
        let mut version = bytes;
        version[0] = 2;
        assert_eq!(
            ListRequest::decode(&version),
            Err(ProtocolError::Version(2))
        );
    }

    #[test]
    fn a_list_reply_round_trips_and_sums_its_served_bytes() {
        let reply = ListReply {
            entries: vec![
                ListReplyEntry {
                    request_id: 7,
                    status: ReplyStatus::Served,
                    length: 4096,
                },
                ListReplyEntry {
                    request_id: 8,
                    status: ReplyStatus::Refused(Refusal::OutOfRange),
                    length: 0,
                },
                ListReplyEntry {
                    request_id: 9,
                    status: ReplyStatus::Served,
                    length: 8,
                },
            ],
        };
        let bytes = reply.encode().unwrap();
        assert_eq!(ListReply::decode(&bytes), Ok(reply.clone()));
        assert_eq!(reply.payload_len(), Some(4104));
    }

    #[test]
    fn a_refused_entry_that_claims_bytes_is_refused() {
        let mut bytes = ListReply {
            entries: vec![ListReplyEntry {
                request_id: 1,
                status: ReplyStatus::Refused(Refusal::RegionUnknown),
                length: 0,
            }],
        }
        .encode()
        .unwrap();
        bytes[8 + 16] = 1;
        assert!(ListReply::decode(&bytes).is_err());
    }

    #[test]
    fn a_small_header_bound_carries_fewer_entries_and_a_full_one_the_maximum() {
        let full = FIXED_LEN + MAX_LIST_ENTRIES * REQUEST_ENTRY_LEN;
        assert_eq!(entries_within(full, REQUEST_ENTRY_LEN), MAX_LIST_ENTRIES);
        assert_eq!(
            entries_within(usize::MAX, REPLY_ENTRY_LEN),
            MAX_LIST_ENTRIES
        );
        assert_eq!(
            entries_within(full - 1, REQUEST_ENTRY_LEN),
            MAX_LIST_ENTRIES - 1
        );
        assert_eq!(entries_within(1000, REPLY_ENTRY_LEN), (1000 - 8) / 24);
        assert_eq!(entries_within(FIXED_LEN + 47, REQUEST_ENTRY_LEN), 0);
        assert_eq!(entries_within(0, REPLY_ENTRY_LEN), 0);
        let bytes = ListRequest {
            entries: (0..entries_within(1000, REQUEST_ENTRY_LEN) as u64)
                .map(|i| read(i, 8))
                .collect(),
        }
        .encode()
        .unwrap();
        assert!(bytes.len() <= 1000);
    }

    #[test]
    fn payload_lengths_that_overflow_have_no_sum() {
        let entry = ListReplyEntry {
            request_id: 1,
            status: ReplyStatus::Served,
            length: u64::MAX,
        };
        let reply = ListReply {
            entries: vec![entry, entry],
        };
        assert_eq!(reply.payload_len(), None);
    }
}
