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
//! - **The owner process is checked right before the write**: the owner's
//!   token is read under its pid first, and a mismatch fails the PUT as
//!   "owner gone" with nothing written. `process_vm_writev` cannot read the
//!   token in its own call, as a vectored read does; a pid is reused only
//!   after its process was reaped and the kernel went once around the
//!   whole pid space, which does not happen between two system calls.
//! - **A PUT completes on the progress thread**, before its answer is
//!   sent: the source is read by the kernel only inside the call, so it is
//!   free once the answer arrives. The deadline does not apply: the copy
//!   cannot be stopped once started.
//! - **A refused copy** (`EPERM`, `ENOSYS`) sends the peer's same-host
//!   reads and writes through its owner from then on, this PUT included.
//! - The owner learns nothing of a direct write: only the writer's answer
//!   (or its notice) says it landed. A writer killed mid-copy can leave
//!   the range partly written, page by page.

use rdmareg_core::{BackendPut, PeerId, RdmaError};

use super::Engine;
use super::vectored::{CopyError, last_errno};
use crate::owner_process::{OwnerProcess, SameHostSource, TOKEN_LEN};
use crate::read_protocol::ReadKey;

/// Most ranges one `process_vm_writev` may name on either side
/// (`UIO_MAXIOV`).
const MAX_VECTORS: usize = 1024;

/// One write of a batch copied into the owner: `len` bytes at `source`
/// to `remote_addr`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WriteEntry {
    pub(crate) remote_addr: u64,
    pub(crate) source: *const u8,
    pub(crate) len: usize,
}

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

/// Copies `len` bytes at `source` into `owner` at `remote_addr`, after
/// reading the owner's token under the same id (module docs).
///
/// # Safety
/// `source..source + len` is readable memory of this process until this
/// returns.
pub(crate) unsafe fn copy_into_process(
    owner: &OwnerProcess,
    remote_addr: u64,
    source: *const u8,
    len: usize,
) -> Result<(), CopyError> {
    let entry = WriteEntry {
        remote_addr,
        source,
        len,
    };
    // SAFETY: this function's contract, for a batch of one.
    let mut outcomes = unsafe { copy_batch_into_process(owner, &[entry]) };
    outcomes.pop().unwrap_or(Err(CopyError(libc::EIO)))
}

/// Copies every entry into `owner`, after reading the owner's token under
/// the same id once (module docs); one outcome per entry, in order. The
/// kernel stops a call at the first byte it cannot write, and after
/// `MAX_RW_COUNT` bytes (2 GiB less a page) in any case, with no error
/// either way: the next call starts where it stopped, inside an entry if
/// need be. A call that writes nothing fails the entry it starts in (an
/// unmapped byte), so each call either writes or fails an entry and the
/// loop cannot spin.
///
/// # Safety
/// Every entry's `source..source + len` is readable memory of this process
/// until this returns.
pub(crate) unsafe fn copy_batch_into_process(
    owner: &OwnerProcess,
    entries: &[WriteEntry],
) -> Vec<Result<(), CopyError>> {
    let mut outcomes = vec![Ok(()); entries.len()];
    if let Err(err) = check_token(owner) {
        outcomes.fill(Err(err));
        return outcomes;
    }
    let Ok(pid) = libc::pid_t::try_from(owner.copy_by()) else {
        outcomes.fill(Err(CopyError(libc::ESRCH)));
        return outcomes;
    };
    let mut local = Vec::with_capacity(entries.len().min(MAX_VECTORS));
    let mut remote = Vec::with_capacity(entries.len().min(MAX_VECTORS));
    // The first entry not wholly written, and how much of it is.
    let mut next = 0;
    let mut written_of_next = 0;
    while next < entries.len() {
        let call = &entries[next..(next + MAX_VECTORS).min(entries.len())];
        local.clear();
        remote.clear();
        for (at, entry) in call.iter().enumerate() {
            let skip = if at == 0 { written_of_next } else { 0 };
            local.push(libc::iovec {
                iov_base: entry.source.wrapping_add(skip) as *mut libc::c_void,
                iov_len: entry.len - skip,
            });
            remote.push(libc::iovec {
                iov_base: (entry.remote_addr as usize).wrapping_add(skip) as *mut libc::c_void,
                iov_len: entry.len - skip,
            });
        }
        // SAFETY: both vectors hold at most UIO_MAXIOV initialised iovecs
        // covering the same number of bytes; the local ranges are only
        // read, inside the caller's readable sources; the remote ranges are
        // written by the kernel in the other process, checked against its
        // page tables there.
        let written = unsafe {
            libc::process_vm_writev(
                pid,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
        if written < 0 {
            let errno = last_errno();
            if errno == libc::ESRCH || CopyError(errno).is_refusal() {
                // Nothing more can be written to this owner.
                outcomes[next..].fill(Err(CopyError(errno)));
                return outcomes;
            }
            outcomes[next] = Err(CopyError(errno));
            (next, written_of_next) = (next + 1, 0);
            continue;
        }
        if written == 0 && entries[next].len > written_of_next {
            // Not a byte of the call's first entry is writable: it fails
            // alone (with what an earlier call wrote of it).
            outcomes[next] = Err(CopyError(libc::EFAULT));
            (next, written_of_next) = (next + 1, 0);
            continue;
        }
        let mut left = written as usize + written_of_next;
        while next < entries.len() && left >= entries[next].len {
            left -= entries[next].len;
            next += 1;
        }
        written_of_next = left;
    }
    outcomes
}

/// Reads `owner`'s token under the id copies name it by: `Ok` if the
/// process there is the owner.
fn check_token(owner: &OwnerProcess) -> Result<(), CopyError> {
    let Ok(pid) = libc::pid_t::try_from(owner.copy_by()) else {
        return Err(CopyError(libc::ESRCH));
    };
    let mut token = [0u8; TOKEN_LEN];
    let local = libc::iovec {
        iov_base: token.as_mut_ptr().cast(),
        iov_len: TOKEN_LEN,
    };
    let remote = libc::iovec {
        iov_base: owner.token_addr() as usize as *mut libc::c_void,
        iov_len: TOKEN_LEN,
    };
    // SAFETY: one iovec on each side, of equal length; the local one is
    // `token`, ours and writable; the remote one is only read, by the
    // kernel, in the other process.
    let read = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    if read < 0 {
        let errno = last_errno();
        // An unmapped token address is another process under the pid.
        return Err(CopyError(if errno == libc::EFAULT {
            libc::ESRCH
        } else {
            errno
        }));
    }
    if read != TOKEN_LEN as isize || !owner.is_token(&token) {
        return Err(CopyError(libc::ESRCH));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::owner_process::this_process_token;

    fn this_process() -> OwnerProcess {
        OwnerProcess::this_process()
    }

    #[test]
    fn a_write_lands_whole_in_the_owner() {
        let _ = this_process_token();
        let source: Vec<u8> = (0..=255u8).cycle().take(3 * 4096 + 17).collect();
        let mut target = vec![0u8; source.len()];
        // SAFETY: `source` is ours and readable across the call.
        let written = unsafe {
            copy_into_process(
                &this_process(),
                target.as_mut_ptr() as u64,
                source.as_ptr(),
                source.len(),
            )
        };
        assert_eq!(written, Ok(()));
        assert_eq!(target, source);
    }

    #[test]
    fn a_write_to_another_token_writes_nothing() {
        let _ = this_process_token();
        let source = [7u8; 64];
        let mut target = [0u8; 64];
        let stranger = this_process().with_token([0x5A; TOKEN_LEN]);
        // SAFETY: as above.
        let written = unsafe {
            copy_into_process(
                &stranger,
                target.as_mut_ptr() as u64,
                source.as_ptr(),
                source.len(),
            )
        };
        assert!(written.is_err_and(|err| err.is_gone()));
        assert_eq!(target, [0u8; 64]);
    }

    #[test]
    fn a_batch_lands_and_an_unwritable_entry_fails_alone() {
        let _ = this_process_token();
        let sources: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i + 1; 5000]).collect();
        let mut targets = vec![vec![0u8; 5000]; 3];
        let mut entries: Vec<WriteEntry> = sources
            .iter()
            .zip(&mut targets)
            .map(|(source, target)| WriteEntry {
                remote_addr: target.as_mut_ptr() as u64,
                source: source.as_ptr(),
                len: source.len(),
            })
            .collect();
        entries.insert(
            1,
            WriteEntry {
                remote_addr: 8,
                source: sources[0].as_ptr(),
                len: 64,
            },
        );
        // SAFETY: every source is ours and readable across the call.
        let outcomes = unsafe { copy_batch_into_process(&this_process(), &entries) };
        assert_eq!(
            outcomes,
            [Ok(()), Err(CopyError(libc::EFAULT)), Ok(()), Ok(())]
        );
        assert_eq!(targets, sources);
    }

    /// An entry the kernel stops inside (its second page is not writable)
    /// fails after its writable part was written, without the loop
    /// spinning on it, and the entry after it still lands.
    #[test]
    fn an_entry_stopped_inside_fails_and_the_next_still_lands() {
        let _ = this_process_token();
        // SAFETY: a fresh anonymous mapping of two pages, the second made
        // inaccessible; unmapped at the end of the test.
        let pages = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(pages, libc::MAP_FAILED);
        // SAFETY: the second page of the mapping above, inside it.
        let second_page = unsafe { pages.cast::<u8>().add(4096) };
        // SAFETY: changes the protection of that page only, which nothing
        // refers to.
        let protected = unsafe { libc::mprotect(second_page.cast(), 4096, libc::PROT_NONE) };
        assert_eq!(protected, 0);
        let source = vec![7u8; 8192];
        let mut after = vec![0u8; 4096];
        let entries = [
            WriteEntry {
                remote_addr: pages as u64,
                source: source.as_ptr(),
                len: 8192,
            },
            WriteEntry {
                remote_addr: after.as_mut_ptr() as u64,
                source: source.as_ptr(),
                len: 4096,
            },
        ];
        // SAFETY: every source is ours and readable across the call.
        let outcomes = unsafe { copy_batch_into_process(&this_process(), &entries) };
        assert_eq!(outcomes, [Err(CopyError(libc::EFAULT)), Ok(())]);
        assert_eq!(after, vec![7u8; 4096]);
        // SAFETY: the first page is readable; the mapping is unmapped once.
        unsafe {
            assert!(
                std::slice::from_raw_parts(pages.cast::<u8>(), 4096)
                    .iter()
                    .all(|&b| b == 7)
            );
            libc::munmap(pages, 8192);
        }
    }

    #[test]
    fn a_write_to_an_unmapped_address_fails() {
        let _ = this_process_token();
        let source = [7u8; 64];
        // SAFETY: as above; the kernel checks the target address.
        let written = unsafe { copy_into_process(&this_process(), 8, source.as_ptr(), 64) };
        assert_eq!(written, Err(CopyError(libc::EFAULT)));
    }
}
