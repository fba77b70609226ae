//! The owner process a same-host copy reads from, held by a pidfd so that a
//! copy never answers with the bytes of another process that took its pid.
//!
//! # Why a pid is not enough
//!
//! `process_vm_readv` names its source by pid. Once the owner exits and is
//! reaped, the kernel may give that pid to any new process; a copy made then
//! reads the newcomer's memory at the owner's addresses and succeeds. A copy
//! that happens to run while the pid is free fails with `ESRCH`, but nothing
//! guarantees one does: the owner can die and its pid be taken between two
//! reads.
//!
//! # How the owner is held
//!
//! - **Opened once, confirmed by start time.** When a peer's process is
//!   first known ([`OwnerProcess::open`]), the engine opens a pidfd for the
//!   published pid, reads that pid's start time (`/proc/<pid>/stat`), and
//!   then checks the pidfd has not exited. A process that has not exited
//!   still holds its pid, so the start time read in between was its own;
//!   it must equal the start time the owner published. A pidfd then names
//!   that one process for as long as it is held, whatever later happens to
//!   the number.
//! - **Checked after every copy.** A copy is kept only if the pidfd shows
//!   the process alive once the copy has returned ([`OwnerProcess::exited`]):
//!   a process alive then was alive throughout the copy, so its pid named it
//!   and no other. A copy followed by an exit is reported as the owner gone,
//!   even if the bytes were the owner's; the read then fails, and
//!   the destination of a failed read holds unspecified bytes.
//!
//! # What this does not cover
//!
//! - **`exec`.** An owner that replaces its program keeps its pid, its
//!   pidfd and its start time; a copy then reads the new program's memory.
//!   No cheap per-copy check of the kernel tells the two images apart.
//! - **A pid reused within one clock tick of the start time.** Start times
//!   count clock ticks since boot (10 ms on most kernels). Two processes
//!   with the same pid and the same start time need a pid taken over within
//!   one tick of the owner's own start, before the engine first opened it.
//! - **Kernels without pidfds** (before Linux 5.3): [`OwnerProcess::open`]
//!   fails and the engine reads through UCX's cma instead, which names the
//!   owner by pid as well.

use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::sync::Arc;

use crate::engine_address::ProcessIdentity;

/// Why a published process cannot be copied from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum OpenError {
    /// `pidfd_open` failed: no such process, no pidfds on this kernel, or
    /// no file descriptor left (the `errno`).
    #[error("no pidfd for the owner's pid ({})", std::io::Error::from_raw_os_error(*.0))]
    NoPidfd(i32),
    /// The pid's start time could not be read.
    #[error("the owner's start time cannot be read")]
    NoStartTime,
    /// The process under that pid exited while it was being confirmed.
    #[error("the owner exited while it was being confirmed")]
    Exited,
    /// Another process than the published one holds the pid.
    #[error("another process holds the owner's pid")]
    NotTheOwner,
}

impl OpenError {
    /// Whether the published process is known to have exited: its pid
    /// names nothing, or another process. (Anything else — no pidfds, no
    /// descriptor left, an unreadable `stat` — says nothing about it.)
    pub(crate) fn means_gone(self) -> bool {
        match self {
            OpenError::NoPidfd(errno) => errno == libc::ESRCH,
            OpenError::NoStartTime => false,
            OpenError::Exited | OpenError::NotTheOwner => true,
        }
    }
}

/// Where a peer's same-host reads come from.
#[derive(Debug, Clone, Default)]
pub(crate) enum SameHostSource {
    /// Through UCX's cma: the peer published no process this engine can
    /// hold (another pid namespace, no pidfds, an older peer), or the
    /// kernel refused this engine's own copies.
    #[default]
    ThroughUcx,
    /// Copied out of this confirmed process.
    Copy(Arc<OwnerProcess>),
    /// The process the peer published has exited. Its same-host reads
    /// fail: a copy, or UCX's cma, which also names the owner by pid,
    /// would read whatever process holds that pid next.
    Gone,
}

impl SameHostSource {
    /// The source for a process the peer published, confirmed now.
    pub(crate) fn open(identity: &ProcessIdentity) -> Result<SameHostSource, OpenError> {
        match OwnerProcess::open(identity) {
            Ok(owner) => Ok(SameHostSource::Copy(Arc::new(owner))),
            Err(error) if error.means_gone() => Ok(SameHostSource::Gone),
            Err(error) => Err(error),
        }
    }
}

/// A process confirmed to be a published owner, held by a pidfd.
#[derive(Debug)]
pub(crate) struct OwnerProcess {
    pid: u32,
    pidfd: OwnedFd,
}

impl OwnerProcess {
    /// Opens the process `identity` names and confirms it is that process
    /// (see the module docs). The caller has checked that `identity` shares
    /// this engine's pid space.
    pub(crate) fn open(identity: &ProcessIdentity) -> Result<OwnerProcess, OpenError> {
        let owner = OwnerProcess::open_pid(identity.pid)?;
        let start_time = start_time_of(identity.pid);
        if owner.exited() {
            return Err(OpenError::Exited);
        }
        let start_time = start_time.ok_or(OpenError::NoStartTime)?;
        if start_time != identity.start_time {
            return Err(OpenError::NotTheOwner);
        }
        Ok(owner)
    }

    /// A pidfd for whatever process holds `pid` now, unconfirmed.
    pub(crate) fn open_pid(pid: u32) -> Result<OwnerProcess, OpenError> {
        let Ok(raw_pid) = libc::pid_t::try_from(pid) else {
            return Err(OpenError::NoPidfd(libc::ESRCH));
        };
        // SAFETY: pidfd_open takes a pid and a flags word and returns a new
        // file descriptor (close-on-exec) or -1; no memory is passed.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw_pid, 0) };
        if fd < 0 {
            let errno = std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO);
            return Err(OpenError::NoPidfd(errno));
        }
        // SAFETY: `fd` was just returned by the kernel and is owned by
        // nothing else; a descriptor number fits an i32.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Ok(OwnerProcess { pid, pidfd })
    }

    /// The same pidfd under another pid: how an owner whose pid was taken
    /// over looks from here.
    #[cfg(test)]
    pub(crate) fn renumbered(self, pid: u32) -> OwnerProcess {
        OwnerProcess { pid, ..self }
    }

    /// The process's id, in this engine's pid namespace.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the process has exited (its pid may then name another
    /// process). `false` means it was alive when the kernel answered, and
    /// so at every moment before.
    pub(crate) fn exited(&self) -> bool {
        let mut poll = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one initialised pollfd, valid for the call; a zero timeout
        // never blocks.
        let ready = unsafe { libc::poll(&mut poll, 1, 0) };
        // A failed poll (no memory for the wait table) cannot vouch for the
        // process: count it as gone, which only sends reads through UCX.
        ready != 0
    }
}

/// `pid`'s start time in clock ticks since boot: field 22 of
/// `/proc/<pid>/stat`.
pub(crate) fn start_time_of(pid: u32) -> Option<u64> {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    parse_start_time(&stat)
}

/// The start time in a `stat` line. The second field, the command name in
/// parentheses, may hold spaces and parentheses of its own, so fields are
/// counted from the last `)`: the state is the first field after it, the
/// start time the twentieth.
fn parse_start_time(stat: &[u8]) -> Option<u64> {
    let after_name = stat.iter().rposition(|&b| b == b')')? + 1;
    let rest = std::str::from_utf8(&stat[after_name..]).ok()?;
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_opens_under_its_published_identity() {
        let me = ProcessIdentity::current().expect("procfs is mounted");
        let owner = OwnerProcess::open(&me).expect("this process confirms itself");
        assert_eq!(owner.pid(), std::process::id());
        assert!(!owner.exited());
    }

    #[test]
    fn a_published_start_time_that_differs_is_another_process() {
        let me = ProcessIdentity::current().expect("procfs is mounted");
        let impostor = ProcessIdentity {
            start_time: me.start_time + 1,
            ..me
        };
        assert_eq!(
            OwnerProcess::open(&impostor).unwrap_err(),
            OpenError::NotTheOwner
        );
    }

    #[test]
    fn a_child_that_exits_shows_as_exited() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let owner = OwnerProcess::open_pid(child.id()).expect("the child is alive until reaped");
        child.wait().unwrap();
        assert!(owner.exited());
    }

    #[test]
    fn a_pid_nobody_holds_opens_nothing() {
        // Above the kernel's pid_max (at most 2^22).
        assert_eq!(
            OwnerProcess::open_pid(1 << 30).unwrap_err(),
            OpenError::NoPidfd(libc::ESRCH)
        );
    }

    #[test]
    fn start_times_are_read_after_a_command_name_with_spaces_and_parentheses() {
        let mut line = b"123 (a) b) c) S".to_vec();
        for field in 4..=21 {
            line.extend_from_slice(format!(" {field}").as_bytes());
        }
        line.extend_from_slice(b" 987654 23 24\n");
        assert_eq!(parse_start_time(&line), Some(987_654));
        assert_eq!(parse_start_time(b"123 (cut short) S 1 2"), None);
        assert_eq!(parse_start_time(b"no parenthesis at all"), None);
    }
}
