//! Fault injection for the loopback backend.
//!
//! A fault is taken when an operation is submitted (first poll), after the
//! request was validated: it sleeps the delay, waits at the hang gate, then
//! fails (changing nothing) or does its work. An unmap of an unknown id
//! returns `Ok(())` whatever the faults, as idempotence requires. Delays
//! use `tokio::time`, so a paused clock controls them.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::watch;

/// The operation kinds faults can be injected into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultOp {
    /// [`RdmaBackend::map`](crate::RdmaBackend::map).
    Map,
    /// [`RdmaBackend::unmap`](crate::RdmaBackend::unmap).
    Unmap,
    /// [`RdmaBackend::get`](crate::RdmaBackend::get), on the issuing instance.
    Get,
    /// [`RdmaBackend::put`](crate::RdmaBackend::put), on the issuing instance.
    Put,
}

impl FaultOp {
    fn index(self) -> usize {
        match self {
            FaultOp::Map => 0,
            FaultOp::Unmap => 1,
            FaultOp::Get => 2,
            FaultOp::Put => 3,
        }
    }

    fn name(self) -> &'static str {
        match self {
            FaultOp::Map => "map",
            FaultOp::Unmap => "unmap",
            FaultOp::Get => "get",
            FaultOp::Put => "put",
        }
    }
}

/// The fault knobs of one loopback instance. Every knob takes effect for
/// operations submitted after it was set.
#[derive(Debug, Default)]
pub struct FaultInjector {
    state: Mutex<FaultState>,
}

#[derive(Debug, Default)]
struct FaultState {
    ops: [OpFaults; 4],
    refuse_unmaps: bool,
    detached_maps: bool,
}

#[derive(Debug, Default)]
struct OpFaults {
    delay: Duration,
    fail_next: usize,
    gate: Option<Arc<Gate>>,
}

impl FaultInjector {
    /// Make every operation of kind `op` sleep `delay` first (zero removes it).
    pub fn set_delay(&self, op: FaultOp, delay: Duration) {
        self.state.lock().ops[op.index()].delay = delay;
    }

    /// Make the next `n` operations of kind `op` fail with
    /// [`RdmaError::Backend`](crate::RdmaError::Backend) (`"injected ..."`),
    /// changing nothing; `0` cancels.
    pub fn fail_next(&self, op: FaultOp, n: usize) {
        self.state.lock().ops[op.index()].fail_next = n;
    }

    /// Make operations of kind `op` block until the returned gate is released
    /// or dropped. A later `hang` replaces the gate for later operations.
    #[must_use = "dropping the gate releases it at once"]
    pub fn hang(&self, op: FaultOp) -> HangGate {
        let gate = Arc::new(Gate::new());
        self.state.lock().ops[op.index()].gate = Some(Arc::clone(&gate));
        HangGate { gate }
    }

    /// While `refuse` is true, unmaps of registered regions fail with
    /// [`RdmaError::Backend`](crate::RdmaError::Backend) and the regions stay
    /// registered, through shutdown too (a wedged backend).
    pub fn refuse_unmaps(&self, refuse: bool) {
        self.state.lock().refuse_unmaps = refuse;
    }

    /// While `detached` is true, a map runs on a task of its own from its
    /// first poll, as a UCX map on the progress thread does: dropping its
    /// future does not stop it, and one that registers afterwards is rolled
    /// back by an unmap (subject to the unmap faults), counted live until
    /// done. Outside a Tokio runtime maps run inline.
    pub fn detach_maps(&self, detached: bool) {
        self.state.lock().detached_maps = detached;
    }

    pub(crate) fn maps_detached(&self) -> bool {
        self.state.lock().detached_maps
    }

    /// Remove every fault, releasing hang gates.
    pub fn clear(&self) {
        let old = std::mem::take(&mut *self.state.lock());
        for op in old.ops {
            if let Some(gate) = op.gate {
                gate.release();
            }
        }
    }

    pub(crate) fn unmaps_refused(&self) -> bool {
        self.state.lock().refuse_unmaps
    }

    /// Take the faults that apply to one operation of kind `op` being
    /// submitted now, consuming one pending failure if there is one.
    pub(crate) fn take(&self, op: FaultOp) -> FaultPlan {
        let mut state = self.state.lock();
        let faults = &mut state.ops[op.index()];
        let fail = faults.fail_next > 0;
        if fail {
            faults.fail_next -= 1;
        }
        let gate = faults.gate.clone().filter(|gate| !gate.is_released());
        FaultPlan {
            op,
            fail,
            delay: faults.delay,
            gate,
        }
    }
}

/// The faults one submitted operation goes through.
#[derive(Debug)]
pub(crate) struct FaultPlan {
    op: FaultOp,
    fail: bool,
    delay: Duration,
    gate: Option<Arc<Gate>>,
}

impl FaultPlan {
    /// Whether the operation goes straight through, without waiting.
    pub(crate) fn is_immediate(&self) -> bool {
        self.delay.is_zero() && self.gate.is_none()
    }

    /// Sleep the delay, then wait at the gate.
    pub(crate) async fn wait(&self) {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        if let Some(gate) = &self.gate {
            gate.pass().await;
        }
    }

    /// The injected failure to return, if this operation drew one.
    pub(crate) fn injected_failure(&self) -> Option<crate::RdmaError> {
        self.fail.then(|| {
            crate::RdmaError::backend(format!("injected {} failure (loopback)", self.op.name()))
        })
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct GateState {
    released: bool,
    waiting: usize,
}

#[derive(Debug)]
struct Gate {
    state: watch::Sender<GateState>,
}

impl Gate {
    fn new() -> Self {
        Self {
            state: watch::Sender::new(GateState::default()),
        }
    }

    fn is_released(&self) -> bool {
        self.state.borrow().released
    }

    fn release(&self) {
        self.state.send_modify(|s| s.released = true);
    }

    async fn pass(&self) {
        let mut seen = self.state.subscribe();
        self.state.send_modify(|s| s.waiting += 1);
        let _leaving = WaitingGuard(self);
        // The sender lives as long as `self`, so this can only end by release.
        let _ = seen.wait_for(|s| s.released).await;
    }
}

/// Counts a waiter out of the gate however it leaves (released or dropped).
struct WaitingGuard<'a>(&'a Gate);

impl Drop for WaitingGuard<'_> {
    fn drop(&mut self) {
        self.0.state.send_modify(|s| s.waiting -= 1);
    }
}

/// Holds operations of one kind until released or dropped.
#[derive(Debug)]
pub struct HangGate {
    gate: Arc<Gate>,
}

impl HangGate {
    /// Let every waiting operation through and hold no new ones. Idempotent.
    pub fn release(&self) {
        self.gate.release();
    }

    /// How many operations are waiting at the gate right now.
    pub fn waiting(&self) -> usize {
        self.gate.state.borrow().waiting
    }

    /// Resolve once at least `n` operations wait at the gate (or it was
    /// released).
    ///
    /// # Cancel safety
    /// Cancel safe: it only observes the gate.
    pub async fn until_waiting(&self, n: usize) {
        let mut seen = self.gate.state.subscribe();
        let _ = seen.wait_for(|s| s.waiting >= n || s.released).await;
    }
}

impl Drop for HangGate {
    fn drop(&mut self) {
        self.gate.release();
    }
}
