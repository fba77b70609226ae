//! Page memory behind an arena, and the one rule about freeing it.
//!
//! [`PageMemory`] is zeroed, page-aligned memory. Once marked registered,
//! dropping it **leaks** the pages (logged) unless
//! [`confirm_unregistered`](PageMemory::confirm_unregistered) was called
//! after a confirmed unmap: a leak is a bounded loss, freeing pages a NIC
//! may write is an invisible use-after-free. Arenas of at least
//! [`HUGE_PAGE`] are advised `MADV_HUGEPAGE` (see `docs/architecture.md`,
//! "Releasing memory").

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rdmareg_core::RdmaError;

/// Arenas at least this large are backed by transparent huge pages.
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// Ask the kernel to back `[ptr, ptr + len)` with transparent huge pages;
/// a refusal is logged and changes nothing else.
fn advise_huge_pages(ptr: NonNull<u8>, len: usize) {
    // SAFETY: madvise reads no memory through the pointer; the range is a
    // live, HUGE_PAGE-aligned allocation the caller owns, and
    // MADV_HUGEPAGE changes no contents.
    let rc = unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
    if rc != 0 {
        tracing::debug!(
            error = %std::io::Error::last_os_error(),
            "MADV_HUGEPAGE refused; arena stays on small pages"
        );
    }
}

/// Page-aligned memory that is freed only when it is known not to be pinned.
#[derive(Debug)]
pub(crate) struct PageMemory {
    ptr: NonNull<u8>,
    layout: Layout,
    /// `true` from just before the map until an unmap is confirmed.
    registered: AtomicBool,
    /// Where leaked bytes are counted (the registry's statistics).
    leaked_bytes: Arc<AtomicU64>,
}

// SAFETY: PageMemory owns its allocation exclusively and hands out no
// references; it is a pointer plus atomics.
unsafe impl Send for PageMemory {}
// SAFETY: shared access only reads `ptr`/`layout` and uses atomics.
unsafe impl Sync for PageMemory {}

impl PageMemory {
    /// Allocate `len` zeroed bytes aligned to `align` (a power of two).
    /// A leak on drop is added to `leaked_bytes`.
    pub(crate) fn allocate(
        len: usize,
        align: usize,
        leaked_bytes: Arc<AtomicU64>,
    ) -> Result<Self, RdmaError> {
        if !align.is_power_of_two() {
            return Err(RdmaError::OutOfRange);
        }
        let huge = len >= HUGE_PAGE;
        let align = if huge { align.max(HUGE_PAGE) } else { align };
        let layout = Layout::from_size_align(len, align)
            .ok()
            .filter(|l| l.size() > 0)
            .ok_or(RdmaError::OutOfRange)?;
        // SAFETY: `layout` has a non-zero size (checked just above).
        let raw = unsafe { std::alloc::alloc(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            RdmaError::backend(format!("could not allocate {len} B of arena memory"))
        })?;
        if huge {
            advise_huge_pages(ptr, len);
        }
        // SAFETY: `ptr` is a fresh, unshared allocation of `len` bytes.
        // Zeroing after the advice makes the first touch fault huge pages.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(Self {
            ptr,
            layout,
            registered: AtomicBool::new(false),
            leaked_bytes,
        })
    }

    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.layout.size()
    }

    /// From now on dropping leaks the pages until an unmap is confirmed.
    pub(crate) fn mark_registered(&self) {
        self.registered.store(true, Ordering::SeqCst);
    }

    /// The backend confirmed the pages are no longer pinned: the last holder
    /// may free them.
    pub(crate) fn confirm_unregistered(&self) {
        self.registered.store(false, Ordering::SeqCst);
    }
}

impl Drop for PageMemory {
    fn drop(&mut self) {
        if self.registered.load(Ordering::SeqCst) {
            tracing::error!(
                addr = self.ptr.as_ptr() as usize,
                len = self.layout.size(),
                "arena pages leaked: their unmap was never confirmed, so freeing them could hand pinned memory back to the allocator"
            );
            self.leaked_bytes
                .fetch_add(self.layout.size() as u64, Ordering::SeqCst);
            return;
        }
        // SAFETY: `ptr` came from `alloc` with this exact `layout` and is
        // freed only here, once; the pages are not registered (never mapped,
        // map failed or rolled back, or the unmap was confirmed).
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_page_aligned_and_zeroed() {
        let m = PageMemory::allocate(3 * 4096, 4096, Arc::default()).unwrap();
        assert_eq!(m.ptr().as_ptr() as usize % 4096, 0);
        // SAFETY: the allocation is `len` bytes, initialised to zero, and not
        // registered with anything, so a shared view of it aliases nothing.
        let bytes = unsafe { std::slice::from_raw_parts(m.ptr().as_ptr(), m.len()) };
        assert!(bytes.iter().all(|b| *b == 0));
    }

    #[test]
    fn large_arenas_are_huge_page_aligned_and_zeroed() {
        let m = PageMemory::allocate(2 * HUGE_PAGE, 4096, Arc::default()).unwrap();
        assert_eq!(m.ptr().as_ptr() as usize % HUGE_PAGE, 0);
        // SAFETY: as above: a fresh, unregistered, zero-initialised allocation.
        let bytes = unsafe { std::slice::from_raw_parts(m.ptr().as_ptr(), m.len()) };
        assert!(bytes.iter().all(|b| *b == 0));
    }

    #[test]
    fn zero_length_and_bad_alignment_are_refused() {
        assert!(PageMemory::allocate(0, 4096, Arc::default()).is_err());
        assert!(PageMemory::allocate(4096, 3000, Arc::default()).is_err());
    }

    #[test]
    fn registered_memory_is_leaked_and_counted_unless_confirmed() {
        let leaked = Arc::new(AtomicU64::new(0));
        let m = PageMemory::allocate(4096, 4096, Arc::clone(&leaked)).unwrap();
        m.mark_registered();
        drop(m);
        assert_eq!(leaked.load(Ordering::SeqCst), 4096);
        let m = PageMemory::allocate(4096, 4096, Arc::clone(&leaked)).unwrap();
        m.mark_registered();
        m.confirm_unregistered();
        drop(m);
        assert_eq!(leaked.load(Ordering::SeqCst), 4096);
    }
}
