//! The UCP calls the progress thread makes, each wrapped with its invariant.
//!
//! Every type here holds a raw UCX handle and is `!Send`: it is created on
//! the progress thread and never leaves it. [`Context`] and [`Worker`]
//! release themselves on drop; memory handles, endpoints, remote keys and
//! requests are plain copies whose owning table tracks their lifetime, so
//! the functions that consume them are `unsafe` with that bookkeeping as
//! their contract.

use std::ffi::{CString, c_void};
use std::os::fd::RawFd;
use std::ptr;

use bytes::Bytes;
use rdmareg_core::RdmaError;
use ucx_sys as sys;

use crate::status::{PtrStatus, backend_error, check};

/// The linked UCX library's version (`ucp_get_version`).
pub(crate) fn ucx_version() -> (u32, u32, u32) {
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: the three out-pointers are valid for writes.
    unsafe { sys::ucp_get_version(&mut major, &mut minor, &mut release) };
    (major, minor, release)
}

/// A `ucp_context_h`, created for one of two roles (see [`ContextRole`]).
pub(crate) struct Context {
    handle: sys::ucp_context_h,
}

/// Releases a `ucp_config_t` on every exit of [`Context::new`].
struct ConfigGuard(*mut sys::ucp_config_t);

impl Drop for ConfigGuard {
    fn drop(&mut self) {
        // SAFETY: the pointer came from a successful ucp_config_read and is
        // released exactly once, here.
        unsafe { sys::ucp_config_release(self.0) };
    }
}

/// What a context is for, which decides its UCP features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ContextRole {
    /// The context every peer can reach: active messages and wake-up, and
    /// deliberately no `UCP_FEATURE_RMA` — a context with RMA installs UCX's
    /// software-RMA handlers, which write and read any address a peer names
    /// on any active-message lane (see `read_protocol`).
    Serving,
    /// The same-host direct-read lane (`direct`): RMA only, on transports
    /// only a same-user process of this host can reach.
    DirectReads,
}

impl Context {
    /// Reads the UCX configuration (environment included), applies
    /// `settings` to it and initialises a context for `role`.
    pub(crate) fn new(
        settings: &[(String, String)],
        role: ContextRole,
    ) -> Result<Context, RdmaError> {
        let mut config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: null prefix and file mean UCX's defaults; the out-pointer is
        // valid for a write.
        let status = unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut config) };
        check(status, "reading the UCX configuration")?;
        let config = ConfigGuard(config);
        for (key, value) in settings {
            let (Ok(k), Ok(v)) = (CString::new(key.as_str()), CString::new(value.as_str())) else {
                return Err(RdmaError::backend(format!(
                    "ucx: setting {key:?} contains a NUL byte"
                )));
            };
            // SAFETY: `config` is live; both strings are NUL-terminated and
            // outlive the call (UCX copies them).
            let status = unsafe { sys::ucp_config_modify(config.0, k.as_ptr(), v.as_ptr()) };
            check(status, &format!("setting UCX_{key}={value}"))?;
        }
        let params = sys::ucp_params_t {
            field_mask: u64::from(
                sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED,
            ),
            features: u64::from(match role {
                ContextRole::Serving => sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP,
                ContextRole::DirectReads => sys::UCP_FEATURE_RMA,
            }),
            mt_workers_shared: 0,
            ..Default::default()
        };
        let mut handle: sys::ucp_context_h = ptr::null_mut();
        // SAFETY: `params` is initialised, `config` is live, and the out-pointer
        // is valid for a write.
        let status = unsafe { sys::ucp_init(&params, config.0, &mut handle) };
        check(status, "initialising the UCP context")?;
        Ok(Context { handle })
    }

    /// Registers `[ptr, ptr + len)` as host memory.
    pub(crate) fn map(&self, address: usize, len: usize) -> Result<MemHandle, RdmaError> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: u64::from(
                sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                    | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                    | sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
            ),
            address: address as *mut c_void,
            length: len,
            memory_type: sys::UCS_MEMORY_TYPE_HOST,
            ..Default::default()
        };
        let mut memh: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: the context is live, `params` is initialised and the
        // out-pointer valid. UCX only records (and, on RDMA hardware, pins)
        // the range; the caller of `RdmaBackend::map` promised it stays
        // allocated until the unmap.
        let status = unsafe { sys::ucp_mem_map(self.handle, &params, &mut memh) };
        check(status, "registering memory (ucp_mem_map)")?;
        Ok(MemHandle(memh))
    }

    /// The range UCX reports for `memh` (`ucp_mem_query`), if it reports one.
    pub(crate) fn mapped_range(&self, memh: MemHandle) -> Option<(u64, u64)> {
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: u64::from(sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH),
            ..Default::default()
        };
        // SAFETY: `memh` is a live handle of this context (the region table
        // holds it) and `attr` is valid for writes.
        let status = unsafe { sys::ucp_mem_query(memh.0, &mut attr) };
        (status == sys::UCS_OK).then_some((attr.address as u64, attr.length as u64))
    }

    /// Deregisters `memh`.
    ///
    /// # Safety
    /// `memh` came from [`Context::map`] on this context and has not been
    /// unmapped; on `Ok` it must not be used again.
    pub(crate) unsafe fn unmap(&self, memh: MemHandle) -> Result<(), RdmaError> {
        // SAFETY: the caller's contract above.
        let status = unsafe { sys::ucp_mem_unmap(self.handle, memh.0) };
        check(status, "deregistering memory (ucp_mem_unmap)")
    }

    /// The remote key of `memh` as packed bytes (`ucp_rkey_pack`).
    pub(crate) fn pack_remote_key(&self, memh: MemHandle) -> Result<Bytes, RdmaError> {
        let mut buffer: *mut c_void = ptr::null_mut();
        let mut len: usize = 0;
        // SAFETY: the context is live, `memh` is a live registration of it
        // (the caller holds it in a table), the out-pointers are valid.
        let status = unsafe { sys::ucp_rkey_pack(self.handle, memh.0, &mut buffer, &mut len) };
        check(status, "packing a remote key (ucp_rkey_pack)")?;
        // SAFETY: on success `buffer` holds `len` bytes until released.
        let bytes =
            Bytes::copy_from_slice(unsafe { std::slice::from_raw_parts(buffer.cast::<u8>(), len) });
        // SAFETY: releases the buffer packed above, once.
        unsafe { sys::ucp_rkey_buffer_release(buffer) };
        Ok(bytes)
    }

    /// The raw handle, for [`Worker::new`].
    fn raw(&self) -> sys::ucp_context_h {
        self.handle
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the handle came from a successful ucp_init and is cleaned up
        // once; the engine destroys its worker (declared before the context
        // and dropped first) before this runs.
        unsafe { sys::ucp_cleanup(self.handle) };
    }
}

/// A registration (`ucp_mem_h`), owned by the region table.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MemHandle(sys::ucp_mem_h);

impl MemHandle {
    pub(crate) fn raw(self) -> sys::ucp_mem_h {
        self.0
    }

    /// A handle value for table tests; never passed to UCX.
    #[cfg(test)]
    pub(crate) fn dangling_for_tests() -> MemHandle {
        MemHandle(std::ptr::NonNull::dangling().as_ptr())
    }
}

/// An endpoint (`ucp_ep_h`), owned by the peer table.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EpHandle(sys::ucp_ep_h);

impl EpHandle {
    pub(crate) fn raw(self) -> sys::ucp_ep_h {
        self.0
    }

    /// The names of the transports this endpoint's lanes use
    /// (`ucp_ep_attr::transports`), as UCX reports them: `tcp`, `cma`,
    /// `posix`, `rc_mlx5`, ...
    pub(crate) fn transport_names(self) -> Result<Vec<String>, RdmaError> {
        let mut names = Vec::new();
        // SAFETY: the endpoint is live (callers hold it between UCX calls
        // on the progress thread).
        unsafe {
            for_each_lane_transport(self.0, |name| {
                names.push(name.to_string_lossy().into_owned());
            })
        }?;
        Ok(names)
    }
}

/// Calls `each` with the transport name of every lane of `ep`
/// (`ucp_ep_attr::transports`).
///
/// # Safety
/// `ep` is a live endpoint, used on its worker's thread.
unsafe fn for_each_lane_transport(
    ep: sys::ucp_ep_h,
    mut each: impl FnMut(&std::ffi::CStr),
) -> Result<(), RdmaError> {
    // UCX 1.22 uses at most 8 lanes per endpoint (`UCP_MAX_LANES`).
    const MOST_LANES: usize = 8;
    let mut entries = [sys::ucp_transport_entry_t {
        transport_name: std::ptr::null(),
        device_name: std::ptr::null(),
    }; MOST_LANES];
    let mut attr = sys::ucp_ep_attr_t {
        field_mask: u64::from(sys::UCP_EP_ATTR_FIELD_TRANSPORTS),
        ..Default::default()
    };
    attr.transports.entries = entries.as_mut_ptr();
    attr.transports.num_entries = MOST_LANES as u32;
    attr.transports.entry_size = std::mem::size_of::<sys::ucp_transport_entry_t>();
    // SAFETY: the endpoint is live (the caller's contract); `entries` has
    // room for the `num_entries` records of `entry_size` bytes it is
    // declared with, and outlives the call.
    let status = unsafe { sys::ucp_ep_query(ep, &mut attr) };
    check(status, "querying an endpoint's transports")?;
    let filled = (attr.transports.num_entries as usize).min(MOST_LANES);
    for entry in entries[..filled]
        .iter()
        .filter(|entry| !entry.transport_name.is_null())
    {
        // SAFETY: UCX wrote a NUL-terminated name that stays valid until
        // the endpoint is closed; it is used during this call only.
        each(unsafe { std::ffi::CStr::from_ptr(entry.transport_name) });
    }
    Ok(())
}

/// The engine's one `UCS_THREAD_MODE_SINGLE` worker.
pub(crate) struct Worker {
    handle: sys::ucp_worker_h,
}

/// Who is told when an endpoint fails.
pub(crate) type EpErrorCallback =
    unsafe extern "C" fn(arg: *mut c_void, ep: sys::ucp_ep_h, status: sys::ucs_status_t);

/// Who is told when a send (an active message) completes.
pub(crate) type SendCallback =
    unsafe extern "C" fn(request: *mut c_void, status: sys::ucs_status_t, user_data: *mut c_void);

/// Who is told when a rendezvous receive completes.
pub(crate) type ReceiveCallback = unsafe extern "C" fn(
    request: *mut c_void,
    status: sys::ucs_status_t,
    length: usize,
    user_data: *mut c_void,
);

/// Who handles an incoming active message.
pub(crate) type ActiveMessageHandler = unsafe extern "C" fn(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t;

impl Worker {
    /// Creates the worker on `context`.
    pub(crate) fn new(context: &Context) -> Result<Worker, RdmaError> {
        let params = sys::ucp_worker_params_t {
            field_mask: u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE),
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut handle: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: the context is live, params initialised, out-pointer valid.
        let status = unsafe { sys::ucp_worker_create(context.raw(), &params, &mut handle) };
        check(status, "creating the UCP worker")?;
        Ok(Worker { handle })
    }

    /// The packed worker address, as owned bytes.
    pub(crate) fn address(&self) -> Result<Bytes, RdmaError> {
        let mut address: *mut sys::ucp_address_t = ptr::null_mut();
        let mut len: usize = 0;
        // SAFETY: the worker is live; out-pointers are valid.
        let status = unsafe { sys::ucp_worker_get_address(self.handle, &mut address, &mut len) };
        check(status, "reading the worker address")?;
        // SAFETY: on success `address` points at `len` bytes that stay valid
        // until ucp_worker_release_address.
        let bytes = Bytes::copy_from_slice(unsafe {
            std::slice::from_raw_parts(address.cast::<u8>(), len)
        });
        // SAFETY: releases the buffer obtained above, once.
        unsafe { sys::ucp_worker_release_address(self.handle, address) };
        Ok(bytes)
    }

    /// The largest active-message header this worker can send
    /// (`ucp_worker_attr::max_am_header`). UCX, built without its parameter
    /// checks, does not refuse a longer one: it writes past the fragment
    /// buffer.
    pub(crate) fn max_am_header(&self) -> Result<usize, RdmaError> {
        let mut attr = sys::ucp_worker_attr_t {
            field_mask: u64::from(sys::UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER),
            ..Default::default()
        };
        // SAFETY: the worker is live; `attr` is initialised and asks for
        // one field, which UCX writes.
        let status = unsafe { sys::ucp_worker_query(self.handle, &mut attr) };
        check(status, "querying the worker")?;
        Ok(attr.max_am_header)
    }

    /// The descriptor that becomes readable when the armed worker has events.
    pub(crate) fn event_fd(&self) -> Result<RawFd, RdmaError> {
        let mut fd: libc::c_int = -1;
        // SAFETY: the worker is live (created with the wake-up feature); the
        // out-pointer is valid.
        let status = unsafe { sys::ucp_worker_get_efd(self.handle, &mut fd) };
        check(status, "reading the worker event fd")?;
        Ok(fd)
    }

    /// One `ucp_worker_progress`; may run completion callbacks.
    #[inline]
    pub(crate) fn progress(&self) -> u32 {
        // SAFETY: the worker is live and used from its own thread only.
        unsafe { sys::ucp_worker_progress(self.handle) }
    }

    /// `ucp_worker_arm`: `Ok(true)` when armed, `Ok(false)` when busy (more
    /// progress needed first).
    pub(crate) fn arm(&self) -> Result<bool, RdmaError> {
        // SAFETY: the worker is live and used from its own thread only.
        let status = unsafe { sys::ucp_worker_arm(self.handle) };
        match status {
            sys::UCS_OK => Ok(true),
            sys::UCS_ERR_BUSY => Ok(false),
            other => Err(backend_error(other, "arming the worker")),
        }
    }

    /// Creates an endpoint to the worker whose packed address is `address`.
    ///
    /// With `on_error`, UCX calls `on_error(error_arg, ..)` (from progress)
    /// when the endpoint fails; with `detect_peer_failure` as well, the
    /// endpoint uses peer error handling (keepalive, forced close).
    ///
    /// # Safety
    /// `address` must be a packed UCP worker address from a peer the engine
    /// trusts: UCX parses it without a length. `error_arg` must stay valid
    /// until the endpoint is closed and the worker can no longer call back.
    pub(crate) unsafe fn create_endpoint(
        &self,
        address: &[u8],
        on_error: Option<(EpErrorCallback, *mut c_void)>,
        detect_peer_failure: bool,
    ) -> Result<EpHandle, RdmaError> {
        let mut params = sys::ucp_ep_params_t {
            field_mask: u64::from(
                sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
            ),
            address: address.as_ptr().cast::<sys::ucp_address_t>(),
            err_mode: sys::UCP_ERR_HANDLING_MODE_NONE,
            ..Default::default()
        };
        if let Some((cb, arg)) = on_error {
            params.field_mask |= u64::from(sys::UCP_EP_PARAM_FIELD_ERR_HANDLER);
            params.err_mode = sys::UCP_ERR_HANDLING_MODE_PEER;
            params.err_handler = sys::ucp_err_handler_t { cb: Some(cb), arg };
            if !detect_peer_failure {
                params.err_mode = sys::UCP_ERR_HANDLING_MODE_NONE;
            }
        }
        let mut ep: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: worker live; params initialised; the address bytes outlive
        // the call (UCX unpacks them during it); the caller vouches for their
        // content and for `arg`.
        let status = unsafe { sys::ucp_ep_create(self.handle, &params, &mut ep) };
        check(status, "creating an endpoint (ucp_ep_create)")?;
        Ok(EpHandle(ep))
    }

    /// Starts closing `ep`: forcibly (outstanding requests complete with
    /// `UCS_ERR_CANCELED`) when `force`, otherwise after a flush.
    ///
    /// # Safety
    /// `ep` was created on this worker and is closed at most once.
    pub(crate) unsafe fn close_endpoint(&self, ep: EpHandle, force: bool) -> PtrStatus {
        let mut param = sys::ucp_request_param_t::default();
        if force {
            param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
        }
        // SAFETY: the caller's contract; `param` is initialised.
        PtrStatus::decode(unsafe { sys::ucp_ep_close_nbx(ep.0, &param) })
    }

    /// The raw handle, for the active-message handlers that receive
    /// rendezvous data from inside the worker's own progress.
    pub(crate) fn raw(&self) -> sys::ucp_worker_h {
        self.handle
    }

    /// Installs `handler` for active messages with `id`; `arg` is passed to
    /// every call.
    ///
    /// # Safety
    /// `arg` must stay valid until the worker is destroyed: UCX calls the
    /// handler from any progress of this worker until then.
    pub(crate) unsafe fn set_am_handler(
        &self,
        id: u32,
        handler: ActiveMessageHandler,
        arg: *mut c_void,
    ) -> Result<(), RdmaError> {
        let params = sys::ucp_am_handler_param_t {
            field_mask: u64::from(
                sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG,
            ),
            id,
            cb: Some(handler),
            arg,
            ..Default::default()
        };
        // SAFETY: the worker is live and used from its own thread; `params`
        // is initialised; the caller vouches for `arg`.
        let status = unsafe { sys::ucp_worker_set_am_recv_handler(self.handle, &params) };
        check(status, "installing an active-message handler")
    }

    /// Whether a request returned by this worker is still in progress.
    ///
    /// # Safety
    /// `request` is a live request of this worker, not yet freed.
    pub(crate) unsafe fn request_in_progress(&self, request: *mut c_void) -> bool {
        // SAFETY: the caller's contract.
        unsafe { sys::ucp_request_check_status(request) == sys::UCS_INPROGRESS }
    }

    /// Returns a request to UCX.
    ///
    /// # Safety
    /// `request` is a request of this worker, freed once.
    pub(crate) unsafe fn free_request(&self, request: *mut c_void) {
        // SAFETY: the caller's contract.
        unsafe { sys::ucp_request_free(request) };
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: the handle came from a successful ucp_worker_create and is
        // destroyed once; its context outlives it (see `Context`'s drop).
        unsafe { sys::ucp_worker_destroy(self.handle) };
    }
}

/// The header bytes UCX passes an active-message handler.
///
/// # Safety
/// `header` and `length` are what UCX passed the handler, and the slice is
/// used only during that call.
pub(crate) unsafe fn handler_header<'a>(header: *const c_void, length: usize) -> &'a [u8] {
    if header.is_null() || length == 0 {
        return &[];
    }
    // SAFETY: UCX passes `length` readable bytes at `header`, valid for the
    // handler call (the caller's contract).
    unsafe { std::slice::from_raw_parts(header.cast::<u8>(), length) }
}

/// Which protocols UCX may pick for an active message's payload.
#[derive(Debug, Clone, Copy)]
pub(crate) enum SendMode {
    /// Small: ask for fast completion (`UCP_OP_ATTR_FLAG_FAST_CMPL`), so
    /// UCX copies the message into one short send instead of its zero-copy
    /// protocol. Only for messages that fit one short send: above that the
    /// hint selects a fragmented copy, slower than zero-copy.
    Small,
    /// Let UCX choose, with no registration named.
    Eager,
    /// Eager protocols only, never rendezvous: for small messages the
    /// receiver takes whole inside its handler.
    EagerOnly,
    /// The payload lies inside this registration, so a zero-copy or
    /// rendezvous protocol can read it in place instead of registering it
    /// again.
    Registered(MemHandle),
}

/// Sends an active message: `header` (copied by UCX before this returns)
/// and `len` payload bytes at `payload`, with the protocols `mode` allows.
/// With `reply`, the receiver's handler gets an endpoint back to this
/// worker.
///
/// # Safety
/// Called on the worker's own thread (inside or outside its progress). `ep`
/// is a live endpoint of that worker. `[payload, payload + len)` stays
/// readable, and registered by the memory handle of
/// [`SendMode::Registered`] if given, until the send completes: inline
/// (`Done`/`Failed`) or when `callback(.., user_data)` runs, and
/// `user_data` stays valid until then.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn send_active_message(
    ep: sys::ucp_ep_h,
    id: u32,
    header: &[u8],
    payload: *const u8,
    len: usize,
    mode: SendMode,
    reply: bool,
    callback: SendCallback,
    user_data: *mut c_void,
) -> PtrStatus {
    let mut flags = sys::UCP_AM_SEND_FLAG_COPY_HEADER;
    if reply {
        flags |= sys::UCP_AM_SEND_FLAG_REPLY;
    }
    let mut param = sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK
            | sys::UCP_OP_ATTR_FIELD_USER_DATA
            | sys::UCP_OP_ATTR_FIELD_FLAGS,
        flags,
        user_data,
        ..Default::default()
    };
    match mode {
        SendMode::Small => param.op_attr_mask |= sys::UCP_OP_ATTR_FLAG_FAST_CMPL,
        SendMode::Eager => {}
        SendMode::EagerOnly => param.flags |= sys::UCP_AM_SEND_FLAG_EAGER,
        SendMode::Registered(memh) => {
            param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_MEMH | sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE;
            param.memh = memh.raw();
            param.memory_type = sys::UCS_MEMORY_TYPE_HOST;
        }
    }
    param.cb.send = Some(callback);
    // SAFETY: the caller's contract; `param` is initialised and the header
    // is copied (COPY_HEADER) before the call returns.
    PtrStatus::decode(unsafe {
        sys::ucp_am_send_nbx(
            ep,
            id,
            header.as_ptr().cast::<c_void>(),
            header.len(),
            payload.cast::<c_void>(),
            len,
            &param,
        )
    })
}

/// Sends an active message whose payload is the concatenation of `iov` (empty
/// for an empty list), always eager and with the reply flag, as for
/// [`send_active_message`] with `reply`.
///
/// With `copy`, UCX is asked for fast completion, which copies the vector
/// into its send segments. Without it UCX 1.22 sends a vector of more than
/// 73 bytes by its multi-fragment zero-copy protocol, which over tcp carries
/// only a few ranges per fragment. The caller decides
/// (`read_lists::copied_into_segments`).
///
/// # Safety
/// As for [`send_active_message`], for every range `iov` names, and the
/// `iov` array itself stays valid and unchanged until the send completes.
pub(crate) unsafe fn send_gathered(
    ep: sys::ucp_ep_h,
    id: u32,
    header: &[u8],
    iov: &[sys::ucp_dt_iov_t],
    copy: bool,
    callback: SendCallback,
    user_data: *mut c_void,
) -> PtrStatus {
    let mut param = sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK
            | sys::UCP_OP_ATTR_FIELD_USER_DATA
            | sys::UCP_OP_ATTR_FIELD_FLAGS,
        flags: sys::UCP_AM_SEND_FLAG_COPY_HEADER
            | sys::UCP_AM_SEND_FLAG_REPLY
            | sys::UCP_AM_SEND_FLAG_EAGER,
        user_data,
        ..Default::default()
    };
    if copy {
        param.op_attr_mask |= sys::UCP_OP_ATTR_FLAG_FAST_CMPL;
    }
    let (buffer, count) = if iov.is_empty() {
        (std::ptr::null(), 0)
    } else {
        param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE;
        param.datatype = sys::ucp_datatype_t::from(sys::UCP_DATATYPE_IOV);
        (iov.as_ptr().cast::<c_void>(), iov.len())
    };
    param.cb.send = Some(callback);
    // SAFETY: the caller's contract; `param` is initialised, the header is
    // copied (COPY_HEADER) before the call returns, and for the IOV
    // datatype `count` is the number of entries in `iov`.
    PtrStatus::decode(unsafe {
        sys::ucp_am_send_nbx(
            ep,
            id,
            header.as_ptr().cast::<c_void>(),
            header.len(),
            buffer,
            count,
            &param,
        )
    })
}

/// Receives the rendezvous data of an active message into `[dest, dest + len)`.
///
/// # Safety
/// Called on `worker`'s thread. `data_desc` is the descriptor UCX passed to
/// the handler for a rendezvous message of exactly `len` bytes (UCX's
/// release build does not check the destination is large enough), not yet
/// received or released. `[dest, dest + len)` lies inside the registration
/// `memh` and stays registered and unaliased until the receive completes:
/// inline, or when `callback(.., user_data)` runs; `user_data` stays valid
/// until then.
pub(crate) unsafe fn receive_rendezvous(
    worker: sys::ucp_worker_h,
    data_desc: *mut c_void,
    dest: *mut u8,
    len: usize,
    memh: MemHandle,
    callback: ReceiveCallback,
    user_data: *mut c_void,
) -> PtrStatus {
    let mut param = sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK
            | sys::UCP_OP_ATTR_FIELD_USER_DATA
            | sys::UCP_OP_ATTR_FIELD_MEMH
            | sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE,
        user_data,
        memh: memh.raw(),
        memory_type: sys::UCS_MEMORY_TYPE_HOST,
        ..Default::default()
    };
    param.cb.recv_am = Some(callback);
    // SAFETY: the caller's contract; `param` is initialised.
    PtrStatus::decode(unsafe {
        sys::ucp_am_recv_data_nbx(worker, data_desc, dest.cast::<c_void>(), len, &param)
    })
}
