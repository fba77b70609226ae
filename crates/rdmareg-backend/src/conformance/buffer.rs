//! Memory the kit registers, and the rule that it is never freed while a
//! backend may still hold it.
//! A [`KitBuffer`] is reached only through its raw pointer, and freed only
//! when nothing registers it (failed map, confirmed rollback, `Ok` unmap);
//! otherwise, a failed unmap or a panicking check, it is leaked on purpose.

use rdmareg_core::{Access, BackendRegion, RdmaError};

use super::support::{kit_map, kit_map_with_access};
use crate::RdmaBackend;

/// A heap buffer the kit hands to backends.
pub(crate) struct KitBuffer {
    base: *mut u8,
    len: usize,
    /// Whether a backend may hold a registration of this memory.
    maybe_registered: bool,
}

// SAFETY: the buffer owns its allocation exclusively; the raw pointer is only
// dereferenced through `&self` methods that copy bytes in or out.
unsafe impl Send for KitBuffer {}
// SAFETY: as above; concurrent `snapshot`s only read.
unsafe impl Sync for KitBuffer {}

impl KitBuffer {
    /// A buffer of `len` bytes (at least one), byte `i` set to `fill(i)`.
    pub(crate) fn filled(len: usize, fill: impl Fn(usize) -> u8) -> Self {
        assert!(len > 0, "kit buffers are never empty");
        let bytes: Box<[u8]> = (0..len).map(fill).collect();
        let base = Box::into_raw(bytes).cast::<u8>();
        Self {
            base,
            len,
            maybe_registered: false,
        }
    }

    pub(crate) fn addr(&self) -> usize {
        self.base as usize
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// A copy of the current contents, taken when no transfer into it can
    /// run, or to check that none does.
    pub(crate) fn snapshot(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        // SAFETY: `base` points to `len` initialised bytes owned by this buffer
        // (allocated in `filled`, freed only in `drop`); `out` is a distinct
        // allocation of the same length.
        unsafe { std::ptr::copy_nonoverlapping(self.base, out.as_mut_ptr(), self.len) };
        out
    }

    /// Sets every byte to `value`, once every transfer into it completed
    /// (contract point 8).
    pub(crate) fn overwrite(&self, value: u8) {
        // SAFETY: `base` points to `len` bytes owned by this buffer; no
        // Rust reference to them exists (snapshots copy out).
        unsafe { std::ptr::write_bytes(self.base, value, self.len) };
    }

    /// From now on, do not free this memory unless told it is unregistered.
    pub(crate) fn mark_registered(&mut self) {
        self.maybe_registered = true;
    }

    /// The backend confirmed it holds no registration of this memory.
    pub(crate) fn mark_unregistered(&mut self) {
        self.maybe_registered = false;
    }
}

impl Drop for KitBuffer {
    fn drop(&mut self) {
        if self.maybe_registered {
            tracing::warn!(
                addr = self.addr(),
                len = self.len,
                "conformance kit leaks a buffer a backend may still hold"
            );
            return;
        }
        let slice = std::ptr::slice_from_raw_parts_mut(self.base, self.len);
        // SAFETY: `slice` is exactly the pointer and length `Box::into_raw`
        // produced in `filled`, and nothing registers it any more.
        drop(unsafe { Box::from_raw(slice) });
    }
}

/// A buffer and the registration a backend made of it.
pub(crate) struct Mapped {
    pub(crate) buf: KitBuffer,
    pub(crate) region: BackendRegion,
}

impl Mapped {
    /// Map `buf` on `backend`.
    pub(crate) async fn new(backend: &dyn RdmaBackend, buf: KitBuffer) -> Result<Self, RdmaError> {
        Self::with_access(backend, buf, None).await
    }

    /// Map `buf` on `backend` granting `access` (`None`: with `map`).
    pub(crate) async fn with_access(
        backend: &dyn RdmaBackend,
        mut buf: KitBuffer,
        access: Option<Access>,
    ) -> Result<Self, RdmaError> {
        buf.mark_registered();
        let mapped = match access {
            None => kit_map(backend, buf.addr(), buf.len()).await,
            Some(access) => kit_map_with_access(backend, buf.addr(), buf.len(), access).await,
        };
        match mapped {
            Ok(region) => Ok(Self { buf, region }),
            Err(e) => {
                // A map that fails with an error registered nothing.
                buf.mark_unregistered();
                Err(e)
            }
        }
    }

    /// Map a buffer of `len` bytes filled by `fill`, panicking if the backend
    /// refuses.
    pub(crate) async fn filled(
        backend: &dyn RdmaBackend,
        len: usize,
        fill: impl Fn(usize) -> u8,
    ) -> Self {
        match Self::new(backend, KitBuffer::filled(len, fill)).await {
            Ok(mapped) => mapped,
            Err(e) => panic!("map of a valid {len}-byte buffer failed: {e}"),
        }
    }

    pub(crate) fn id(&self) -> u64 {
        self.region.backend_region_id
    }

    pub(crate) fn addr(&self) -> u64 {
        self.buf.addr() as u64
    }

    /// Unmap; on `Ok` the buffer is freed, on an error it is leaked.
    pub(crate) async fn unmap(mut self, backend: &dyn RdmaBackend) -> Result<(), RdmaError> {
        let result = backend.unmap(self.id()).await;
        if result.is_ok() {
            self.buf.mark_unregistered();
        }
        result
    }

    /// Unmap and insist on `Ok`.
    pub(crate) async fn release(self, backend: &dyn RdmaBackend) {
        let id = self.id();
        if let Err(e) = self.unmap(backend).await {
            panic!("unmap of live region {id} failed: {e}");
        }
    }

    /// The backend returned `Ok(())` to an unmap of this region issued
    /// elsewhere: hand back the buffer, now free to be dropped.
    pub(crate) fn confirm_unmapped(mut self) -> KitBuffer {
        self.buf.mark_unregistered();
        self.buf
    }
}
