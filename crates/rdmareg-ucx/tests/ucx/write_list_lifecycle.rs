//! Write lists and the lifetimes around them: an unmap of an owner's
//! target racing write lists into it, an unmap of the writer's source
//! while its lists wait for their reply, and a writer shut down with a
//! list in flight. No byte lands after a target's unmap answered, a source
//! stays held until its PUTs are answered, and every PUT of a list is
//! answered once, never `Ok` without the owner's acknowledgement.

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use common::raw_am::Raw;
use common::write_lists::*;
use common::write_races::{BatchRace, SENTINEL, UNMAP_BOUND, pause_for, until};
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{Access, BackendPut, BackendRegion, RdmaError};
use rdmareg_engine::served::wire;
use rdmareg_ucx::read_protocol::WRITE_LIST_REPLY_AM_ID;
use rdmareg_ucx::{Transport, UcxEngine};

const KIB: usize = 1024;

/// Batches of eight 1 KiB PUTs into a registration, each beside a PUT
/// under a key unmapped before any batch, posted in a loop over tcp (so
/// as write lists) while the registration is unmapped at varying points:
/// once the unmap answered, and the memory was set to a sentinel, no byte
/// of it changes, and every PUT under a stale key answers `RegionNotFound`
/// (`BatchRace`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmap_racing_write_lists_waits_for_them() {
    let (owner, writer) = served_engines(Transport::Tcp);
    let (ob, wb) = (owner.backend(), writer.backend());
    let src = PageBuf::filled(8 * KIB, pattern);
    let src_region = map(&wb, &src).await;
    let stale = PageBuf::zeroed(4 * KIB);
    let stale_part = map_part(&ob, &stale, 0, 4 * KIB, Access::Write).await;
    unmap_bounded_part(&ob, &stale_part).await;
    stale.fill(SENTINEL);
    for iteration in 0..24 {
        let live = PageBuf::zeroed(16 * KIB);
        let part = map_part(&ob, &live, 0, 16 * KIB, Access::Write).await;
        let mut requests = Vec::new();
        for i in 0..8 {
            requests.push(put_of(
                OWNER,
                &src_region,
                i * KIB,
                part.start + (i * 2 * KIB) as u64,
                &part.packed,
                KIB,
            ));
            requests.push(put_of(
                OWNER,
                &src_region,
                0,
                stale_part.start + (i * 256) as u64,
                &stale_part.packed,
                256,
            ));
        }
        // SAFETY: the sources are `src`, alive until the race stopped.
        let race = unsafe { BatchRace::start(&wb, requests) };
        until(|| race.batches() >= 1, "a first batch").await;
        pause_for(iteration).await;
        unmap_bounded_part(&ob, &part).await;
        live.fill(SENTINEL);
        race.wait_for(3, "batches after the unmap").await;
        race.stop().await;
        assert_untouched(&live, &format!("iteration {iteration}"));
        assert_untouched(&stale, "a registration unmapped before every batch");
    }
    assert_eq!(wb.unmap(src_region.backend_region_id).await, Ok(()));
    writer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(owner.live_registrations(), Some(0));
    assert_eq!(writer.live_registrations(), Some(0));
}

/// Unmaps `part` on `owner`, which must answer within the unmap bound.
async fn unmap_bounded_part(owner: &rdmareg_ucx::UcxBackend, part: &Part) {
    let answered = tokio::time::timeout(UNMAP_BOUND, owner.unmap(part.id))
        .await
        .expect("an unmap with no stopped writer answers");
    assert_eq!(answered, Ok(()));
}

/// Fails the test if a byte of `buf` is not the sentinel.
fn assert_untouched(buf: &PageBuf, what: &str) {
    let snapshot = buf.snapshot();
    if let Some(at) = snapshot.iter().position(|&b| b != SENTINEL) {
        panic!("{what}: written after the unmap answered, first at offset {at}");
    }
}

/// A writer whose [`OWNER`] is a raw peer, and a batch of `count` PUTs of
/// 1 KiB to it posted; returns once the raw owner holds its write list.
struct RawOwnerBatch {
    rt: tokio::runtime::Runtime,
    writer: UcxEngine,
    raw: Raw,
    src: PageBuf,
    src_region: BackendRegion,
    batch: tokio::task::JoinHandle<Answers>,
}

impl RawOwnerBatch {
    fn new(count: usize) -> RawOwnerBatch {
        init_tracing();
        let rt = runtime();
        let writer = tcp_engine();
        let raw = Raw::new(false);
        writer.add_peer(OWNER, raw.address()).unwrap();
        let backend = writer.backend();
        let src = PageBuf::filled(count * KIB, pattern);
        let src_region = rt.block_on(map(&backend, &src));
        let key = Bytes::copy_from_slice(
            &rdmareg_ucx::read_protocol::ServedKey {
                region_id: 3,
                capability: [0x33; 16],
            }
            .encode(),
        );
        let requests: Vec<BackendPut> = (0..count)
            .map(|i| {
                put_of(
                    OWNER,
                    &src_region,
                    i * KIB,
                    0x20_0000 + (i * KIB) as u64,
                    &key,
                    KIB,
                )
            })
            .collect();
        let batch = rt.spawn(async move { put_batch(&backend, requests).await });
        assert!(
            raw.progress_until(Duration::from_secs(10), |raw| entries_received(raw)
                >= count),
            "the write list did not reach the raw owner"
        );
        RawOwnerBatch {
            rt,
            writer,
            raw,
            src,
            src_region,
            batch,
        }
    }
}

/// The writer's source region stays held while a write list from it is
/// unanswered: its unmap, asked while the raw owner sits on the list,
/// does not answer; once the owner acknowledges the list, every PUT
/// answers `Ok` and the unmap answers `Ok`.
#[test]
fn a_sources_unmap_waits_for_its_write_lists() {
    let RawOwnerBatch {
        rt,
        writer,
        raw,
        src,
        src_region,
        batch,
    } = RawOwnerBatch::new(8);
    let backend = writer.backend();
    let unmap = rt.spawn(async move { backend.unmap(src_region.backend_region_id).await });
    raw.progress_for(Duration::from_millis(300));
    let early = (unmap.is_finished(), batch.is_finished());
    acknowledge_all(&raw);
    let answers = settle(&rt, &raw, batch);
    let unmapped = rt.block_on(async { tokio::time::timeout(DEADLINE, unmap).await });
    rt.block_on(writer.shutdown());
    drop(raw);
    drop(src);
    assert_eq!(
        early,
        (false, false),
        "(unmap, batch) answered before the owner did"
    );
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    assert!(matches!(unmapped, Ok(Ok(Ok(())))), "{unmapped:?}");
    assert_eq!(writer.live_registrations(), Some(0));
}

/// A writer shut down while the raw owner sits on a write list of 16
/// PUTs, 8 of them acknowledged just before: the batch answers once,
/// every PUT never acknowledged `ShuttingDown` (never `Ok`), an
/// acknowledged one `Ok` or `ShuttingDown`.
#[test]
fn a_writer_shutting_down_answers_each_listed_put_once() {
    let RawOwnerBatch {
        rt,
        writer,
        raw,
        src,
        src_region: _,
        batch,
    } = RawOwnerBatch::new(16);
    let lists = lists_received(&raw);
    let (entries, _, ep) = &lists[0];
    let half =
        wire::encode_list_reply_fields(entries[..8].iter().map(|w| (w.request_id, 0u8, w.length)))
            .unwrap();
    raw.send_wait(*ep, WRITE_LIST_REPLY_AM_ID, &half, &[], EAGER_REPLY);
    raw.progress_for(Duration::from_millis(20));
    let shutdown = rt.spawn(async move {
        writer.shutdown().await;
        writer
    });
    // (No acknowledgement after this: UCX frees the raw owner's reply
    // endpoint once the writer's side closed.)
    let answers = settle(&rt, &raw, batch);
    let writer = rt.block_on(shutdown).expect("the shutdown task");
    drop(raw);
    drop(src);
    assert_eq!(answers.len(), 16);
    for (i, answer) in answers.iter().enumerate() {
        if i < 8 {
            assert!(
                matches!(answer, Ok(()) | Err(RdmaError::ShuttingDown)),
                "PUT {i}: {answer:?}"
            );
        } else {
            assert_eq!(*answer, Err(RdmaError::ShuttingDown), "PUT {i}");
        }
    }
    assert_eq!(writer.live_registrations(), Some(0));
}
