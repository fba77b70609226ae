//! `get` and `put` of the loopback backend: validation, pinning, and the
//! copy, one way or the other.
//!
//! Order of checks (each failure is the typed error the contract names):
//! shutdown, zero length, key format, peer, the key's registration and remote
//! range, the access the remote registration grants, the local region and
//! range. Only then is an injected fault taken, so a malformed request never
//! consumes one.
//!
//! Both regions are pinned from submission until the copy is done or
//! abandoned, by a guard that lives in the future: the copy is synchronous and
//! happens in the same poll as the final checks, so a dropped future has
//! either copied everything or nothing, and its pins go with it. A lease key
//! grants reads only: a put with one is [`RdmaError::AccessDenied`]. A put's
//! range is listed in the owner's log of written ranges once its copy is
//! done, while both pins still hold.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use rdmareg_core::{BackendGet, BackendPut, RdmaError};
use tokio::select;

use super::key::PackedKey;
use super::leases::LeaseKey;
use super::table::{PinError, RegionTable, Span};
use super::{FaultOp, LoopbackBackend, shut_down};

/// Which way a transfer copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// From the peer's registration into a local one.
    Get,
    /// From a local registration into the peer's.
    Put,
}

impl Direction {
    fn operation(self) -> &'static str {
        match self {
            Direction::Get => "read",
            Direction::Put => "write",
        }
    }
}

/// A GET or a PUT, which name the same things.
struct Transfer {
    direction: Direction,
    request: BackendGet,
}

impl LoopbackBackend {
    pub(super) async fn run_get(&self, request: BackendGet) -> Result<(), RdmaError> {
        self.run(Transfer {
            direction: Direction::Get,
            request,
        })
        .await
    }

    pub(super) async fn run_put(&self, request: BackendPut) -> Result<(), RdmaError> {
        let BackendPut {
            peer,
            remote_addr,
            packed_key,
            local_region_id,
            local_offset,
            len,
            deadline,
        } = request;
        self.run(Transfer {
            direction: Direction::Put,
            request: BackendGet {
                peer,
                remote_addr,
                packed_key,
                local_region_id,
                local_offset,
                len,
                deadline,
            },
        })
        .await
    }

    async fn run(&self, transfer: Transfer) -> Result<(), RdmaError> {
        let direction = transfer.direction;
        let mut outcome = Outcome {
            backend: self,
            direction,
            finished: false,
        };
        let result = self.transfer(transfer).await;
        outcome.finished = true;
        let counter = match (&result, direction) {
            (Ok(()), Direction::Get) => &self.counters.gets_completed,
            (Err(_), Direction::Get) => &self.counters.gets_failed,
            (Ok(()), Direction::Put) => &self.counters.puts_completed,
            (Err(_), Direction::Put) => &self.counters.puts_failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        result
    }

    async fn transfer(&self, transfer: Transfer) -> Result<(), RdmaError> {
        let Transfer { direction, request } = transfer;
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
        // A lease's capability stands for the region's nonce; it grants
        // reads only.
        let nonce = match &lease {
            Some(_) if direction == Direction::Put => {
                return Err(RdmaError::AccessDenied { operation: "write" });
            }
            Some(lease) => {
                owner.judge_lease(lease)?;
                None
            }
            None => Some(key.nonce),
        };

        // `owner` is declared before the pins, so it outlives them.
        let remote = owner
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
        let _remote_pin = PinGuard {
            table: &owner.table,
            id: key.region,
        };
        // Pinned, so still registered: its access cannot change under us.
        let granted = owner.table.access(key.region).unwrap_or_default();
        let allowed = match direction {
            Direction::Get => granted.allows_read(),
            Direction::Put => granted.allows_write(),
        };
        if !allowed {
            return Err(RdmaError::AccessDenied {
                operation: direction.operation(),
            });
        }
        let local = self
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
        let _local_pin = PinGuard {
            table: &self.table,
            id: request.local_region_id,
        };

        let plan = self.faults.take(match direction {
            Direction::Get => FaultOp::Get,
            Direction::Put => FaultOp::Put,
        });
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

        let (source, destination) = match direction {
            Direction::Get => (remote, local),
            Direction::Put => (local, remote),
        };
        // SAFETY: both ranges were checked to lie inside the pointer and length
        // given to `map`, whose caller promised they stay allocated until an
        // unmap returns `Ok(())`. Both regions are pinned by the guards above,
        // so no unmap can complete (and so none return `Ok(())`) before this
        // copy returns. No Rust reference aliases registered bytes while a
        // peer may access them (the map caller's other promise), so the raw
        // copy does not invalidate one; a PUT writes only a registration
        // its owner mapped with write access (checked above), whose owner
        // accepted peers' writes. `copy` tolerates overlap, which happens
        // when both regions are in one instance and share bytes.
        unsafe {
            std::ptr::copy(
                std::ptr::with_exposed_provenance::<u8>(source),
                std::ptr::with_exposed_provenance_mut::<u8>(destination),
                len,
            );
        }
        if direction == Direction::Put {
            owner.table.record_written(key.region, destination, len);
        }
        self.counters
            .bytes_copied
            .fetch_add(request.len, Ordering::Relaxed);
        Ok(())
    }
}

/// Counts a transfer future dropped before it completed as a failed one.
struct Outcome<'a> {
    backend: &'a LoopbackBackend,
    direction: Direction,
    finished: bool,
}

impl Drop for Outcome<'_> {
    fn drop(&mut self) {
        if !self.finished {
            let counters = &self.backend.counters;
            match self.direction {
                Direction::Get => &counters.gets_failed,
                Direction::Put => &counters.puts_failed,
            }
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
