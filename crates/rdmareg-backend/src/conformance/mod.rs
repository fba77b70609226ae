//! The conformance kit: the contract of [`RdmaBackend`] as a reusable test
//! suite (feature `testkit`), run from a backend crate's own tests:
//!
//! ```
//! use rdmareg_backend::PeerId;
//! use rdmareg_backend::conformance::{self, BackendPair};
//! use rdmareg_backend::loopback::LoopbackFabric;
//!
//! /// Two connected instances of the backend under test.
//! async fn loopback_pair() -> BackendPair {
//!     let fabric = LoopbackFabric::new();
//!     BackendPair::new(fabric.backend(PeerId(1)), fabric.backend(PeerId(2)), PeerId(1))
//! }
//!
//! // In a test file: the whole suite, one #[test] per check.
//! rdmareg_backend::conformance_tests!(loopback_pair);
//!
//! // Or one check, inside a runtime of your own.
//! # fn main() {
//! conformance::block_on(async {
//!     let pair = loopback_pair().await;
//!     conformance::get_moves_the_right_bytes(&pair).await;
//!     pair.teardown().await;
//! });
//! # }
//! ```
//!
//! Each check is also a `pub async fn` over a `&BackendPair`, to run inside
//! a runtime of one's own (timer enabled); [`model_based`] is synchronous
//! and runs outside any runtime.
//!
//! The kit keeps registered memory alive until an unmap returned `Ok(())` or
//! the backend's count confirms a rollback, and otherwise leaks it on
//! purpose. It never asks a backend whose keys bound nothing ([`Capabilities`])
//! to read outside a registration, and skips live-count checks for a backend
//! whose [`live_registrations`](RdmaBackend::live_registrations) is `None`.

mod batch_checks;
mod buffer;
mod get_checks;
mod in_flight_checks;
mod key_checks;
mod lease_checks;
mod map_checks;
mod model;
mod notice_checks;
mod support;
mod unmap_checks;
mod write_checks;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use parking_lot::Mutex;
use rdmareg_core::PeerId;

use crate::RdmaBackend;

pub use batch_checks::{
    a_batch_fails_each_entry_with_its_own_error,
    a_batch_writes_every_entry_and_returns_each_in_order,
    a_dropped_batch_keeps_its_destinations_until_the_transfers_are_over,
    a_shared_batch_completes_every_post_as_a_fresh_one_would,
};
pub use get_checks::{
    get_from_an_unknown_peer_is_not_configured,
    get_into_an_unknown_local_region_is_region_not_found, get_moves_the_right_bytes,
    get_outside_the_local_mapping_is_out_of_range,
    get_outside_the_remote_registration_is_out_of_range,
};
pub use in_flight_checks::{
    dropped_get_keeps_the_destination_until_the_transfer_is_over,
    no_byte_is_written_after_a_get_completes,
    unmapping_destination_refuses_new_gets_and_waits_for_the_one_in_flight,
};
pub use key_checks::{malformed_keys_are_invalid_key, stale_key_after_unmap_is_refused};
pub use lease_checks::{
    a_lease_ends_when_its_reader_released_it, a_lease_serves_reads_until_its_expiry,
    a_release_counts_once_and_only_for_its_lease,
    leases_of_bad_terms_or_unmapped_regions_are_refused,
};
pub use map_checks::{
    cancelled_map_leaves_no_registration, cancelled_maps_stay_within_the_memory_the_caller_holds,
    degenerate_map_is_out_of_range, effective_range_is_page_enclosing,
};
pub use model::{MODEL_CASES, model_based};
pub use notice_checks::{
    a_notice_is_withheld_when_its_read_fails, a_notice_reaches_the_owner_after_its_read,
    a_notice_to_an_unknown_peer_is_not_configured,
    an_oversized_notice_is_refused_before_anything_is_read, notices_arrive_once_and_in_send_order,
};
pub use unmap_checks::{
    concurrent_unmaps_of_one_region_all_return_ok, dropped_unmap_still_unmaps,
    ok_unmap_decrements_the_live_count, unmap_after_teardown_returns_ok_for_released_ids,
    unmap_of_a_never_mapped_id_returns_ok, unmap_twice_returns_ok_and_counts_once,
};
pub use write_checks::{
    a_put_batch_answers_each_entry_on_its_own, a_put_outside_either_registration_is_refused,
    a_put_to_a_read_only_registration_is_access_denied,
    a_put_writes_exactly_its_range_of_a_writable_registration,
    the_written_log_lists_exactly_the_ranges_puts_filled,
};

/// What the backend under test can detect; the kit checks only that.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// A GET outside the key's registration is refused with `OutOfRange`
    /// (false for UCX over tcp and shared memory).
    pub remote_bounds_enforced: bool,
    /// A stale key (its region unmapped) is refused with an error.
    pub unknown_remote_key_detected: bool,
    /// How long a cancelled map's or dropped unmap's rollback may take to
    /// show in the live count before it counts as a leak.
    pub rollback_within: Duration,
    /// The backend sends and receives notices; without them it must refuse
    /// them as [`RdmaError::Unsupported`](crate::RdmaError::Unsupported).
    pub notices: bool,
    /// The backend makes descriptor leases; without them it must refuse
    /// them as [`RdmaError::Unsupported`](crate::RdmaError::Unsupported).
    pub leases: bool,
    /// The backend maps memory writable, puts into it and keeps the log
    /// of written ranges; without writes it must refuse both as
    /// [`RdmaError::Unsupported`](crate::RdmaError::Unsupported).
    pub writes: bool,
    /// The owner's written log lists every write into a registration
    /// (false where peers may write one-sided, unseen by the owner, as on
    /// UCX's same-host direct lane: the log then lists only what the owner
    /// served and always says it is incomplete).
    pub written_log_complete: bool,
}

impl Capabilities {
    /// Everything detected, rollbacks settling within five seconds: what the
    /// contract asks of a backend that can tell.
    pub const fn full() -> Self {
        Self {
            remote_bounds_enforced: true,
            unknown_remote_key_detected: true,
            rollback_within: Duration::from_secs(5),
            notices: true,
            leases: true,
            writes: true,
            written_log_complete: true,
        }
    }

    /// Set [`remote_bounds_enforced`](Self::remote_bounds_enforced).
    pub const fn with_remote_bounds_enforced(mut self, enforced: bool) -> Self {
        self.remote_bounds_enforced = enforced;
        self
    }

    /// Set [`rollback_within`](Self::rollback_within).
    pub const fn with_rollback_within(mut self, within: Duration) -> Self {
        self.rollback_within = within;
        self
    }

    /// Set [`notices`](Self::notices).
    pub const fn with_notices(mut self, notices: bool) -> Self {
        self.notices = notices;
        self
    }

    /// Set [`leases`](Self::leases).
    pub const fn with_leases(mut self, leases: bool) -> Self {
        self.leases = leases;
        self
    }

    /// Set [`writes`](Self::writes).
    pub const fn with_writes(mut self, writes: bool) -> Self {
        self.writes = writes;
        self
    }

    /// Set [`written_log_complete`](Self::written_log_complete).
    pub const fn with_written_log_complete(mut self, complete: bool) -> Self {
        self.written_log_complete = complete;
        self
    }

    /// Set [`unknown_remote_key_detected`](Self::unknown_remote_key_detected).
    pub const fn with_unknown_remote_key_detected(mut self, detected: bool) -> Self {
        self.unknown_remote_key_detected = detected;
        self
    }
}

impl Default for Capabilities {
    fn default() -> Self {
        Self::full()
    }
}

/// Two connected instances of the backend under test: sources are registered
/// on the owner, destinations on the consumer.
pub struct BackendPair {
    /// The instance whose memory is read.
    pub owner: Arc<dyn RdmaBackend>,
    /// The instance that issues GETs.
    pub consumer: Arc<dyn RdmaBackend>,
    /// How the consumer names the owner in [`BackendGet::peer`](crate::BackendGet::peer).
    pub owner_as_seen_by_consumer: PeerId,
    /// What the backend can detect.
    pub capabilities: Capabilities,
    /// Behind a mutex only so the pair is `Sync`; taken once.
    teardown: Mutex<Option<BoxFuture<'static, ()>>>,
}

impl fmt::Debug for BackendPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendPair")
            .field("owner", &self.owner.key())
            .field("consumer", &self.consumer.key())
            .field("owner_as_seen_by_consumer", &self.owner_as_seen_by_consumer)
            .field("capabilities", &self.capabilities)
            .field("teardown", &self.teardown.lock().is_some())
            .finish()
    }
}

impl BackendPair {
    /// A pair with [`Capabilities::full`] and no teardown.
    pub fn new(
        owner: Arc<dyn RdmaBackend>,
        consumer: Arc<dyn RdmaBackend>,
        owner_as_seen_by_consumer: PeerId,
    ) -> Self {
        Self {
            owner,
            consumer,
            owner_as_seen_by_consumer,
            capabilities: Capabilities::full(),
            teardown: Mutex::new(None),
        }
    }

    /// Replace the capabilities.
    pub fn with_capabilities(mut self, capabilities: Capabilities) -> Self {
        self.capabilities = capabilities;
        self
    }

    /// Work the kit awaits on its runtime after the checks passed.
    pub fn with_teardown(self, teardown: impl Future<Output = ()> + Send + 'static) -> Self {
        *self.teardown.lock() = Some(Box::pin(teardown));
        self
    }

    /// Run the teardown, if any.
    ///
    /// # Cancel safety
    /// Dropping the future drops the teardown work wherever it stands.
    pub async fn teardown(self) {
        self.teardown_now().await;
    }

    /// Run the teardown now, from a check, if it has not run yet; returns
    /// whether it ran.
    ///
    /// # Cancel safety
    /// Dropping the future drops the teardown work wherever it stands.
    pub async fn teardown_now(&self) -> bool {
        let teardown = self.teardown.lock().take();
        match teardown {
            Some(teardown) => {
                teardown.await;
                true
            }
            None => false,
        }
    }
}

/// Run `future` on a fresh two-worker multi-threaded runtime with every
/// driver enabled, as each generated test does.
///
/// # Panics
/// If the runtime cannot be built, or if called from inside a runtime.
pub fn block_on<F: Future>(future: F) -> F::Output {
    kit_runtime().block_on(future)
}

pub(crate) fn kit_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("the conformance kit could not build its tokio runtime")
}

/// Expand to the whole conformance suite for a backend: one `#[test]` per
/// contract check plus the model-based property test. `$factory` returns a
/// future of a fresh [`BackendPair`](crate::conformance::BackendPair); invoke
/// the macro once per module.
#[macro_export]
macro_rules! conformance_tests {
    ($factory:expr $(,)?) => {
        $crate::__conformance_checks!(
            $factory;
            cancelled_map_leaves_no_registration,
            cancelled_maps_stay_within_the_memory_the_caller_holds,
            degenerate_map_is_out_of_range,
            effective_range_is_page_enclosing,
            unmap_of_a_never_mapped_id_returns_ok,
            unmap_twice_returns_ok_and_counts_once,
            unmap_after_teardown_returns_ok_for_released_ids,
            concurrent_unmaps_of_one_region_all_return_ok,
            ok_unmap_decrements_the_live_count,
            dropped_unmap_still_unmaps,
            get_moves_the_right_bytes,
            get_outside_the_local_mapping_is_out_of_range,
            get_outside_the_remote_registration_is_out_of_range,
            get_into_an_unknown_local_region_is_region_not_found,
            get_from_an_unknown_peer_is_not_configured,
            malformed_keys_are_invalid_key,
            stale_key_after_unmap_is_refused,
            unmapping_destination_refuses_new_gets_and_waits_for_the_one_in_flight,
            dropped_get_keeps_the_destination_until_the_transfer_is_over,
            no_byte_is_written_after_a_get_completes,
            a_batch_writes_every_entry_and_returns_each_in_order,
            a_batch_fails_each_entry_with_its_own_error,
            a_dropped_batch_keeps_its_destinations_until_the_transfers_are_over,
            a_shared_batch_completes_every_post_as_a_fresh_one_would,
            a_notice_reaches_the_owner_after_its_read,
            a_notice_is_withheld_when_its_read_fails,
            notices_arrive_once_and_in_send_order,
            an_oversized_notice_is_refused_before_anything_is_read,
            a_notice_to_an_unknown_peer_is_not_configured,
            a_lease_serves_reads_until_its_expiry,
            a_lease_ends_when_its_reader_released_it,
            a_release_counts_once_and_only_for_its_lease,
            leases_of_bad_terms_or_unmapped_regions_are_refused,
            a_put_writes_exactly_its_range_of_a_writable_registration,
            a_put_to_a_read_only_registration_is_access_denied,
            a_put_outside_either_registration_is_refused,
            a_put_batch_answers_each_entry_on_its_own,
            the_written_log_lists_exactly_the_ranges_puts_filled,
        );

        #[test]
        fn model_based_sequences_keep_live_counts_equal_to_the_model() {
            $crate::conformance::model_based($factory, $crate::conformance::MODEL_CASES);
        }
    };
}

/// One `#[test]` per named check; the implementation of
/// [`conformance_tests!`](crate::conformance_tests).
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_checks {
    ($factory:expr; $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                $crate::conformance::block_on(async {
                    let pair = ($factory)().await;
                    $crate::conformance::$check(&pair).await;
                    pair.teardown().await;
                });
            }
        )*
    };
}
