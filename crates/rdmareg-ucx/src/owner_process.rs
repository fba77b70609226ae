//! The owner process a same-host copy reads from, recognised by a token.
//!
//! `process_vm_readv` names its source by pid, and a pid is reused once
//! the owner is reaped, or names a new program after `exec`. So each
//! process draws 16 random bytes once, keeps them in a static for its life
//! and publishes them and their address beside its pid
//! ([`ProcessIdentity`]); see `docs/safety.md`, "The token".
//!
//! - A `fork`ed child redraws its token before `fork` returns in it (a
//!   `pthread_atfork` handler); with no random bytes it inverts its
//!   parent's and publishes none.
//! - Every vectored copy reads the token first, in the same system call
//!   (`progress::vectored`): the kernel resolves the pid once per call, so
//!   a matching token means the whole call read the owner.
//! - A mismatch fails every read of the call as "owner gone", zeroing what
//!   the kernel wrote, and the peer's same-host reads fail from then on
//!   (`SameHostSource::Gone`).
//! - Copies name the owner's published thread (its progress thread),
//!   because a pid stops resolving once the main thread exits; the pid only
//!   for a peer that published no thread. A recycled thread id fails the
//!   token check the same way.
//!
//! The token says whose memory a copy read; whether the registration is
//! still live is the release table's (`release_table`), opened once per
//! peer. Peers with no token, no table or another pid namespace are read
//! through their owner's engine ([`SameHostSource::ThroughOwner`]).

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

use crate::engine_address::ProcessIdentity;
use crate::release_table::{ReleaseView, TableLocation};

/// Bytes in a process token.
pub(crate) const TOKEN_LEN: usize = 16;

/// The token's bytes, aligned so that they never straddle a page: the
/// kernel either reads all of them or none. Atomic only so that a `fork`ed
/// child can redraw them in place (see [`redraw_in_forked_child`]); every
/// other write is the first draw, before any reader.
#[repr(align(16))]
struct TokenCell([AtomicU8; TOKEN_LEN]);

/// This process's token, at one address for the process's life.
static THIS_PROCESS_TOKEN: TokenCell = TokenCell([const { AtomicU8::new(0) }; TOKEN_LEN]);

/// Whether the first draw succeeded; drawn at most once per process image.
static TOKEN_DRAWN: OnceLock<bool> = OnceLock::new();

/// Set in a `fork`ed child whose redraw got no random bytes: it publishes
/// no token rather than its parent's.
static TOKEN_LOST: AtomicBool = AtomicBool::new(false);

/// Fills `bytes` from the kernel; false if it gave fewer.
fn draw(bytes: &mut [u8; TOKEN_LEN]) -> bool {
    // SAFETY: getrandom writes at most `TOKEN_LEN` bytes into the buffer it
    // is given, which is that long and ours.
    let drawn = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), TOKEN_LEN, 0) };
    drawn == TOKEN_LEN as isize
}

fn store(bytes: &[u8; TOKEN_LEN]) {
    for (cell, &byte) in THIS_PROCESS_TOKEN.0.iter().zip(bytes) {
        cell.store(byte, Ordering::Relaxed);
    }
}

fn load() -> [u8; TOKEN_LEN] {
    let mut bytes = [0; TOKEN_LEN];
    for (byte, cell) in bytes.iter_mut().zip(&THIS_PROCESS_TOKEN.0) {
        *byte = cell.load(Ordering::Relaxed);
    }
    bytes
}

/// Runs in the child of every `fork` once a token exists (registered with
/// `pthread_atfork`), so a descendant given the parent's pid never holds
/// the parent's token. Only the forking thread lives in the child, and
/// `getrandom` and atomic stores are async-signal-safe.
extern "C" fn redraw_in_forked_child() {
    let mut bytes = [0; TOKEN_LEN];
    if draw(&mut bytes) {
        store(&bytes);
    } else {
        // No random bytes: invert the parent's, which guarantees a mismatch
        // with it, and publish no token from here on.
        let mut inverted = load();
        for byte in &mut inverted {
            *byte = !*byte;
        }
        store(&inverted);
        TOKEN_LOST.store(true, Ordering::Relaxed);
    }
}

/// This process's token and the address it lives at for the rest of the
/// process's life; `None` if the kernel gave no random bytes.
pub(crate) fn this_process_token() -> Option<(u64, [u8; TOKEN_LEN])> {
    let drawn = *TOKEN_DRAWN.get_or_init(|| {
        // The handler goes in before the token exists, so that no `fork`
        // ever copies a token into a child without redrawing it.
        // SAFETY: registers a plain `extern "C" fn` that lives as long as
        // the program (see `redraw_in_forked_child` for what it may do in
        // a child). Registered once per process image: `TOKEN_DRAWN`
        // initialises once, and a child inherits the registration.
        let registered = unsafe { libc::pthread_atfork(None, None, Some(redraw_in_forked_child)) };
        if registered != 0 {
            tracing::warn!(
                error = registered,
                "cannot redraw the process token in forked children; publishing none"
            );
            return false;
        }
        let mut bytes = [0; TOKEN_LEN];
        if !draw(&mut bytes) {
            return false;
        }
        store(&bytes);
        true
    });
    if !drawn || TOKEN_LOST.load(Ordering::Relaxed) {
        return None;
    }
    Some((THIS_PROCESS_TOKEN.0.as_ptr() as u64, load()))
}

/// A peer's process as its engine address named it: what every copy out
/// of it checks.
#[derive(Debug)]
pub(crate) struct OwnerProcess {
    pid: u32,
    /// The task id copies name: the published thread, else the pid.
    copy_by: u32,
    token_addr: u64,
    token: [u8; TOKEN_LEN],
    /// The owner engine's release table, if it published one this process
    /// could open.
    release: Option<ReleaseView>,
}

impl OwnerProcess {
    /// The process `identity` names, without a release table.
    pub(crate) fn new(identity: &ProcessIdentity) -> OwnerProcess {
        OwnerProcess {
            pid: identity.pid,
            copy_by: identity.thread.unwrap_or(identity.pid),
            token_addr: identity.token_addr,
            token: identity.token,
            release: None,
        }
    }

    /// The process `identity` names, and its engine's release table at
    /// `table`, opened now through the thread copies name; without a table
    /// (none published, or it cannot be opened) its same-host reads go
    /// through its engine.
    pub(crate) fn with_release_table(
        identity: &ProcessIdentity,
        table: Option<TableLocation>,
    ) -> OwnerProcess {
        let mut owner = OwnerProcess::new(identity);
        owner.release = table.and_then(|table| match ReleaseView::open(owner.copy_by, table) {
            Ok(view) => Some(view),
            Err(err) => {
                tracing::debug!(error = %err, "cannot open the peer's release table; reading through its owner");
                None
            }
        });
        owner
    }

    /// The owner engine's release table, if this process opened it.
    pub(crate) fn release(&self) -> Option<&ReleaseView> {
        self.release.as_ref()
    }

    /// The process's id, in this engine's pid namespace.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// The id a copy names the process by, in this engine's pid namespace
    /// (module docs: "Which id a copy names").
    pub(crate) fn copy_by(&self) -> u32 {
        self.copy_by
    }

    /// Where the token lies in the owner.
    pub(crate) fn token_addr(&self) -> u64 {
        self.token_addr
    }

    /// Whether `read` is this owner's token.
    pub(crate) fn is_token(&self, read: &[u8; TOKEN_LEN]) -> bool {
        *read == self.token
    }

    /// This process, as its own engine address publishes it.
    #[cfg(test)]
    pub(crate) fn this_process() -> OwnerProcess {
        OwnerProcess::new(&ProcessIdentity::current().expect("procfs is mounted"))
    }

    /// The same process expected to hold another token: how a process
    /// that took an owner's pid looks from here.
    #[cfg(test)]
    pub(crate) fn with_token(self, token: [u8; TOKEN_LEN]) -> OwnerProcess {
        OwnerProcess { token, ..self }
    }
}

/// Where a peer's same-host reads come from.
#[derive(Debug, Clone, Default)]
pub(crate) enum SameHostSource {
    /// Not copied: the peer published no process this engine can check
    /// (another pid namespace, an older peer), or UCX does not reach its
    /// direct lane; its reads go through the owner's engine.
    #[default]
    NotCopied,
    /// Copied out of this process, checked on every copy.
    Copy(Arc<OwnerProcess>),
    /// The kernel refused a copy from the peer's process (`EPERM`,
    /// `ENOSYS`), or its release table could not be opened: its same-host
    /// reads go through the owner's engine, never UCX's cma, which names
    /// the owner by pid with no token.
    ThroughOwner,
    /// The process the peer published is gone (a copy found another
    /// address space under its pid, or none): its same-host reads fail.
    Gone,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_keeps_one_token_at_one_address() {
        let (addr, token) = this_process_token().expect("the kernel gives random bytes");
        assert_eq!(this_process_token(), Some((addr, token)));
        assert_eq!(addr % TOKEN_LEN as u64, 0, "aligned: never across a page");
        assert_ne!(token, [0; TOKEN_LEN]);
        let me = OwnerProcess::this_process();
        assert_eq!(me.pid(), std::process::id());
        assert_eq!(me.copy_by(), me.pid(), "named by the pid without a thread");
        assert_eq!(me.token_addr(), addr);
        assert!(me.is_token(&token));
        assert!(!me.with_token([0; TOKEN_LEN]).is_token(&token));
    }

    /// The child's token, read back through a pipe from a child made by
    /// `spawn` (which returns 0 in the child, like `fork`).
    fn token_of_a_child_made_by(spawn: unsafe extern "C" fn() -> libc::pid_t) -> [u8; TOKEN_LEN] {
        let mut pipe = [0; 2];
        // SAFETY: `pipe` has room for the two descriptors.
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        // SAFETY: the child only loads atomics, writes to a pipe and
        // `_exit`s: all async-signal-safe.
        let child = unsafe { spawn() };
        assert!(child >= 0, "the child was not made");
        if child == 0 {
            let token = this_process_token().map_or([0xFF; TOKEN_LEN], |t| t.1);
            // SAFETY: writes the token to the pipe's write end and exits
            // without running the parent's destructors.
            unsafe {
                libc::write(pipe[1], token.as_ptr().cast(), TOKEN_LEN);
                libc::_exit(0);
            }
        }
        let mut token = [0u8; TOKEN_LEN];
        // SAFETY: closes this process's write end once, reads into `token`,
        // which is that long, reaps the child and closes the read end once.
        let read = unsafe {
            libc::close(pipe[1]);
            let read = libc::read(pipe[0], token.as_mut_ptr().cast(), TOKEN_LEN);
            let mut status = 0;
            libc::waitpid(child, &mut status, 0);
            libc::close(pipe[0]);
            read
        };
        assert_eq!(read, TOKEN_LEN as isize);
        token
    }

    unsafe extern "C" {
        /// glibc's `_Fork` (POSIX.1-2024): a `fork` that runs no
        /// `pthread_atfork` handler.
        fn _Fork() -> libc::pid_t;
    }

    #[test]
    fn a_child_made_without_fork_handlers_keeps_its_parents_token_as_documented() {
        // `docs/safety.md` names this limit: a child made without the
        // handlers (glibc's `_Fork`, a raw `clone`) holds the parent's
        // memory, token included, until it `exec`s.
        let (_, token) = this_process_token().expect("the kernel gives random bytes");
        assert_eq!(token_of_a_child_made_by(_Fork), token);
        assert_ne!(token_of_a_child_made_by(libc::fork), token);
    }

    #[test]
    fn a_forked_child_draws_a_token_of_its_own_at_the_same_address() {
        let (addr, token) = this_process_token().expect("the kernel gives random bytes");
        let mut pipe = [0; 2];
        // SAFETY: `pipe` has room for the two descriptors.
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        // SAFETY: the child only loads atomics, writes to a pipe and
        // `_exit`s: all async-signal-safe, as a child of a multi-threaded
        // process must be.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork failed");
        if child == 0 {
            let mut report = [0u8; 8 + TOKEN_LEN];
            match this_process_token() {
                Some((child_addr, child_token)) => {
                    report[..8].copy_from_slice(&child_addr.to_le_bytes());
                    report[8..].copy_from_slice(&child_token);
                }
                None => report.fill(0xFF),
            }
            // SAFETY: writes the report to the pipe's write end and exits
            // without running the parent's destructors.
            unsafe {
                libc::write(pipe[1], report.as_ptr().cast(), report.len());
                libc::_exit(0);
            }
        }
        // SAFETY: closes this process's copy of the write end, once.
        unsafe { libc::close(pipe[1]) };
        let mut report = [0u8; 8 + TOKEN_LEN];
        // SAFETY: reads into `report`, which is that long.
        let read = unsafe { libc::read(pipe[0], report.as_mut_ptr().cast(), report.len()) };
        let mut status = 0;
        // SAFETY: reaps the child forked above; closes the read end once.
        unsafe {
            libc::waitpid(child, &mut status, 0);
            libc::close(pipe[0]);
        }
        assert_eq!(read, report.len() as isize);
        assert_eq!(u64::from_le_bytes(report[..8].try_into().unwrap()), addr);
        assert_ne!(
            &report[8..],
            &token[..],
            "the child kept its parent's token"
        );
        assert_eq!(
            this_process_token(),
            Some((addr, token)),
            "the parent's is unchanged"
        );
    }
}
