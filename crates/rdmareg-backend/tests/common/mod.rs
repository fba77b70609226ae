//! Helpers shared by the loopback tests: test memory and request building.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use rdmareg_backend::loopback::{LoopbackBackend, LoopbackFabric};
use rdmareg_backend::{BackendGet, BackendRegion, PeerId, RdmaBackend, RdmaError};

pub const OWNER: PeerId = PeerId(1);
pub const CONSUMER: PeerId = PeerId(2);
pub const FILL: u8 = 0xEE;

/// Memory handed to the backend. Reached only through its raw pointer, and
/// never freed: a test that fails may leave it registered, and leaking a few
/// test buffers is harmless where freeing registered memory is not.
pub struct TestMemory {
    base: *mut u8,
    len: usize,
}

// SAFETY: the allocation is owned by this value and only copied in and out of.
unsafe impl Send for TestMemory {}
// SAFETY: as above; `bytes` only reads.
unsafe impl Sync for TestMemory {}

impl TestMemory {
    pub fn filled(len: usize, fill: impl Fn(usize) -> u8) -> Self {
        let bytes: Box<[u8]> = (0..len).map(fill).collect();
        Self {
            base: Box::into_raw(bytes).cast::<u8>(),
            len,
        }
    }

    pub fn pattern(len: usize) -> Self {
        Self::filled(len, pattern_byte)
    }

    pub fn blank(len: usize) -> Self {
        Self::filled(len, |_| FILL)
    }

    pub fn addr(&self) -> usize {
        self.base as usize
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// A copy of the contents; taken when no GET into the memory is running.
    pub fn bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        // SAFETY: `base` points to `len` initialised bytes that are never freed.
        unsafe { std::ptr::copy_nonoverlapping(self.base, out.as_mut_ptr(), self.len) };
        out
    }
}

/// The seam's `unsafe` calls, made on memory that follows these tests'
/// discipline.
///
/// The discipline: every range a test maps is inside a [`TestMemory`] (or
/// is degenerate — null, empty, wrapping — which a backend refuses). A
/// `TestMemory` is never freed and is reached only through its raw pointer,
/// so no reference aliases bytes a backend may write, and a test reads it
/// (by copying out) only once the GETs into it answered, or to check that
/// nothing landed. Region ids a test names are its own regions of test
/// memory, or ids that name nothing.
pub trait SeamForTestMemory: RdmaBackend {
    fn map_test_memory(
        &self,
        ptr: usize,
        len: usize,
    ) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
        // SAFETY: by the discipline above, the range is test memory that is
        // never freed, or degenerate.
        unsafe { self.map(ptr, len) }
    }

    fn get_into_test_memory(&self, request: BackendGet) -> BoxFuture<'_, Result<(), RdmaError>> {
        // SAFETY: by the discipline above, the destination is test memory no
        // reference aliases, or an id that names nothing.
        unsafe { self.get(request) }
    }

    fn get_batch_into_test_memory(
        &self,
        requests: Vec<BackendGet>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        // SAFETY: as `get_into_test_memory`, for every request.
        unsafe { self.get_batch(requests) }
    }
}

impl<B: RdmaBackend + ?Sized> SeamForTestMemory for B {}

pub fn pattern_byte(i: usize) -> u8 {
    (i % 251) as u8
}

/// A fabric with an owner and a consumer instance.
pub fn pair() -> (LoopbackFabric, Arc<LoopbackBackend>, Arc<LoopbackBackend>) {
    let fabric = LoopbackFabric::new();
    let owner = fabric.backend(OWNER);
    let consumer = fabric.backend(CONSUMER);
    (fabric, owner, consumer)
}

/// A GET of `len` bytes from the start of `source` (registered on `peer` at
/// `source_addr`) into `destination` at `local_offset`.
pub fn get(
    peer: PeerId,
    source: &BackendRegion,
    source_addr: usize,
    destination: &BackendRegion,
    local_offset: u64,
    len: u64,
) -> BackendGet {
    BackendGet {
        peer,
        remote_addr: source_addr as u64,
        packed_key: source.packed_key.clone(),
        local_region_id: destination.backend_region_id,
        local_offset,
        len,
        deadline: Some(Duration::from_secs(60)),
    }
}

/// Let spawned tasks run until they are parked.
pub async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}
