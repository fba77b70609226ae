//! Descriptor leases over libfabric: the engine kit's owner keeps them
//! (`rdmareg_engine::served::leases`); this engine issues their keys,
//! serves their reads and gives the owner the time.
//!
//! # The contract kept here
//!
//! - **A lease key is owner-served** (`key`, "Lease keys"): the region's
//!   id, range and owner address with the lease's capability, so every
//!   read under a lease is a request the owner machine judges, on either
//!   read path. On [`ReadPath::OneSided`] the region's own key is read
//!   with `fi_read`, which nothing could refuse once the lease ended; so
//!   the first lease such an engine makes posts the request receives that
//!   path otherwise never posts ([`Engine::open_request_receives`]), before
//!   the key is returned, and a consumer on that path reads a lease key by
//!   request as the owner-served path does (`reads`). Registrations on that
//!   path grant `FI_SEND | FI_RECV` beside the RMA access for that reason
//!   (`Fabric::register`). Once the receives are posted, a request under a
//!   region's own capability is served too: that grants nothing its
//!   one-sided key did not.
//! - **Reads are judged at the time they are served**: once any lease was
//!   made, the owner is given the time before each request or list it
//!   judges ([`Engine::give_owner_time`]).
//! - **A release is a message of the notice series** (`notices`): kind 1
//!   of the notice wire, the lease key's region and capability, sent like
//!   a notice with the next number of this engine's series, and handed to
//!   the owner machine by the notice receive, never to the notice board.
//!   The owner counts it once per reader; a reader is its sender number
//!   alone ([`RELEASE_CONNECTION`]), since the provider names a message's
//!   sender unreliably (`FI_ADDR_NOTAVAIL` until the sender's address is in
//!   the vector, and always where the engine does not ask for `FI_SOURCE`:
//!   on `shm` and on the one-sided path), and a reader named two ways would
//!   otherwise count twice.
//!
//! Not covered: on the one-sided path neither side asks the provider to
//! name a request's sender (`FI_SOURCE`), so an owner replies to the
//! address a lease read names, as owner-served `shm` does; and a consumer
//! on that path sends its owner no liveness probes, so a lease read of an
//! owner that died after taking the request ends at its deadline.

use std::time::Instant;

use futures::FutureExt;
use rdmareg_backend::BackendLease;
use rdmareg_core::{LeaseTerms, RdmaError};

use crate::key::PackedKey;

use super::*;

/// The connection every release is counted under: a reader is its sender
/// number alone (module docs).
pub(super) const RELEASE_CONNECTION: u64 = 0;

impl Engine {
    /// `Command::Lease`: hands `region` out under the lease `capability`
    /// with `terms`, replying with its key and the future of its end.
    pub(super) fn make_lease(
        &mut self,
        region: u64,
        capability: [u8; CAPABILITY_LEN],
        terms: LeaseTerms,
        reply: Reply<BackendLease>,
    ) {
        if self.closing {
            let _ = reply.send(Err(RdmaError::ShuttingDown));
            return;
        }
        let Some((ptr, len)) = self
            .regions
            .get(&region)
            .filter(|held| !held.unmapping)
            .map(|held| (held.ptr, held.len))
        else {
            let _ = reply.send(Err(RdmaError::RegionNotFound));
            return;
        };
        let released = match self
            .owner
            .register_lease(region, capability, terms, Instant::now())
        {
            Ok(released) => released,
            Err(err) => {
                let _ = reply.send(Err(err));
                return;
            }
        };
        // Before the key leaves: its reads are requests.
        self.open_request_receives();
        let packed_key = PackedKey {
            owner_served: true,
            virt_addr: false,
            region_id: region,
            capability,
            mr_key: 0,
            base: ptr as u64,
            len: len as u64,
            owner: self.fabric.address.clone(),
        }
        .encode_lease();
        let _ = reply.send(Ok(BackendLease {
            packed_key,
            released: released.boxed(),
        }));
    }

    /// Gives the owner machine the time before it judges a request, once
    /// any lease was made (a lease read's expiry is compared with it).
    pub(super) fn give_owner_time(&mut self) {
        if self.owner.is_leasing() {
            self.owner.set_time(Instant::now());
        }
    }

    /// A reader's release arrived as a notice message: the owner machine
    /// counts it (or ignores it: a capability of no live lease of the
    /// region, a reader that released already).
    pub(super) fn receive_release(&mut self, message: &[u8]) {
        let release = match rdmareg_backend::notices::wire::decode_release(message) {
            Ok(release) => release,
            Err(err) => {
                tracing::debug!(error = %err, "a malformed lease release was dropped");
                return;
            }
        };
        self.owner.set_time(Instant::now());
        self.owner.handle_release(
            RELEASE_CONNECTION,
            release.sender,
            release.region,
            &release.capability,
        );
    }
}
