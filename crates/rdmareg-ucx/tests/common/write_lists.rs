//! What the write-list tests share: registrations of parts of a test
//! buffer as a writer knows them, write-list headers as a raw writer sends
//! them, the replies a raw peer received, and byte comparisons.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::ops::Range;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{
    Access, BackendPut, BackendRegion, PeerId, RdmaError, WrittenLog, WrittenRanges,
};
use rdmareg_engine::served::wire::{self, WRITE_REQUEST_ID_BIT};
use rdmareg_engine::served::{Refusal, Write};
use rdmareg_ucx::read_protocol::{
    READ_REPLY_AM_ID, ReadKey, ServedKey, WRITE_LIST_REPLY_AM_ID, WRITE_LIST_REQUEST_AM_ID,
    WRITE_REQUEST_AM_ID,
};
use rdmareg_ucx::{EngineAddress, UcxBackend, UcxEngine};
use ucx_sys as sys;

use super::PageBuf;
use super::raw_am::Raw;

/// A reply flag and eager, as owners send replies.
pub const EAGER_REPLY: u32 = sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_EAGER;
/// The deadline of the PUTs [`put_of`] makes.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// A registration of `[buf + offset, buf + offset + len)` at an owner.
#[derive(Debug, Clone)]
pub struct Part {
    pub id: u64,
    /// The served form of the owner's key: every write under it goes
    /// through the owner, on every transport.
    pub packed: Bytes,
    pub key: ServedKey,
    /// Offset of the part in its buffer.
    pub offset: usize,
    /// Its first byte, as an address in the owner's process.
    pub start: u64,
    pub len: usize,
}

impl Part {
    /// One past its last byte, as an address.
    pub fn end(&self) -> u64 {
        self.start + self.len as u64
    }

    /// A write list entry for `[at, at + length)` of this part (an offset
    /// into it) under write id `n`.
    pub fn write(&self, n: u64, at: u64, length: u64) -> Write {
        Write {
            request_id: WRITE_REQUEST_ID_BIT | n,
            region: self.key.region_id,
            capability: self.key.capability,
            address: self.start + at,
            length,
        }
    }
}

/// Maps part of `buf` on `backend` with `access` (`Access::Read` through
/// `map`, as an owner registers read-only memory).
pub async fn map_part(
    backend: &UcxBackend,
    buf: &PageBuf,
    offset: usize,
    len: usize,
    access: Access,
) -> Part {
    assert!(offset + len <= buf.len());
    let ptr = buf.addr() + offset;
    let region: BackendRegion = if access == Access::Read {
        // SAFETY: inside a `PageBuf` every caller keeps alive until the
        // registration's unmap answered `Ok` or the engine shut down, and
        // reads only by copying through its raw pointer.
        unsafe { backend.map(ptr, len) }.await
    } else {
        // SAFETY: as above.
        unsafe { backend.map_with_access(ptr, len, access) }.await
    }
    .expect("map succeeds");
    let key = ReadKey::decode(&region.packed_key)
        .expect("an engine key")
        .served();
    Part {
        id: region.backend_region_id,
        packed: Bytes::copy_from_slice(&key.encode()),
        key,
        offset,
        start: ptr as u64,
        len,
    }
}

/// The owner's serving worker address, as a raw UCX peer connects to it.
pub fn serving(engine: &UcxEngine) -> Bytes {
    EngineAddress::decode(&engine.worker_address())
        .expect("an engine address")
        .serving
}

/// A write list's header as the kit encodes it.
pub fn list_header(entries: &[Write]) -> Vec<u8> {
    wire::encode_write_list_request(entries).expect("a list within the format's bounds")
}

/// A list header of any count, with `entries` after it, as a hostile
/// writer could send it.
pub fn raw_list_header(count: u16, entries: &[Write]) -> Vec<u8> {
    let mut out = vec![1, 0, 0, 0];
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&[0, 0]);
    for write in entries {
        let one = list_header(std::slice::from_ref(write));
        out.extend_from_slice(&one[8..]);
    }
    out
}

/// The entries of one write list reply, as `(request id, outcome)`.
pub type ReplyEntries = Vec<(u64, Result<u64, Refusal>)>;

/// Every write list reply `raw` received, in order: its entries, or
/// `None` for a header that did not decode.
pub fn list_replies(raw: &Raw) -> Vec<Option<ReplyEntries>> {
    raw.messages(WRITE_LIST_REPLY_AM_ID)
        .iter()
        .map(|m| {
            wire::decode_list_reply(&m.header).ok().map(|entries| {
                entries
                    .into_iter()
                    .map(|reply| (reply.request_id, reply.outcome))
                    .collect()
            })
        })
        .collect()
}

/// Payload bytes that came with write list replies to `raw` (they carry
/// none).
pub fn list_reply_payload_bytes(raw: &Raw) -> usize {
    raw.messages(WRITE_LIST_REPLY_AM_ID)
        .iter()
        .map(|m| m.data.len() + m.rndv_len)
        .sum()
}

/// Where `got` and `want` differ, as `(first, last, count)`.
pub fn differences(got: &[u8], want: &[u8]) -> Option<(usize, usize, usize)> {
    assert_eq!(got.len(), want.len(), "compared buffers of unequal length");
    let mut found: Option<(usize, usize, usize)> = None;
    for (i, _) in got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (a, b))| a != b)
    {
        found = Some(match found {
            None => (i, i, 1),
            Some((first, _, count)) => (first, i, count + 1),
        });
    }
    found
}

/// What an owner's written log must list once exactly `ranges` (offsets
/// in a registration) were written, coalesced as the log coalesces.
pub fn listed(ranges: impl IntoIterator<Item = Range<u64>>) -> WrittenRanges {
    let mut log = WrittenLog::default();
    for range in ranges {
        log.record(range);
    }
    log.take()
}

/// A PUT of `len` bytes from `local_offset` of `src` under `key`.
pub fn put_of(
    peer: PeerId,
    src: &BackendRegion,
    local_offset: usize,
    remote_addr: u64,
    key: &Bytes,
    len: usize,
) -> BackendPut {
    BackendPut {
        peer,
        remote_addr,
        packed_key: key.clone(),
        local_region_id: src.backend_region_id,
        local_offset: local_offset as u64,
        len: len as u64,
        deadline: Some(DEADLINE),
    }
}

/// Posts `requests` as one batch on `backend`.
pub async fn put_batch(backend: &rdmareg_ucx::UcxBackend, requests: Vec<BackendPut>) -> Answers {
    // SAFETY: every caller's sources are `PageBuf`s mapped on `backend`
    // that it keeps alive until the batch answered; nothing writes them.
    unsafe { backend.put_batch(requests) }.await
}

/// A batch's answers.
pub type Answers = Vec<Result<(), RdmaError>>;

/// What a raw owner received as write lists: each one's entries, payload
/// and the endpoint to answer it on.
pub fn lists_received(raw: &Raw) -> Vec<(Vec<Write>, Vec<u8>, sys::ucp_ep_h)> {
    raw.messages(WRITE_LIST_REQUEST_AM_ID)
        .iter()
        .map(|m| {
            let entries =
                wire::decode_write_list_request(&m.header).expect("a well-formed write list");
            (entries, m.data.clone(), m.reply_ep)
        })
        .collect()
}

/// The entries of every write list a raw owner received.
pub fn entries_received(raw: &Raw) -> usize {
    lists_received(raw).iter().map(|(e, ..)| e.len()).sum()
}

/// Acknowledges every entry of every list and every single write `raw`
/// received, each with its length.
pub fn acknowledge_all(raw: &Raw) {
    for (entries, _, ep) in lists_received(raw) {
        let header =
            wire::encode_list_reply_fields(entries.iter().map(|w| (w.request_id, 0u8, w.length)))
                .expect("a reply within its bounds");
        raw.send_wait(ep, WRITE_LIST_REPLY_AM_ID, &header, &[], EAGER_REPLY);
    }
    let singles: Vec<(Write, sys::ucp_ep_h)> = raw
        .messages(WRITE_REQUEST_AM_ID)
        .iter()
        .map(|m| (wire::decode_write_request(&m.header).unwrap(), m.reply_ep))
        .collect();
    for (write, ep) in singles {
        let header = wire::encode_reply_fields(write.request_id, 0, write.length);
        raw.send_wait(ep, READ_REPLY_AM_ID, &header, &[], EAGER_REPLY);
    }
}

/// Waits (progressing `raw`) until `batch` answered, at most 10 s.
pub fn settle(
    rt: &tokio::runtime::Runtime,
    raw: &Raw,
    batch: tokio::task::JoinHandle<Answers>,
) -> Answers {
    let start = Instant::now();
    while !batch.is_finished() && start.elapsed() < Duration::from_secs(10) {
        raw.progress_for(Duration::from_millis(2));
    }
    assert!(batch.is_finished(), "the batch did not answer within 10 s");
    rt.block_on(batch).expect("the batch task")
}
