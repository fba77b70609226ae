//! Kernel copies into the owner's process (`process_vm_writev`), with the
//! source staged where the kernel would copy it slowly.
//!
//! # Contract
//!
//! - **The owner's token is read first**, under the same pid the writes
//!   name, and again every [`CALLS_PER_TOKEN_CHECK`] calls: a mismatch
//!   fails every entry not yet written as "owner gone".
//!   `process_vm_writev` cannot read the token in its own call, as a
//!   vectored read does; a pid is reused only after its process was reaped
//!   and the kernel went once around the whole pid space, which does not
//!   happen within the few milliseconds between two reads.
//! - **One outcome per entry, in order.** The kernel stops a call at the
//!   first byte it cannot write, and after `MAX_RW_COUNT` bytes (2 GiB less
//!   a page) in any case, with no error either way: the next call starts
//!   where it stopped, inside an entry if need be. A call that writes
//!   nothing fails the entry it starts in (an unmapped byte), so each call
//!   either writes or fails an entry and the loop cannot spin. An empty
//!   entry is written by definition and never fails.
//! - **Staging.** The kernel copies a write one target page at a time,
//!   reading the source with the processor's string copy. Where the
//!   source's offset within its page differs from the target's, that copy
//!   runs at about half speed on some processors, while a copy from a
//!   source at the target's page offset does not (`docs/benchmarks.md`,
//!   "Same-host PUTs"). So such an entry, if at least a page long, is
//!   first copied on this thread into a staging buffer at the target's
//!   page offset, in pieces of about 64 KiB that stay in the processor's
//!   cache, and the kernel copies from there. Other entries go straight
//!   from their source. Direct entries and staged pieces share a call, up
//!   to the vector limit and the staging buffer's size.
//! - The source is read only inside [`copy_batch_into_process`], by this
//!   thread or by the kernel, so it is free once that returns.

use std::cell::RefCell;

use super::vectored::{CopyError, MAX_VECTORS, last_errno};
use crate::owner_process::{OwnerProcess, TOKEN_LEN};

/// The page size the kernel copies by (x86-64 and aarch64 Linux's base
/// page; a larger page still splits at this size's boundaries).
const PAGE: usize = 4096;

/// Bytes a staged piece may hold at most, past its page offset.
const STAGE_BYTES: usize = 64 * 1024;

/// Entries shorter than this go from their source whatever their offsets:
/// a staged entry may leave up to a page of the stage unused before it,
/// so short ones would fill it long before the vector limit and split a
/// batch of small writes into many calls, for no measured gain.
const STAGE_FROM: usize = PAGE;

/// Calls between two reads of the owner's token: a staged write of a
/// gigabyte is thousands of calls, and the token is read again every so
/// many so that no stretch of them outlasts the argument that a pid is not
/// reused meanwhile (module docs).
const CALLS_PER_TOKEN_CHECK: usize = 64;

thread_local! {
    /// This thread's staging buffer, allocated at its first staged write.
    static STAGE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// One write of a batch copied into the owner: `len` bytes at `source`
/// to `remote_addr`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WriteEntry {
    pub(crate) remote_addr: u64,
    pub(crate) source: *const u8,
    pub(crate) len: usize,
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

/// Copies every entry into `owner` (module docs); one outcome per entry,
/// in order.
///
/// # Safety
/// Every entry's `source..source + len` is readable memory of this process
/// until this returns.
pub(crate) unsafe fn copy_batch_into_process(
    owner: &OwnerProcess,
    entries: &[WriteEntry],
) -> Vec<Result<(), CopyError>> {
    let copy = |stage: Option<&mut Vec<u8>>| {
        // SAFETY: the caller's contract.
        unsafe { copy_with_stage(owner, entries, stage) }
    };
    // Only this function borrows the stage and it calls nothing that comes
    // back here; should it ever, or should a thread write while its
    // thread-locals are being destroyed, entries go unstaged.
    STAGE
        .try_with(|stage| copy(stage.try_borrow_mut().ok().as_deref_mut()))
        .unwrap_or_else(|_| copy(None))
}

/// [`copy_batch_into_process`], staging in `stage` if there is one.
///
/// # Safety
/// As [`copy_batch_into_process`].
unsafe fn copy_with_stage(
    owner: &OwnerProcess,
    entries: &[WriteEntry],
    mut stage: Option<&mut Vec<u8>>,
) -> Vec<Result<(), CopyError>> {
    let mut outcomes = vec![Ok(()); entries.len()];
    let Ok(pid) = libc::pid_t::try_from(owner.copy_by()) else {
        outcomes.fill(Err(CopyError(libc::ESRCH)));
        return outcomes;
    };
    let mut call = Call::with_capacity(entries.len().min(MAX_VECTORS));
    // The first entry not wholly written, and how much of it is.
    let mut next = 0;
    let mut written_of_next = 0;
    let mut calls = 0usize;
    loop {
        // Empty entries are written by definition; skipping them here
        // keeps a call's failure on the entry it stopped in.
        while next < entries.len() && entries[next].len == written_of_next {
            (next, written_of_next) = (next + 1, 0);
        }
        if next == entries.len() {
            return outcomes;
        }
        if calls % CALLS_PER_TOKEN_CHECK == 0 {
            if let Err(err) = check_token(owner) {
                outcomes[next..].fill(Err(err));
                return outcomes;
            }
        }
        calls += 1;
        // SAFETY: the caller's contract: every source is readable.
        unsafe { call.plan(entries, next, written_of_next, stage.as_deref_mut()) };
        // SAFETY: both vectors hold at most UIO_MAXIOV initialised iovecs,
        // pairwise of equal length; the local ranges are only read, inside
        // the caller's readable sources or the stage, which stays
        // untouched until the next plan; the remote ranges are written by
        // the kernel in the other process, checked against its page tables
        // there.
        let written = unsafe {
            libc::process_vm_writev(
                pid,
                call.local.as_ptr(),
                call.local.len() as libc::c_ulong,
                call.remote.as_ptr(),
                call.remote.len() as libc::c_ulong,
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
        if written == 0 {
            // Not a byte of the call's first entry (not empty, above) is
            // writable: it fails alone, with what an earlier call wrote of
            // it.
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
}

/// The two sides of one `process_vm_writev`.
struct Call {
    local: Vec<libc::iovec>,
    remote: Vec<libc::iovec>,
}

impl Call {
    fn with_capacity(vectors: usize) -> Call {
        Call {
            local: Vec::with_capacity(vectors),
            remote: Vec::with_capacity(vectors),
        }
    }

    /// Plans the next call from `written_of_next` bytes into entry
    /// `next`: entries go in order, whole or (once the stage is full) up
    /// to a piece of one, until the vector limit. An entry whose source
    /// and target differ in page offset is copied into `stage` at the
    /// target's offset (module docs); with no stage, every entry goes
    /// from its source. The call's bytes are, in order, the entries'
    /// from that point on, with no gap.
    ///
    /// # Safety
    /// Every entry's `source..source + len` is readable memory.
    unsafe fn plan(
        &mut self,
        entries: &[WriteEntry],
        next: usize,
        written_of_next: usize,
        mut stage: Option<&mut Vec<u8>>,
    ) {
        self.local.clear();
        self.remote.clear();
        let mut staged_end = 0;
        let mut from = written_of_next;
        for entry in &entries[next..] {
            if self.local.len() == MAX_VECTORS {
                break;
            }
            let source = entry.source.wrapping_add(from);
            let target = (entry.remote_addr as usize).wrapping_add(from);
            let len = entry.len - from;
            from = 0;
            let offsets_differ = (source as usize ^ target) & (PAGE - 1) != 0;
            let staging = stage
                .as_deref_mut()
                .filter(|_| offsets_differ && len >= STAGE_FROM);
            let Some(stage) = staging else {
                self.push(source, target, len);
                continue;
            };
            if stage.is_empty() {
                stage.resize(STAGE_BYTES + PAGE, 0);
            }
            // The first place at or after `staged_end` with the target's
            // page offset.
            let base = stage.as_ptr() as usize;
            let here = base + staged_end;
            let at = here + (target.wrapping_sub(here) & (PAGE - 1)) - base;
            if at >= stage.len() {
                break;
            }
            let piece = len.min(stage.len() - at);
            // SAFETY: `source..source + piece` is readable (the caller's
            // contract, `piece <= len`); `stage[at..at + piece]` is inside
            // the stage, which no source overlaps.
            unsafe {
                std::ptr::copy_nonoverlapping(source, stage.as_mut_ptr().add(at), piece);
            }
            self.push(stage[at..].as_ptr(), target, piece);
            staged_end = at + piece;
            if piece < len {
                // The stage is full inside this entry.
                break;
            }
        }
    }

    fn push(&mut self, source: *const u8, target: usize, len: usize) {
        self.local.push(libc::iovec {
            iov_base: source as *mut libc::c_void,
            iov_len: len,
        });
        self.remote.push(libc::iovec {
            iov_base: target as *mut libc::c_void,
            iov_len: len,
        });
    }
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
mod tests;
