//! [`Events`]: what UCX callbacks leave for the loop.
//!
//! UCX runs callbacks inside the loop's own calls (`ucp_worker_progress`,
//! endpoint close, worker destroy). A callback does the latency-critical part
//! itself — it answers the waiting caller — and records the rest here:
//! bookkeeping that needs the engine's tables (a region's in-flight count, a
//! remote key's users, freeing the request) and that must not run inside
//! UCX. The loop drains this after every UCX call that can call back.
//!
//! Callbacks reach it through a raw pointer, so it lives in a `Box` whose
//! address the engine keeps stable and frees only after the worker is
//! destroyed. Mutation goes through `RefCell`s: the loop never holds a borrow
//! across a UCX call, so a callback never finds one taken.

use std::cell::RefCell;

use ucx_sys::ucs_status_t;

/// Completion records waiting for the loop.
#[derive(Debug, Default)]
pub(crate) struct Events {
    /// `(op slot, status)` of GET requests that completed.
    pub(crate) completed_gets: RefCell<Vec<(u32, ucs_status_t)>>,
    /// `(endpoint serial, status)` of endpoints UCX declared failed.
    pub(crate) failed_endpoints: RefCell<Vec<(u64, ucs_status_t)>>,
}

impl Events {
    /// Whether anything waits for the loop.
    pub(crate) fn is_empty(&self) -> bool {
        self.completed_gets.borrow().is_empty() && self.failed_endpoints.borrow().is_empty()
    }
}
