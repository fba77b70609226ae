//! One PUT from a writer engine to a raw owner, held until the raw owner
//! received every byte of it: what the tests of how PUTs are cut into
//! writes share (`write_chunks`, `chunked_put_attacks`).

#![allow(dead_code)] // Each test binary uses its own subset.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::BackendRegion;
use rdmareg_engine::served::{Write, wire};
use rdmareg_ucx::read_protocol::{READ_REPLY_AM_ID, ServedKey, WRITE_REQUEST_AM_ID};
use rdmareg_ucx::{UcxBackend, UcxConfig, UcxEngine};
use ucx_sys as sys;

use super::raw_am::Raw;
use super::write_lists::{Answers, EAGER_REPLY, put_batch, put_of, settle};
use super::{OWNER, PageBuf, init_tracing, map, pattern, runtime};

/// Where the PUT is aimed (a raw owner checks nothing).
pub const RAW_TARGET: u64 = 0x4000_0000;
/// The PUT's offset in its source: odd, so that no write starts on a page
/// by accident.
pub const SOURCE_OFFSET: usize = 5;
/// The region id and capability of [`raw_owner_key`].
pub const RAW_KEY: (u64, [u8; 16]) = (9, [0x99; 16]);

/// A served key a raw owner accepts (it checks nothing).
pub fn raw_owner_key() -> Bytes {
    Bytes::copy_from_slice(
        &ServedKey {
            region_id: RAW_KEY.0,
            capability: RAW_KEY.1,
        }
        .encode(),
    )
}

/// One write request as the raw owner received it.
pub struct ReceivedWrite {
    pub write: Write,
    pub payload: Vec<u8>,
    /// The endpoint to answer it on.
    pub endpoint: sys::ucp_ep_h,
}

/// A writer engine with one PUT in flight to a raw owner that has
/// received every byte of it and answered nothing yet.
pub struct RawPut {
    pub rt: tokio::runtime::Runtime,
    pub writer: UcxEngine,
    pub backend: Arc<UcxBackend>,
    pub raw: Raw,
    pub src: PageBuf,
    pub src_region: BackendRegion,
    batch: Option<tokio::task::JoinHandle<Answers>>,
    /// Every write received, in arrival order.
    pub received: Vec<ReceivedWrite>,
}

impl RawPut {
    /// A writer of `config` posts a PUT of `len` bytes (due in `deadline`,
    /// else the default of [`put_of`]); waits until the raw owner received
    /// all of it, and anything more the writer sent.
    pub fn start(config: UcxConfig, len: usize, deadline: Option<Duration>) -> RawPut {
        init_tracing();
        let rt = runtime();
        let writer = UcxEngine::start(config).expect("writer starts");
        let raw = Raw::new(false);
        writer.add_peer(OWNER, raw.address()).unwrap();
        let backend = writer.backend();
        let src = PageBuf::filled(len + SOURCE_OFFSET, pattern);
        let src_region = rt.block_on(map(&backend, &src));
        let mut put = put_of(
            OWNER,
            &src_region,
            SOURCE_OFFSET,
            RAW_TARGET,
            &raw_owner_key(),
            len,
        );
        if let Some(deadline) = deadline {
            put.deadline = Some(deadline);
        }
        let batch = rt.spawn({
            let backend = Arc::clone(&backend);
            async move { put_batch(&backend, vec![put]).await }
        });
        let received_bytes = |raw: &Raw| {
            raw.messages(WRITE_REQUEST_AM_ID)
                .iter()
                .map(|m| m.data.len())
                .sum::<usize>()
        };
        let all_in = raw.progress_until(Duration::from_secs(10), |raw| received_bytes(raw) >= len);
        raw.progress_for(Duration::from_millis(50));
        assert!(all_in, "the PUT's bytes did not all reach the raw owner");
        let received = raw
            .messages(WRITE_REQUEST_AM_ID)
            .iter()
            .map(|m| {
                let write = wire::decode_write_request(&m.header).expect("a write request");
                assert_eq!(write.length, m.data.len() as u64, "header and payload");
                ReceivedWrite {
                    write,
                    payload: m.data.clone(),
                    endpoint: m.reply_ep,
                }
            })
            .collect();
        RawPut {
            rt,
            writer,
            backend,
            raw,
            src,
            src_region,
            batch: Some(batch),
            received,
        }
    }

    /// Replies to write `index` with `status` and `length`, and `payload`.
    pub fn reply(&self, index: usize, status: u8, length: u64, payload: &[u8]) {
        let received = &self.received[index];
        let header = wire::encode_reply_fields(received.write.request_id, status, length);
        self.raw.send_wait(
            received.endpoint,
            READ_REPLY_AM_ID,
            &header,
            payload,
            EAGER_REPLY,
        );
    }

    /// Acknowledges write `index` as an honest owner would.
    pub fn acknowledge(&self, index: usize) {
        self.reply(index, 0, self.received[index].write.length, &[]);
    }

    /// The PUT's answers, once it answered (at most 10 s).
    pub fn answers(&mut self) -> Answers {
        let batch = self.batch.take().expect("answered once");
        settle(&self.rt, &self.raw, batch)
    }

    /// The PUT's source bytes.
    pub fn source(&self) -> Vec<u8> {
        self.src.snapshot()[SOURCE_OFFSET..].to_vec()
    }

    /// Unmaps the source, which must answer `Ok` within 5 s, and shuts the
    /// writer down clean.
    pub fn finish(self) {
        let unmap = self.backend.unmap(self.src_region.backend_region_id);
        let unmapped = self
            .rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(5), unmap).await });
        assert_eq!(
            unmapped,
            Ok(Ok(())),
            "the source's unmap after the PUT answered"
        );
        self.rt.block_on(self.writer.shutdown());
        assert_eq!(self.writer.live_registrations(), Some(0));
        drop(self.src);
    }
}
