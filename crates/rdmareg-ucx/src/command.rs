//! What submitters ask of the progress thread, and the state both share.
//!
//! The commands and their two lanes are the engine kit's
//! ([`rdmareg_engine::command`], [`rdmareg_engine::lanes`]); peer changes,
//! which carry UCX addresses, travel as [`PeerChange`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize};

use rdmareg_core::{BackendGet, NoticeSender, PeerId};
use rdmareg_engine::lifecycle::Lifecycle;
use rdmareg_engine::notices::NoticeBoard;

use crate::caller_copies::CallerCopies;
use crate::engine_address::EngineAddress;

pub(crate) use rdmareg_engine::command::Reply;

/// One request to the progress thread.
pub(crate) type Command = rdmareg_engine::command::Command<PeerChange>;

/// A change to the peer table.
#[derive(Debug)]
pub enum PeerChange {
    /// Record (or replace) how to reach `peer`: its addresses, validated
    /// and padded for `ucp_ep_create`.
    Add {
        peer: PeerId,
        address: EngineAddress,
    },
    /// Forget `peer`, closing its endpoint.
    Remove { peer: PeerId },
}

/// State the progress thread and the submitters share. Holds no UCX handle.
#[derive(Debug)]
pub struct Signals {
    /// Teardown begun, registrations held, what teardown left; the doorbell.
    pub(crate) lifecycle: Arc<Lifecycle>,
    /// Replies the thread serves whose sends UCX has not finished, over
    /// every consumer connection (kept by the request handler).
    pub(crate) served_replies_in_flight: Arc<AtomicUsize>,
    /// What same-host reads copied on the caller's thread need (see
    /// `caller_copies`).
    pub(crate) caller_copies: CallerCopies,
    /// Posts of shared lists the thread completed from their copy plan (see
    /// `progress::copy_plans`).
    pub(crate) lists_copied_by_plan: AtomicU64,
    /// Served reads asked in chunks (see `progress::chunks`).
    pub(crate) reads_asked_in_chunks: AtomicU64,
    /// Served PUTs sent in chunks of one fragment (see `progress::chunks`).
    pub(crate) puts_sent_in_chunks: AtomicU64,
    /// Notices readers sent this engine, named by the address of their
    /// connection's reply endpoint (see `progress::notices`).
    pub(crate) notices: Arc<NoticeBoard<usize>>,
    /// The number this engine's own notices carry.
    pub(crate) notice_sender: NoticeSender,
}

/// The backend front tries a same-host read on the caller's thread first
/// (see `caller_copies`), unless teardown has begun.
impl rdmareg_engine::front::CallerCopies for Signals {
    unsafe fn try_copy(&self, request: &BackendGet) -> bool {
        // SAFETY: the caller keeps `RdmaBackend::get`'s contract, which is
        // `CallerCopies::try_copy`'s.
        unsafe { self.caller_copies.try_copy(request) }
    }

    unsafe fn try_copy_batch(&self, requests: &[BackendGet]) -> bool {
        // SAFETY: as in `try_copy`, for the whole batch.
        unsafe { self.caller_copies.try_copy_batch(requests) }
    }

    unsafe fn try_write(&self, request: &rdmareg_core::BackendPut) -> bool {
        // SAFETY: the caller keeps `RdmaBackend::put`'s contract, which is
        // `CallerCopies::try_write`'s.
        unsafe { self.caller_copies.try_write(request) }
    }

    fn withdraw_destination(&self, region_id: u64) {
        self.caller_copies.withdraw_destination(region_id);
    }

    fn yield_due(&self) -> bool {
        crate::caller_copies::yield_due()
    }
}
