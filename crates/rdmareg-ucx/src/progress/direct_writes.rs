//! Same-host writes as kernel copies (`process_vm_writev`) into the
//! owner's process, under its release table's lock.
//!
//! A PUT whose key is a writable same-host key (lane 4,
//! `read_protocol::SameHostKey`) is copied one-sided when everything a
//! direct read needs holds (the owner's process, token and release table
//! are published and this engine's direct lane reaches the owner's) and
//! the range lies inside the key's. Anything else goes through the owner
//! (`puts`), which checks the write itself.
//!
//! # Contract
//!
//! - **Nothing is written unless the registration is live under the
//!   lock**: the write takes the slot's lock and checks its tag
//!   ([`ReleaseView::lock_for_write`](crate::release_table::ReleaseView)),
//!   and the owner's unmap waits for that lock (`release_table`,
//!   "Writers"). A slot found retired fails the PUT with `RegionNotFound`,
//!   nothing written.
//! - **The owner process is checked right before the write**, and the
//!   copy itself is `process_writes`'s: the owner's token is read under
//!   its pid first, and a mismatch fails the PUT as "owner gone" with
//!   nothing written.
//! - **A PUT completes on the progress thread**, before its answer is
//!   sent: the source is read only inside the copy, so it is free once
//!   the answer arrives. The deadline does not apply: the copy
//!   cannot be stopped once started.
//! - **A refused copy** (`EPERM`, `ENOSYS`) sends the peer's same-host
//!   reads and writes through its owner from then on, this PUT included.
//! - The owner learns nothing of a direct write: only the writer's answer
//!   (or its notice) says it landed. A writer killed mid-copy can leave
//!   the range partly written, page by page.

use rdmareg_core::{BackendPut, PeerId, RdmaError};

use super::Engine;
use super::process_writes::{WriteEntry, copy_batch_into_process};
use crate::owner_process::SameHostSource;
use crate::read_protocol::ReadKey;

/// PUTs of a batch, each with the index its answer goes to.
type Indexed = Vec<(usize, BackendPut)>;

/// Answers, each with the index of the PUT it answers.
type Answers = Vec<(usize, Result<(), RdmaError>)>;

/// One peer's PUTs the direct lane may take: their candidates and the
/// requests themselves, for the owner if the lane cannot write them.
struct PeerWrites {
    peer: PeerId,
    candidates: Vec<Candidate>,
    requests: Indexed,
}

/// A PUT of a batch that the direct lane may take: its entry and the
/// release slot and tag its key names.
#[derive(Debug)]
struct Candidate {
    index: usize,
    entry: WriteEntry,
    slot: u32,
    tag: u64,
}

impl Engine {
    /// Writes one-sided every PUT of `requests` (each with the index its
    /// answer goes to) that its key and its peer allow (module docs):
    /// returns the answers of those written or failed here, and hands back
    /// the rest for the owner. The PUTs of one peer share one lock hold on
    /// their slots, one token read and as few `process_vm_writev` calls as
    /// the vector limit allows.
    pub(super) fn write_directly(&mut self, requests: Indexed) -> (Answers, Indexed) {
        let mut answered = Vec::new();
        let mut through_owner = Vec::new();
        let mut by_peer: Vec<PeerWrites> = Vec::new();
        for (index, request) in requests {
            let Some(candidate) = self.direct_candidate(index, &request) else {
                through_owner.push((index, request));
                continue;
            };
            match by_peer
                .iter_mut()
                .find(|writes| writes.peer == request.peer)
            {
                Some(writes) => {
                    writes.candidates.push(candidate);
                    writes.requests.push((index, request));
                }
                None => by_peer.push(PeerWrites {
                    peer: request.peer,
                    candidates: vec![candidate],
                    requests: vec![(index, request)],
                }),
            }
        }
        for PeerWrites {
            peer,
            candidates,
            requests: held,
        } in by_peer
        {
            // Not `copy_source`: its memo lives only until a turn's reads
            // are copied, and no read may follow this to clear it.
            let owner = match self.look_up_copy_source(peer) {
                SameHostSource::Copy(owner) => owner,
                SameHostSource::Gone => {
                    let gone = RdmaError::backend(format!(
                        "ucx: the same-host owner process of {peer} is gone"
                    ));
                    answered.extend(
                        held.into_iter()
                            .map(|(index, _)| (index, Err(gone.clone()))),
                    );
                    continue;
                }
                SameHostSource::NotCopied | SameHostSource::ThroughOwner => {
                    through_owner.extend(held);
                    continue;
                }
            };
            let Some(table) = owner.release() else {
                through_owner.extend(held);
                continue;
            };
            let wanted: Vec<(u32, u64)> = candidates.iter().map(|c| (c.slot, c.tag)).collect();
            let locks = table.lock_slots_for_write(&wanted);
            let (live, released): (Vec<&Candidate>, Vec<&Candidate>) = candidates
                .iter()
                .partition(|c| locks.is_live(c.slot, c.tag));
            answered.extend(
                released
                    .iter()
                    .map(|c| (c.index, Err(RdmaError::RegionNotFound))),
            );
            let entries: Vec<WriteEntry> = live.iter().map(|c| c.entry).collect();
            // SAFETY: every source lies inside a region this engine mapped,
            // checked when the candidate was made, which cannot be unmapped
            // before this returns (unmaps run on this thread); every target
            // is inside its key's range of a registration whose slot is live
            // and locked, so the owner's unmap waits for `locks`.
            let outcomes = unsafe { copy_batch_into_process(&owner, &entries) };
            drop(locks);
            let mut held = held;
            let mut refused = false;
            for (candidate, outcome) in live.iter().zip(outcomes) {
                match outcome {
                    Ok(()) => answered.push((candidate.index, Ok(()))),
                    Err(err) if err.is_refusal() => {
                        // Written through the owner instead, with the rest.
                        refused = true;
                        if let Some(at) = held.iter().position(|(i, _)| *i == candidate.index) {
                            through_owner.push(held.swap_remove(at));
                        }
                    }
                    Err(err) => {
                        if err.is_gone() {
                            tracing::debug!(%peer, "same-host owner process gone; its same-host transfers fail from now on");
                            self.stop_copying_from(peer, SameHostSource::Gone);
                        }
                        answered.push((
                            candidate.index,
                            Err(RdmaError::backend(format!(
                                "ucx: same-host write to {peer} failed: {err}"
                            ))),
                        ));
                    }
                }
            }
            if refused {
                tracing::debug!(%peer, "same-host writes refused; writing through the owner");
                self.stop_copying_from(peer, SameHostSource::ThroughOwner);
            }
        }
        (answered, through_owner)
    }

    /// `request` as a direct-lane write, if its key grants a write this
    /// engine can make one-sided and its ranges check out; `None` leaves it
    /// to the owner (which refuses what is wrong with it).
    fn direct_candidate(&mut self, index: usize, request: &BackendPut) -> Option<Candidate> {
        self.direct.as_ref()?;
        let (source, len, _) = self
            .checked_destination(
                request.local_region_id,
                request.local_offset,
                request.len,
                request.remote_addr,
            )
            .ok()?;
        let decoded = self.decoded_key(&request.packed_key)?;
        let ReadKey::SameHost(key) = &*decoded.key else {
            return None;
        };
        if !decoded.direct_well_formed
            || !key.access.allows_write()
            || !key.covers(request.remote_addr, request.len)
        {
            return None;
        }
        Some(Candidate {
            index,
            entry: WriteEntry {
                remote_addr: request.remote_addr,
                source,
                len,
            },
            slot: key.release_slot,
            tag: key.release_tag(),
        })
    }
}
