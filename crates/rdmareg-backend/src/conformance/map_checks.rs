//! Checks of `map`: cancellation at every await point (contract point 1),
//! degenerate inputs (contract point 6) and page-enclosing effective ranges
//! (contract point 7).

use std::time::Duration;

use rdmareg_core::RdmaError;

use super::BackendPair;
use super::buffer::{KitBuffer, Mapped};
use super::support::{
    FILL, assert_live_now, kit_map, live, plus, poll_then_drop, settle_live_and_hold,
};
use crate::RdmaBackend;
use crate::page_size;

/// Most polls the cancellation check gives one map before dropping it.
const MAX_CANCEL_POLLS: usize = 64;
/// Pause between hand polls, so work running elsewhere (a progress thread, a
/// timer) moves on between them and cancellation comes at different stages.
const POLL_GAP: Duration = Duration::from_micros(200);

/// Contract point 1: a map dropped after 0, 1, 2, … polls leaves no
/// registration behind once its rollback settled, on both instances. Stops
/// when a map completes on its own (that region is then unmapped normally).
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn cancelled_map_leaves_no_registration(pair: &BackendPair) {
    for backend in [&*pair.owner, &*pair.consumer] {
        cancel_maps_at_every_await(backend, pair.capabilities.rollback_within).await;
    }
}

async fn cancel_maps_at_every_await(backend: &dyn RdmaBackend, rollback_within: Duration) {
    let baseline = live(backend);
    for polls in 0..=MAX_CANCEL_POLLS {
        let mut buf = KitBuffer::filled(8192 + 3, |_| FILL);
        buf.mark_registered();
        let map = kit_map(backend, buf.addr(), buf.len());
        let outcome = poll_then_drop(map, polls, POLL_GAP).await;
        match outcome {
            Some(Ok(region)) => {
                assert_live_now(backend, plus(baseline, 1), "after a completed map");
                Mapped { buf, region }.release(backend).await;
                assert_live_now(backend, baseline, "after unmapping the completed map");
                return;
            }
            Some(Err(e)) => panic!("map of a valid buffer failed after {polls} polls: {e}"),
            None => {
                let what = format!("after a map dropped at poll {polls}");
                if settle_live_and_hold(backend, baseline, rollback_within, &what).await {
                    buf.mark_unregistered();
                }
            }
        }
    }
    // Never done within the poll budget by hand: it must still work awaited.
    let mapped = Mapped::filled(backend, 4096, |_| FILL).await;
    assert_live_now(backend, plus(baseline, 1), "after an awaited map");
    mapped.release(backend).await;
    assert_live_now(backend, baseline, "after unmapping the awaited map");
}

/// How many maps [`cancelled_maps_stay_within_the_memory_the_caller_holds`]
/// drops before it waits for their rollbacks.
const CANCELLED_BATCH: usize = 8;

/// Contract point 1, from the side of a caller that frees memory: maps
/// dropped after 0, 1, 2, … polls, their rollbacks all outstanding at once
/// (a backend may roll back later, through an unmap of its own). At every
/// sample the backend's live count stays within the model — the baseline,
/// plus the maps that completed, plus the cancelled maps whose memory the
/// caller still holds — and the caller frees that memory only once the count
/// shows every rollback done and holds still. After the free the count must
/// not move: a registration appearing then would pin freed memory.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn cancelled_maps_stay_within_the_memory_the_caller_holds(pair: &BackendPair) {
    for backend in [&*pair.owner, &*pair.consumer] {
        let Some(baseline) = live(backend) else {
            // Without a count there is no evidence to free on: leak.
            return;
        };
        let mut held = Vec::new();
        let mut completed = Vec::new();
        for polls in 0..CANCELLED_BATCH {
            let mut buf = KitBuffer::filled(8192 + 3, |_| FILL);
            buf.mark_registered();
            let map = kit_map(backend, buf.addr(), buf.len());
            match poll_then_drop(map, polls, POLL_GAP).await {
                Some(Ok(region)) => completed.push(Mapped { buf, region }),
                Some(Err(e)) => panic!("map of a valid buffer failed after {polls} polls: {e}"),
                None => held.push(buf),
            }
        }
        let settled = baseline + completed.len();
        let within = pair.capabilities.rollback_within;
        let start = std::time::Instant::now();
        loop {
            let now = live(backend).unwrap_or(usize::MAX);
            assert!(
                now <= settled + held.len(),
                "live registrations {now} exceed the model: {baseline} before, {} completed, {} cancelled maps' memory held",
                completed.len(),
                held.len()
            );
            if now == settled {
                break;
            }
            assert!(
                start.elapsed() < within,
                "cancelled maps not rolled back after {within:?}: {now} live, {settled} expected"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let what = "after a batch of cancelled maps";
        if !settle_live_and_hold(backend, Some(settled), within, what).await {
            return;
        }
        // The caller frees; nothing may register that memory from now on.
        for mut buf in held {
            buf.mark_unregistered();
        }
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_millis(1)).await;
            assert_live_now(
                backend,
                Some(settled),
                "after the caller freed cancelled maps' memory",
            );
        }
        for mapped in completed {
            mapped.release(backend).await;
        }
        assert_live_now(
            backend,
            Some(baseline),
            "after unmapping the completed maps",
        );
    }
}

/// Contract point 6: a null pointer, a zero length and a range that overflows
/// the address space are each refused with `OutOfRange`, and register nothing.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn degenerate_map_is_out_of_range(pair: &BackendPair) {
    for backend in [&*pair.owner, &*pair.consumer] {
        let baseline = live(backend);
        let mut buf = KitBuffer::filled(64, |_| FILL);
        buf.mark_registered();
        let cases = [
            ("null pointer", 0, 64),
            ("zero length", buf.addr(), 0),
            (
                "range past the end of the address space",
                usize::MAX - 15,
                64,
            ),
            ("one byte past the end of the address space", usize::MAX, 2),
        ];
        for (what, ptr, len) in cases {
            let outcome = kit_map(backend, ptr, len)
                .await
                .map(|region| region.backend_region_id);
            assert_eq!(outcome, Err(RdmaError::OutOfRange), "map with {what}");
            assert_live_now(backend, baseline, &format!("after a map with {what}"));
        }
        buf.mark_unregistered();
    }
}

/// Contract point 7: the effective range of a map is page-aligned and covers
/// every page the mapped bytes touch — for one byte at the end of a page, two
/// bytes straddling a page boundary, and a range of several pages starting
/// one byte into a page.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn effective_range_is_page_enclosing(pair: &BackendPair) {
    let page = page_size();
    let page_len = usize::try_from(page).expect("the page size fits usize");
    for backend in [&*pair.owner, &*pair.consumer] {
        let baseline = live(backend);
        let mut buf = KitBuffer::filled(4 * page_len, |_| FILL);
        buf.mark_registered();
        // The first page boundary inside the buffer; three pages follow it.
        let boundary = (buf.addr() + page_len - 1) & !(page_len - 1);
        let cases = [
            ("one byte at the end of a page", boundary + page_len - 1, 1),
            (
                "two bytes straddling a page boundary",
                boundary + page_len - 1,
                2,
            ),
            (
                "two pages from one byte into a page",
                boundary + 1,
                2 * page_len,
            ),
            ("one whole page", boundary, page_len),
        ];
        for (what, ptr, len) in cases {
            let region = match kit_map(backend, ptr, len).await {
                Ok(region) => region,
                Err(e) => panic!("map of {what} failed: {e}"),
            };
            let (first, end) = (ptr as u64 & !(page - 1), (ptr + len) as u64);
            let covered = region.effective_addr.checked_add(region.effective_len);
            let enclosing = region.effective_addr % page == 0
                && region.effective_len % page == 0
                && region.effective_addr <= first
                && covered.is_some_and(|covered| covered >= end.next_multiple_of(page));
            let id = region.backend_region_id;
            if let Err(e) = backend.unmap(id).await {
                panic!("unmap of live region {id} ({what}) failed: {e}");
            }
            assert!(
                enclosing,
                "map of {what} ({len} B at {ptr:#x}, page {page}) reported the effective range \
                 {:#x} + {} B, which is not the page-aligned cover of its pages",
                region.effective_addr, region.effective_len
            );
        }
        assert_live_now(backend, baseline, "after the page-enclosing checks");
        buf.mark_unregistered();
    }
}
