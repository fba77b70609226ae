//! The served read protocol over tagged messages: requests and replies.
//!
//! On `tcp;ofi_rxm` and `shm` a one-sided `fi_read` keeps copying out of a
//! region after its `fi_close` returned, so the owner's engine serves each
//! read itself, holding a read lease until the reply's send completes (see
//! `docs/ofi.md`, "Owner-served reads").
//!
//! # Exchange
//!
//! 1. The consumer posts a tagged receive of `length` bytes into its
//!    destination, directed at the owner, with tag `request_id` and ignore
//!    mask [`REPLY_IGNORE`], *before* it asks.
//! 2. It sends a [`ReadRequest`] with tag [`REQUEST_TAG`].
//! 3. The owner sends the `length` bytes with tag `request_id`, or a
//!    zero-length refusal with tag [`refusal_tag`]`(request_id, reason)`;
//!    the completion's tag tells which.
//!
//! Where the provider names a receive's sender (`FI_SOURCE`), bytes go only
//! to the endpoint that sent the request: another reply address is refused
//! ([`Refusal::NotTheRequester`]), and a sender the provider cannot name yet
//! gets [`Refusal::Unverified`] with no lease and asks again with the same
//! id (up to three times). Request ids are below 2⁴⁸, so they never collide
//! with the refusal bit, the reason byte or the request bit.
//!
//! # Request, version 1 (integers little-endian)
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | version, `1` |
//! | 1 | 3 | zero |
//! | 4 | 8 | `request_id`, 1 to 2⁴⁸ − 1 |
//! | 12 | 8 | `region_id` (from the key) |
//! | 20 | 16 | `capability` (from the key) |
//! | 36 | 8 | `address`: the first byte wanted, as an address in the owner |
//! | 44 | 8 | `length`, non-zero |
//! | 52 | 2 | `reply_len`: length of the consumer's fabric address, 1 to 256 |
//! | 54 | `reply_len` | the consumer's fabric address: where the reply goes |
//!
//! Decoding never panics and refuses trailing or missing bytes.
//!
//! # Batched lists
//!
//! A batch's small reads of one owner go as one *list request* of up to
//! [`MAX_LIST_ENTRIES`] entries, each at most [`GATHER_ENTRY_MAX`] bytes and
//! together at most [`GATHER_TOTAL_MAX`], into one receive of
//! [`ListRequest::reply_len`] bytes of the consumer's scratch memory. The
//! reply is a status byte per entry (`0` served, else the [`Refusal`] code),
//! then the served entries' bytes back to back; the consumer uses it only if
//! its length adds up exactly. A busy owner refuses the whole list.
//! List request (integers little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | version, `2` (a list) |
//! | 1 | 1 | entry count `n`, 1 to [`MAX_LIST_ENTRIES`] |
//! | 2 | 2 | zero |
//! | 4 | 8 | `request_id`, 1 to 2⁴⁸ − 1 |
//! | 12 | 2 | `reply_len`: length of the consumer's fabric address, 1 to 256 |
//! | 14 | 40 × `n` | entries: `region_id` (8), `capability` (16), `address` (8), `length` (8, 1 to [`GATHER_ENTRY_MAX`]) |
//! | 14 + 40 × `n` | `reply_len` | the consumer's fabric address |
//!
//! # Served writes
//!
//! A put is split into *chunks* of at most [`WRITE_CHUNK_MAX`] bytes; each
//! chunk is one write of the engine kit's writer
//! (`rdmareg_engine::served::Writer`) and one tagged message with tag
//! [`WRITE_TAG`]: the header below, the writer's fabric address, then the
//! chunk's bytes. Before sending it the writer posts an 8-byte tagged
//! receive for the reply, directed at the owner, with tag `request_id` and
//! ignore mask [`REPLY_IGNORE`] (ids are minted as for reads). The owner
//! keeps [`WRITE_RECEIVES`] receives of
//! [`WRITE_RECEIVE_MAX`] bytes posted on [`WRITE_TAG`], admits the write
//! with the kit's owner, copies the bytes into the registration in the same
//! loop turn, and only then sends the reply: an 8-byte message, the length
//! written (little-endian), with tag `request_id`; a refusal is a
//! zero-length message with tag [`refusal_tag`]`(request_id, reason)`, as
//! for reads (`9` access denied; `10`, receive failed, is never sent: the
//! copy cannot fail). A malformed write message is dropped.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | version, `3` (a write) |
//! | 1 | 3 | zero |
//! | 4 | 8 | `request_id`, 1 to 2⁴⁸ − 1 |
//! | 12 | 8 | `region_id` (from the key) |
//! | 20 | 16 | `capability` (from the key) |
//! | 36 | 8 | `address`: the first byte to write, as an address in the owner |
//! | 44 | 8 | `length`, 1 to [`WRITE_CHUNK_MAX`] |
//! | 52 | 2 | `reply_len`: length of the writer's fabric address, 1 to 256 |
//! | 54 | `reply_len` | the writer's fabric address: where the reply goes |
//! | 54 + `reply_len` | the rest | the bytes to write (the owner refuses the write as malformed unless exactly `length`) |
//!
//! # Write lists
//!
//! A batch's writes of at most [`WRITE_LIST_ENTRY_MAX`] bytes to one owner
//! go as one *write list*: one message on [`WRITE_TAG`], a list request's
//! header with version `4` (entries as there, one per write, in payload
//! order), the writer's fabric address, then the writes' bytes back to
//! back, at most [`WRITE_LIST_TOTAL_MAX`] together and the whole message
//! at most [`WRITE_RECEIVE_MAX`], what a single write's receive takes
//! (so an owner of any build receives it whole). The writer posts one
//! receive of a byte per entry for the reply, as for a single write. The
//! owner judges each entry as a single write at its place in the payload
//! (the engine kit's write lists: a bad entry is refused alone; lengths
//! that do not add up to the payload refuse every entry with code `1`, as
//! a request the owner cannot parse), copies the accepted ones in the same loop turn, and only then
//! replies: one status byte per entry, `0` when its bytes are in, else its
//! refusal's code, with tag `request_id`. A writer takes a reply of any
//! other length, or a refusal tag, as no answer: each entry fails, its
//! outcome unknown. An owner of a build without write lists drops the
//! message as malformed, and the writes time out.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | version, `4` (a write list) |
//! | 1 | 1 | entry count `n`, 1 to [`MAX_LIST_ENTRIES`] |
//! | 2 | 2 | zero |
//! | 4 | 8 | `request_id`, 1 to 2⁴⁸ − 1 |
//! | 12 | 2 | `reply_len`: length of the writer's fabric address, 1 to 256 |
//! | 14 | 40 × `n` | entries: `region_id` (8), `capability` (16), `address` (8), `length` (8) |
//! | 14 + 40 × `n` | `reply_len` | the writer's fabric address |
//! | then | the rest | the entries' bytes, back to back |
//!
//! # Probe
//!
//! The four bytes [`PROBE`] with tag [`REQUEST_TAG`] ask nothing and get no
//! reply; a consumer sends one to an owner it hears nothing from, to learn
//! whether the provider can deliver to it at all. Its first byte is no
//! request version, so an owner that does not know probes drops it.

use rdmareg_core::RdmaError;

use crate::key::{CAPABILITY_LEN, MAX_FABRIC_ADDRESS};

mod write_lists;

pub use write_lists::{
    WRITE_LIST_ENTRY_MAX, WRITE_LIST_TOTAL_MAX, WRITE_LIST_VERSION, WriteListRequest,
    encode_write_list_reply, parse_write_list_reply, write_list_message_len,
};

/// The request layout version.
pub const REQUEST_VERSION: u8 = 1;
/// Bytes of a request before the consumer's address.
pub const REQUEST_HEADER_LEN: usize = 54;
/// The longest request.
pub const REQUEST_MAX: usize = REQUEST_HEADER_LEN + MAX_FABRIC_ADDRESS;
/// The list request layout version (its first byte).
pub const LIST_VERSION: u8 = 2;
/// The most entries of one list request.
pub const MAX_LIST_ENTRIES: usize = 64;
/// The largest entry a list carries.
pub const GATHER_ENTRY_MAX: u64 = 16 << 10;
/// The most bytes a list's entries ask for together.
pub const GATHER_TOTAL_MAX: u64 = 256 << 10;
/// Bytes of a list request before its entries.
const LIST_HEADER_LEN: usize = 14;
/// Bytes of one list entry.
const LIST_ENTRY_LEN: usize = 40;
/// The longest list request.
pub const LIST_REQUEST_MAX: usize =
    LIST_HEADER_LEN + MAX_LIST_ENTRIES * LIST_ENTRY_LEN + MAX_FABRIC_ADDRESS;
/// The longest message an owner's request receive takes.
pub const RECEIVE_MAX: usize = if LIST_REQUEST_MAX > REQUEST_MAX {
    LIST_REQUEST_MAX
} else {
    REQUEST_MAX
};
/// A liveness probe (see the module docs).
pub const PROBE: [u8; 4] = [0xFF, 0, 0, 0];
/// The tag of every request.
pub const REQUEST_TAG: u64 = 1 << 63;
/// The tag bit of a refusal.
pub const REFUSAL_BIT: u64 = 1 << 62;
/// The tag of every write message (see "Served writes" in the module
/// docs). No reply, refusal, request or notice tag has this bit.
pub const WRITE_TAG: u64 = 1 << 60;
/// The write message layout version (its first byte).
pub const WRITE_VERSION: u8 = 3;
/// The most bytes one write message carries: a larger put goes as several.
/// Above `tcp;ofi_rxm`'s eager (16 KiB) and segmentation (128 KiB) limits,
/// so a full chunk travels by rendezvous.
pub const WRITE_CHUNK_MAX: u64 = 256 << 10;
/// The longest write message an owner's write receive takes: a single
/// write of [`WRITE_CHUNK_MAX`] bytes; a write list is packed within it.
pub const WRITE_RECEIVE_MAX: usize =
    REQUEST_HEADER_LEN + MAX_FABRIC_ADDRESS + WRITE_CHUNK_MAX as usize;
/// Receives an engine keeps posted for write messages.
pub const WRITE_RECEIVES: usize = 4;
/// Length of a write's reply: the length written, little-endian.
pub const WRITE_REPLY_LEN: usize = 8;
/// The tag of every notice: the message is the notice format every backend
/// shares (`rdmareg_backend::notices::wire`). No reply or request tag has
/// this bit, and a notice receive ignores no bit of the tag.
pub const NOTICE_TAG: u64 = 1 << 61;
/// Where a refusal's reason sits in its tag.
const REASON_SHIFT: u32 = 48;
/// The bits of a refusal's reason.
const REASON_MASK: u64 = 0xFF << REASON_SHIFT;
/// The bits of a request id.
pub const REQUEST_ID_MASK: u64 = (1 << REASON_SHIFT) - 1;
/// What a consumer's receive ignores of the tag: it matches the reply and
/// every refusal of its request id.
pub const REPLY_IGNORE: u64 = REFUSAL_BIT | REASON_MASK;

/// Why an owner refused a read: the engine kit's, which also gives the
/// caller's error for each (`From<Refusal> for RdmaError`).
pub use rdmareg_engine::served::Refusal;
pub use rdmareg_engine::served::{BUSY_TEXT, NOT_THE_REQUESTER_TEXT, UNVERIFIED_TEXT};

/// The code of `refusal` in this format: in a refusal's tag, and as the
/// status byte of a refused list entry. Codes are only ever added, never
/// reassigned. The kit's refusals this format has no code for (a request
/// the owner could not parse) travel as `RegionUnknown`, as they always
/// did.
pub fn refusal_code(refusal: Refusal) -> u8 {
    match refusal {
        Refusal::CapabilityMismatch => 2,
        Refusal::OutOfRange => 3,
        Refusal::Deregistering => 4,
        Refusal::Busy => 5,
        Refusal::Unverified => 6,
        Refusal::NotTheRequester => 7,
        Refusal::LeaseExpired => 8,
        Refusal::AccessDenied => 9,
        Refusal::ReceiveFailed => 10,
        _ => 1,
    }
}

/// The refusal a non-zero code names; one this build does not know is
/// [`Refusal::Unrecognized`].
fn refusal_of_code(code: u8) -> Refusal {
    match code {
        1 => Refusal::RegionUnknown,
        2 => Refusal::CapabilityMismatch,
        3 => Refusal::OutOfRange,
        4 => Refusal::Deregistering,
        5 => Refusal::Busy,
        6 => Refusal::Unverified,
        7 => Refusal::NotTheRequester,
        8 => Refusal::LeaseExpired,
        9 => Refusal::AccessDenied,
        10 => Refusal::ReceiveFailed,
        other => Refusal::Unrecognized(other),
    }
}

/// The reason code in a refusal's tag.
fn reason_of(tag: u64) -> u8 {
    ((tag & REASON_MASK) >> REASON_SHIFT) as u8
}

/// Whether a reply's tag is a [`Refusal::Unverified`]: the consumer asks
/// again.
pub fn is_unverified(tag: u64) -> bool {
    tag & REFUSAL_BIT != 0 && reason_of(tag) == refusal_code(Refusal::Unverified)
}

/// The tag of a refusal of `request_id`.
pub fn refusal_tag(request_id: u64, refusal: Refusal) -> u64 {
    REFUSAL_BIT
        | (u64::from(refusal_code(refusal)) << REASON_SHIFT)
        | (request_id & REQUEST_ID_MASK)
}

/// The refusal a reply's tag carries, if it is a refusal.
pub fn refusal_of_tag(tag: u64) -> Option<Refusal> {
    (tag & REFUSAL_BIT != 0).then(|| refusal_of_code(reason_of(tag)))
}

/// What a completed reply receive means, from its tag: `Ok` for the bytes,
/// else the caller's error for the refusal (see [`Refusal`]).
pub fn reply_outcome(tag: u64) -> Result<(), RdmaError> {
    if tag & REFUSAL_BIT == 0 {
        return Ok(());
    }
    Err(refusal_of_code(reason_of(tag)).into())
}

/// One entry of a [`ListRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListEntry {
    /// The owner's registration id, from the key.
    pub region_id: u64,
    /// The capability, from the key.
    pub capability: [u8; CAPABILITY_LEN],
    /// First byte wanted, as an address in the owner.
    pub address: u64,
    /// Bytes wanted, 1 to [`GATHER_ENTRY_MAX`].
    pub length: u64,
}

/// A consumer's list of small reads of one owner, returned in one reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListRequest {
    /// The consumer's id of this list (the reply's tag).
    pub request_id: u64,
    /// 1 to [`MAX_LIST_ENTRIES`] entries, together at most
    /// [`GATHER_TOTAL_MAX`] bytes.
    pub entries: Vec<ListEntry>,
    /// The consumer's fabric address.
    pub reply_to: Vec<u8>,
}

/// A list message's fields before its entries, shared by read lists and
/// write lists (which differ in their version byte).
struct ListHeader {
    request_id: u64,
    /// Where the entries end and the reply address starts.
    entries_end: usize,
    /// Where the reply address ends.
    reply_end: usize,
}

impl ListHeader {
    /// Appends a list's header, its entries and its reply address.
    fn encode_into(
        out: &mut Vec<u8>,
        version: u8,
        request_id: u64,
        entries: &[ListEntry],
        reply_to: &[u8],
    ) {
        out.extend_from_slice(&[version, entries.len() as u8, 0, 0]);
        out.extend_from_slice(&request_id.to_le_bytes());
        out.extend_from_slice(&(reply_to.len() as u16).to_le_bytes());
        for entry in entries {
            out.extend_from_slice(&entry.region_id.to_le_bytes());
            out.extend_from_slice(&entry.capability);
            out.extend_from_slice(&entry.address.to_le_bytes());
            out.extend_from_slice(&entry.length.to_le_bytes());
        }
        out.extend_from_slice(reply_to);
    }

    /// Checks the fixed fields of untrusted list bytes of `version`: no
    /// reserved bit set, 1 to [`MAX_LIST_ENTRIES`] entries, a request id
    /// of 1 to 2⁴⁸ − 1, a reply address of 1 to 256 bytes, and at least
    /// the bytes these announce.
    fn decode(bytes: &[u8], version: u8) -> Option<ListHeader> {
        if bytes.len() < LIST_HEADER_LEN || bytes[0] != version || bytes[2..4] != [0, 0] {
            return None;
        }
        let count = usize::from(bytes[1]);
        let request_id = u64_at(bytes, 4);
        let reply_len = usize::from(u16::from_le_bytes([bytes[12], bytes[13]]));
        if count == 0 || count > MAX_LIST_ENTRIES {
            return None;
        }
        if request_id == 0 || request_id & !REQUEST_ID_MASK != 0 {
            return None;
        }
        let entries_end = LIST_HEADER_LEN + count * LIST_ENTRY_LEN;
        let reply_end = entries_end + reply_len;
        if reply_len == 0 || reply_len > MAX_FABRIC_ADDRESS || bytes.len() < reply_end {
            return None;
        }
        Some(ListHeader {
            request_id,
            entries_end,
            reply_end,
        })
    }

    /// The entries of bytes this header was decoded from.
    fn entries<'a>(&self, bytes: &'a [u8]) -> impl Iterator<Item = ListEntry> + 'a {
        bytes[LIST_HEADER_LEN..self.entries_end]
            .chunks_exact(LIST_ENTRY_LEN)
            .map(|entry| {
                let mut capability = [0u8; CAPABILITY_LEN];
                capability.copy_from_slice(&entry[8..24]);
                ListEntry {
                    region_id: u64_at(entry, 0),
                    capability,
                    address: u64_at(entry, 24),
                    length: u64_at(entry, 32),
                }
            })
    }
}

/// The little-endian `u64` at `at` of `bytes`, which holds it.
fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(raw)
}

impl ListRequest {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            LIST_HEADER_LEN + self.entries.len() * LIST_ENTRY_LEN + self.reply_to.len(),
        );
        ListHeader::encode_into(
            &mut out,
            LIST_VERSION,
            self.request_id,
            &self.entries,
            &self.reply_to,
        );
        out
    }

    /// Decodes untrusted list bytes; `None` for anything malformed: a
    /// count, length or total out of bounds, missing or trailing bytes.
    pub fn decode(bytes: &[u8]) -> Option<ListRequest> {
        if bytes.len() > LIST_REQUEST_MAX {
            return None;
        }
        let header = ListHeader::decode(bytes, LIST_VERSION)?;
        if bytes.len() != header.reply_end {
            return None;
        }
        let entries: Vec<ListEntry> = header.entries(bytes).collect();
        let within = |entry: &ListEntry| (1..=GATHER_ENTRY_MAX).contains(&entry.length);
        if !entries.iter().all(within) {
            return None;
        }
        let total: u64 = entries.iter().map(|entry| entry.length).sum();
        if total > GATHER_TOTAL_MAX {
            return None;
        }
        Some(ListRequest {
            request_id: header.request_id,
            entries,
            reply_to: bytes[header.entries_end..].to_vec(),
        })
    }

    /// The longest reply this list can get: a status byte per entry and
    /// every entry's bytes.
    pub fn reply_len(&self) -> usize {
        self.entries.len()
            + self
                .entries
                .iter()
                .map(|entry| entry.length as usize)
                .sum::<usize>()
    }
}

/// Reads the reply to a list that asked for `lengths`: for each entry,
/// where its bytes start in `reply` or why it was refused. `None` when the
/// reply's length is not exactly what its statuses and `lengths` add up to:
/// then none of it may be written.
pub fn parse_gathered(reply: &[u8], lengths: &[u64]) -> Option<Vec<Result<usize, RdmaError>>> {
    let statuses = reply.get(..lengths.len())?;
    let mut at = lengths.len();
    let mut outcomes = Vec::with_capacity(lengths.len());
    for (&status, &length) in statuses.iter().zip(lengths) {
        if status == 0 {
            outcomes.push(Ok(at));
            at = at.checked_add(usize::try_from(length).ok()?)?;
        } else {
            outcomes.push(Err(refusal_of_code(status).into()));
        }
    }
    (at == reply.len()).then_some(outcomes)
}

/// A consumer's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadRequest {
    /// The consumer's id of this read (the reply's tag).
    pub request_id: u64,
    /// The owner's registration id, from the key.
    pub region_id: u64,
    /// The capability, from the key.
    pub capability: [u8; CAPABILITY_LEN],
    /// First byte wanted, as an address in the owner.
    pub address: u64,
    /// Bytes wanted.
    pub length: u64,
    /// The consumer's fabric address.
    pub reply_to: Vec<u8>,
}

impl ReadRequest {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(REQUEST_HEADER_LEN + self.reply_to.len());
        out.extend_from_slice(&[REQUEST_VERSION, 0, 0, 0]);
        out.extend_from_slice(&self.request_id.to_le_bytes());
        out.extend_from_slice(&self.region_id.to_le_bytes());
        out.extend_from_slice(&self.capability);
        out.extend_from_slice(&self.address.to_le_bytes());
        out.extend_from_slice(&self.length.to_le_bytes());
        out.extend_from_slice(&(self.reply_to.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.reply_to);
        out
    }

    /// Decodes untrusted request bytes; `None` for anything malformed.
    pub fn decode(bytes: &[u8]) -> Option<ReadRequest> {
        if bytes.len() < REQUEST_HEADER_LEN || bytes.len() > REQUEST_MAX {
            return None;
        }
        if bytes[0] != REQUEST_VERSION || bytes[1..4] != [0, 0, 0] {
            return None;
        }
        let u64_at = |at: usize| {
            let mut raw = [0u8; 8];
            raw.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(raw)
        };
        let request_id = u64_at(4);
        let length = u64_at(44);
        let reply_len = usize::from(u16::from_le_bytes([bytes[52], bytes[53]]));
        if request_id == 0 || request_id & !REQUEST_ID_MASK != 0 || length == 0 {
            return None;
        }
        if reply_len == 0 || bytes.len() != REQUEST_HEADER_LEN + reply_len {
            return None;
        }
        let mut capability = [0u8; CAPABILITY_LEN];
        capability.copy_from_slice(&bytes[20..36]);
        Some(ReadRequest {
            request_id,
            region_id: u64_at(12),
            capability,
            address: u64_at(36),
            length,
            reply_to: bytes[REQUEST_HEADER_LEN..].to_vec(),
        })
    }
}

/// A write message's header (see "Served writes" in the module docs); the
/// bytes to write follow it on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteRequest {
    /// The writer's id of this write (the reply's tag).
    pub request_id: u64,
    /// The owner's registration id, from the key.
    pub region_id: u64,
    /// The capability, from the key.
    pub capability: [u8; CAPABILITY_LEN],
    /// First byte to write, as an address in the owner.
    pub address: u64,
    /// Bytes to write, 1 to [`WRITE_CHUNK_MAX`].
    pub length: u64,
    /// The writer's fabric address.
    pub reply_to: Vec<u8>,
}

impl WriteRequest {
    /// The wire form with `payload` appended.
    pub fn encode_with(&self, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(REQUEST_HEADER_LEN + self.reply_to.len() + payload.len());
        out.extend_from_slice(&[WRITE_VERSION, 0, 0, 0]);
        out.extend_from_slice(&self.request_id.to_le_bytes());
        out.extend_from_slice(&self.region_id.to_le_bytes());
        out.extend_from_slice(&self.capability);
        out.extend_from_slice(&self.address.to_le_bytes());
        out.extend_from_slice(&self.length.to_le_bytes());
        out.extend_from_slice(&(self.reply_to.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.reply_to);
        out.extend_from_slice(payload);
        out
    }

    /// Decodes an untrusted write message into its header and the bytes
    /// after it (the payload, of any length: the owner judges it); `None`
    /// for a malformed header.
    pub fn decode(bytes: &[u8]) -> Option<(WriteRequest, &[u8])> {
        if bytes.len() < REQUEST_HEADER_LEN || bytes.len() > WRITE_RECEIVE_MAX {
            return None;
        }
        if bytes[0] != WRITE_VERSION || bytes[1..4] != [0, 0, 0] {
            return None;
        }
        let u64_at = |at: usize| {
            let mut raw = [0u8; 8];
            raw.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(raw)
        };
        let request_id = u64_at(4);
        let length = u64_at(44);
        let reply_len = usize::from(u16::from_le_bytes([bytes[52], bytes[53]]));
        if request_id == 0 || request_id & !REQUEST_ID_MASK != 0 {
            return None;
        }
        if length == 0 || length > WRITE_CHUNK_MAX {
            return None;
        }
        let reply_end = REQUEST_HEADER_LEN + reply_len;
        if reply_len == 0 || reply_len > MAX_FABRIC_ADDRESS || bytes.len() < reply_end {
            return None;
        }
        let mut capability = [0u8; CAPABILITY_LEN];
        capability.copy_from_slice(&bytes[20..36]);
        Some((
            WriteRequest {
                request_id,
                region_id: u64_at(12),
                capability,
                address: u64_at(36),
                length,
                reply_to: bytes[REQUEST_HEADER_LEN..reply_end].to_vec(),
            },
            &bytes[reply_end..],
        ))
    }
}

/// Compares capabilities in time independent of where they differ.
pub fn capability_matches(a: &[u8; CAPABILITY_LEN], b: &[u8; CAPABILITY_LEN]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ReadRequest {
        ReadRequest {
            request_id: 42,
            region_id: 7,
            capability: [5; CAPABILITY_LEN],
            address: 0x1000,
            length: 64,
            reply_to: b"fi_shm://9\0".to_vec(),
        }
    }

    #[test]
    fn a_request_round_trips_and_every_cut_or_extension_is_refused() {
        let wire = sample().encode();
        assert_eq!(ReadRequest::decode(&wire), Some(sample()));
        for cut in 0..wire.len() {
            assert_eq!(ReadRequest::decode(&wire[..cut]), None, "cut at {cut}");
        }
        let mut longer = wire.clone();
        longer.push(0);
        assert_eq!(ReadRequest::decode(&longer), None);
    }

    fn list() -> ListRequest {
        ListRequest {
            request_id: 77,
            entries: (0..3)
                .map(|i| ListEntry {
                    region_id: 7 + i,
                    capability: [i as u8; CAPABILITY_LEN],
                    address: 0x1000 * (i + 1),
                    length: 8 << i,
                })
                .collect(),
            reply_to: b"fi_shm://9\0".to_vec(),
        }
    }

    #[test]
    fn a_list_round_trips_and_every_cut_or_extension_is_refused() {
        let wire = list().encode();
        assert_eq!(ListRequest::decode(&wire), Some(list()));
        for cut in 0..wire.len() {
            assert_eq!(ListRequest::decode(&wire[..cut]), None, "cut at {cut}");
        }
        let mut longer = wire.clone();
        longer.push(0);
        assert_eq!(ListRequest::decode(&longer), None);
        assert_eq!(ReadRequest::decode(&wire), None, "a list is no single read");
        assert_eq!(ListRequest::decode(&sample().encode()), None);
    }

    #[test]
    fn a_list_with_an_entry_too_long_or_a_total_too_large_is_refused() {
        let mut big = list();
        big.entries[1].length = GATHER_ENTRY_MAX + 1;
        assert_eq!(ListRequest::decode(&big.encode()), None);
        let mut empty = list();
        empty.entries[0].length = 0;
        assert_eq!(ListRequest::decode(&empty.encode()), None);
        let full = ListRequest {
            entries: vec![
                ListEntry {
                    length: GATHER_ENTRY_MAX,
                    ..list().entries[0].clone()
                };
                (GATHER_TOTAL_MAX / GATHER_ENTRY_MAX) as usize + 1
            ],
            ..list()
        };
        assert_eq!(ListRequest::decode(&full.encode()), None);
        let mut at_limit = full.clone();
        at_limit.entries.pop();
        assert_eq!(ListRequest::decode(&at_limit.encode()), Some(at_limit));
    }

    #[test]
    fn a_list_reply_is_used_only_when_its_lengths_add_up() {
        let lengths = [8u64, 16, 32];
        // Entry 1 refused (out of range): 3 statuses + 8 + 32 bytes.
        let mut reply = vec![0, refusal_code(Refusal::OutOfRange), 0];
        reply.extend(std::iter::repeat_n(0xAB, 40));
        let parsed = parse_gathered(&reply, &lengths).expect("adds up");
        assert_eq!(parsed, vec![Ok(3), Err(RdmaError::OutOfRange), Ok(11)]);
        for wrong in [reply.len() - 1, reply.len() + 1, 2, 0] {
            let mut bytes = reply.clone();
            bytes.resize(wrong, 0);
            assert_eq!(parse_gathered(&bytes, &lengths), None, "{wrong} bytes");
        }
        // A refusal claimed as served makes the lengths not add up.
        reply[1] = 0;
        assert_eq!(parse_gathered(&reply, &lengths), None);
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_decode_to_a_canonical_list_or_nothing(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..3000)
        ) {
            if let Some(list) = ListRequest::decode(&bytes) {
                proptest::prop_assert_eq!(list.encode(), bytes);
            }
        }

        #[test]
        fn a_list_reply_of_arbitrary_bytes_never_points_past_its_end(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
            lengths in proptest::collection::vec(1u64..64, 1..8),
        ) {
            if let Some(outcomes) = parse_gathered(&bytes, &lengths) {
                for (outcome, &length) in outcomes.iter().zip(&lengths) {
                    if let Ok(at) = outcome {
                        proptest::prop_assert!(at + length as usize <= bytes.len());
                    }
                }
            }
        }
    }

    fn write_sample() -> WriteRequest {
        WriteRequest {
            request_id: 43,
            region_id: 7,
            capability: [6; CAPABILITY_LEN],
            address: 0x2000,
            length: 5,
            reply_to: b"fi_shm://9\0".to_vec(),
        }
    }

    #[test]
    fn a_write_round_trips_with_its_payload_and_bad_headers_are_refused() {
        let wire = write_sample().encode_with(b"hello");
        let (header, payload) = WriteRequest::decode(&wire).expect("decodes");
        assert_eq!((header, payload), (write_sample(), &b"hello"[..]));
        let header_len = REQUEST_HEADER_LEN + write_sample().reply_to.len();
        for cut in 0..header_len {
            assert_eq!(WriteRequest::decode(&wire[..cut]), None, "cut at {cut}");
        }
        // A short payload decodes: the owner refuses it as malformed.
        assert_eq!(
            WriteRequest::decode(&wire[..header_len]).map(|w| w.1.len()),
            Some(0)
        );
        assert_eq!(ReadRequest::decode(&wire), None, "a write is no read");
        assert_eq!(
            WriteRequest::decode(&sample().encode()),
            None,
            "a read is no write"
        );
        for (id, length) in [(0, 5), (1 << 48, 5), (43, 0), (43, WRITE_CHUNK_MAX + 1)] {
            let wire = WriteRequest {
                request_id: id,
                length,
                ..write_sample()
            }
            .encode_with(b"hello");
            assert_eq!(
                WriteRequest::decode(&wire),
                None,
                "id {id:#x}, length {length}"
            );
        }
    }

    #[test]
    fn the_write_tag_is_no_other_tag() {
        for tag in [
            REQUEST_TAG,
            REFUSAL_BIT,
            NOTICE_TAG,
            REASON_MASK,
            REQUEST_ID_MASK,
        ] {
            assert_eq!(WRITE_TAG & tag, 0, "{tag:#x}");
        }
        assert_eq!(
            refusal_of_tag(refusal_tag(42, Refusal::AccessDenied)),
            Some(Refusal::AccessDenied)
        );
        assert_eq!(refusal_of_tag(42), None);
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_decode_to_a_canonical_write_or_nothing(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)
        ) {
            if let Some((header, payload)) = WriteRequest::decode(&bytes) {
                proptest::prop_assert_eq!(header.encode_with(payload), bytes);
            }
        }
    }

    #[test]
    fn a_probe_is_no_request() {
        assert_eq!(ReadRequest::decode(&PROBE), None);
        assert_ne!(PROBE[0], REQUEST_VERSION);
    }

    #[test]
    fn a_request_id_beyond_48_bits_or_zero_is_refused() {
        for id in [0, 1 << 48, REQUEST_TAG | 1] {
            let wire = ReadRequest {
                request_id: id,
                ..sample()
            }
            .encode();
            assert_eq!(ReadRequest::decode(&wire), None, "id {id:#x}");
        }
    }

    #[test]
    fn each_refusal_tag_maps_to_its_seam_error_and_a_plain_tag_to_ok() {
        assert_eq!(reply_outcome(42), Ok(()));
        assert_eq!(
            reply_outcome(refusal_tag(42, Refusal::OutOfRange)),
            Err(RdmaError::OutOfRange)
        );
        for refusal in [
            Refusal::RegionUnknown,
            Refusal::CapabilityMismatch,
            Refusal::Deregistering,
        ] {
            let tag = refusal_tag(42, refusal);
            assert_eq!(tag & REQUEST_ID_MASK, 42);
            assert_eq!(tag & !REPLY_IGNORE, 42, "the reply receive matches it");
            assert_eq!(reply_outcome(tag), Err(RdmaError::RegionNotFound));
        }
        assert!(matches!(
            reply_outcome(REFUSAL_BIT | (11 << 48) | 42),
            Err(RdmaError::Backend(text)) if text.contains("code 11")
        ));
    }

    #[test]
    fn every_refusal_with_a_code_survives_the_tag() {
        for refusal in [
            Refusal::RegionUnknown,
            Refusal::CapabilityMismatch,
            Refusal::OutOfRange,
            Refusal::Deregistering,
            Refusal::Busy,
            Refusal::Unverified,
            Refusal::NotTheRequester,
        ] {
            let tag = refusal_tag(42, refusal);
            assert_eq!(refusal_of_code(reason_of(tag)), refusal, "{refusal}");
            assert_eq!(reply_outcome(tag), Err(RdmaError::from(refusal)));
        }
        // The kit's refusals this format has no code for travel as an
        // unknown region, as they always did.
        assert_eq!(
            refusal_code(Refusal::Malformed),
            refusal_code(Refusal::RegionUnknown)
        );
    }

    #[test]
    fn an_unverified_refusal_is_code_six_and_told_apart_from_the_others() {
        let tag = refusal_tag(42, Refusal::Unverified);
        assert_eq!((tag & REASON_MASK) >> REASON_SHIFT, 6);
        assert!(is_unverified(tag));
        assert_eq!(tag & !REPLY_IGNORE, 42, "the reply receive matches it");
        for other in [
            42,
            refusal_tag(42, Refusal::Busy),
            refusal_tag(42, Refusal::NotTheRequester),
        ] {
            assert!(!is_unverified(other), "{other:#x}");
        }
        assert_eq!(reply_outcome(tag), Err(RdmaError::backend(UNVERIFIED_TEXT)));
        let tag = refusal_tag(42, Refusal::NotTheRequester);
        assert_eq!((tag & REASON_MASK) >> REASON_SHIFT, 7);
        assert_eq!(
            reply_outcome(tag),
            Err(RdmaError::backend(NOT_THE_REQUESTER_TEXT))
        );
    }

    #[test]
    fn a_busy_refusal_is_code_five_and_a_transient_error() {
        let tag = refusal_tag(42, Refusal::Busy);
        assert_eq!((tag & REASON_MASK) >> REASON_SHIFT, 5);
        assert_eq!(tag & !REPLY_IGNORE, 42, "the reply receive matches it");
        let err = reply_outcome(tag).unwrap_err();
        assert_eq!(err, RdmaError::backend(BUSY_TEXT));
        assert!(err.is_transient());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_decode_to_a_canonical_request_or_nothing(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)
        ) {
            if let Some(request) = ReadRequest::decode(&bytes) {
                proptest::prop_assert_eq!(request.encode(), bytes);
            }
        }
    }

    #[test]
    fn capabilities_match_only_when_every_byte_does() {
        let a = [3u8; CAPABILITY_LEN];
        let mut b = a;
        assert!(capability_matches(&a, &b));
        b[15] ^= 1;
        assert!(!capability_matches(&a, &b));
    }
}
