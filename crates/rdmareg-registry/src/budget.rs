//! The registered-bytes budget and the [`Reservation`] that carries a charge.
//!
//! A registration reserves its page-enclosing length before the map, with
//! one compare-and-swap, so two racing for the last bytes cannot both pass.
//! Dropping the reservation returns the charge. After the map it is
//! reconciled to what the backend pinned (never below the page-enclosing
//! range, contract point 7); an upward reconcile may pass the ceiling, as
//! the bytes are already pinned.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rdmareg_core::RdmaError;

/// A ceiling on registered bytes and the running total charged against it.
#[derive(Debug)]
pub(crate) struct Budget {
    limit: u64,
    used: AtomicU64,
}

impl Budget {
    pub(crate) fn new(limit: u64) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicU64::new(0),
        })
    }

    /// The configured ceiling.
    pub(crate) fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes currently charged.
    pub(crate) fn used(&self) -> u64 {
        self.used.load(Ordering::SeqCst)
    }

    /// Charge `bytes`, or refuse with [`RdmaError::BudgetExceeded`] if that
    /// would pass the ceiling.
    pub(crate) fn reserve(self: &Arc<Self>, bytes: u64) -> Result<Reservation, RdmaError> {
        self.try_charge(bytes)?;
        Ok(Reservation {
            budget: Arc::clone(self),
            bytes,
        })
    }

    /// The refusal a request for `bytes` would get now.
    pub(crate) fn refusal(&self, bytes: u64) -> RdmaError {
        RdmaError::BudgetExceeded {
            requested: bytes,
            registered: self.used(),
            budget: self.limit,
        }
    }

    fn try_charge(&self, bytes: u64) -> Result<(), RdmaError> {
        let mut current = self.used.load(Ordering::SeqCst);
        loop {
            let next = current
                .checked_add(bytes)
                .filter(|next| *next <= self.limit)
                .ok_or(RdmaError::BudgetExceeded {
                    requested: bytes,
                    registered: current,
                    budget: self.limit,
                })?;
            match self
                .used
                .compare_exchange_weak(current, next, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return Ok(()),
                Err(seen) => current = seen,
            }
        }
    }

    fn release(&self, bytes: u64) {
        let before = self.used.fetch_sub(bytes, Ordering::SeqCst);
        debug_assert!(before >= bytes, "budget released more than it charged");
    }
}

/// Bytes charged against a [`Budget`]; returned when dropped.
#[derive(Debug)]
pub(crate) struct Reservation {
    budget: Arc<Budget>,
    bytes: u64,
}

impl Reservation {
    /// Bytes this reservation holds.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Adjust the charge to `actual` bytes, the length the backend pinned;
    /// growing charges even past the ceiling (the bytes are pinned), logged.
    pub(crate) fn reconcile(&mut self, actual: u64) {
        if actual < self.bytes {
            self.budget.release(self.bytes - actual);
        } else if actual > self.bytes {
            let extra = actual - self.bytes;
            if self.budget.try_charge(extra).is_err() {
                tracing::warn!(
                    reserved = self.bytes,
                    pinned = actual,
                    budget = self.budget.limit,
                    "backend pinned more than the page-enclosing range; charging the excess past the budget"
                );
                self.budget.used.fetch_add(extra, Ordering::SeqCst);
            }
        }
        self.bytes = actual;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.release(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_carries_requested_registered_and_budget() {
        let budget = Budget::new(10_000);
        let _held = budget.reserve(8192).unwrap();
        assert_eq!(
            budget.reserve(4096).unwrap_err(),
            RdmaError::BudgetExceeded {
                requested: 4096,
                registered: 8192,
                budget: 10_000
            }
        );
        assert_eq!(budget.used(), 8192);
    }

    #[test]
    fn dropping_a_reservation_returns_its_charge() {
        let budget = Budget::new(1 << 20);
        let r = budget.reserve(4096).unwrap();
        assert_eq!(budget.used(), 4096);
        drop(r);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn reconcile_moves_the_charge_to_the_pinned_length() {
        let budget = Budget::new(1 << 20);
        let mut r = budget.reserve(8192).unwrap();
        r.reconcile(4096);
        assert_eq!((budget.used(), r.bytes()), (4096, 4096));
        r.reconcile(12288);
        assert_eq!((budget.used(), r.bytes()), (12288, 12288));
        drop(r);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn reconcile_past_the_ceiling_still_charges_what_is_pinned() {
        let budget = Budget::new(8192);
        let mut r = budget.reserve(8192).unwrap();
        r.reconcile(16384);
        assert_eq!(budget.used(), 16384);
        drop(r);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn overflowing_request_is_refused_not_wrapped() {
        let budget = Budget::new(u64::MAX);
        let _r = budget.reserve(10).unwrap();
        assert!(matches!(
            budget.reserve(u64::MAX),
            Err(RdmaError::BudgetExceeded { .. })
        ));
    }

    #[test]
    fn concurrent_reservations_never_overshoot() {
        const THREADS: usize = 8;
        const PER_THREAD: usize = 2_000;
        let budget = Budget::new(100 * 4096);
        let peak = Arc::new(AtomicU64::new(0));
        std::thread::scope(|s| {
            for _ in 0..THREADS {
                let budget = Arc::clone(&budget);
                let peak = Arc::clone(&peak);
                s.spawn(move || {
                    let mut held = Vec::new();
                    for i in 0..PER_THREAD {
                        if let Ok(r) = budget.reserve(4096 * (1 + (i % 7) as u64)) {
                            held.push(r);
                        }
                        peak.fetch_max(budget.used(), Ordering::SeqCst);
                        if i % 3 == 0 {
                            held.clear();
                        }
                    }
                });
            }
        });
        assert!(peak.load(Ordering::SeqCst) <= budget.limit());
        assert_eq!(budget.used(), 0);
    }
}
