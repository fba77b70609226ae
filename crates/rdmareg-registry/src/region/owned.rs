//! [`OwnedBuffer`]: a `Box<[u8]>` held in raw form while it is registered.
//!
//! Peers may write a registered buffer, so no reference (nor a `Box`, which
//! asserts uniqueness) may exist: the box is raw from before the map until
//! the registration is confirmed gone, and leaked if that never comes.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A heap buffer handed to the registry, in raw form.
#[derive(Debug)]
pub(crate) struct OwnedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    /// `true` from the confirmed map until a confirmed unmap.
    registered: bool,
    leaked_bytes: Arc<AtomicU64>,
}

// SAFETY: OwnedBuffer is the unique owner of its heap allocation (it came
// from `Box::into_raw`) and creates no references except in `into_box`.
unsafe impl Send for OwnedBuffer {}
// SAFETY: `&OwnedBuffer` exposes only the address and length, never the bytes.
unsafe impl Sync for OwnedBuffer {}

impl OwnedBuffer {
    /// Take ownership of a non-empty buffer.
    pub(crate) fn from_box(buffer: Box<[u8]>, leaked_bytes: Arc<AtomicU64>) -> Self {
        let len = buffer.len();
        let raw = Box::into_raw(buffer);
        // Box::into_raw never returns null.
        let ptr = NonNull::new(raw.cast::<u8>()).unwrap_or(NonNull::dangling());
        Self {
            ptr,
            len,
            registered: false,
            leaked_bytes,
        }
    }

    pub(crate) fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    pub(crate) fn as_ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The backend mapped it: dropping it now leaks instead of freeing.
    pub(crate) fn mark_registered(&mut self) {
        self.registered = true;
    }

    /// The unmap was confirmed: the buffer may be handed back or freed.
    pub(crate) fn confirm_unregistered(&mut self) {
        self.registered = false;
    }

    /// The buffer as a box again, or `None` (and the buffer leaked) if it is
    /// still registered.
    pub(crate) fn into_box(mut self) -> Option<Box<[u8]>> {
        if self.registered {
            return None; // Drop leaks and counts it.
        }
        let slice = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
        // Leave an empty husk behind so Drop has nothing to free.
        self.ptr = NonNull::dangling();
        self.len = 0;
        // SAFETY: `slice` is exactly what `Box::into_raw` produced; it is
        // rebuilt once (the husk owns nothing), and the buffer is not
        // registered, so no peer can write it.
        Some(unsafe { Box::from_raw(slice) })
    }
}

impl Drop for OwnedBuffer {
    fn drop(&mut self) {
        if self.len == 0 {
            return; // emptied by `into_box`
        }
        if self.registered {
            tracing::error!(
                addr = self.addr(),
                len = self.len,
                "owned buffer leaked: its unmap was never confirmed"
            );
            self.leaked_bytes
                .fetch_add(self.len as u64, Ordering::SeqCst);
            return;
        }
        let slice = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
        // SAFETY: `slice` is the pointer and length from `Box::into_raw`
        // (non-empty, so `into_box` has not taken it), rebuilt once, and
        // the buffer is not registered.
        drop(unsafe { Box::from_raw(slice) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unregistered_buffer_comes_back_intact() {
        let owned = OwnedBuffer::from_box(vec![7u8; 100].into_boxed_slice(), Arc::default());
        assert_eq!(owned.len(), 100);
        let back = owned.into_box().unwrap();
        assert_eq!(&back[..], &[7u8; 100][..]);
    }

    #[test]
    fn registered_buffer_is_leaked_and_counted_not_freed() {
        let leaked = Arc::new(AtomicU64::new(0));
        let mut owned = OwnedBuffer::from_box(vec![0u8; 64].into_boxed_slice(), leaked.clone());
        owned.mark_registered();
        assert!(owned.into_box().is_none());
        assert_eq!(leaked.load(Ordering::SeqCst), 64);
    }
}
