//! The libfabric objects of one engine, and every call into libfabric.
//!
//! Only the progress thread holds a [`Fabric`] (raw pointers make it
//! neither `Send` nor `Sync`), as `FI_THREAD_DOMAIN` asks.
//!
//! Most of libfabric's API is `static inline`: one indirect call through an
//! ops table the object carries. This module makes those calls itself
//! (`(*(*ep).rma).read`) and checks each entry is present, so the build
//! needs no C compiler; table entries must follow the 1.17 headers.
//! `struct fi_ops_tagged` is opaque in the bindings, so [`TaggedOps`]
//! mirrors its leading entries and the table's `size` is checked first.
//!
//! # Memory registration
//!
//! The hints offer every `FI_MR_*` mode the engine honours (`LOCAL`: every
//! destination's descriptor is passed; `VIRT_ADDR`: recorded in the key;
//! `PROV_KEY`: else the engine requests the never-reused region id;
//! `ALLOCATED`; `ENDPOINT`: regions are bound and enabled). Served
//! registrations grant `FI_SEND | FI_RECV` under a random key no peer is
//! told; one-sided ones grant `FI_READ | FI_REMOTE_READ`. No key lets a
//! peer write this process's memory.
//!
//! # Two `shm` engines in one process
//!
//! libfabric 1.17's `shm` maps a peer endpoint of the same process by
//! reusing that endpoint's region, which closing the endpoint unmaps, so an
//! engine never closes its `shm` endpoint at teardown while another `shm`
//! engine of the process is open: its objects are *parked* and closed when
//! the last one closes. Open engines progress parked endpoints
//! ([`Fabric::progress_parked`]) so replies to cancelled reads are written
//! into their discard receives and their senders' sends complete. Why, and
//! what it costs: `docs/ofi.md`, "The registry's integration tests over
//! libfabric".

use std::ffi::{CStr, CString, c_void};
use std::os::fd::RawFd;
use std::ptr;

use bytes::Bytes;
use rdmareg_core::RdmaError;
use rdmareg_ofi_sys as ffi;

use crate::config::{OfiConfig, Provider, ReadPath};
use crate::key::{AddressFormat, MAX_FABRIC_ADDRESS};
use crate::signals::TerminationActions;

/// Context space a provider may use (`FI_CONTEXT`/`FI_CONTEXT2` mode): the
/// size of `struct fi_context2`, eight pointers.
pub(crate) type ProviderContext = [*mut c_void; 8];

/// `FI_VERSION(1, 17)`: the API the engine asks for.
const API_VERSION: u32 = ffi::fi_version_of(1, 17);

/// MR mode bits the engine honours (see the module docs).
const MR_MODES_HANDLED: u32 = ffi::FI_MR_LOCAL
    | ffi::FI_MR_VIRT_ADDR
    | ffi::FI_MR_ALLOCATED
    | ffi::FI_MR_PROV_KEY
    | ffi::FI_MR_ENDPOINT;

/// `struct fi_ops_tagged` of `<rdma/fi_tagged.h>` (1.17), which the
/// bindings leave opaque: the entries the engine calls, in header order.
#[repr(C)]
struct TaggedOps {
    size: usize,
    recv: Option<
        unsafe extern "C" fn(
            ep: *mut ffi::fid_ep,
            buf: *mut c_void,
            len: usize,
            desc: *mut c_void,
            src_addr: u64,
            tag: u64,
            ignore: u64,
            context: *mut c_void,
        ) -> isize,
    >,
    recvv: Option<unsafe extern "C" fn()>,
    recvmsg: Option<unsafe extern "C" fn()>,
    send: Option<
        unsafe extern "C" fn(
            ep: *mut ffi::fid_ep,
            buf: *const c_void,
            len: usize,
            desc: *mut c_void,
            dest_addr: u64,
            tag: u64,
            context: *mut c_void,
        ) -> isize,
    >,
}

/// `struct fi_cq_tagged_entry` (`FI_CQ_FORMAT_TAGGED`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CqTaggedEntry {
    op_context: *mut c_void,
    flags: u64,
    len: usize,
    buf: *mut c_void,
    data: u64,
    tag: u64,
}

impl Default for CqTaggedEntry {
    fn default() -> Self {
        CqTaggedEntry {
            op_context: ptr::null_mut(),
            flags: 0,
            len: 0,
            buf: ptr::null_mut(),
            data: 0,
            tag: 0,
        }
    }
}

/// `FI_ADDR_UNSPEC`: a receive from any peer.
pub(crate) const ADDR_UNSPEC: u64 = u64::MAX;

/// `FI_ADDR_NOTAVAIL`: a completion's sender is not known.
pub(crate) const ADDR_NOTAVAIL: u64 = u64::MAX;

/// `FI_ETRUNC`, the error of a receive a longer message arrived into (its
/// first bytes were written; the message is consumed).
pub(crate) const ERR_TRUNCATED: i32 = ffi::FI_ETRUNC as i32;

/// `FI_ENOTCONN`, the error of a send posted on a connection its peer
/// closed (over `tcp;ofi_rxm`, before this end learnt of it).
pub(crate) const ERR_NOT_CONNECTED: i32 = ffi::FI_ENOTCONN as i32;

/// Text for a libfabric error number.
pub(crate) fn error_text(errno: i64) -> String {
    let code = errno.unsigned_abs().min(i32::MAX as u64) as i32;
    // SAFETY: fi_strerror returns a pointer to a static string for any value.
    let text = unsafe { CStr::from_ptr(ffi::fi_strerror(code)) };
    format!("{} ({})", text.to_string_lossy(), -i64::from(code))
}

fn failed(what: &str, rc: i64) -> RdmaError {
    RdmaError::backend(format!("ofi: {what}: {}", error_text(rc)))
}

/// Calls an ops-table entry, or fails naming it when the provider left it
/// null.
macro_rules! op {
    ($table:expr, $entry:ident, $what:literal) => {
        match (*$table).$entry {
            Some(f) => f,
            None => {
                return Err(RdmaError::backend(format!(
                    "ofi: the provider does not implement {}",
                    $what
                )))
            }
        }
    };
}

/// Closes a fid through its ops table.
///
/// # Safety
/// `fid` must be a live libfabric object not used again after this returns 0.
unsafe fn close_fid(fid: *mut ffi::fid) -> i32 {
    // SAFETY: the caller passes a live fid; every fid carries fi_ops.
    unsafe {
        match (*(*fid).ops).close {
            Some(close) => close(fid),
            None => -(ffi::FI_ENOSYS as i32),
        }
    }
}

/// One registered memory region, as libfabric sees it.
#[derive(Debug)]
pub(crate) struct MemoryRegion {
    mr: *mut ffi::fid_mr,
    pub(crate) key: u64,
    pub(crate) desc: *mut c_void,
}

/// What a completion queue read found.
#[derive(Debug)]
pub(crate) enum Completion {
    /// An operation finished; its context pointer, and for a receive the
    /// bytes written, the tag that matched and the sender's address-vector
    /// entry ([`ADDR_NOTAVAIL`] when the provider does not know it).
    Done(*mut c_void, usize, u64, u64),
    /// An operation failed; its context pointer and the error text.
    Failed(*mut c_void, i32, String),
}

/// Every libfabric object of one engine.
#[derive(Debug)]
pub(crate) struct Fabric {
    info: *mut ffi::fi_info,
    fabric: *mut ffi::fid_fabric,
    domain: *mut ffi::fid_domain,
    cq: *mut ffi::fid_cq,
    av: *mut ffi::fid_av,
    ep: *mut ffi::fid_ep,
    pub(crate) mr_mode: u32,
    pub(crate) provider: String,
    pub(crate) address: Bytes,
    pub(crate) address_format: AddressFormat,
    pub(crate) wait_fd: Option<RawFd>,
    pub(crate) provider_version: u32,
    pub(crate) read_path: ReadPath,
    /// The provider reports each receive's sender (`FI_SOURCE`).
    pub(crate) reports_source: bool,
    /// `fi_av_remove` closes the peer's connection, ending what is in
    /// flight on it (`tcp;ofi_rxm` with `FI_AV_REMOVE_CLEANUP` set).
    pub(crate) av_remove_closes: bool,
    /// How long the provider may leave a peer's connection request queued
    /// unread (`tcp;ofi_rxm`; see [`Fabric::connection_requests_taken`]);
    /// `None` for a provider that queues none.
    pub(crate) connection_requests_read_within: Option<std::time::Duration>,
    /// Counted among the process's open `shm` fabrics ([`SHM_FABRICS`]).
    shm_counted: bool,
    /// The endpoint was left open at teardown ([`Fabric::close_or_park_endpoint`]):
    /// dropping hands the objects to [`SHM_FABRICS`] instead of closing them.
    parked: bool,
    /// Memory a parked endpoint may still write (its posted receives),
    /// handed over by [`keep_while_parked`](Self::keep_while_parked).
    kept: Vec<KeptMemory>,
}

/// Memory the provider may write through an endpoint until it is closed:
/// kept with a parked endpoint and freed only after it is closed, so it is
/// neither freed early nor leaked.
pub(crate) type KeptMemory = Box<dyn std::any::Any + Send>;

/// The open libfabric objects of a parked `shm` engine (see the module
/// docs), closed once no `shm` fabric of the process is open.
struct ParkedFabric {
    info: *mut ffi::fi_info,
    fabric: *mut ffi::fid_fabric,
    domain: *mut ffi::fid_domain,
    cq: *mut ffi::fid_cq,
    av: *mut ffi::fid_av,
    ep: *mut ffi::fid_ep,
    /// Freed after the endpoint is closed.
    kept: Vec<KeptMemory>,
}

// SAFETY: a parked fabric's objects are used by no thread any more; the
// only thing done with them is closing each once, under `SHM_FABRICS`'s
// lock, which serialises it as `FI_THREAD_DOMAIN` asks.
unsafe impl Send for ParkedFabric {}

impl ParkedFabric {
    /// Closes the objects, endpoint first, and frees the info.
    ///
    /// # Safety
    /// The objects are live and used by no one else.
    unsafe fn close(self) {
        // SAFETY: per the caller, each object is live and closed once,
        // children before parents; the info list is freed last.
        unsafe {
            close_all(
                self.ep,
                self.av,
                self.cq,
                self.domain,
                self.fabric,
                self.info,
            )
        };
        // The endpoint is closed: nothing writes the kept memory any more.
        drop(self.kept);
    }
}

/// The process's `shm` fabrics: how many are open, and the parked ones.
struct ShmFabrics {
    open: usize,
    parked: Vec<ParkedFabric>,
}

/// How many fabrics [`SHM_FABRICS`] holds parked: read without the lock,
/// so an open `shm` engine looks for parked endpoints to progress
/// ([`Fabric::progress_parked`]) only when there are some.
static PARKED_COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// See the module docs: parked `shm` endpoints stay open while any `shm`
/// fabric of the process is.
static SHM_FABRICS: std::sync::Mutex<ShmFabrics> = std::sync::Mutex::new(ShmFabrics {
    open: 0,
    parked: Vec::new(),
});

/// Closes whichever of the objects are non-null, children before parents,
/// then frees `info`.
///
/// # Safety
/// Every non-null object is live and not used again.
unsafe fn close_all(
    ep: *mut ffi::fid_ep,
    av: *mut ffi::fid_av,
    cq: *mut ffi::fid_cq,
    domain: *mut ffi::fid_domain,
    fabric: *mut ffi::fid_fabric,
    info: *mut ffi::fi_info,
) {
    // SAFETY: per the caller, each non-null object is live and closed once.
    unsafe {
        for fid in [
            (!ep.is_null()).then(|| &raw mut (*ep).fid),
            (!av.is_null()).then(|| &raw mut (*av).fid),
            (!cq.is_null()).then(|| &raw mut (*cq).fid),
            (!domain.is_null()).then(|| &raw mut (*domain).fid),
            (!fabric.is_null()).then(|| &raw mut (*fabric).fid),
        ]
        .into_iter()
        .flatten()
        {
            let rc = close_fid(fid);
            if rc != 0 {
                tracing::warn!(error = %error_text(rc.into()), "fi_close failed at teardown");
            }
        }
        if !info.is_null() {
            ffi::fi_freeinfo(info);
        }
    }
}

/// How [`Fabric::close_or_park_endpoint`] left the endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EndpointEnd {
    /// Closed: the provider touches no buffer posted on it.
    Closed,
    /// Left open (parked) or not closed: receives posted on it may still
    /// be written, so their buffers must never be freed.
    StillOpen,
}

/// A name for this process's next `shm` region: `rdmareg-`, the process
/// id (so an operator can tell a dead process's regions), `-` and 32 hex
/// digits from the OS's random source, which no other user can guess.
fn unguessable_shm_name() -> Result<std::ffi::CString, RdmaError> {
    use std::fmt::Write;
    let random = rdmareg_engine::command::draw_capability()?;
    let mut name = format!("rdmareg-{}-", std::process::id());
    for byte in random {
        let _ = write!(name, "{byte:02x}");
    }
    std::ffi::CString::new(name)
        .map_err(|_| RdmaError::backend("ofi: an shm region name with a NUL byte"))
}

impl Fabric {
    /// Opens fabric, domain, completion queue, address vector and one
    /// reliable-datagram endpoint on the configured provider. On failure
    /// whatever was opened is closed again (by `Drop`).
    ///
    /// An `shm` endpoint's region gets a random name (see
    /// `unguessable_shm_name`), and the process's SIGINT and SIGTERM
    /// actions are the same after its creation as before it (see
    /// `crate::signals`).
    pub(crate) fn open(config: &OfiConfig) -> Result<Fabric, RdmaError> {
        let mut this = Fabric {
            info: ptr::null_mut(),
            fabric: ptr::null_mut(),
            domain: ptr::null_mut(),
            cq: ptr::null_mut(),
            av: ptr::null_mut(),
            ep: ptr::null_mut(),
            mr_mode: 0,
            provider: String::new(),
            address: Bytes::new(),
            address_format: AddressFormat::Opaque(0),
            wait_fd: None,
            provider_version: 0,
            read_path: config.effective_read_path(),
            reports_source: false,
            av_remove_closes: config.provider == Provider::Tcp && env_flag("FI_AV_REMOVE_CLEANUP"),
            connection_requests_read_within: (config.provider == Provider::Tcp)
                .then(rxm_cm_progress_interval),
            shm_counted: false,
            parked: false,
            kept: Vec::new(),
        };
        // SAFETY: every call below follows libfabric's object lifecycle on
        // objects this function created and stored in `this` (whose Drop
        // closes them in reverse order); every pointer argument is live for
        // the call, and every ops-table entry is checked for null by `op!`.
        unsafe {
            this.info = getinfo(config)?;
            let info = this.info;
            this.mr_mode = (*(*info).domain_attr).mr_mode as u32;
            this.provider = CStr::from_ptr((*(*info).fabric_attr).prov_name)
                .to_string_lossy()
                .into_owned();
            this.provider_version = (*(*info).fabric_attr).prov_version;
            // Only where it was asked for (a provider may offer it unasked).
            this.reports_source = asks_for_source(config) && (*info).caps & ffi::FI_SOURCE != 0;
            if this.mr_mode & !MR_MODES_HANDLED & !(ffi::FI_MR_BASIC | ffi::FI_MR_SCALABLE) != 0 {
                return Err(RdmaError::backend(format!(
                    "ofi: provider {} needs memory-registration modes {:#x} the engine does not handle",
                    this.provider, this.mr_mode
                )));
            }
            let rc = ffi::fi_fabric((*info).fabric_attr, &mut this.fabric, ptr::null_mut());
            if rc != 0 {
                return Err(failed("fi_fabric", rc.into()));
            }
            let domain = op!((*this.fabric).ops, domain, "fi_domain");
            let rc = domain(this.fabric, info, &mut this.domain, ptr::null_mut());
            if rc != 0 {
                return Err(failed("fi_domain", rc.into()));
            }
            let cq_open = op!((*this.domain).ops, cq_open, "fi_cq_open");
            let mut attr = ffi::fi_cq_attr {
                format: ffi::FI_CQ_FORMAT_TAGGED,
                wait_obj: ffi::FI_WAIT_FD,
                ..Default::default()
            };
            let mut rc = cq_open(this.domain, &mut attr, &mut this.cq, ptr::null_mut());
            if rc != 0 {
                tracing::debug!(provider = %this.provider, error = %error_text(rc.into()), "no completion queue with a wait descriptor; polling instead");
                attr.wait_obj = ffi::FI_WAIT_NONE;
                rc = cq_open(this.domain, &mut attr, &mut this.cq, ptr::null_mut());
            } else {
                let control = op!((*this.cq).fid.ops, control, "fi_control");
                let mut fd: i32 = -1;
                let got = control(
                    &mut (*this.cq).fid,
                    ffi::FI_GETWAIT as i32,
                    (&raw mut fd).cast(),
                );
                if got == 0 && fd >= 0 {
                    this.wait_fd = Some(fd);
                }
            }
            if rc != 0 {
                return Err(failed("fi_cq_open", rc.into()));
            }
            let av_open = op!((*this.domain).ops, av_open, "fi_av_open");
            let mut av_attr = ffi::fi_av_attr {
                type_: (*(*info).domain_attr).av_type,
                ..Default::default()
            };
            let rc = av_open(this.domain, &mut av_attr, &mut this.av, ptr::null_mut());
            if rc != 0 {
                return Err(failed("fi_av_open", rc.into()));
            }
            let endpoint = op!((*this.domain).ops, endpoint, "fi_endpoint");
            // 1.17's `shm` installs SIGINT and SIGTERM handlers as it opens
            // its first endpoint, which end the process; the program's own
            // actions are put back (see `crate::signals`).
            let actions = (this.provider == "shm").then(TerminationActions::now);
            let rc = endpoint(this.domain, info, &mut this.ep, ptr::null_mut());
            if let Some(actions) = actions {
                actions.put_back();
            }
            if rc != 0 {
                return Err(failed("fi_endpoint", rc.into()));
            }
            if this.provider == "shm" {
                // libfabric 1.17 names an `shm` region `<pid>:<uid>:<n>` in
                // the world-writable /dev/shm and, when that name exists,
                // opens and maps the file it finds: a predictable name lets
                // any local user pre-create it and crash (SIGBUS) or block
                // this engine. A name with 128 random bits cannot be
                // guessed before the region exists.
                let name = unguessable_shm_name()?;
                let setname = op!((*this.ep).cm, setname, "fi_setname");
                let rc = setname(
                    &mut (*this.ep).fid,
                    name.as_ptr().cast_mut().cast(),
                    name.as_bytes_with_nul().len(),
                );
                if rc != 0 {
                    return Err(failed("fi_setname", rc.into()));
                }
            }
            let bind = op!((*this.ep).fid.ops, bind, "fi_ep_bind");
            let rc = bind(
                &mut (*this.ep).fid,
                &mut (*this.cq).fid,
                u64::from(ffi::FI_TRANSMIT | ffi::FI_RECV),
            );
            if rc != 0 {
                return Err(failed("fi_ep_bind (completion queue)", rc.into()));
            }
            let rc = bind(&mut (*this.ep).fid, &mut (*this.av).fid, 0);
            if rc != 0 {
                return Err(failed("fi_ep_bind (address vector)", rc.into()));
            }
            let control = op!((*this.ep).fid.ops, control, "fi_enable");
            let rc = control(&mut (*this.ep).fid, ffi::FI_ENABLE as i32, ptr::null_mut());
            if rc != 0 {
                return Err(failed("fi_enable", rc.into()));
            }
            let getname = op!((*this.ep).cm, getname, "fi_getname");
            let mut buf = [0u8; MAX_FABRIC_ADDRESS];
            let mut len = buf.len();
            let rc = getname(&mut (*this.ep).fid, buf.as_mut_ptr().cast(), &mut len);
            if rc != 0 || len == 0 || len > buf.len() {
                return Err(failed("fi_getname", rc.into()));
            }
            this.address = Bytes::copy_from_slice(&buf[..len]);
            this.address_format = match (*info).addr_format {
                f if f == ffi::FI_SOCKADDR_IN => AddressFormat::SockaddrIn,
                f if f == ffi::FI_SOCKADDR_IN6 => AddressFormat::SockaddrIn6,
                f if f == ffi::FI_ADDR_STR => AddressFormat::Str,
                _ => AddressFormat::Opaque(len),
            };
        }
        if this.provider == "shm" {
            let mut shm = SHM_FABRICS
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            shm.open += 1;
            this.shm_counted = true;
        }
        tracing::debug!(
            provider = %this.provider,
            mr_mode = format_args!("{:#x}", this.mr_mode),
            wait_fd = ?this.wait_fd,
            "libfabric endpoint open"
        );
        Ok(this)
    }

    /// Local buffers need a registration's descriptor (`FI_MR_LOCAL`).
    pub(crate) fn needs_local_desc(&self) -> bool {
        self.mr_mode & ffi::FI_MR_LOCAL != 0
    }

    /// Remote addresses are virtual addresses (else offsets).
    pub(crate) fn virt_addr(&self) -> bool {
        self.mr_mode & ffi::FI_MR_VIRT_ADDR != 0
            || self.mr_mode & (ffi::FI_MR_BASIC | ffi::FI_MR_SCALABLE) == ffi::FI_MR_BASIC
    }

    /// Registers `[ptr, ptr + len)` for local reads into it and remote reads
    /// from it.
    ///
    /// # Safety
    /// The range must stay allocated until [`Fabric::deregister`] of the
    /// result returned `Ok`.
    pub(crate) unsafe fn register(
        &mut self,
        ptr: usize,
        len: usize,
        requested_key: u64,
    ) -> Result<MemoryRegion, RdmaError> {
        let mut mr: *mut ffi::fid_mr = ptr::null_mut();
        // Served regions are only sent from or received into; no peer is
        // given a key the provider would honour. One-sided regions are also
        // sent from and received into, for reads under descriptor leases,
        // which are served on that path too (`progress::leases`).
        let access = match self.read_path {
            ReadPath::OwnerServed => ffi::FI_SEND | ffi::FI_RECV,
            ReadPath::OneSided => ffi::FI_READ | ffi::FI_REMOTE_READ | ffi::FI_SEND | ffi::FI_RECV,
        };
        // SAFETY: the domain is live; the caller keeps the range allocated;
        // `mr` is a live out-pointer.
        unsafe {
            let reg = op!((*self.domain).mr, reg, "fi_mr_reg");
            let rc = reg(
                &mut (*self.domain).fid,
                ptr as *const c_void,
                len,
                u64::from(access),
                0,
                requested_key,
                0,
                &mut mr,
                ptr::null_mut(),
            );
            if rc != 0 {
                return Err(failed("fi_mr_reg", rc.into()));
            }
            let region = MemoryRegion {
                mr,
                key: (*mr).key,
                desc: (*mr).mem_desc,
            };
            if self.mr_mode & ffi::FI_MR_ENDPOINT != 0 {
                let bound = match (*(*mr).fid.ops).bind {
                    Some(bind) => bind(&mut (*mr).fid, &mut (*self.ep).fid, 0),
                    None => -(ffi::FI_ENOSYS as i32),
                };
                let enabled = if bound == 0 {
                    match (*(*mr).fid.ops).control {
                        Some(control) => {
                            control(&mut (*mr).fid, ffi::FI_ENABLE as i32, ptr::null_mut())
                        }
                        None => -(ffi::FI_ENOSYS as i32),
                    }
                } else {
                    bound
                };
                if enabled != 0 {
                    let closed = close_fid(&mut (*mr).fid);
                    if closed != 0 {
                        // Still registered: the caller must not free.
                        return Err(failed(
                            "fi_mr_bind/fi_mr_enable failed and fi_close of the region too",
                            closed.into(),
                        ));
                    }
                    return Err(failed("fi_mr_bind/fi_mr_enable", enabled.into()));
                }
            }
            Ok(region)
        }
    }

    /// Deregisters a region. On error it is still registered.
    pub(crate) fn deregister(&mut self, region: &MemoryRegion) -> Result<(), RdmaError> {
        // SAFETY: `region.mr` came from `register` and was not closed before
        // (the engine deregisters each region once, on success forgetting
        // it).
        let rc = unsafe { close_fid(&mut (*region.mr).fid) };
        if rc != 0 {
            return Err(failed("fi_close of a memory region", rc.into()));
        }
        Ok(())
    }

    /// Inserts a validated peer address into the address vector.
    pub(crate) fn insert_peer(&mut self, address: &[u8]) -> Result<u64, RdmaError> {
        // Providers read as many bytes as their own address length, which
        // may exceed what this peer sent (string formats): hand them a
        // zero-padded buffer of the longest address accepted.
        let mut padded = [0u8; MAX_FABRIC_ADDRESS + 1];
        padded[..address.len()].copy_from_slice(address);
        let mut fi_addr: u64 = u64::MAX;
        // SAFETY: the address vector is live; `padded` outlives the call and
        // is longer than any address the provider reads; one address in,
        // one fi_addr out.
        let rc = unsafe {
            let insert = op!((*self.av).ops, insert, "fi_av_insert");
            insert(
                self.av,
                padded.as_ptr().cast(),
                1,
                &mut fi_addr,
                0,
                ptr::null_mut(),
            )
        };
        if rc != 1 || fi_addr == u64::MAX {
            return Err(failed("fi_av_insert", if rc < 0 { rc.into() } else { -5 }));
        }
        Ok(fi_addr)
    }

    /// Removes an address-vector entry no operation uses any more.
    pub(crate) fn remove_peer(&mut self, mut fi_addr: u64) {
        // SAFETY: the address vector is live; one fi_addr from insert_peer.
        let rc = unsafe {
            match (*(*self.av).ops).remove {
                Some(remove) => remove(self.av, &mut fi_addr, 1, 0),
                None => 0,
            }
        };
        if rc != 0 {
            tracing::debug!(error = %error_text(rc.into()), "fi_av_remove failed; the entry stays until teardown");
        }
    }

    /// Posts one read. `Ok(false)` when the provider asks to retry later
    /// (`-FI_EAGAIN`).
    ///
    /// # Safety
    /// `buf..buf + len` must lie inside the registered region `desc` belongs
    /// to and stay registered until the completion for `context` was read or
    /// the endpoint was closed; `context` must point to provider context
    /// space that lives as long.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn read(
        &mut self,
        buf: usize,
        len: usize,
        desc: *mut c_void,
        src: u64,
        addr: u64,
        key: u64,
        context: *mut c_void,
    ) -> Result<bool, RdmaError> {
        if self.ep.is_null() {
            return Err(RdmaError::ShuttingDown);
        }
        // SAFETY: the endpoint is live; the caller guarantees the buffer and
        // the context.
        let rc = unsafe {
            let read = op!((*self.ep).rma, read, "fi_read");
            read(
                self.ep,
                buf as *mut c_void,
                len,
                desc,
                src,
                addr,
                key,
                context,
            )
        };
        match rc {
            0 => Ok(true),
            rc if rc == -(ffi::FI_EAGAIN as isize) => Ok(false),
            rc => Err(failed("fi_read", rc as i64)),
        }
    }

    /// The tagged-message ops table, if the provider has one.
    fn tagged(&self) -> Result<&TaggedOps, RdmaError> {
        if self.ep.is_null() {
            return Err(RdmaError::ShuttingDown);
        }
        // SAFETY: the endpoint is live; its `tagged` table, when present,
        // is a `struct fi_ops_tagged` whose leading entries `TaggedOps`
        // mirrors, and it lives as long as the endpoint.
        unsafe {
            let table = (*self.ep).tagged.cast::<TaggedOps>();
            if table.is_null() || (*table).size < std::mem::size_of::<TaggedOps>() {
                return Err(RdmaError::backend(
                    "ofi: the provider has no tagged messages",
                ));
            }
            Ok(&*table)
        }
    }

    /// Posts a tagged receive. `Ok(false)` when the provider asks to retry
    /// later.
    ///
    /// # Safety
    /// `buf..buf + len` must stay allocated (and, when `desc` is given,
    /// registered) until the completion for `context` was read or the
    /// endpoint was closed; `context` must point to provider context space
    /// that lives as long.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn trecv(
        &mut self,
        buf: usize,
        len: usize,
        desc: *mut c_void,
        src: u64,
        tag: u64,
        ignore: u64,
        context: *mut c_void,
    ) -> Result<bool, RdmaError> {
        let recv = match self.tagged()?.recv {
            Some(recv) => recv,
            None => return Err(RdmaError::backend("ofi: no fi_trecv")),
        };
        // SAFETY: live endpoint; the caller guarantees buffer and context.
        let rc = unsafe {
            recv(
                self.ep,
                buf as *mut c_void,
                len,
                desc,
                src,
                tag,
                ignore,
                context,
            )
        };
        // `shm` returns -FI_ENOMEM, not -FI_EAGAIN, once its pool of posted
        // receives is used up; entries come back as receives complete, so
        // it is the same "later".
        if rc == -(ffi::FI_ENOMEM as isize) {
            return Ok(false);
        }
        eagain(rc, "fi_trecv")
    }

    /// Posts a tagged send. `Ok(false)` when the provider asks to retry
    /// later.
    ///
    /// # Safety
    /// As for [`trecv`](Self::trecv): the buffer and the context stay
    /// valid until the completion for `context` was read or the endpoint
    /// was closed.
    pub(crate) unsafe fn tsend(
        &mut self,
        buf: usize,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        tag: u64,
        context: *mut c_void,
    ) -> Result<bool, RdmaError> {
        let send = match self.tagged()?.send {
            Some(send) => send,
            None => return Err(RdmaError::backend("ofi: no fi_tsend")),
        };
        // SAFETY: live endpoint; the caller guarantees buffer and context.
        let rc = unsafe { send(self.ep, buf as *const c_void, len, desc, dest, tag, context) };
        eagain(rc, "fi_tsend")
    }

    /// Reads up to `out.capacity()` completions (progressing the provider).
    pub(crate) fn poll_completions(&mut self, out: &mut Vec<Completion>, max: usize) {
        let mut entries = [CqTaggedEntry::default(); 16];
        let mut sources = [ADDR_NOTAVAIL; 16];
        while out.len() < max {
            // SAFETY: the completion queue is live; `entries` holds 16
            // fi_cq_tagged_entry records (FI_CQ_FORMAT_TAGGED) and
            // `sources` 16 fi_addr_t.
            let n = unsafe {
                match ((*(*self.cq).ops).read, (*(*self.cq).ops).readfrom) {
                    (_, Some(readfrom)) if self.reports_source => readfrom(
                        self.cq,
                        entries.as_mut_ptr().cast(),
                        entries.len(),
                        sources.as_mut_ptr(),
                    ),
                    (Some(read), _) => read(self.cq, entries.as_mut_ptr().cast(), entries.len()),
                    (None, _) => return,
                }
            };
            if n > 0 {
                let n = n as usize;
                let known = self.reports_source;
                out.extend(entries[..n].iter().zip(&sources[..n]).map(|(e, &source)| {
                    Completion::Done(
                        e.op_context,
                        e.len,
                        e.tag,
                        if known { source } else { ADDR_NOTAVAIL },
                    )
                }));
                continue;
            }
            if n == -(ffi::FI_EAVAIL as isize) {
                let mut err = ffi::fi_cq_err_entry::default();
                // SAFETY: live queue; `err` is a zeroed entry (err_data_size
                // 0: the provider writes no error data).
                let got = unsafe {
                    match (*(*self.cq).ops).readerr {
                        Some(readerr) => readerr(self.cq, &mut err, 0),
                        None => return,
                    }
                };
                if got > 0 {
                    out.push(Completion::Failed(
                        err.op_context,
                        err.err,
                        error_text(err.err.into()),
                    ));
                    continue;
                }
            }
            return;
        }
    }

    /// Whether the loop may sleep on [`wait_fd`](Self::wait_fd) now
    /// (`fi_trywait`); without a descriptor, always.
    pub(crate) fn try_wait(&mut self) -> bool {
        if self.wait_fd.is_none() {
            return true;
        }
        // SAFETY: fabric and queue are live; the array holds one fid.
        unsafe {
            let mut fids = [&raw mut (*self.cq).fid];
            match (*(*self.fabric).ops).trywait {
                Some(trywait) => trywait(self.fabric, fids.as_mut_ptr(), 1) == 0,
                None => false,
            }
        }
    }

    /// Whether no connection request is left queued in the provider, as
    /// `fi_trywait` tells: it first runs the connection manager, which may
    /// queue requests that arrived, and fails while any is queued.
    ///
    /// Over `tcp;ofi_rxm` a peer's connection request is queued as an
    /// `FI_CONNREQ` event carrying a `fi_info` (`fi_dupinfo` in
    /// `tcpx_cm_recv_req`) in the event queue of the `ofi_rxm` endpoint,
    /// which reads that queue only from a completion-queue read, at most
    /// every `FI_OFI_RXM_CM_PROGRESS_INTERVAL` (10 ms by default), and
    /// frees the info when it handles the request. Closing the endpoint
    /// closes that queue with the request still in it, and libfabric 1.17
    /// frees the queued event but not its `fi_info` (`ofi_eq_cleanup`), so
    /// teardown must not close the endpoint while a request is queued
    /// (`Engine::settle_connection_requests`).
    pub(crate) fn connection_requests_taken(&mut self) -> bool {
        self.connection_requests_read_within.is_none() || self.try_wait()
    }

    /// Asks the provider to cancel an operation (most cannot for RMA; the
    /// completion still decides).
    pub(crate) fn cancel(&mut self, context: *mut c_void) {
        if self.ep.is_null() {
            return;
        }
        // SAFETY: live endpoint; `context` names an operation posted on it.
        unsafe {
            if let Some(cancel) = (*(*self.ep).ops).cancel {
                let _ = cancel(&mut (*self.ep).fid, context);
            }
        }
    }

    /// Closes the endpoint: from then on the provider touches no buffer of
    /// an operation posted on it. Returns whether it closed.
    pub(crate) fn close_endpoint(&mut self) -> bool {
        if self.ep.is_null() {
            return true;
        }
        // SAFETY: the endpoint is live and not used after a successful close.
        let rc = unsafe { close_fid(&mut (*self.ep).fid) };
        if rc == 0 {
            self.ep = ptr::null_mut();
            true
        } else {
            tracing::warn!(error = %error_text(rc.into()), "fi_close of the endpoint failed");
            false
        }
    }
}

impl Fabric {
    /// Keeps `memory` until this fabric's parked endpoint is closed; gives
    /// it back when the endpoint is not parked (the caller then must never
    /// free it: an endpoint left open any other way was not closed).
    pub(crate) fn keep_while_parked(&mut self, memory: KeptMemory) -> Result<(), KeptMemory> {
        if self.parked {
            self.kept.push(memory);
            Ok(())
        } else {
            Err(memory)
        }
    }

    /// The last step of teardown: closes the endpoint, unless it was
    /// parked ([`park_at_teardown`](Self::park_at_teardown)) or another
    /// `shm` fabric of the process is open (module docs); then it is left
    /// open and closed when the last `shm` fabric of the process closes.
    pub(crate) fn close_or_park_endpoint(&mut self) -> EndpointEnd {
        if self.ep.is_null() {
            return EndpointEnd::Closed;
        }
        if self.parked {
            return EndpointEnd::StillOpen;
        }
        if self.shm_counted {
            let shm = SHM_FABRICS
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if shm.open > 1 {
                self.parked = true;
                tracing::debug!(
                    other_shm_engines = shm.open - 1,
                    "shm endpoint parked until the process's other shm engines close"
                );
                return EndpointEnd::StillOpen;
            }
        }
        if self.close_endpoint() {
            EndpointEnd::Closed
        } else {
            EndpointEnd::StillOpen
        }
    }
}

impl Fabric {
    /// Whether this is a `shm` fabric (counted in [`SHM_FABRICS`]).
    pub(crate) fn is_shm(&self) -> bool {
        self.shm_counted
    }

    /// Decides at teardown that this endpoint will be parked, because
    /// another `shm` fabric of the process is open (module docs); once
    /// decided it stays parked. Returns whether it will be.
    pub(crate) fn park_at_teardown(&mut self) -> bool {
        if self.parked {
            return true;
        }
        if self.ep.is_null() || !self.shm_counted {
            return false;
        }
        let shm = SHM_FABRICS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        self.parked = shm.open > 1;
        self.parked
    }

    /// Progresses every parked `shm` endpoint of the process once, so
    /// replies to its cancelled reads are written into its discard receives
    /// and their senders' sends complete; completions are dropped. Returns
    /// whether any completion was read.
    pub(crate) fn progress_parked() -> bool {
        if PARKED_COUNT.load(std::sync::atomic::Ordering::Acquire) == 0 {
            return false;
        }
        let Ok(shm) = SHM_FABRICS.try_lock() else {
            return false;
        };
        let mut read = false;
        for parked in &shm.parked {
            // SAFETY: a parked fabric's completion queue is live until it is
            // closed, which happens under this lock; the lock also keeps any
            // other thread from using it meanwhile (FI_THREAD_DOMAIN).
            read |= unsafe { drain_cq(parked.cq) };
        }
        read
    }
}

/// Reads (and drops) what a completion queue holds, errors included,
/// progressing its endpoint. Returns whether anything was read.
///
/// # Safety
/// `cq` is null or a live completion queue no other thread uses meanwhile.
unsafe fn drain_cq(cq: *mut ffi::fid_cq) -> bool {
    if cq.is_null() {
        return false;
    }
    let mut entries = [CqTaggedEntry::default(); 16];
    let mut read = false;
    for _ in 0..64 {
        // SAFETY: per the caller the queue is live; `entries` holds 16
        // records of its format (FI_CQ_FORMAT_TAGGED).
        let n = unsafe {
            match (*(*cq).ops).read {
                Some(read) => read(cq, entries.as_mut_ptr().cast(), entries.len()),
                None => return read,
            }
        };
        if n > 0 {
            read = true;
            continue;
        }
        if n == -(ffi::FI_EAVAIL as isize) {
            let mut err = ffi::fi_cq_err_entry::default();
            // SAFETY: live queue; a zeroed entry asks for no error data.
            let got = unsafe {
                match (*(*cq).ops).readerr {
                    Some(readerr) => readerr(cq, &mut err, 0),
                    None => return read,
                }
            };
            if got > 0 {
                read = true;
                continue;
            }
        }
        break;
    }
    read
}

impl Drop for Fabric {
    fn drop(&mut self) {
        let objects = ParkedFabric {
            info: std::mem::replace(&mut self.info, ptr::null_mut()),
            fabric: std::mem::replace(&mut self.fabric, ptr::null_mut()),
            domain: std::mem::replace(&mut self.domain, ptr::null_mut()),
            cq: std::mem::replace(&mut self.cq, ptr::null_mut()),
            av: std::mem::replace(&mut self.av, ptr::null_mut()),
            ep: std::mem::replace(&mut self.ep, ptr::null_mut()),
            kept: std::mem::take(&mut self.kept),
        };
        if !self.shm_counted {
            // SAFETY: the objects are this fabric's, live (or null) and
            // used by no one after this.
            unsafe { objects.close() };
            return;
        }
        let mut shm = SHM_FABRICS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        shm.open -= 1;
        if self.parked && shm.open > 0 {
            shm.parked.push(objects);
            PARKED_COUNT.store(shm.parked.len(), std::sync::atomic::Ordering::Release);
            return;
        }
        // SAFETY: as above; closed under the lock, so no parked fabric is
        // closed concurrently.
        unsafe { objects.close() };
        if shm.open == 0 {
            PARKED_COUNT.store(0, std::sync::atomic::Ordering::Release);
            for parked in std::mem::take(&mut shm.parked) {
                // SAFETY: parked objects are live and used by no one; no
                // shm fabric of the process is open to reach them.
                unsafe { parked.close() };
            }
        }
    }
}

/// A posting call's result: posted, retry later, or failed.
fn eagain(rc: isize, what: &str) -> Result<bool, RdmaError> {
    match rc {
        0 => Ok(true),
        rc if rc == -(ffi::FI_EAGAIN as isize) => Ok(false),
        rc => Err(failed(what, rc as i64)),
    }
}

/// Whether a libfabric boolean parameter is set in the environment, read
/// as libfabric reads it (`1`, `yes`, `true`, `on`, any case).
fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|value| libfabric_true(&value))
}

/// Whether libfabric 1.17 reads `value` of a boolean parameter as true
/// (`fi_parse_bool`: exactly `1`, or `true`, `yes`, `on` in any case). The
/// engine must agree with the provider about `FI_AV_REMOVE_CLEANUP`, or it
/// would count on a connection reset that never comes.
fn libfabric_true(value: &str) -> bool {
    value == "1"
        || ["true", "yes", "on"]
            .iter()
            .any(|word| value.eq_ignore_ascii_case(word))
}

/// `ofi_rxm`'s `cm_progress_interval` parameter as libfabric 1.17 reads
/// it (`FI_OFI_RXM_CM_PROGRESS_INTERVAL`, microseconds, 10000 when unset):
/// the longest its endpoint leaves its connection events unread while its
/// completion queue is read.
fn rxm_cm_progress_interval() -> std::time::Duration {
    let micros = std::env::var("FI_OFI_RXM_CM_PROGRESS_INTERVAL")
        .map(|value| libfabric_int(&value))
        .unwrap_or(10_000);
    std::time::Duration::from_micros(micros.max(0).unsigned_abs())
}

/// An integer parameter as libfabric 1.17 reads it (`fi_param_get`:
/// `strtol(value, NULL, 0)`): leading blanks, a sign, then hexadecimal
/// after `0x`, octal after `0`, else decimal, up to the first other
/// character; 0 when no digit comes.
fn libfabric_int(value: &str) -> i64 {
    let text = value.trim_start();
    let (negative, text) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    let (radix, digits) = if let Some(hex) = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .filter(|hex| hex.starts_with(|c: char| c.is_ascii_hexdigit()))
    {
        (16, hex)
    } else if text.starts_with('0') {
        (8, text)
    } else {
        (10, text)
    };
    let mut magnitude: i64 = 0;
    for digit in digits.chars().map_while(|c| c.to_digit(radix)) {
        magnitude = magnitude
            .saturating_mul(i64::from(radix))
            .saturating_add(i64::from(digit));
    }
    if negative { -magnitude } else { magnitude }
}

/// Whether the engine asks the provider to name each receive's sender
/// (`FI_SOURCE`) so an owner can check a request's reply address: served
/// reads over `tcp;ofi_rxm` only; on `shm` it named an earlier consumer of
/// the same process (`docs/ofi.md`).
fn asks_for_source(config: &OfiConfig) -> bool {
    config.effective_read_path() == ReadPath::OwnerServed && config.provider == Provider::Tcp
}

/// `fi_getinfo` for the configured provider: RDM endpoints with tagged
/// messages (owner-served reads) or RMA reads (one-sided).
///
/// # Safety
/// Calls into libfabric; the result must be freed with `fi_freeinfo`.
unsafe fn getinfo(config: &OfiConfig) -> Result<*mut ffi::fi_info, RdmaError> {
    // SAFETY: fi_dupinfo(NULL) allocates zeroed hints with attribute
    // structs (what fi_allocinfo does); strings set on it are strdup'ed
    // because fi_freeinfo frees them.
    unsafe {
        let hints = ffi::fi_dupinfo(ptr::null());
        if hints.is_null() {
            return Err(RdmaError::backend("ofi: fi_dupinfo failed"));
        }
        (*hints).caps = match config.effective_read_path() {
            ReadPath::OwnerServed => {
                u64::from(ffi::FI_TAGGED | ffi::FI_SEND | ffi::FI_RECV) | ffi::FI_DIRECTED_RECV
            }
            // Tagged messages carry notices on this path too.
            ReadPath::OneSided => u64::from(
                ffi::FI_RMA
                    | ffi::FI_READ
                    | ffi::FI_REMOTE_READ
                    | ffi::FI_TAGGED
                    | ffi::FI_SEND
                    | ffi::FI_RECV,
            ),
        };
        (*hints).mode = ffi::FI_CONTEXT | ffi::FI_CONTEXT2;
        (*(*hints).ep_attr).type_ = ffi::FI_EP_RDM;
        (*(*hints).domain_attr).mr_mode = MR_MODES_HANDLED as i32;
        (*(*hints).domain_attr).threading = ffi::FI_THREAD_DOMAIN;
        let provider = CString::new(config.provider.name()).map_err(|_| RdmaError::OutOfRange)?;
        (*(*hints).fabric_attr).prov_name = libc::strdup(provider.as_ptr());
        if let Some(domain) = &config.domain {
            let domain = CString::new(domain.as_str()).map_err(|_| RdmaError::OutOfRange)?;
            (*(*hints).domain_attr).name = libc::strdup(domain.as_ptr());
        }
        let mut info: *mut ffi::fi_info = ptr::null_mut();
        let mut rc = -1;
        if asks_for_source(config) {
            (*hints).caps |= ffi::FI_SOURCE;
            rc = ffi::fi_getinfo(API_VERSION, ptr::null(), ptr::null(), 0, hints, &mut info);
            (*hints).caps &= !ffi::FI_SOURCE;
        }
        if rc != 0 || info.is_null() {
            info = ptr::null_mut();
            rc = ffi::fi_getinfo(API_VERSION, ptr::null(), ptr::null(), 0, hints, &mut info);
        }
        ffi::fi_freeinfo(hints);
        if rc != 0 || info.is_null() {
            return Err(RdmaError::backend(format!(
                "ofi: no provider {:?}{} offers {} on RDM endpoints: {}",
                config.provider.name(),
                config
                    .domain
                    .as_deref()
                    .map(|d| format!(" on domain {d:?}"))
                    .unwrap_or_default(),
                match config.effective_read_path() {
                    ReadPath::OwnerServed => "directed tagged messages",
                    ReadPath::OneSided => "RMA reads",
                },
                error_text(rc.into())
            )));
        }
        // Keep only the first entry: the one the engine opens.
        let rest = (*info).next;
        (*info).next = ptr::null_mut();
        if !rest.is_null() {
            ffi::fi_freeinfo(rest);
        }
        Ok(info)
    }
}

#[cfg(test)]
mod tests {
    use super::{libfabric_int, libfabric_true};

    #[test]
    fn an_integer_parameter_reads_as_libfabric_reads_it() {
        for (value, read) in [
            ("10000", 10_000),
            ("  250", 250),
            ("+7", 7),
            ("-3", -3),
            ("0x10", 16),
            ("0X1f", 31),
            ("010", 8),
            ("0", 0),
            ("12ms", 12),
            ("0x", 0),
            ("09", 0),
            ("", 0),
            ("ten", 0),
            ("99999999999999999999999", i64::MAX),
        ] {
            assert_eq!(libfabric_int(value), read, "{value:?}");
        }
    }

    #[test]
    fn a_boolean_parameter_is_true_exactly_where_libfabric_reads_it_true() {
        for value in ["1", "true", "TRUE", "Yes", "on", "ON"] {
            assert!(libfabric_true(value), "{value:?}");
        }
        for value in [
            "0", "false", "no", "off", "y", " 1", "1 ", "2", "", "enabled",
        ] {
            assert!(!libfabric_true(value), "{value:?}");
        }
    }
}
