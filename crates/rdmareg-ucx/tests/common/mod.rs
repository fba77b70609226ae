//! Shared helpers of the integration tests: engines on the loopback
//! interface, page-aligned buffers, descriptors and GET requests.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use rdmareg_backend::RdmaBackend;
use rdmareg_backend::conformance::{BackendPair, Capabilities};
use rdmareg_core::{BackendGet, BackendRegion, Descriptor, PeerId, RdmaError};
use rdmareg_ucx::{Transport, UcxBackend, UcxConfig, UcxEngine};

pub mod attacked_memory;
pub mod c_fixtures;
pub mod child_process;
pub mod list_pieces;
pub mod list_reads;
pub mod list_scene;
pub mod raw_am;
pub mod raw_put;
pub mod scene;
pub mod sockets;
pub mod write_lists;
pub mod write_races;

/// How the consumer engine names the owner engine.
pub const OWNER: PeerId = PeerId(1);

/// Logs to the test output when `RUST_LOG` is set.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// An engine configuration for tests: loopback only.
pub fn config(transport: Transport) -> UcxConfig {
    UcxConfig::default()
        .with_transport(transport)
        .with_net_devices("lo")
        .with_teardown_timeout(Duration::from_secs(2))
}

/// Starts an owner and a consumer engine; the consumer knows the owner as
/// [`OWNER`].
pub fn engines(transport: Transport) -> (UcxEngine, UcxEngine) {
    init_tracing();
    let owner = UcxEngine::start(config(transport.clone())).expect("owner engine starts");
    let consumer = UcxEngine::start(config(transport)).expect("consumer engine starts");
    consumer
        .add_peer(OWNER, owner.worker_address())
        .expect("consumer records the owner");
    (owner, consumer)
}

/// Starts an owner and a consumer engine from `config`; the consumer knows
/// the owner as [`OWNER`].
pub fn engines_with(config: UcxConfig) -> (UcxEngine, UcxEngine) {
    init_tracing();
    let owner = UcxEngine::start(config.clone()).expect("owner engine starts");
    let consumer = UcxEngine::start(config).expect("consumer engine starts");
    consumer
        .add_peer(OWNER, owner.worker_address())
        .expect("consumer records the owner");
    (owner, consumer)
}

/// [`engines`] with the same-host direct-read lane closed: every read goes
/// through the owner, on every transport.
pub fn served_engines(transport: Transport) -> (UcxEngine, UcxEngine) {
    engines_with(config(transport).with_same_host_direct_reads(false))
}

/// A conformance-kit pair over two engines of `transport`; its teardown
/// shuts both down and checks they released everything.
pub fn backend_pair(transport: Transport) -> BackendPair {
    backend_pair_with(config(transport))
}

/// A conformance-kit pair over two engines started from `config`.
pub fn backend_pair_with(config: UcxConfig) -> BackendPair {
    let direct = config.direct_reads_enabled();
    let direct_writes = direct && config.same_host_direct_writes;
    let (owner, consumer) = engines_with(config);
    // An owner serving every read itself enforces bounds and refuses keys
    // it never issued: the full contract applies. On the same-host direct
    // lane the kernel copies without asking the owner: the consumer's
    // engine still checks the range against the key's mapped range, but a
    // stale key reads whatever the memory holds now; and the owner's
    // written log cannot list the writes it never saw.
    let capabilities = if direct {
        Capabilities::full()
            .with_unknown_remote_key_detected(false)
            .with_written_log_complete(!direct_writes)
    } else {
        Capabilities::full()
    };
    let pair = BackendPair::new(
        owner.backend() as Arc<dyn RdmaBackend>,
        consumer.backend() as Arc<dyn RdmaBackend>,
        OWNER,
    )
    .with_capabilities(capabilities);
    pair.with_teardown(async move {
        consumer.shutdown().await;
        owner.shutdown().await;
        assert_eq!(
            consumer.live_registrations(),
            Some(0),
            "consumer live count after shutdown"
        );
        assert_eq!(
            owner.live_registrations(),
            Some(0),
            "owner live count after shutdown"
        );
    })
}

/// A two-worker Tokio runtime for tests that drive engines from the test
/// thread.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// An engine on the loopback interface over tcp, logging when `RUST_LOG`
/// is set.
pub fn tcp_engine() -> UcxEngine {
    init_tracing();
    UcxEngine::start(config(Transport::Tcp)).expect("engine starts")
}

/// A zeroed, page-aligned heap buffer that is freed on drop. Tests keep it
/// alive until the registration over it is gone.
pub struct PageBuf {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: PageBuf uniquely owns its allocation; the raw pointer is only an
// address, so moving or sharing the owner across threads is sound.
unsafe impl Send for PageBuf {}
// SAFETY: as above; shared access only reads through `snapshot`.
unsafe impl Sync for PageBuf {}

impl PageBuf {
    /// `len` zero bytes (at least one page is allocated).
    pub fn zeroed(len: usize) -> PageBuf {
        let layout = Layout::from_size_align(len.max(1), 4096).expect("layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "allocation of {len} bytes");
        PageBuf { ptr, layout }
    }

    /// `len` bytes where byte `i` is `pattern(i)`.
    pub fn filled(len: usize, pattern: impl Fn(usize) -> u8) -> PageBuf {
        let buf = PageBuf::zeroed(len);
        // SAFETY: the allocation holds `len` bytes and nothing else refers to
        // it yet.
        let bytes = unsafe { std::slice::from_raw_parts_mut(buf.ptr, len) };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = pattern(i);
        }
        buf
    }

    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Overwrites every byte with `value`. Call only once the backend has
    /// answered every transfer into the buffer: that is when it is the
    /// caller's again (what the tests calling this check).
    pub fn fill(&self, value: u8) {
        // SAFETY: the allocation holds `len()` bytes; the backend answered
        // every transfer into it, so by its contract nothing else writes it.
        unsafe { std::ptr::write_bytes(self.ptr, value, self.len()) };
    }

    /// A copy of the current contents. Call only while no GET writes into
    /// the buffer.
    pub fn snapshot(&self) -> Vec<u8> {
        // SAFETY: the allocation holds `len()` initialised bytes; callers
        // read only when no transfer is in flight into it.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len()) }.to_vec()
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout, freed once.
        unsafe { dealloc(self.ptr, self.layout) };
    }
}

/// The seam's `unsafe` calls, made on memory that follows these tests'
/// discipline.
///
/// The discipline: every range a test maps is inside a [`PageBuf`] (or is
/// degenerate — null, empty, wrapping — which the engine refuses), and the
/// test keeps that buffer alive until an unmap of the registration answered
/// `Ok` or the engine's teardown ended it. A `PageBuf` is reached only
/// through its raw pointer, so no reference aliases bytes the engine may
/// write, and a test reads it (by copying out) or overwrites it only once
/// the GETs into it answered, or to check that nothing landed. Region ids a
/// test names are its own registrations of such buffers, or ids that name
/// nothing.
pub trait SeamForTestMemory: RdmaBackend {
    fn map_test_memory(
        &self,
        ptr: usize,
        len: usize,
    ) -> BoxFuture<'_, Result<BackendRegion, RdmaError>> {
        // SAFETY: by the discipline above, the range is a test buffer that
        // outlives its registration, or degenerate.
        unsafe { self.map(ptr, len) }
    }

    fn get_into_test_memory(&self, request: BackendGet) -> BoxFuture<'_, Result<(), RdmaError>> {
        // SAFETY: by the discipline above, the destination is a test buffer
        // no reference aliases, or an id that names nothing.
        unsafe { self.get(request) }
    }

    fn get_batch_into_test_memory(
        &self,
        requests: Vec<BackendGet>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        // SAFETY: as `get_into_test_memory`, for every request.
        unsafe { self.get_batch(requests) }
    }

    fn get_shared_batch_into_test_memory(
        &self,
        requests: std::sync::Arc<[BackendGet]>,
    ) -> BoxFuture<'_, Vec<Result<(), RdmaError>>> {
        // SAFETY: as `get_into_test_memory`, for every request.
        unsafe { self.get_shared_batch(requests) }
    }
}

impl<B: RdmaBackend + ?Sized> SeamForTestMemory for B {}

/// `bytes` as lowercase hex, two digits a byte: how a parent test passes
/// addresses and keys to its child processes.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes [`hex`] wrote as `text`.
pub fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
        .collect()
}

/// The source pattern: never zero, period not a power of two.
pub fn pattern(i: usize) -> u8 {
    (i % 251) as u8 + 1
}

/// How many bytes of `got` differ from the byte at the same place in
/// `want`, compared over the shorter of the two.
pub fn differing_bytes(got: &[u8], want: &[u8]) -> usize {
    got.iter().zip(want).filter(|(a, b)| a != b).count()
}

/// The descriptor an owner would send for `region` over `buf`.
pub fn describe(buf: &PageBuf, region: &BackendRegion) -> Descriptor {
    Descriptor::new(
        "ucx",
        buf.addr() as u64,
        buf.len() as u64,
        region.backend_region_id,
        region.packed_key.clone(),
    )
    .expect("a valid descriptor")
}

/// A GET of all of `source` into `dest_region` at `dest_offset`.
pub fn get_request(
    peer: PeerId,
    source: &Descriptor,
    dest_region: &BackendRegion,
    dest_offset: u64,
    deadline: Option<Duration>,
) -> BackendGet {
    BackendGet {
        peer,
        remote_addr: source.addr(),
        packed_key: source.packed_key().clone(),
        local_region_id: dest_region.backend_region_id,
        local_offset: dest_offset,
        len: source.len(),
        deadline,
    }
}

/// Maps `buf` on `backend`.
pub async fn map(backend: &UcxBackend, buf: &PageBuf) -> BackendRegion {
    backend
        .map_test_memory(buf.addr(), buf.len())
        .await
        .expect("map succeeds")
}

/// A packed key that is well formed for UCX 1.22 (md_map 0, host memory):
/// what a `ucp_rkey_pack` on tcp or shared memory produces.
pub fn nine_byte_ucx_key() -> Bytes {
    Bytes::from_static(&[0, 0, 0, 0, 0, 0, 0, 0, 0])
}

/// A bare UCP context and single-threaded worker for a raw peer: UCX's own
/// API, not the engine's, on `tls` over loopback, with `features`. The
/// caller owns both handles and destroys the worker, then cleans up the
/// context.
pub fn raw_context_and_worker(
    tls: &str,
    features: u32,
) -> (ucx_sys::ucp_context_h, ucx_sys::ucp_worker_h) {
    use std::ffi::CString;
    use std::ptr;
    use ucx_sys as sys;

    let mut config: *mut sys::ucp_config_t = ptr::null_mut();
    // SAFETY: null prefix and file mean UCX's defaults; valid out-pointer.
    let status = unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut config) };
    assert_eq!(status, sys::UCS_OK);
    for (key, value) in [("TLS", tls), ("NET_DEVICES", "lo"), ("MEM_EVENTS", "n")] {
        let (k, v) = (CString::new(key).unwrap(), CString::new(value).unwrap());
        // SAFETY: live config; NUL-terminated strings UCX copies.
        let status = unsafe { sys::ucp_config_modify(config, k.as_ptr(), v.as_ptr()) };
        assert_eq!(status, sys::UCS_OK, "UCX_{key}={value}");
    }
    let params = sys::ucp_params_t {
        field_mask: u64::from(sys::UCP_PARAM_FIELD_FEATURES),
        features: u64::from(features),
        ..Default::default()
    };
    let mut context: sys::ucp_context_h = ptr::null_mut();
    // SAFETY: initialised params, live config, valid out-pointer.
    let status = unsafe { sys::ucp_init_version(1, 22, &params, config, &mut context) };
    // SAFETY: read above, released once, after use.
    unsafe { sys::ucp_config_release(config) };
    assert_eq!(status, sys::UCS_OK, "raw context");
    let worker_params = sys::ucp_worker_params_t {
        field_mask: u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE),
        thread_mode: sys::UCS_THREAD_MODE_SINGLE,
        ..Default::default()
    };
    let mut worker: sys::ucp_worker_h = ptr::null_mut();
    // SAFETY: live context, initialised params, valid out-pointer.
    let status = unsafe { sys::ucp_worker_create(context, &worker_params, &mut worker) };
    assert_eq!(status, sys::UCS_OK, "raw worker");
    (context, worker)
}

/// `key` with the last 8 bytes of its capability altered: the part no
/// release table holds, so only the owner itself can tell (a served read
/// is refused, a one-sided read is not).
pub fn forged_capability_tail(key: &[u8]) -> Bytes {
    use rdmareg_ucx::read_protocol::ReadKey;
    match ReadKey::decode(key).expect("an engine key") {
        ReadKey::SameHost(mut same_host) => {
            same_host.served.capability[8..].fill(0xAB);
            Bytes::from(same_host.encode().expect("a same-host key"))
        }
        other => panic!("unexpected key {other:?}"),
    }
}

/// `key` (either lane) with its capability replaced: a well-formed key the
/// owner never issued.
pub fn forged_capability(key: &[u8]) -> Bytes {
    use rdmareg_ucx::read_protocol::ReadKey;
    match ReadKey::decode(key).expect("an engine key") {
        ReadKey::Served(mut served) => {
            served.capability = [0xAB; 16];
            Bytes::copy_from_slice(&served.encode())
        }
        ReadKey::SameHost(mut same_host) => {
            same_host.served.capability = [0xAB; 16];
            Bytes::from(same_host.encode().expect("a same-host key"))
        }
        other => panic!("unexpected key {other:?}"),
    }
}

/// Maps `buf` on `backend` with `access` (writable registrations).
pub async fn map_writable(
    backend: &UcxBackend,
    buf: &PageBuf,
    access: rdmareg_core::Access,
) -> BackendRegion {
    // SAFETY: every caller keeps the buffer alive until its registration is
    // unmapped (or its engine shut down) and every PUT into it answered, and
    // reads it only by copying through its raw pointer.
    unsafe { backend.map_with_access(buf.addr(), buf.len(), access) }
        .await
        .expect("map succeeds")
}

/// The same-host key `packed` decodes to; panics on any other key.
pub fn same_host_key(packed: &[u8]) -> rdmareg_ucx::read_protocol::SameHostKey {
    use rdmareg_ucx::read_protocol::ReadKey;
    match ReadKey::decode(packed) {
        Ok(ReadKey::SameHost(key)) => key,
        other => panic!("expected a same-host key, got {other:?}"),
    }
}

/// A PUT to [`OWNER`] of `len` bytes of `src_region` from `local_offset`
/// to `remote_addr` under `packed_key`, with a ten-second deadline.
pub fn put_request(
    src_region: &BackendRegion,
    local_offset: u64,
    remote_addr: u64,
    packed_key: Bytes,
    len: usize,
) -> rdmareg_core::BackendPut {
    rdmareg_core::BackendPut {
        peer: OWNER,
        remote_addr,
        packed_key,
        local_region_id: src_region.backend_region_id,
        local_offset,
        len: len as u64,
        deadline: Some(Duration::from_secs(10)),
    }
}

/// Posts `request` on `backend` and waits for its answer.
pub async fn put(backend: &UcxBackend, request: rdmareg_core::BackendPut) -> Result<(), RdmaError> {
    // SAFETY: every caller's source is a `PageBuf` mapped on `backend` that
    // it keeps alive until the PUT answered; nothing writes it meanwhile.
    unsafe { backend.put(request) }.await
}
