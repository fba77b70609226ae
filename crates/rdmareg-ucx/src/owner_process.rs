//! The owner process a same-host copy reads from, recognised inside every
//! copy by a token only it holds, so that a copy never answers with the
//! bytes of another process that took its pid or replaced its program.
//!
//! # Why a pid is not enough
//!
//! `process_vm_readv` names its source by pid. Once the owner exits and is
//! reaped, the kernel may give that pid to any new process; a copy made then
//! reads the newcomer's memory at the owner's addresses and succeeds. An
//! owner that `exec`s keeps its pid, and a copy reads the new program. A
//! copy that happens to run while the pid is free fails with `ESRCH`, but
//! nothing guarantees one does.
//!
//! # The token
//!
//! - Each process draws 16 random bytes (`getrandom`) the first time it
//!   publishes its identity, and keeps them in a static for the rest of its
//!   life: the address never changes and nothing writes there again. The
//!   engine address carries the token and its address beside the pid
//!   ([`ProcessIdentity`]).
//! - Every vectored copy reads the token first, in the same system call as
//!   the reads it carries (`progress::vectored`). The kernel resolves the
//!   pid to one address space at the start of the call and copies every
//!   range of that call out of it, in order; so if the first 16 bytes are
//!   the owner's token, the whole call read the owner's memory. Any other
//!   process under that pid — a newcomer, or the owner's own pid after an
//!   `exec`, whose statics are new — holds other bytes there (a random
//!   16-byte value repeats with probability 2⁻¹²⁸), or nothing at all.
//! - A copy whose token does not match fails every read it carried as if
//!   the owner were gone; the engine stops reading that peer's same-host
//!   memory altogether (`SameHostSource::Gone`). The destination of a
//!   failed read holds unspecified bytes.
//!
//! This costs no extra system call and 16 bytes per copy. It vouches for
//! the address space, not for the process's intentions: a same-user
//! process can write the owner's token as it can write any of its memory,
//! which is the kernel's trust domain (see `docs/safety.md`).
//!
//! # What this does not cover
//!
//! Peers that publish no token (version-1 engine addresses), peers in
//! another pid namespace, and reads this engine does not copy itself go
//! through UCX's cma, which names the owner by pid alone.

use std::sync::{Arc, OnceLock};

use crate::engine_address::ProcessIdentity;

/// Bytes in a process token.
pub(crate) const TOKEN_LEN: usize = 16;

/// A token, aligned so that it never straddles a page: the kernel either
/// reads all of it or none.
#[repr(align(16))]
struct AlignedToken([u8; TOKEN_LEN]);

/// This process's token, drawn once.
static THIS_PROCESS_TOKEN: OnceLock<Option<AlignedToken>> = OnceLock::new();

/// This process's token and the address it lives at for the rest of the
/// process's life; `None` if the kernel gave no random bytes.
pub(crate) fn this_process_token() -> Option<(u64, [u8; TOKEN_LEN])> {
    let token = THIS_PROCESS_TOKEN
        .get_or_init(|| {
            let mut bytes = [0; TOKEN_LEN];
            // SAFETY: getrandom writes at most `TOKEN_LEN` bytes into the
            // buffer it is given, which is that long and ours.
            let drawn = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), TOKEN_LEN, 0) };
            (drawn == TOKEN_LEN as isize).then_some(AlignedToken(bytes))
        })
        .as_ref()?;
    Some((token.0.as_ptr() as u64, token.0))
}

/// A peer's process as its engine address named it: what every copy out
/// of it checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OwnerProcess {
    pid: u32,
    token_addr: u64,
    token: [u8; TOKEN_LEN],
}

impl OwnerProcess {
    /// The process `identity` names.
    pub(crate) fn new(identity: &ProcessIdentity) -> OwnerProcess {
        OwnerProcess {
            pid: identity.pid,
            token_addr: identity.token_addr,
            token: identity.token,
        }
    }

    /// The process's id, in this engine's pid namespace.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
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
    /// Through UCX's cma: the peer published no process this engine can
    /// check (another pid namespace, an older peer), or the kernel refused
    /// this engine's own copies.
    #[default]
    ThroughUcx,
    /// Copied out of this process, checked on every copy.
    Copy(Arc<OwnerProcess>),
    /// The process the peer published is gone (a copy found another
    /// address space under its pid, or none). Its same-host reads fail: a
    /// copy, or UCX's cma, which names the owner by pid too, would read
    /// whatever process holds that pid now.
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
        assert_eq!(me.token_addr(), addr);
        assert!(me.is_token(&token));
        assert!(!me.with_token([0; TOKEN_LEN]).is_token(&token));
    }
}
