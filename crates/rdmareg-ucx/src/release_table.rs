//! The release table: how a same-host reader learns a registration is gone.
//!
//! A same-host reader copies out of the owner's process without asking it;
//! the table is what tells it a registration was released. See
//! `docs/safety.md`, "The same-host direct lane".
//!
//! # Contract
//!
//! - **One table per engine with a direct lane**, in a sealed `memfd` with
//!   no name, so another process opens it only through
//!   `/proc/<owner>/fd/<n>`, which needs ptrace rights over the owner, as
//!   `process_vm_readv` does. The engine address publishes the descriptor
//!   number and a random table id ([`TableLocation`]).
//! - **A slot per live direct-lane registration**, holding its release tag
//!   (`read_protocol::ServedKey::release_tag`, never 0), named by its
//!   same-host keys. Not the region id: ids restart with every engine, and a
//!   later engine of the same process would vouch for an earlier one's keys.
//! - **The owner empties the slot when the unmap is submitted**, before any
//!   reply to it reaches `deregistered()` (`progress::regions`). A slot is
//!   reused only under a new random tag.
//! - **A read counts only if the slot held the key's tag before the copy
//!   and still holds it after**, loaded behind an acquire fence; otherwise
//!   it fails with `RegionNotFound` and its destination is
//!   zeroed.
//!
//! The check after the copy decides: the owner stores 0 before it replies
//! to the unmap, so every write made after `deregistered()` follows that
//! store, and a copy that read such a byte then sees the slot changed
//! (message passing; the fence makes it hold on weakly ordered CPUs). The
//! check before only saves a useless copy. It guards honest readers of
//! stale descriptors, not against a hostile same-user process.
//!
//! # Writers
//!
//! A write cannot be discarded after the fact, so a same-host writer
//! checks the slot *under a lock* the owner's unmap must take as well: an
//! open-file-description read lock (`F_OFD_SETLK`) on the slot's eight
//! bytes of the table file, held from before its check until its
//! `process_vm_writev` returned ([`ReleaseView::lock_for_write`]).
//!
//! - The owner of a writable registration empties its slot, then answers
//!   the unmap only once it can take a write lock on those bytes
//!   ([`ReleaseTable::writers_gone`]); until then the slot stays out of
//!   use. Either the writer's lock came first, and the unmap waits for its
//!   write to end, or the owner's did, and the writer's check (ordered
//!   after it by the kernel's lock) finds the slot empty and writes
//!   nothing.
//! - A writer refuses to wait: a slot it cannot lock is being retired, so
//!   its write fails as a released registration's would.
//! - The kernel drops a lock when its holder's last descriptor of the
//!   table closes, so a writer killed mid-write holds no unmap up; one
//!   that is stopped (`SIGSTOP`) holds it until it runs again or dies.
//! - Locks belong to an open file description, not a thread: a process
//!   holds one per opened view and makes one write under it at a time
//!   (a mutex of the view's, held with the lock), since unlocking ends
//!   every lock of the description on that range, another thread's too.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::sync::{Mutex, MutexGuard};

/// Slots in a table: the most direct-lane registrations an engine holds at
/// once. Registrations past that get served-only keys. The file is sparse:
/// only pages of slots in use take memory.
pub(crate) const SLOTS: usize = 1 << 20;

/// Header: magic, then the table id.
const MAGIC: [u8; 16] = *b"rdmareg-release1";
const HEADER_LEN: usize = 64;
const TABLE_LEN: usize = HEADER_LEN + SLOTS * 8;

/// Where a peer's reader finds an engine's release table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TableLocation {
    /// The descriptor number of the table's `memfd` in the owner's process.
    pub fd: u32,
    /// 16 random bytes the table's header carries.
    pub id: [u8; 16],
}

/// A mapping of a table: read-write for the owner, read-only for readers.
#[derive(Debug)]
struct Mapping {
    base: *mut u8,
}

// SAFETY: the mapping is only accessed through atomics (slots) or read
// once after creation (header); it lives until drop on any thread.
unsafe impl Send for Mapping {}
// SAFETY: as above: shared access is through atomic loads and stores only.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn map(fd: &OwnedFd, writable: bool) -> std::io::Result<Mapping> {
        let protection = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: maps `TABLE_LEN` bytes of a file at least that long (the
        // caller checked or set its size, and sealed it against shrinking);
        // nothing else is at the address the kernel picks.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                TABLE_LEN,
                protection,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping { base: base.cast() })
    }

    fn header(&self) -> [u8; 32] {
        let mut header = [0u8; 32];
        // SAFETY: the header is the mapping's first bytes, written by the
        // owner before its table's location was published.
        unsafe { std::ptr::copy_nonoverlapping(self.base, header.as_mut_ptr(), 32) };
        header
    }

    fn slot(&self, slot: u32) -> Option<&AtomicU64> {
        let index = usize::try_from(slot).ok().filter(|&i| i < SLOTS)?;
        // SAFETY: inside the mapping (index below SLOTS), 8-byte aligned
        // (the mapping is page-aligned and HEADER_LEN is a multiple of 8);
        // slots are only ever accessed atomically, by both processes.
        Some(unsafe { &*self.base.add(HEADER_LEN + index * 8).cast::<AtomicU64>() })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; no reference
        // into it outlives `self`.
        unsafe { libc::munmap(self.base.cast(), TABLE_LEN) };
    }
}

/// A lock request on `slot`'s bytes of the table file: `kind` is
/// `F_RDLCK` (a writer), `F_WRLCK` (the owner) or `F_UNLCK`.
fn slot_lock(slot: u32, kind: libc::c_int) -> Option<libc::flock> {
    let index = usize::try_from(slot).ok().filter(|&i| i < SLOTS)?;
    // SAFETY: `flock` is plain data; all-zero is a valid value, and
    // `l_pid` must be 0 for open-file-description locks.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = (HEADER_LEN + index * 8) as libc::off_t;
    lock.l_len = 8;
    Some(lock)
}

/// Sets an open-file-description lock without waiting: `Ok(true)` when
/// set (or released), `Ok(false)` when another description holds a lock
/// that conflicts.
fn set_lock(fd: &OwnedFd, slot: u32, kind: libc::c_int) -> std::io::Result<bool> {
    let Some(lock) = slot_lock(slot, kind) else {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    };
    // SAFETY: `lock` is a valid `flock` record that lives across the
    // call; the descriptor is open (owned by the caller).
    let set = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &lock) };
    if set == 0 {
        return Ok(true);
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EAGAIN | libc::EACCES) => Ok(false),
        _ => Err(err),
    }
}

/// The owner's table.
#[derive(Debug)]
pub(crate) struct ReleaseTable {
    mapping: Mapping,
    /// Kept open: readers open the table through it.
    fd: OwnedFd,
    id: [u8; 16],
    free: Vec<u32>,
    next: u32,
}

impl ReleaseTable {
    /// A new, empty, sealed table.
    pub(crate) fn create() -> std::io::Result<ReleaseTable> {
        let name = CString::new("rdmareg-release").expect("no NUL");
        // SAFETY: a valid C string; the flags are memfd_create's.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a descriptor memfd_create just returned, owned here only.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain system calls on the descriptor above.
        let sized = unsafe { libc::ftruncate(fd.as_raw_fd(), TABLE_LEN as libc::off_t) };
        if sized != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Readers map the whole length: nobody may shrink it under them.
        // SAFETY: as above.
        let sealed = unsafe {
            libc::fcntl(
                fd.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
            )
        };
        if sealed != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mapping = Mapping::map(&fd, true)?;
        let mut id = [0u8; 16];
        getrandom::fill(&mut id).map_err(|e| std::io::Error::other(e.to_string()))?;
        // SAFETY: the header lies inside the fresh mapping; no reader has
        // the table's location yet.
        unsafe {
            std::ptr::copy_nonoverlapping(MAGIC.as_ptr(), mapping.base, 16);
            std::ptr::copy_nonoverlapping(id.as_ptr(), mapping.base.add(16), 16);
        }
        Ok(ReleaseTable {
            mapping,
            fd,
            id,
            free: Vec::new(),
            next: 0,
        })
    }

    /// Where readers find this table.
    pub(crate) fn location(&self) -> Option<TableLocation> {
        Some(TableLocation {
            fd: u32::try_from(self.fd.as_raw_fd()).ok()?,
            id: self.id,
        })
    }

    /// A slot now holding `tag` (a registration's release tag, never 0);
    /// `None` when every slot is taken.
    pub(crate) fn publish(&mut self, tag: u64) -> Option<u32> {
        debug_assert_ne!(tag, 0);
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None if (self.next as usize) < SLOTS => {
                self.next += 1;
                self.next - 1
            }
            None => return None,
        };
        self.mapping.slot(slot)?.store(tag, Ordering::Release);
        Some(slot)
    }

    /// Empties `slot`: from this store on, no read of its registration
    /// counts. Callers store before they reply to the unmap.
    pub(crate) fn retire(&mut self, slot: u32) {
        if let Some(entry) = self.mapping.slot(slot) {
            entry.store(0, Ordering::SeqCst);
            self.free.push(slot);
        }
    }

    /// Empties the slot of a registration peers may write: no read counts
    /// and no write starts from this store on, but a write that checked the
    /// slot before may still run; [`ReleaseTable::writers_gone`] says when
    /// none does, and only then is the slot used again.
    pub(crate) fn retire_writable(&mut self, slot: u32) {
        if let Some(entry) = self.mapping.slot(slot) {
            entry.store(0, Ordering::SeqCst);
        }
    }

    /// Whether no writer holds `slot` any more (module docs, "Writers"),
    /// for a slot [`ReleaseTable::retire_writable`] emptied; once it says
    /// so, the slot is free again. A lock the kernel will not take for
    /// another reason counts as a writer: the unmap keeps waiting rather
    /// than answering under a write.
    pub(crate) fn writers_gone(&mut self, slot: u32) -> bool {
        match set_lock(&self.fd, slot, libc::F_WRLCK) {
            Ok(true) => {
                if let Err(err) = set_lock(&self.fd, slot, libc::F_UNLCK) {
                    tracing::warn!(error = %err, slot, "cannot release a release-table slot's lock");
                }
                self.free.push(slot);
                true
            }
            Ok(false) => false,
            Err(err) => {
                tracing::warn!(error = %err, slot, "cannot lock a release-table slot; its unmap waits");
                false
            }
        }
    }
}

/// Why a peer's table could not be opened.
#[derive(Debug)]
pub(crate) struct OpenError(String);

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A reader's read-only view of a peer's table.
#[derive(Debug)]
pub(crate) struct ReleaseView {
    mapping: Mapping,
    /// This view's own open file description of the table: the one a
    /// writer's locks belong to (module docs, "Writers").
    fd: OwnedFd,
    /// Held with a slot's lock: one write under this description at a
    /// time, whichever thread makes it.
    writing: Mutex<()>,
}

/// Slots a writer locked: writes into the registrations found live may
/// run while this lives; dropping it lets the owner's unmaps go on.
#[derive(Debug)]
pub(crate) struct SlotWrites<'view> {
    fd: &'view OwnedFd,
    /// The slots this holds a lock on, each once.
    locked: Vec<u32>,
    /// The (slot, tag) pairs found live under the locks.
    live: Vec<(u32, u64)>,
    /// Released after the locks (fields drop after `drop` ran).
    _one_at_a_time: MutexGuard<'view, ()>,
}

impl SlotWrites<'_> {
    /// Whether `slot` held `tag` under its lock: a write that checked it
    /// may run.
    pub(crate) fn is_live(&self, slot: u32, tag: u64) -> bool {
        self.live.contains(&(slot, tag))
    }
}

impl Drop for SlotWrites<'_> {
    fn drop(&mut self) {
        for &slot in &self.locked {
            if let Err(err) = set_lock(self.fd, slot, libc::F_UNLCK) {
                // The lock then ends when the view closes.
                tracing::warn!(error = %err, slot, "cannot release a peer's release-table lock");
            }
        }
    }
}

impl ReleaseView {
    /// Opens the table at `location` in the process that `task` (a
    /// process or thread id in this pid namespace) belongs to.
    pub(crate) fn open(task: u32, location: TableLocation) -> Result<ReleaseView, OpenError> {
        use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _, OpenOptionsExt as _};
        let path = format!("/proc/{task}/fd/{}", location.fd);
        let fail = |what: &str, err: std::io::Error| OpenError(format!("{path}: {what}: {err}"));
        // What the link names, before opening it: a stale descriptor number
        // may name a FIFO or a device, which must not be opened.
        let named = std::fs::metadata(&path).map_err(|e| fail("stat", e))?;
        let file_type = named.file_type();
        if !named.is_file() || file_type.is_fifo() || named.len() != TABLE_LEN as u64 {
            return Err(OpenError(format!(
                "{path} is not a release table ({} bytes)",
                named.len()
            )));
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| fail("open", e))?;
        let opened = file.metadata().map_err(|e| fail("fstat", e))?;
        if (opened.dev(), opened.ino()) != (named.dev(), named.ino())
            || opened.len() != TABLE_LEN as u64
        {
            return Err(OpenError(format!("{path} changed while it was opened")));
        }
        // SAFETY: F_GET_SEALS on a descriptor this function owns.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(OpenError(format!("{path} is not sealed against shrinking")));
        }
        let fd = OwnedFd::from(file);
        let mapping = Mapping::map(&fd, false).map_err(|e| fail("mmap", e))?;
        let header = mapping.header();
        if header[..16] != MAGIC || header[16..32] != location.id {
            return Err(OpenError(format!("{path} is another table")));
        }
        Ok(ReleaseView {
            mapping,
            fd,
            writing: Mutex::new(()),
        })
    }

    /// Locks `slot` for one write and checks that it holds `tag` under
    /// the lock; `None` when the slot is retired or being retired, or the
    /// kernel refuses the lock (the write then must not run). Hold the
    /// result until the write's system call returned (module docs,
    /// "Writers").
    pub(crate) fn lock_for_write(&self, slot: u32, tag: u64) -> Option<SlotWrites<'_>> {
        let writes = self.lock_slots_for_write(&[(slot, tag)]);
        writes.is_live(slot, tag).then_some(writes)
    }

    /// Locks each slot of `wanted` once and checks under the locks which
    /// (slot, tag) pairs are live ([`SlotWrites::is_live`]); a slot that
    /// is being retired, or that the kernel will not lock, is live for no
    /// tag. One such hold per view at a time: a second waits for the first
    /// to drop (module docs, "Writers").
    pub(crate) fn lock_slots_for_write(&self, wanted: &[(u32, u64)]) -> SlotWrites<'_> {
        // A panic under the mutex leaves no lock of the description held
        // (`SlotWrites` unlocks as it unwinds), so a poisoned one is sound.
        let one_at_a_time = self.writing.lock().unwrap_or_else(|e| e.into_inner());
        let mut writes = SlotWrites {
            fd: &self.fd,
            locked: Vec::with_capacity(1),
            live: Vec::with_capacity(wanted.len()),
            _one_at_a_time: one_at_a_time,
        };
        for &(slot, tag) in wanted {
            if writes.live.contains(&(slot, tag)) {
                continue;
            }
            if !writes.locked.contains(&slot) {
                match set_lock(&self.fd, slot, libc::F_RDLCK) {
                    Ok(true) => writes.locked.push(slot),
                    Ok(false) => continue,
                    Err(err) => {
                        tracing::debug!(error = %err, slot, "cannot lock a peer's release-table slot");
                        continue;
                    }
                }
            }
            let live = self
                .mapping
                .slot(slot)
                .is_some_and(|entry| entry.load(Ordering::SeqCst) == tag);
            if live {
                writes.live.push((slot, tag));
            }
        }
        writes
    }

    /// Whether `slot` holds `tag`: the check before a copy.
    pub(crate) fn is_live(&self, slot: u32, tag: u64) -> bool {
        self.mapping
            .slot(slot)
            .is_some_and(|entry| entry.load(Ordering::Acquire) == tag)
    }

    /// Whether `slot` still holds `tag` after a copy this thread made (a
    /// `process_vm_readv` that has returned): the check that decides
    /// (module docs).
    pub(crate) fn still_live_after_copy(&self, slot: u32, tag: u64) -> bool {
        // Orders the copy's loads (made by the kernel on this thread)
        // before the slot's.
        fence(Ordering::Acquire);
        self.is_live(slot, tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_sees_a_slot_live_until_it_is_retired_and_never_again() {
        let mut table = ReleaseTable::create().expect("memfd");
        let location = table.location().unwrap();
        let view = ReleaseView::open(std::process::id(), location).expect("opened");
        let slot = table.publish(7).unwrap();
        assert!(view.is_live(slot, 7));
        assert!(!view.is_live(slot, 8));
        table.retire(slot);
        assert!(!view.still_live_after_copy(slot, 7));
        // The slot is reused under another id: the old one never matches.
        assert_eq!(table.publish(9), Some(slot));
        assert!(view.is_live(slot, 9));
        assert!(!view.is_live(slot, 7));
        assert!(!view.is_live(u32::MAX, 9), "a slot past the table");
    }

    #[test]
    fn a_table_is_not_taken_for_another() {
        let table = ReleaseTable::create().expect("memfd");
        let mut location = table.location().unwrap();
        location.id[0] ^= 1;
        assert!(ReleaseView::open(std::process::id(), location).is_err());
        // A descriptor number naming something else (stdin, or nothing).
        let elsewhere = TableLocation {
            fd: 0,
            id: table.location().unwrap().id,
        };
        assert!(ReleaseView::open(std::process::id(), elsewhere).is_err());
        let nothing = TableLocation {
            fd: 1 << 30,
            id: table.location().unwrap().id,
        };
        assert!(ReleaseView::open(std::process::id(), nothing).is_err());
    }

    #[test]
    fn an_unmap_waits_for_a_write_that_checked_the_slot_first() {
        let mut table = ReleaseTable::create().expect("memfd");
        let location = table.location().unwrap();
        let view = ReleaseView::open(std::process::id(), location).expect("opened");
        let slot = table.publish(7).unwrap();
        let write = view.lock_for_write(slot, 7).expect("a live slot locks");
        table.retire_writable(slot);
        assert!(!table.writers_gone(slot), "the write still runs");
        assert_ne!(
            table.publish(8),
            Some(slot),
            "a slot being drained is not reused"
        );
        drop(write);
        assert!(table.writers_gone(slot));
        assert!(view.lock_for_write(slot, 7).is_none(), "a retired slot");
    }

    #[test]
    fn a_write_after_the_owner_retired_the_slot_never_starts() {
        let mut table = ReleaseTable::create().expect("memfd");
        let location = table.location().unwrap();
        let view = ReleaseView::open(std::process::id(), location).expect("opened");
        let slot = table.publish(7).unwrap();
        assert!(view.lock_for_write(slot, 8).is_none(), "another tag");
        table.retire_writable(slot);
        assert!(view.lock_for_write(slot, 7).is_none());
        assert!(table.writers_gone(slot), "a refused writer holds nothing");
    }

    #[test]
    fn a_batch_locks_each_slot_once_and_sees_which_are_live() {
        let mut table = ReleaseTable::create().expect("memfd");
        let location = table.location().unwrap();
        let view = ReleaseView::open(std::process::id(), location).expect("opened");
        let (first, second) = (table.publish(7).unwrap(), table.publish(8).unwrap());
        let writes = view.lock_slots_for_write(&[(first, 7), (second, 9), (first, 7), (second, 8)]);
        assert!(writes.is_live(first, 7) && writes.is_live(second, 8));
        assert!(!writes.is_live(second, 9), "another tag");
        table.retire_writable(first);
        table.retire_writable(second);
        assert!(!table.writers_gone(first) && !table.writers_gone(second));
        drop(writes);
        assert!(table.writers_gone(first) && table.writers_gone(second));
    }

    #[test]
    fn a_closed_view_holds_no_lock() {
        let mut table = ReleaseTable::create().expect("memfd");
        let location = table.location().unwrap();
        let view = ReleaseView::open(std::process::id(), location).expect("opened");
        let slot = table.publish(7).unwrap();
        // What a writer killed mid-write leaves: its lock taken, never
        // released, then its descriptor closed by the kernel.
        assert!(set_lock(&view.fd, slot, libc::F_RDLCK).unwrap());
        table.retire_writable(slot);
        assert!(!table.writers_gone(slot));
        drop(view);
        assert!(table.writers_gone(slot));
    }

    #[test]
    fn a_full_table_gives_no_slot() {
        let mut table = ReleaseTable::create().expect("memfd");
        table.next = SLOTS as u32;
        assert_eq!(table.publish(1), None);
        table.retire(3);
        assert_eq!(table.publish(1), Some(3));
    }
}
