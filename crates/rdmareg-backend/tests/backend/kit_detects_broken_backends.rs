//! The conformance kit has teeth: each check below fails against a backend
//! with one deliberate contract violation (a wrapper around the loopback
//! backend), while the honest loopback backend passes the same check.
//!
//! The flaws are chosen so that a broken backend never makes the kit free
//! memory a transfer could still write: a check that fails leaks its buffers.

use std::collections::{HashMap, HashSet};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use parking_lot::Mutex;
use rdmareg_backend::BackendLease;
use rdmareg_backend::conformance::{self, BackendPair, Capabilities};
use rdmareg_backend::loopback::{FaultOp, LoopbackBackend, LoopbackFabric};
use rdmareg_backend::{
    Access, BackendGet, BackendPut, BackendRegion, PeerId, RdmaBackend, RdmaError,
};
use rdmareg_core::{LeaseEnd, LeaseTerms, Notice, NoticeSender, WrittenLog, WrittenRanges};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flaw {
    /// Registers, then awaits once more before answering: dropping it there
    /// strands the registration.
    KeepsCancelledMaps,
    /// Reports zero registrations whatever it holds.
    CountsNothing,
    /// Answers `RegionNotFound` to an unmap of an id it never minted.
    RefusesUnknownUnmaps,
    /// Answers every GET failure as a generic backend error.
    FlattensGetErrors,
    /// Answers `Ok(())` to an unmap without unmapping anything.
    UnmapLiesAndKeepsTheRegion,
    /// Reports the mapped bytes, unrounded, as the effective range (what
    /// `ucp_mem_query` answers).
    ReportsUnroundedRanges,
    /// Answers `Timeout` at once and lets the transfer write the destination
    /// afterwards (what answering a deadline before UCX released the request
    /// did).
    AnswersBeforeTheTransferEnds,
    /// Answers a batch with its first failure for every entry (one bad entry
    /// fails the batch).
    FailsWholeBatches,
    /// Answers a batch in completion order instead of request order.
    ReordersBatchAnswers,
    /// Answers a batch `Ok` at once and lets its transfers run on.
    AnswersBatchesBeforeTheyEnd,
    /// Answers `ShuttingDown` to every unmap once torn down, released ids
    /// included.
    RefusesUnmapsAfterTeardown,
    /// Sends a GET's notice whether or not the read succeeded.
    SendsNoticesOfFailedReads,
    /// Sends every notice twice.
    SendsNoticesTwice,
    /// Makes every lease last an hour, whatever expiry it was asked for.
    ServesLeasesPastTheirExpiry,
    /// Makes every lease a one-reader lease: the first release ends it.
    EndsLeasesAtTheFirstRelease,
    /// Reports every lease released as soon as it is made.
    ReportsLeasesReleasedAtOnce,
    /// Maps every registration read-write, whatever access was asked for.
    MapsEverythingWritable,
    /// Answers every put failure as a generic backend error.
    FlattensPutErrors,
    /// Lists one range from the first written byte to the last, gaps
    /// included.
    JoinsWrittenRangesAcrossGaps,
    /// Lists every range ever written: a take does not empty the log.
    KeepsWrittenRangesAfterATake,
}

struct Flawed {
    inner: Arc<LoopbackBackend>,
    flaw: Flaw,
    minted: Mutex<HashSet<u64>>,
    /// Set by the pair's teardown.
    torn_down: Arc<AtomicBool>,
    /// Every range taken so far, per region
    /// ([`Flaw::KeepsWrittenRangesAfterATake`]).
    kept: Mutex<HashMap<u64, WrittenLog>>,
}

// SAFETY: not kept, on purpose: `Flawed` breaks the contract to show the
// kit notices. It is handed only to the kit, whose memory (`KitBuffer`s,
// reached through raw pointers and leaked whenever a release is in doubt)
// is never referenced by Rust while a backend may write it.
unsafe impl RdmaBackend for Flawed {
    fn key(&self) -> &str {
        self.inner.key()
    }

    unsafe fn map(
        &self,
        ptr: usize,
        len: usize,
    ) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
        Box::pin(async move {
            let region = if self.flaw == Flaw::MapsEverythingWritable {
                // SAFETY: not kept, on purpose (see the impl's note): the
                // kit's buffers are reached only through raw pointers, so
                // writes nobody allowed land in memory nothing aliases.
                unsafe { self.inner.map_with_access(ptr, len, Access::ReadWrite) }.await?
            } else {
                // SAFETY: forwards the promise this method's own caller gave.
                unsafe { self.inner.map(ptr, len) }.await?
            };
            self.minted.lock().insert(region.backend_region_id);
            match self.flaw {
                Flaw::KeepsCancelledMaps => tokio::time::sleep(Duration::from_millis(1)).await,
                Flaw::ReportsUnroundedRanges => {
                    return Ok(BackendRegion {
                        effective_addr: ptr as u64,
                        effective_len: len as u64,
                        ..region
                    });
                }
                _ => {}
            }
            Ok(region)
        })
    }

    unsafe fn map_with_access(
        &self,
        ptr: usize,
        len: usize,
        access: Access,
    ) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
        let access = match self.flaw {
            Flaw::MapsEverythingWritable => Access::ReadWrite,
            _ => access,
        };
        Box::pin(async move {
            // SAFETY: forwards the promise this method's own caller gave,
            // or (for the flaw) as in `map`.
            let region = unsafe { self.inner.map_with_access(ptr, len, access) }.await?;
            self.minted.lock().insert(region.backend_region_id);
            Ok(region)
        })
    }

    unsafe fn put(&self, request: BackendPut) -> BoxFuture<'_, Result<(), RdmaError>> {
        Box::pin(async move {
            // SAFETY: forwards the promise this method's own caller gave.
            let answer = unsafe { self.inner.put(request) }.await;
            match (self.flaw, answer) {
                (Flaw::FlattensPutErrors, Err(e)) => Err(RdmaError::backend(e.to_string())),
                (_, answer) => answer,
            }
        })
    }

    fn unmap(&self, id: u64) -> BoxFuture<'_, Result<(), RdmaError>> {
        Box::pin(async move {
            match self.flaw {
                Flaw::RefusesUnknownUnmaps if !self.minted.lock().contains(&id) => {
                    Err(RdmaError::RegionNotFound)
                }
                Flaw::UnmapLiesAndKeepsTheRegion => Ok(()),
                Flaw::RefusesUnmapsAfterTeardown if self.torn_down.load(Ordering::SeqCst) => {
                    Err(RdmaError::ShuttingDown)
                }
                _ => self.inner.unmap(id).await,
            }
        })
    }

    unsafe fn get(&self, request: BackendGet) -> BoxFuture<'_, Result<(), RdmaError>> {
        Box::pin(async move {
            if self.flaw == Flaw::AnswersBeforeTheTransferEnds {
                let inner = Arc::clone(&self.inner);
                let transfer = BackendGet {
                    deadline: None,
                    ..request
                };
                // The copy starts a little after the answer, as a transfer
                // still streaming would land: without the pause the spawned
                // copy could finish before the check rewrites the
                // destination, and the flaw would go unseen by chance.
                tokio::spawn(async move {
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    // SAFETY: kept only as far as the kit's memory allows: this flaw
                    // lets the copy outlive the answer, and the kit's destinations are
                    // reached only through raw pointers and leaked when in doubt (see
                    // the impl's note), so the late write lands in memory nothing aliases.
                    unsafe { inner.get(transfer) }.await
                });
                return Err(RdmaError::Timeout);
            }
            // SAFETY: forwards the promise this method's own caller gave.
            let answer = unsafe { self.inner.get(request) }.await;
            match self.flaw {
                Flaw::FlattensGetErrors => answer.map_err(|_| RdmaError::backend("failed")),
                _ => answer,
            }
        })
    }

    unsafe fn get_batch(
        &self,
        requests: Vec<BackendGet>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        Box::pin(async move {
            let n = requests.len();
            match self.flaw {
                Flaw::FailsWholeBatches => {
                    // SAFETY: forwards the promise this method's own caller gave.
                    let answers = unsafe { self.inner.get_batch(requests) }.await;
                    match answers.iter().find_map(|a| a.clone().err()) {
                        Some(first) => vec![Err(first); n],
                        None => answers,
                    }
                }
                Flaw::ReordersBatchAnswers => {
                    // SAFETY: forwards the promise this method's own caller gave.
                    let mut answers = unsafe { self.inner.get_batch(requests) }.await;
                    answers.sort_by_key(|a| a.is_ok());
                    answers
                }
                Flaw::AnswersBatchesBeforeTheyEnd => {
                    let inner = Arc::clone(&self.inner);
                    // As for a single GET: the copies start a little after
                    // the answer, or under load they could finish before
                    // the check looks and the flaw would go unseen.
                    tokio::spawn(async move {
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                        // SAFETY: kept only as far as the kit's memory allows: this flaw
                        // lets the copy outlive the answer, and the kit's destinations are
                        // reached only through raw pointers and leaked when in doubt (see
                        // the impl's note), so the late write lands in memory nothing aliases.
                        unsafe { inner.get_batch(requests) }.await
                    });
                    vec![Ok(()); n]
                }
                // SAFETY: forwards the promise this method's own caller gave.
                _ => unsafe { self.inner.get_batch(requests) }.await,
            }
        })
    }

    unsafe fn get_with_notice(
        &self,
        request: BackendGet,
        notice: Bytes,
    ) -> BoxFuture<'_, Result<(), RdmaError>> {
        if self.flaw != Flaw::SendsNoticesOfFailedReads {
            // SAFETY: forwards the promise this method's own caller gave.
            return unsafe { self.inner.get_with_notice(request, notice) };
        }
        Box::pin(async move {
            let peer = request.peer;
            // SAFETY: forwards the promise this method's own caller gave.
            let read = unsafe { self.inner.get(request) }.await;
            let _ = self.inner.send_notice(peer, notice).await;
            read
        })
    }

    fn send_notice(&self, peer: PeerId, notice: Bytes) -> BoxFuture<'_, Result<(), RdmaError>> {
        Box::pin(async move {
            if self.flaw == Flaw::SendsNoticesTwice {
                self.inner.send_notice(peer, notice.clone()).await?;
            }
            self.inner.send_notice(peer, notice).await
        })
    }

    fn notices(&self) -> Result<BoxStream<'static, Notice>, RdmaError> {
        self.inner.notices()
    }

    fn notice_sender(&self) -> Option<NoticeSender> {
        self.inner.notice_sender()
    }

    fn lease(
        &self,
        backend_region_id: u64,
        mut terms: LeaseTerms,
    ) -> BoxFuture<'_, Result<BackendLease, RdmaError>> {
        Box::pin(async move {
            terms.check(Instant::now())?;
            match self.flaw {
                Flaw::ServesLeasesPastTheirExpiry => {
                    terms.expires_at = Instant::now() + Duration::from_secs(3600);
                }
                Flaw::EndsLeasesAtTheFirstRelease => terms.readers = 1,
                _ => {}
            }
            let mut lease = self.inner.lease(backend_region_id, terms).await?;
            if self.flaw == Flaw::ReportsLeasesReleasedAtOnce {
                lease.released = Box::pin(async { LeaseEnd::Released });
            }
            Ok(lease)
        })
    }

    fn release_lease(
        &self,
        peer: PeerId,
        packed_key: Bytes,
    ) -> BoxFuture<'_, Result<(), RdmaError>> {
        self.inner.release_lease(peer, packed_key)
    }

    fn transfers_in_flight(&self, backend_region_id: u64) -> Option<usize> {
        self.inner.transfers_in_flight(backend_region_id)
    }

    fn take_written(
        &self,
        backend_region_id: u64,
    ) -> BoxFuture<'_, Result<WrittenRanges, RdmaError>> {
        Box::pin(async move {
            let mut taken = self.inner.take_written(backend_region_id).await?;
            match self.flaw {
                Flaw::JoinsWrittenRangesAcrossGaps => {
                    if let (Some(first), Some(last)) = (taken.ranges.first(), taken.ranges.last()) {
                        taken.ranges = std::iter::once(first.start..last.end).collect();
                    }
                }
                Flaw::KeepsWrittenRangesAfterATake => {
                    let mut kept = self.kept.lock();
                    let log = kept.entry(backend_region_id).or_default();
                    for range in taken.ranges {
                        log.record(range);
                    }
                    taken = log.clone().take();
                }
                _ => {}
            }
            Ok(taken)
        })
    }

    fn live_registrations(&self) -> Option<usize> {
        match self.flaw {
            Flaw::CountsNothing => Some(0),
            _ => self.inner.live_registrations(),
        }
    }
}

fn flawed_pair(flaw: Option<Flaw>) -> BackendPair {
    let fabric = LoopbackFabric::new();
    let (owner, consumer) = (fabric.backend(PeerId(1)), fabric.backend(PeerId(2)));
    // GETs stay in flight long enough for the in-flight checks to race them.
    consumer
        .faults()
        .set_delay(FaultOp::Get, Duration::from_millis(2));
    let torn_down = Arc::new(AtomicBool::new(false));
    let wrap = |inner: Arc<LoopbackBackend>| -> Arc<dyn RdmaBackend> {
        match flaw {
            Some(flaw) => Arc::new(Flawed {
                inner,
                flaw,
                minted: Mutex::new(HashSet::new()),
                torn_down: Arc::clone(&torn_down),
                kept: Mutex::new(HashMap::new()),
            }),
            None => inner,
        }
    };
    let (o, c, down) = (
        Arc::clone(&owner),
        Arc::clone(&consumer),
        Arc::clone(&torn_down),
    );
    let teardown = async move {
        c.shutdown().await;
        o.shutdown().await;
        down.store(true, Ordering::SeqCst);
    };
    // The loopback backend rolls back synchronously; a short bound keeps the
    // failing runs quick.
    let capabilities = Capabilities::full().with_rollback_within(Duration::from_millis(100));
    let (owner, consumer) = (wrap(owner), wrap(consumer));
    BackendPair::new(owner, consumer, PeerId(1))
        .with_capabilities(capabilities)
        .with_teardown(teardown)
}

#[test]
fn after_teardown_check_catches_a_backend_that_refuses_unmaps_once_torn_down() {
    assert_only_the_flawed_backend_fails(Flaw::RefusesUnmapsAfterTeardown, |p| {
        Box::pin(conformance::unmap_after_teardown_returns_ok_for_released_ids(p))
    });
}

/// Run one check on a pair with `flaw` (or an honest pair) and say whether it
/// passed.
fn check_passes<F>(flaw: Option<Flaw>, check: F) -> bool
where
    F: for<'a> Fn(&'a BackendPair) -> BoxFuture<'a, ()>,
{
    catch_unwind(AssertUnwindSafe(|| {
        conformance::block_on(async {
            let pair = flawed_pair(flaw);
            check(&pair).await;
        })
    }))
    .is_ok()
}

fn assert_only_the_flawed_backend_fails<F>(flaw: Flaw, check: F)
where
    F: for<'a> Fn(&'a BackendPair) -> BoxFuture<'a, ()>,
{
    assert!(
        check_passes(None, &check),
        "the honest loopback backend failed the check"
    );
    assert!(
        !check_passes(Some(flaw), &check),
        "the check missed {flaw:?}"
    );
}

#[test]
fn cancelled_map_check_catches_a_map_that_strands_its_registration() {
    assert_only_the_flawed_backend_fails(Flaw::KeepsCancelledMaps, |p| {
        Box::pin(conformance::cancelled_map_leaves_no_registration(p))
    });
}

#[test]
fn cancelled_batch_check_catches_a_map_that_strands_its_registration() {
    assert_only_the_flawed_backend_fails(Flaw::KeepsCancelledMaps, |p| {
        Box::pin(conformance::cancelled_maps_stay_within_the_memory_the_caller_holds(p))
    });
}

#[test]
fn page_enclosing_check_catches_a_backend_that_reports_unrounded_ranges() {
    assert_only_the_flawed_backend_fails(Flaw::ReportsUnroundedRanges, |p| {
        Box::pin(conformance::effective_range_is_page_enclosing(p))
    });
}

#[test]
fn late_write_check_catches_a_backend_that_answers_before_the_transfer_ends() {
    assert_only_the_flawed_backend_fails(Flaw::AnswersBeforeTheTransferEnds, |p| {
        Box::pin(conformance::no_byte_is_written_after_a_get_completes(p))
    });
}

#[test]
fn live_count_check_catches_a_backend_that_miscounts() {
    assert_only_the_flawed_backend_fails(Flaw::CountsNothing, |p| {
        Box::pin(conformance::ok_unmap_decrements_the_live_count(p))
    });
}

#[test]
fn idempotence_check_catches_an_unmap_that_refuses_unknown_ids() {
    assert_only_the_flawed_backend_fails(Flaw::RefusesUnknownUnmaps, |p| {
        Box::pin(conformance::unmap_of_a_never_mapped_id_returns_ok(p))
    });
}

#[test]
fn key_check_catches_a_backend_that_flattens_its_errors() {
    assert_only_the_flawed_backend_fails(Flaw::FlattensGetErrors, |p| {
        Box::pin(conformance::malformed_keys_are_invalid_key(p))
    });
}

#[test]
fn bounds_check_catches_a_backend_that_flattens_its_errors() {
    assert_only_the_flawed_backend_fails(Flaw::FlattensGetErrors, |p| {
        Box::pin(conformance::get_outside_the_local_mapping_is_out_of_range(
            p,
        ))
    });
}

#[test]
fn in_flight_check_catches_an_unmap_that_answers_ok_without_unmapping() {
    assert_only_the_flawed_backend_fails(Flaw::UnmapLiesAndKeepsTheRegion, |p| {
        Box::pin(
            conformance::unmapping_destination_refuses_new_gets_and_waits_for_the_one_in_flight(p),
        )
    });
}

#[test]
fn model_based_test_catches_an_unmap_that_answers_ok_without_unmapping() {
    let run = |flaw| {
        catch_unwind(AssertUnwindSafe(|| {
            conformance::model_based(move || async move { flawed_pair(flaw) }, 16)
        }))
        .is_ok()
    };
    assert!(run(None), "the honest loopback backend failed the model");
    assert!(
        !run(Some(Flaw::UnmapLiesAndKeepsTheRegion)),
        "the model missed the lying unmap"
    );
}

#[test]
fn batch_error_check_catches_a_backend_that_fails_whole_batches() {
    assert_only_the_flawed_backend_fails(Flaw::FailsWholeBatches, |p| {
        Box::pin(conformance::a_batch_fails_each_entry_with_its_own_error(p))
    });
}

#[test]
fn batch_error_check_catches_a_backend_that_reorders_answers() {
    assert_only_the_flawed_backend_fails(Flaw::ReordersBatchAnswers, |p| {
        Box::pin(conformance::a_batch_fails_each_entry_with_its_own_error(p))
    });
}

#[test]
fn batch_check_catches_a_backend_that_answers_before_the_transfers_end() {
    assert_only_the_flawed_backend_fails(Flaw::AnswersBatchesBeforeTheyEnd, |p| {
        Box::pin(conformance::a_batch_writes_every_entry_and_returns_each_in_order(p))
    });
}

#[test]
fn withheld_notice_check_catches_notices_sent_after_failed_reads() {
    assert_only_the_flawed_backend_fails(Flaw::SendsNoticesOfFailedReads, |p| {
        Box::pin(conformance::a_notice_is_withheld_when_its_read_fails(p))
    });
}

#[test]
fn notice_order_check_catches_notices_delivered_twice() {
    assert_only_the_flawed_backend_fails(Flaw::SendsNoticesTwice, |p| {
        Box::pin(conformance::notices_arrive_once_and_in_send_order(p))
    });
}

#[test]
fn lease_expiry_check_catches_leases_served_past_their_expiry() {
    assert_only_the_flawed_backend_fails(Flaw::ServesLeasesPastTheirExpiry, |p| {
        Box::pin(conformance::a_lease_serves_reads_until_its_expiry(p))
    });
}

#[test]
fn release_count_check_catches_leases_ended_by_one_reader() {
    assert_only_the_flawed_backend_fails(Flaw::EndsLeasesAtTheFirstRelease, |p| {
        Box::pin(conformance::a_release_counts_once_and_only_for_its_lease(p))
    });
}

#[test]
fn release_check_catches_leases_reported_released_at_once() {
    assert_only_the_flawed_backend_fails(Flaw::ReportsLeasesReleasedAtOnce, |p| {
        Box::pin(conformance::a_lease_ends_when_its_reader_released_it(p))
    });
}

#[test]
fn access_check_catches_a_backend_that_maps_everything_writable() {
    assert_only_the_flawed_backend_fails(Flaw::MapsEverythingWritable, |p| {
        Box::pin(conformance::a_put_to_a_read_only_registration_is_access_denied(p))
    });
}

#[test]
fn put_bounds_check_catches_a_backend_that_flattens_its_errors() {
    assert_only_the_flawed_backend_fails(Flaw::FlattensPutErrors, |p| {
        Box::pin(conformance::a_put_outside_either_registration_is_refused(p))
    });
}

#[test]
fn written_log_check_catches_ranges_joined_across_gaps() {
    assert_only_the_flawed_backend_fails(Flaw::JoinsWrittenRangesAcrossGaps, |p| {
        Box::pin(conformance::the_written_log_lists_exactly_the_ranges_puts_filled(p))
    });
}

#[test]
fn written_log_check_catches_a_take_that_keeps_the_log() {
    assert_only_the_flawed_backend_fails(Flaw::KeepsWrittenRangesAfterATake, |p| {
        Box::pin(conformance::the_written_log_lists_exactly_the_ranges_puts_filled(p))
    });
}
