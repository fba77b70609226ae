//! [`Events`]: the state UCX callbacks share with the loop.
//!
//! UCX runs callbacks inside the loop's own calls. A callback does the
//! latency-critical part itself (a consumer's reply handler copies the
//! bytes and completes the read; an owner's request handler checks the read
//! and sends the reply) and records here the bookkeeping that needs the
//! engine's tables and must not run inside UCX; the loop drains the records
//! after every UCX call that can call back.
//!
//! Callbacks reach this through a raw pointer, so it lives in a `Box` freed
//! only after the worker is destroyed. Mutation goes through `Cell`s and
//! `RefCell`s: nobody holds a borrow across a UCX call, so none is ever
//! found taken.

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rdmareg_engine::notices::NoticeBoard;
use rdmareg_engine::served::consumer::{Completion, Consumer, ReadId};
use rdmareg_engine::served::writer::{WriteId, Writer};
use rdmareg_engine::served::{Owner, OwnerConfig};
use ucx_sys::{ucp_worker_h, ucs_status_t};

use super::ops::GetOp;
use super::ucp::MemHandle;

/// What callbacks and the loop share.
#[derive(Debug)]
pub(crate) struct Events {
    /// Op slots of reads whose destination UCX has let go of (completed, or
    /// to be completed by the loop).
    pub(crate) finished_reads: RefCell<Vec<u32>>,
    /// `(op slot, status)` of read-request sends that completed.
    pub(crate) sent_requests: RefCell<Vec<(u32, ucs_status_t)>>,
    /// `(endpoint serial, status)` of endpoints UCX declared failed.
    pub(crate) failed_endpoints: RefCell<Vec<(u64, ucs_status_t)>>,
    /// Regions the owner finished unmapping (`Action::Unmapped`): no
    /// reply reads them any more.
    pub(crate) unmapped: RefCell<Vec<u64>>,
    /// Addresses of the records handed to UCX with reply sends still in
    /// flight; teardown frees those whose callback never ran once the worker
    /// is gone (`serve`).
    pub(crate) reply_records: RefCell<HashSet<usize>>,
    /// The same for notice sends (`notices`).
    pub(crate) notice_records: RefCell<HashSet<usize>>,
    /// The number of the last notice this engine sent (`notices`).
    pub(crate) notice_sequence: Cell<u64>,
    /// Where notices readers send this engine go; `None` only in tests
    /// that build an `Events` alone.
    pub(crate) notices: Option<Arc<NoticeBoard<usize>>>,
    /// The consumer side of served reads: the engine kit's state machine,
    /// holding each read from its request until UCX lets go of its
    /// destination. Endpoints are named by their UCP handle's address, freed
    /// only after their reads were told it closed.
    pub(crate) consumer: RefCell<Consumer<usize, *mut GetOp>>,
    /// The owner side of served reads: the engine kit's state machine,
    /// which admits each request (`serve`). Connections are named by the
    /// address of the endpoint UCX hands the request handler.
    pub(crate) owner: RefCell<Owner<usize>>,
    /// The writer side of served writes: the engine kit's state machine,
    /// holding each write from its request until UCX ended its send and
    /// its owner answered (`puts`).
    pub(crate) writer: RefCell<Writer<usize, super::puts::PutValue>>,
    /// `(write, status)` of write sends UCX ended.
    pub(crate) put_sends: RefCell<Vec<(WriteId, ucs_status_t)>>,
    /// Records of write sends still in flight, freed at teardown if their
    /// callback never ran (`puts`).
    pub(crate) put_records: RefCell<HashSet<usize>>,
    /// The payload of the write request whose handler is running
    /// (`serve_writes`).
    pub(crate) write_payload: Cell<Option<super::serve_writes::WritePayload>>,
    /// The memory handle of each registration the owner serves, for
    /// zero-copy replies.
    pub(crate) served_memh: RefCell<HashMap<u64, MemHandle>>,
    /// Served replies unfinished, for other threads
    /// (`UcxEngine::served_replies_in_flight`).
    pub(crate) served_gauge: Arc<AtomicUsize>,
    /// The worker, for receiving rendezvous data inside a handler. Null
    /// until the worker exists and again once it is destroyed.
    pub(crate) worker: Cell<ucp_worker_h>,
    /// The largest active-message header the worker can send (0 until the
    /// worker exists): bounds the entries of a list request or reply.
    pub(crate) max_am_header: Cell<usize>,
    /// Set when teardown begins: reads cancelled from then on fail with
    /// `ShuttingDown`.
    pub(crate) tearing_down: Cell<bool>,
    /// Messages dropped as malformed or matching no read, for the logs
    /// (the owner counts its own).
    pub(crate) dropped_messages: Cell<u64>,
    /// Steps this turn that left the next move to another thread: a read
    /// request sent, a read completed, a reply sent (see "Handing over" in
    /// the loop's docs).
    pub(crate) hand_offs: Cell<u32>,
    /// Whether this engine, as an owner, replies to a list in replies of at
    /// most one tcp fragment each on tcp-only connections (`read_lists`); off
    /// where the operator shapes UCX's protocols
    /// (`UcxConfig::fragment_chunks_allowed`).
    pub(crate) fragment_sized_replies: Cell<bool>,
    /// The transport list leaves a peer no lane but tcp
    /// (`UcxSettings::every_lane_is_tcp`), so list replies go one tcp
    /// fragment each; no endpoint is ever asked.
    pub(crate) every_lane_is_tcp: Cell<bool>,
    /// Ranges one zero-copy fragment carries on a tcp-only connection
    /// (`read_lists::copied_into_segments`), from
    /// `UcxConfig::tcp_ranges_per_zero_copy_fragment`.
    pub(crate) tcp_ranges_per_zero_copy_fragment: Cell<usize>,
}

impl Default for Events {
    fn default() -> Self {
        Events {
            finished_reads: RefCell::default(),
            sent_requests: RefCell::default(),
            failed_endpoints: RefCell::default(),
            unmapped: RefCell::default(),
            reply_records: RefCell::default(),
            notice_records: RefCell::default(),
            notice_sequence: Cell::new(0),
            notices: None,
            consumer: RefCell::default(),
            owner: RefCell::new(Owner::new(OwnerConfig {
                max_replies_per_endpoint:
                    crate::UcxConfig::DEFAULT_MAX_SERVED_REPLIES_PER_CONNECTION,
                ..OwnerConfig::default()
            })),
            writer: RefCell::new(Writer::new()),
            put_sends: RefCell::default(),
            put_records: RefCell::default(),
            write_payload: Cell::new(None),
            served_memh: RefCell::default(),
            served_gauge: Arc::default(),
            worker: Cell::new(std::ptr::null_mut()),
            max_am_header: Cell::new(0),
            tearing_down: Cell::new(false),
            dropped_messages: Cell::new(0),
            hand_offs: Cell::new(0),
            fragment_sized_replies: Cell::new(false),
            every_lane_is_tcp: Cell::new(false),
            tcp_ranges_per_zero_copy_fragment: Cell::new(
                super::read_lists::ZERO_COPY_RANGES_PER_FRAGMENT,
            ),
        }
    }
}

impl Events {
    /// Counts a message dropped as malformed or matching no read.
    pub(crate) fn dropped_message(&self) {
        self.dropped_messages.set(self.dropped_messages.get() + 1);
    }

    /// Takes every completion the consumer machine holds: each finishes its
    /// op (returning to its caller) and queues the slot for the loop. Called
    /// after every input to the machine, inside callbacks too, so a caller
    /// wakes as soon as its read completes.
    pub(crate) fn complete_reads(&self) {
        loop {
            // The borrow ends before the op is finished.
            let next = self.consumer.borrow_mut().poll_completion();
            let Some(Completion {
                payload: op,
                outcome,
                ..
            }) = next
            else {
                return;
            };
            // SAFETY: an op leaves the machine only through this completion, so
            // it is an active slot; slots outlive the worker, and the loop
            // and callbacks touch them only between UCX calls.
            let op = unsafe { &mut *op };
            op.finish(outcome);
            self.finished_reads.borrow_mut().push(op.slot);
        }
    }

    /// The driver value of a read the machine still holds.
    pub(crate) fn op_of(&self, read: ReadId) -> Option<*mut GetOp> {
        self.consumer.borrow().payload(read).copied()
    }

    /// Publishes how many served replies are unfinished.
    pub(crate) fn publish_served_gauge(&self) {
        let leases = self.owner.borrow().leases_in_flight();
        self.served_gauge.store(leases, Ordering::Relaxed);
    }

    /// Counts a step whose next move belongs to another thread.
    pub(crate) fn handed_off(&self) {
        self.hand_offs.set(self.hand_offs.get().saturating_add(1));
    }

    /// Whether any record waits for the loop.
    pub(crate) fn is_empty(&self) -> bool {
        self.finished_reads.borrow().is_empty()
            && self.sent_requests.borrow().is_empty()
            && self.put_sends.borrow().is_empty()
            && self.failed_endpoints.borrow().is_empty()
            && self.unmapped.borrow().is_empty()
    }
}
