//! Same-host reads as vectored kernel copies (`process_vm_readv`).
//!
//! Through UCX's cma each direct read pays a key unpack, a request and a
//! system call; the kernel copies a whole scatter list in one call, so the
//! engine does that itself, every direct read of one turn to one owner in
//! as few calls as the vector limit allows.
//!
//! # Contract
//!
//! [`copy_from_process`] runs on the progress thread and returns when every
//! entry is done, so no reply is sent while the kernel still writes. Each
//! entry gets its own outcome. Entries go in the owner's address order; the
//! kernel stops at the first byte it cannot read, so the entries wholly
//! before it succeed, the one it stopped in fails if it is the first of its
//! call (so a half-readable entry cannot make the loop spin), and the rest
//! are tried again in the next call.
//!
//! Every call reads the owner's token first ([`OwnerProcess`]). A call that
//! does not read it read another process under the owner's pid, or nothing:
//! its destinations are zeroed (the kernel copied on past the token) and it
//! and every later entry fail as if the owner were gone (`ESRCH`); earlier
//! calls keep their outcomes.

use crate::owner_process::{OwnerProcess, TOKEN_LEN};

/// Most ranges one call may name on either side (`UIO_MAXIOV`).
pub(crate) const MAX_VECTORS: usize = 1024;

/// Reads one call carries: the token takes a vector on each side.
const ENTRIES_PER_CALL: usize = MAX_VECTORS - 1;

/// One read: `len` bytes at `remote_addr` in the owner into `dest`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CopyEntry {
    pub(crate) remote_addr: u64,
    pub(crate) dest: *mut u8,
    pub(crate) len: usize,
}

/// Why a copy failed: the `errno` of the call that stopped at it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CopyError(pub(crate) i32);

impl CopyError {
    /// Whether the kernel refused this process any copy from the owner
    /// (not permitted, or no such system call): a reason to read another
    /// way, not a failure of the read.
    pub(crate) fn is_refusal(self) -> bool {
        self.0 == libc::EPERM || self.0 == libc::ENOSYS
    }

    /// Whether the owner process no longer exists: its pid is free for
    /// another process, so it must not be copied from again.
    pub(crate) fn is_gone(self) -> bool {
        self.0 == libc::ESRCH
    }
}

impl std::fmt::Display for CopyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.0 {
            libc::ESRCH => "the owner process is gone",
            libc::EFAULT => "the range is not mapped in the owner",
            libc::EPERM => "the kernel does not let this process read the owner",
            libc::ENOMEM => "the kernel is out of memory",
            _ => "the copy failed",
        };
        write!(f, "{what} ({})", std::io::Error::from_raw_os_error(self.0))
    }
}

/// Most bytes of one entry a call carries. The kernel copies at most 2 GiB
/// less a page per call and then returns a short count, as it does at a
/// byte it cannot read; an entry longer than that would be cut short as
/// the first of its call and fail. So longer entries go in pieces of this,
/// and a call stops inside one only after a whole piece.
const PIECE: usize = 1 << 30;

/// Copies every entry out of `owner`; one outcome per entry, in order.
///
/// # Safety
/// Every entry's `dest..dest + len` is writable memory of this process that
/// nothing else reads or writes until this returns.
pub(crate) unsafe fn copy_from_process(
    owner: &OwnerProcess,
    entries: &[CopyEntry],
) -> Vec<Result<(), CopyError>> {
    // SAFETY: this function's contract.
    unsafe { copy_in_pieces(owner, entries, PIECE) }
}

/// [`copy_from_process`] with entries longer than `piece` copied as pieces
/// of at most that; an entry fails with its first piece that failed.
///
/// # Safety
/// As [`copy_from_process`].
unsafe fn copy_in_pieces(
    owner: &OwnerProcess,
    entries: &[CopyEntry],
    piece: usize,
) -> Vec<Result<(), CopyError>> {
    if entries.iter().all(|entry| entry.len <= piece) {
        // SAFETY: this function's contract.
        return unsafe { copy_entries(owner, entries) };
    }
    let mut pieces = Vec::with_capacity(entries.len());
    let mut whose = Vec::with_capacity(entries.len());
    for (index, entry) in entries.iter().enumerate() {
        let mut offset = 0;
        loop {
            let len = piece.min(entry.len - offset);
            pieces.push(CopyEntry {
                remote_addr: entry.remote_addr + offset as u64,
                // Inside the entry's destination: `offset + len <= len`.
                dest: entry.dest.wrapping_add(offset),
                len,
            });
            whose.push(index);
            offset += len;
            if offset >= entry.len {
                break;
            }
        }
    }
    // SAFETY: each piece lies inside its entry's destination, covered by
    // this function's contract.
    let piece_outcomes = unsafe { copy_entries(owner, &pieces) };
    let mut outcomes = vec![Ok(()); entries.len()];
    for (index, outcome) in whose.into_iter().zip(piece_outcomes) {
        if outcomes[index].is_ok() {
            outcomes[index] = outcome;
        }
    }
    outcomes
}

/// Copies every entry out of `owner`, each at most [`PIECE`] bytes.
///
/// # Safety
/// As [`copy_from_process`].
unsafe fn copy_entries(owner: &OwnerProcess, entries: &[CopyEntry]) -> Vec<Result<(), CopyError>> {
    let mut outcomes = vec![Ok(()); entries.len()];
    let Ok(pid) = libc::pid_t::try_from(owner.copy_by()) else {
        outcomes.fill(Err(CopyError(libc::ESRCH)));
        return outcomes;
    };
    // In the owner's address order, so that ranges adjacent there merge
    // into one remote vector (see `merge_adjacent`).
    // Entries reading the same address may go in either order: each has
    // its own destination.
    let mut order: Vec<usize> = (0..entries.len()).collect();
    if !entries.is_sorted_by_key(|entry| entry.remote_addr) {
        order.sort_unstable_by_key(|&i| entries[i].remote_addr);
    }
    let mut local = Vec::with_capacity(entries.len().min(ENTRIES_PER_CALL) + 1);
    let mut remote = Vec::with_capacity(entries.len().min(ENTRIES_PER_CALL) + 1);
    let mut next = 0;
    while next < order.len() {
        let call = &order[next..(next + ENTRIES_PER_CALL).min(order.len())];
        local.clear();
        remote.clear();
        let mut token = [0u8; TOKEN_LEN];
        local.push(libc::iovec {
            iov_base: token.as_mut_ptr().cast(),
            iov_len: TOKEN_LEN,
        });
        remote.push(libc::iovec {
            iov_base: owner.token_addr() as usize as *mut libc::c_void,
            iov_len: TOKEN_LEN,
        });
        for &i in call {
            let entry = entries[i];
            merge_adjacent(&mut local, entry.dest as usize as u64, entry.len);
            merge_adjacent(&mut remote, entry.remote_addr, entry.len);
        }
        // SAFETY: both vectors hold at most UIO_MAXIOV initialised iovecs
        // covering the same number of bytes; the local ranges are writable
        // and unshared (`token` is ours, the rest by the caller's contract);
        // the remote ranges are only read, by the kernel, inside the other
        // process.
        let copied = unsafe {
            libc::process_vm_readv(
                pid,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
        // The token comes first: a call that copied anything read it. One
        // that failed with EFAULT could not read it (it cannot straddle a
        // page), so the address space under that pid is not the owner's.
        let errno = (copied < 0).then(last_errno);
        let read_the_owner = copied >= TOKEN_LEN as isize && owner.is_token(&token);
        if !read_the_owner && errno.is_none_or(|errno| errno == libc::EFAULT) {
            if copied > TOKEN_LEN as isize {
                // The kernel went on past the token: the call's destinations
                // hold that other process's bytes. None of them is kept.
                for &i in call {
                    let entry = entries[i];
                    // SAFETY: the entry's destination is writable memory of
                    // this process that only this call touches (the
                    // function's contract); the kernel's copy has returned.
                    unsafe { std::ptr::write_bytes(entry.dest, 0, entry.len) };
                }
            }
            for &i in &order[next..] {
                outcomes[i] = Err(CopyError(libc::ESRCH));
            }
            return outcomes;
        }
        if let Some(errno) = errno {
            if errno == libc::ESRCH || CopyError(errno).is_refusal() {
                // Nothing of this owner can be read: every entry left fails.
                for &i in &order[next..] {
                    outcomes[i] = Err(CopyError(errno));
                }
                return outcomes;
            }
            // Any other error (the kernel out of memory) before the token.
            outcomes[call[0]] = Err(CopyError(errno));
            next += 1;
            continue;
        }
        let mut left = copied as usize - TOKEN_LEN;
        let mut done = 0;
        while done < call.len() && left >= entries[call[done]].len {
            left -= entries[call[done]].len;
            done += 1;
        }
        if done == 0 {
            // The first range was cut short: the kernel cannot read all of
            // it, and trying it again would cut it again.
            outcomes[call[0]] = Err(CopyError(libc::EFAULT));
            done = 1;
        }
        next += done;
    }
    outcomes
}

/// The `errno` of the system call that just failed on this thread.
pub(crate) fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Appends `len` bytes at `addr` to `vectors`, extending the last vector when
/// the range starts where it ends.
///
/// The kernel treats each side's vectors as one byte stream, so merging
/// moves no byte; it saves per-vector work (the owner's pages are pinned
/// once per vector).
fn merge_adjacent(vectors: &mut Vec<libc::iovec>, addr: u64, len: usize) {
    if let Some(last) = vectors.last_mut() {
        if (last.iov_base as u64).checked_add(last.iov_len as u64) == Some(addr) {
            if let Some(merged) = last.iov_len.checked_add(len) {
                last.iov_len = merged;
                return;
            }
        }
    }
    vectors.push(libc::iovec {
        iov_base: addr as usize as *mut libc::c_void,
        iov_len: len,
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine_address::ProcessIdentity;

    fn this_process() -> OwnerProcess {
        OwnerProcess::this_process()
    }

    fn entry(source: &[u8], dest: &mut [u8]) -> CopyEntry {
        assert_eq!(source.len(), dest.len());
        CopyEntry {
            remote_addr: source.as_ptr() as u64,
            dest: dest.as_mut_ptr(),
            len: dest.len(),
        }
    }

    #[test]
    fn a_scatter_list_lands_every_block_where_it_was_asked_to() {
        let source: Vec<u8> = (0..64 * 3000).map(|i| (i % 251) as u8).collect();
        let mut dest = vec![0u8; 64 * 3000];
        // More entries than one call takes, read in a permuted order.
        let order: Vec<usize> = (0..3000).map(|i| i * 7 % 3000).collect();
        let entries: Vec<CopyEntry> = dest
            .chunks_mut(64)
            .zip(&order)
            .map(|(chunk, &block)| entry(&source[block * 64..(block + 1) * 64], chunk))
            .collect();
        // SAFETY: the destinations are `dest`'s chunks, untouched until the
        // call returns.
        let outcomes = unsafe { copy_from_process(&this_process(), &entries) };
        assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
        for (chunk, &block) in dest.chunks(64).zip(&order) {
            assert_eq!(chunk, &source[block * 64..(block + 1) * 64]);
        }
    }

    #[test]
    fn a_list_in_order_on_both_sides_lands_whole_through_merged_vectors() {
        // Blocks back to back at the source and at the destination, in the
        // same order: one vector a side per call. The second half's source
        // skips a block, so only the destination side merges across it.
        let source: Vec<u8> = (0..64 * 2001).map(|i| (i % 241) as u8).collect();
        let mut dest = vec![0u8; 64 * 2000];
        let entries: Vec<CopyEntry> = dest
            .chunks_mut(64)
            .enumerate()
            .map(|(i, chunk)| {
                let block = if i < 1000 { i } else { i + 1 };
                entry(&source[block * 64..(block + 1) * 64], chunk)
            })
            .collect();
        // SAFETY: the destinations are `dest`'s chunks, untouched until the
        // call returns.
        let outcomes = unsafe { copy_from_process(&this_process(), &entries) };
        assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
        assert_eq!(&dest[..64 * 1000], &source[..64 * 1000]);
        assert_eq!(&dest[64 * 1000..], &source[64 * 1001..]);
    }

    #[test]
    fn an_unreadable_entry_fails_alone_and_the_others_land() {
        let source = vec![0xA5u8; 4096];
        let mut dest = vec![0u8; 3 * 4096];
        let mut chunks = dest.chunks_mut(4096);
        let first = entry(&source, chunks.next().unwrap());
        let bad_dest = chunks.next().unwrap();
        let bad = CopyEntry {
            // The zero page is never mapped.
            remote_addr: 0x10,
            dest: bad_dest.as_mut_ptr(),
            len: bad_dest.len(),
        };
        let last = entry(&source, chunks.next().unwrap());
        // SAFETY: as above.
        let outcomes = unsafe { copy_from_process(&this_process(), &[first, bad, last]) };
        assert_eq!(outcomes[0], Ok(()));
        assert_eq!(outcomes[1], Err(CopyError(libc::EFAULT)));
        assert_eq!(outcomes[2], Ok(()));
        assert!(dest[..4096].iter().all(|&b| b == 0xA5));
        assert!(dest[4096..8192].iter().all(|&b| b == 0));
        assert!(dest[8192..].iter().all(|&b| b == 0xA5));
    }

    #[test]
    fn a_range_that_runs_off_its_mapping_fails_without_looping() {
        // Two pages, the second unmapped: a range across the boundary can be
        // read only in part.
        let page = 4096;
        // SAFETY: a fresh anonymous mapping of two pages, private to this
        // test; the second page is unmapped before use and the first
        // unmapped at the end.
        let base = unsafe {
            let base = libc::mmap(
                std::ptr::null_mut(),
                2 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(base, libc::MAP_FAILED);
            assert_eq!(libc::munmap(base.cast::<u8>().add(page).cast(), page), 0);
            base
        };
        let mut dest = vec![0u8; page];
        let straddling = CopyEntry {
            remote_addr: base as u64 + (page / 2) as u64,
            dest: dest.as_mut_ptr(),
            len: page,
        };
        // SAFETY: `dest` is untouched until the call returns.
        let outcomes = unsafe { copy_from_process(&this_process(), &[straddling]) };
        assert_eq!(outcomes, vec![Err(CopyError(libc::EFAULT))]);
        // SAFETY: the first page of the mapping above, unmapped once.
        unsafe { libc::munmap(base, page) };
    }

    /// An entry longer than a piece goes in several, merged again into
    /// one vector on each side: it lands whole, and its neighbours too.
    #[test]
    fn an_entry_longer_than_a_piece_lands_whole() {
        let source: Vec<u8> = (0..5 * 4096 + 100).map(|i| (i % 251) as u8).collect();
        let mut dest = vec![0u8; source.len()];
        let mut small = [0u8; 10];
        let entries = [entry(&source, &mut dest), entry(&source[..10], &mut small)];
        // SAFETY: both destinations are ours and unshared until it returns.
        let outcomes = unsafe { copy_in_pieces(&this_process(), &entries, 4096) };
        assert_eq!(outcomes, [Ok(()), Ok(())]);
        assert_eq!(dest, source);
        assert_eq!(small[..], source[..10]);
    }

    #[test]
    fn adjacent_ranges_merge_and_others_do_not() {
        let mut remote = Vec::new();
        merge_adjacent(&mut remote, 0x1000, 0x100);
        merge_adjacent(&mut remote, 0x1100, 0x100);
        merge_adjacent(&mut remote, 0x1100, 0x10); // overlaps: a vector of its own
        merge_adjacent(&mut remote, 0x5000, 8);
        let shape: Vec<(u64, usize)> = remote
            .iter()
            .map(|v| (v.iov_base as u64, v.iov_len))
            .collect();
        assert_eq!(shape, vec![(0x1000, 0x200), (0x1100, 0x10), (0x5000, 8)]);
    }

    #[test]
    fn reads_of_the_same_bytes_into_two_places_both_land() {
        let source: Vec<u8> = (0..4096).map(|i| (i % 199) as u8).collect();
        let mut dest = vec![0u8; 2 * 4096];
        let (a, b) = dest.split_at_mut(4096);
        let entries = [entry(&source, a), entry(&source, b)];
        // SAFETY: as above.
        let outcomes = unsafe { copy_from_process(&this_process(), &entries) };
        assert_eq!(outcomes, vec![Ok(()), Ok(())]);
        assert_eq!(&dest[..4096], &source[..]);
        assert_eq!(&dest[4096..], &source[..]);
    }

    #[test]
    fn a_copy_that_finds_another_token_under_the_pid_keeps_nothing() {
        // This process read as an owner that published another token: how
        // a later process under a dead owner's pid, or an owner after
        // `exec`, looks to a copy.
        let stranger = this_process().with_token([0x3C; TOKEN_LEN]);
        let source = [7u8; 64];
        let mut dest = [0u8; 64];
        let one = entry(&source, &mut dest);
        // SAFETY: `dest` is untouched until the call returns.
        let outcomes = unsafe { copy_from_process(&stranger, &[one, one]) };
        assert_eq!(outcomes, vec![Err(CopyError(libc::ESRCH)); 2]);
        assert_eq!(
            dest, [0; 64],
            "the stranger's bytes stayed in the destination"
        );
    }

    #[test]
    fn a_stranger_under_the_pid_leaves_no_bytes_in_any_destination_of_a_list_longer_than_a_call() {
        // More entries than one call carries: the first call reads the
        // stranger's memory past its token; no call after it runs.
        let stranger = this_process().with_token([0x3C; TOKEN_LEN]);
        let count = ENTRIES_PER_CALL + 8;
        let source: Vec<u8> = (0..count * 8).map(|i| (i % 251) as u8 | 1).collect();
        let mut dest = vec![0u8; source.len()];
        let entries: Vec<CopyEntry> = dest
            .chunks_mut(8)
            .zip(source.chunks(8))
            .map(|(d, s)| entry(s, d))
            .collect();
        // SAFETY: the destinations are `dest`'s chunks, untouched until the
        // call returns.
        let outcomes = unsafe { copy_from_process(&stranger, &entries) };
        assert_eq!(outcomes, vec![Err(CopyError(libc::ESRCH)); count]);
        assert!(
            dest.iter().all(|&b| b == 0),
            "the stranger's bytes stayed in a destination"
        );
    }

    /// A child forked from this process, which its token reported, and
    /// killed and reaped on drop.
    struct ForkedChild {
        pid: libc::pid_t,
        token: [u8; TOKEN_LEN],
        /// The read end of the pipe the child reports on.
        report: libc::c_int,
    }

    impl ForkedChild {
        /// Forks a child that writes its token to a pipe and then runs
        /// `after_reporting` with the pipe's write end, which must not
        /// return and may do only what is async-signal-safe (the child of a
        /// multi-threaded process).
        fn start(after_reporting: unsafe fn(report: libc::c_int) -> !) -> ForkedChild {
            let mut pipe = [0; 2];
            // SAFETY: `pipe` has room for the two descriptors.
            assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
            // SAFETY: the child only loads atomics, writes to a pipe and runs
            // `after_reporting`, under the contract above; it never returns
            // into the test harness.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork failed");
            if pid == 0 {
                let token =
                    crate::owner_process::this_process_token().map_or([0; TOKEN_LEN], |t| t.1);
                // SAFETY: writes the token to the pipe's write end, then
                // hands over to `after_reporting`.
                unsafe {
                    libc::write(pipe[1], token.as_ptr().cast(), TOKEN_LEN);
                    after_reporting(pipe[1])
                }
            }
            let mut token = [0u8; TOKEN_LEN];
            // SAFETY: closes this process's write end once and reads into
            // `token`, which is that long; the read end is closed on drop.
            let read = unsafe {
                libc::close(pipe[1]);
                libc::read(pipe[0], token.as_mut_ptr().cast(), TOKEN_LEN)
            };
            let child = ForkedChild {
                pid,
                token,
                report: pipe[0],
            };
            assert_eq!(read, TOKEN_LEN as isize, "the child reported no token");
            child
        }

        /// A thread id the child reports after its token.
        fn reported_thread(&self) -> u32 {
            let mut thread = [0u8; 4];
            // SAFETY: reads into `thread`, which is that long, from the
            // pipe's read end this value owns.
            let read = unsafe { libc::read(self.report, thread.as_mut_ptr().cast(), 4) };
            assert_eq!(read, 4, "the child reported no thread");
            u32::from_ne_bytes(thread)
        }

        /// A copy of `source` out of this child as `identity` names it,
        /// with the child's pid.
        fn copy_as(
            &self,
            identity: &ProcessIdentity,
            source: &[u8],
        ) -> (Vec<Result<(), CopyError>>, Vec<u8>) {
            let identity = ProcessIdentity {
                pid: self.pid as u32,
                ..*identity
            };
            let mut dest = vec![0u8; source.len()];
            let one = entry(source, &mut dest);
            // SAFETY: `dest` is untouched until the call returns.
            let outcomes = unsafe { copy_from_process(&OwnerProcess::new(&identity), &[one]) };
            (outcomes, dest)
        }
    }

    impl Drop for ForkedChild {
        fn drop(&mut self) {
            let mut status = 0;
            // SAFETY: kills and reaps the child this value forked, once.
            unsafe {
                libc::kill(self.pid, libc::SIGKILL);
                libc::waitpid(self.pid, &mut status, 0);
                libc::close(self.report);
            }
        }
    }

    /// Sleeps until killed.
    unsafe fn pause_forever() -> ! {
        loop {
            // SAFETY: pause takes no arguments.
            unsafe { libc::pause() };
        }
    }

    /// Reports nothing more, then sleeps until killed.
    unsafe fn report_nothing_and_pause(_report: libc::c_int) -> ! {
        // SAFETY: only pauses.
        unsafe { pause_forever() }
    }

    #[test]
    fn a_forked_child_is_never_copied_from_as_its_parent() {
        // A child forked without `exec` holds the parent's memory at the
        // parent's addresses. Should the parent die and the child (or a
        // later fork of it) get the parent's pid, a copy aimed at the
        // parent must not read it: here the child's pid stands for that.
        let parent = ProcessIdentity::current().expect("procfs is mounted");
        let source: Vec<u8> = (0..256).map(|i| i as u8).collect();
        let child = ForkedChild::start(report_nothing_and_pause);
        let as_parent = child.copy_as(&parent, &source);
        let as_itself = child.copy_as(
            &ProcessIdentity {
                token: child.token,
                ..parent
            },
            &source,
        );
        drop(child);
        assert_eq!(as_parent.0, vec![Err(CopyError(libc::ESRCH))]);
        // The child is readable as itself: the refusal above is the token's.
        assert_eq!(as_itself.0, vec![Ok(())]);
        assert_eq!(as_itself.1, source);
    }

    /// A thread that reports its id on the pipe `report` (passed as the
    /// argument) and then sleeps until killed.
    extern "C" fn report_this_thread_and_sleep(report: *mut libc::c_void) -> *mut libc::c_void {
        // SAFETY: gettid and write are async-signal-safe; `report` is the
        // write end of the child's report pipe, and `thread` is 4 bytes.
        unsafe {
            let thread = libc::gettid() as u32;
            libc::write(
                report as usize as libc::c_int,
                thread.to_ne_bytes().as_ptr().cast(),
                4,
            );
            pause_forever()
        }
    }

    /// Starts a thread that reports its id and sleeps until killed, then
    /// ends the calling thread: a process whose main thread exited while
    /// another runs.
    unsafe fn end_the_main_thread(report: libc::c_int) -> ! {
        // SAFETY: a zeroed `pthread_t` is only an out-parameter here; the
        // new thread reports and pauses, and keeps the process alive after
        // this, its main thread, exits.
        unsafe {
            let mut thread = std::mem::zeroed();
            libc::pthread_create(
                &mut thread,
                std::ptr::null(),
                report_this_thread_and_sleep,
                report as usize as *mut libc::c_void,
            );
            // The thread's own exit system call: `pthread_exit` would
            // unwind through the forked test's frames, which abort.
            libc::syscall(libc::SYS_exit, 0);
            unreachable!("SYS_exit returned")
        }
    }

    /// A child whose main thread has exited while another thread runs,
    /// that other thread's id, and the child's identity as this test's
    /// process names it with the child's token.
    fn a_child_whose_main_thread_exited() -> (ForkedChild, u32, ProcessIdentity) {
        let parent = ProcessIdentity::current().expect("procfs is mounted");
        let child = ForkedChild::start(end_the_main_thread);
        let thread = child.reported_thread();
        // The main thread exits right after starting the other: wait until
        // the kernel shows the leader a zombie and the other thread alive.
        let state = |task: u32| {
            std::fs::read_to_string(format!("/proc/{}/task/{task}/status", child.pid))
                .ok()
                .and_then(|status| {
                    let line = status.lines().find(|l| l.starts_with("State:"))?;
                    line.split_whitespace().nth(1).map(str::to_owned)
                })
        };
        let exited_alone = (0..100).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            state(child.pid as u32).as_deref() == Some("Z")
                && state(thread).is_some_and(|s| s == "S" || s == "R")
        });
        assert!(exited_alone, "the child's main thread did not exit alone");
        assert_ne!(thread, child.pid as u32);
        let identity = ProcessIdentity {
            token: child.token,
            thread: None,
            ..parent
        };
        (child, thread, identity)
    }

    #[test]
    fn a_live_owner_whose_main_thread_exited_is_still_copied_from_by_its_published_thread() {
        let source: Vec<u8> = (0..256).map(|i| i as u8).collect();
        let (child, thread, identity) = a_child_whose_main_thread_exited();
        let (outcomes, dest) = child.copy_as(
            &ProcessIdentity {
                thread: Some(thread),
                ..identity
            },
            &source,
        );
        drop(child);
        assert_eq!(outcomes, vec![Ok(())], "a live owner was taken for gone");
        assert_eq!(dest, source);
    }

    #[test]
    fn an_owner_that_published_no_thread_is_taken_for_gone_once_its_main_thread_exited() {
        // Why the thread is published: by its pid alone (a version-2
        // address) such an owner cannot be read, and the copy fails closed.
        let source = [5u8; 64];
        let (child, _, identity) = a_child_whose_main_thread_exited();
        let (outcomes, dest) = child.copy_as(&identity, &source);
        drop(child);
        assert_eq!(outcomes, vec![Err(CopyError(libc::ESRCH))]);
        assert_eq!(dest, vec![0; 64]);
    }

    #[test]
    fn a_thread_id_that_names_another_process_is_never_copied_from() {
        // A published thread recycled for another process after the owner
        // died: the token check refuses it as it refuses a recycled pid.
        let source = [9u8; 64];
        let (child, thread, _) = a_child_whose_main_thread_exited();
        let this_process = ProcessIdentity::current().expect("procfs is mounted");
        let (outcomes, dest) = child.copy_as(
            &ProcessIdentity {
                thread: Some(thread),
                ..this_process
            },
            &source,
        );
        drop(child);
        assert_eq!(outcomes, vec![Err(CopyError(libc::ESRCH))]);
        assert_eq!(dest, vec![0; 64]);
    }

    #[test]
    fn a_token_address_with_nothing_mapped_is_another_process() {
        let mut identity = ProcessIdentity::current().expect("procfs is mounted");
        // The zero page is never mapped.
        identity.token_addr = 0x10;
        let source = [7u8; 64];
        let mut dest = [0u8; 64];
        let one = entry(&source, &mut dest);
        // SAFETY: `dest` is untouched until the call returns.
        let outcomes = unsafe { copy_from_process(&OwnerProcess::new(&identity), &[one]) };
        assert_eq!(outcomes, vec![Err(CopyError(libc::ESRCH))]);
        assert_eq!(dest, [0; 64]);
    }

    #[test]
    fn a_process_that_does_not_exist_fails_every_entry() {
        let source = [1u8; 8];
        let mut dest = [0u8; 8];
        let one = entry(&source, &mut dest);
        let mut identity = ProcessIdentity::current().expect("procfs is mounted");
        // Above the kernel's pid_max (at most 2^22).
        identity.pid = 1 << 30;
        // SAFETY: `dest` is untouched until the call returns.
        let outcomes = unsafe { copy_from_process(&OwnerProcess::new(&identity), &[one, one]) };
        assert_eq!(outcomes, vec![Err(CopyError(libc::ESRCH)); 2]);
    }
}
