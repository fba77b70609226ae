//! `get` of the loopback backend: validation, pinning, and the copy.
//!
//! Order of checks (each failure is the typed error the contract names):
//! shutdown, zero length, key format, peer, the key's registration and remote
//! range, the local region and range. Only then is an injected fault taken,
//! so a malformed request never consumes one.
//!
//! Both regions are pinned from submission until the copy is done or
//! abandoned, by a guard that lives in the future: the copy is synchronous and
//! happens in the same poll as the final checks, so a dropped future has
//! either copied everything or nothing, and its pins go with it.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use rdmareg_core::{BackendGet, RdmaError};
use tokio::select;

use super::key::PackedKey;
use super::leases::LeaseKey;
use super::table::{PinError, RegionTable, Span};
use super::{FaultOp, LoopbackBackend, shut_down};

impl LoopbackBackend {
    pub(super) async fn run_get(&self, request: BackendGet) -> Result<(), RdmaError> {
        let mut outcome = Outcome {
            backend: self,
            finished: false,
        };
        let result = self.transfer(request).await;
        outcome.finished = true;
        let counter = match &result {
            Ok(()) => &self.counters.gets_completed,
            Err(_) => &self.counters.gets_failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        result
    }

    async fn transfer(&self, request: BackendGet) -> Result<(), RdmaError> {
        if self.is_shutting_down() {
            return Err(RdmaError::ShuttingDown);
        }
        if request.len == 0 {
            return Err(RdmaError::OutOfRange);
        }
        let len = usize::try_from(request.len).map_err(|_| RdmaError::OutOfRange)?;
        let lease = LeaseKey::decode(&request.packed_key);
        let key = match lease {
            Some(lease) => PackedKey {
                instance: lease.instance,
                region: lease.region,
                nonce: 0,
            },
            None => PackedKey::decode(&request.packed_key)?,
        };
        let owner = self
            .fabric
            .lookup(request.peer)
            .ok_or(RdmaError::NotConfigured)?;
        if key.instance != owner.instance {
            return Err(RdmaError::RegionNotFound);
        }
        // A lease's capability stands for the region's nonce.
        let nonce = match &lease {
            Some(lease) => {
                owner.judge_lease(lease)?;
                None
            }
            None => Some(key.nonce),
        };

        // `owner` is declared before the pins, so it outlives them.
        let source = owner
            .table
            .pin(
                key.region,
                nonce,
                Span::Absolute {
                    addr: request.remote_addr,
                    len: request.len,
                },
            )
            .map_err(|e| remote_pin_error(e, &owner))?;
        let _source_pin = PinGuard {
            table: &owner.table,
            id: key.region,
        };
        let destination = self
            .table
            .pin(
                request.local_region_id,
                None,
                Span::Offset {
                    offset: request.local_offset,
                    len: request.len,
                },
            )
            .map_err(local_pin_error)?;
        let _destination_pin = PinGuard {
            table: &self.table,
            id: request.local_region_id,
        };

        let plan = self.faults.take(FaultOp::Get);
        if !plan.is_immediate() {
            let deadline = request.deadline.unwrap_or(self.config.default_get_deadline);
            select! {
                () = plan.wait() => {}
                () = tokio::time::sleep(deadline) => return Err(RdmaError::Timeout),
                () = shut_down(self.shutdown_signal()) => return Err(RdmaError::ShuttingDown),
                () = shut_down(owner.shutdown_signal()) => return Err(peer_shutting_down(&owner)),
            }
        }
        if let Some(injected) = plan.injected_failure() {
            return Err(injected);
        }

        // SAFETY: both ranges were checked to lie inside the pointer and length
        // given to `map`, whose caller promised they stay allocated until an
        // unmap returns `Ok(())`. Both regions are pinned by the guards above,
        // so no unmap can complete (and so none return `Ok(())`) before this
        // copy returns. No Rust reference aliases registered bytes while a
        // peer may access them (the map caller's other promise), so the raw
        // copy does not invalidate one. `copy` tolerates overlap, which
        // happens when both regions are in one instance and share bytes.
        unsafe {
            std::ptr::copy(
                std::ptr::with_exposed_provenance::<u8>(source),
                std::ptr::with_exposed_provenance_mut::<u8>(destination),
                len,
            );
        }
        self.counters
            .bytes_copied
            .fetch_add(request.len, Ordering::Relaxed);
        Ok(())
    }
}

/// Counts a GET future dropped before it completed as a failed GET.
struct Outcome<'a> {
    backend: &'a LoopbackBackend,
    finished: bool,
}

impl Drop for Outcome<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.backend
                .counters
                .gets_failed
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One transfer's hold on one region.
struct PinGuard<'a> {
    table: &'a RegionTable,
    id: u64,
}

impl Drop for PinGuard<'_> {
    fn drop(&mut self) {
        self.table.unpin(self.id);
    }
}

fn local_pin_error(e: PinError) -> RdmaError {
    match e {
        PinError::Closed => RdmaError::ShuttingDown,
        PinError::NotFound => RdmaError::RegionNotFound,
        PinError::OutOfRange => RdmaError::OutOfRange,
    }
}

fn remote_pin_error(e: PinError, owner: &Arc<LoopbackBackend>) -> RdmaError {
    match e {
        PinError::Closed => peer_shutting_down(owner),
        PinError::NotFound => RdmaError::RegionNotFound,
        PinError::OutOfRange => RdmaError::OutOfRange,
    }
}

fn peer_shutting_down(owner: &LoopbackBackend) -> RdmaError {
    RdmaError::backend(format!("loopback peer {} is shutting down", owner.peer_id))
}
