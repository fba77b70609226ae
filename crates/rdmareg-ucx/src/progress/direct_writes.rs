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

use rdmareg_core::{PeerId, RdmaError};

use super::Engine;
use super::vectored::CopyError;
use crate::owner_process::{OwnerProcess, SameHostSource, TOKEN_LEN};
use crate::read_protocol::SameHostKey;

/// What became of a PUT offered to the direct lane.
#[derive(Debug)]
pub(super) enum DirectWrite {
    /// Written one-sided, or failed there: the PUT's answer.
    Done(Result<(), RdmaError>),
    /// Not for the direct lane: send it through the owner.
    ThroughOwner,
}

impl Engine {
    /// Writes `len` bytes at `source` to `remote_addr` of `peer` one-sided
    /// if `key` and the peer allow it (module docs).
    ///
    /// # Safety
    /// `source..source + len` is mapped memory of this process that stays
    /// readable until this returns.
    pub(super) unsafe fn write_directly(
        &mut self,
        peer: PeerId,
        key: &SameHostKey,
        remote_addr: u64,
        source: *const u8,
        len: usize,
    ) -> DirectWrite {
        if !key.access.allows_write()
            || !key.covers(remote_addr, len as u64)
            || !self.direct_key_is_well_formed(&key.ucx_key)
        {
            return DirectWrite::ThroughOwner;
        }
        // Not `copy_source`: its memo lives only until a turn's reads are
        // copied, and no read may follow this to clear it.
        let owner = match self.look_up_copy_source(peer) {
            SameHostSource::Copy(owner) => owner,
            SameHostSource::Gone => {
                return DirectWrite::Done(Err(RdmaError::backend(format!(
                    "ucx: the same-host owner process of {peer} is gone"
                ))));
            }
            SameHostSource::NotCopied | SameHostSource::ThroughOwner => {
                return DirectWrite::ThroughOwner;
            }
        };
        let Some(table) = owner.release() else {
            return DirectWrite::ThroughOwner;
        };
        let Some(lock) = table.lock_for_write(key.release_slot, key.release_tag()) else {
            return DirectWrite::Done(Err(RdmaError::RegionNotFound));
        };
        // SAFETY: the source is readable until this returns (the caller's
        // contract); the destination is inside the key's range of a
        // registration whose slot is live and locked, so the owner's unmap
        // of it waits until `lock` is dropped below.
        let copied = unsafe { copy_into_process(&owner, remote_addr, source, len) };
        drop(lock);
        match copied {
            Ok(()) => DirectWrite::Done(Ok(())),
            Err(err) if err.is_refusal() => {
                tracing::debug!(%peer, error = %err, "same-host writes refused; writing through the owner");
                self.stop_copying_from(peer, SameHostSource::ThroughOwner);
                DirectWrite::ThroughOwner
            }
            Err(err) => {
                if err.is_gone() {
                    tracing::debug!(%peer, "same-host owner process gone; its same-host transfers fail from now on");
                    self.stop_copying_from(peer, SameHostSource::Gone);
                }
                DirectWrite::Done(Err(RdmaError::backend(format!(
                    "ucx: same-host write to {peer} failed: {err}"
                ))))
            }
        }
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
    let mut done = 0usize;
    while done < len {
        let local = libc::iovec {
            iov_base: source.wrapping_add(done) as *mut libc::c_void,
            iov_len: len - done,
        };
        let remote = libc::iovec {
            iov_base: (remote_addr as usize).wrapping_add(done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: one iovec on each side, of equal length; the local range
        // is inside the caller's readable source and only read; the remote
        // range is written by the kernel in the other process, checked
        // against its page tables there.
        let written = unsafe { libc::process_vm_writev(pid, &local, 1, &remote, 1, 0) };
        match written {
            n if n < 0 => return Err(CopyError(last_errno())),
            // Nothing written and no error: stop rather than spin.
            0 => return Err(CopyError(libc::EFAULT)),
            n => done += n as usize,
        }
    }
    Ok(())
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
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
    fn a_write_to_an_unmapped_address_fails() {
        let _ = this_process_token();
        let source = [7u8; 64];
        // SAFETY: as above; the kernel checks the target address.
        let written = unsafe { copy_into_process(&this_process(), 8, source.as_ptr(), 64) };
        assert_eq!(written, Err(CopyError(libc::EFAULT)));
    }
}
