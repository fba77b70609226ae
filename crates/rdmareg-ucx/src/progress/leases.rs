//! Descriptor leases over UCX: the engine kit's owner keeps them
//! (`rdmareg_engine::served::leases`); this engine issues their keys and
//! gives the owner the time.
//!
//! A lease key is a served key of lane 3 (`read_protocol`), so every read
//! under a lease goes through the owner's request handler, on every lane:
//! the same-host direct lane is one-sided, and nothing there could refuse
//! a read once the lease ended. The request handlers give the owner the
//! time before each request once any lease was made, so a read is judged
//! at the instant its request is handled. A reader's release is a message
//! of its notice series (`notices`).

use std::time::Instant;

use bytes::Bytes;
use futures::FutureExt;
use rdmareg_backend::BackendLease;
use rdmareg_core::{LeaseTerms, RdmaError};

use super::Engine;
use super::events::Events;
use crate::command::Reply;
use crate::read_protocol::ServedKey;

impl Engine {
    /// `Command::Lease`.
    pub(super) fn make_lease(
        &mut self,
        region: u64,
        capability: [u8; 16],
        terms: LeaseTerms,
        reply: Reply<BackendLease>,
    ) {
        if self.events.tearing_down.get() {
            let _ = reply.send(Err(RdmaError::ShuttingDown));
            return;
        }
        let made = self.events.owner.borrow_mut().register_lease(
            region,
            capability,
            terms,
            Instant::now(),
        );
        let lease = made.map(|released| BackendLease {
            packed_key: Bytes::copy_from_slice(
                &ServedKey {
                    region_id: region,
                    capability,
                }
                .encode_lease(),
            ),
            released: released.boxed(),
        });
        let _ = reply.send(lease);
    }
}

/// Gives the owner the time before it judges a request, once any lease
/// was made (a read's expiry is compared with it).
pub(super) fn give_time(events: &Events) {
    let mut owner = events.owner.borrow_mut();
    if owner.is_leasing() {
        owner.set_time(Instant::now());
    }
}
