//! Hostile peers against the owner-served protocol, built from a bare
//! endpoint of this crate's `Fabric` (the stand-in for a remote machine
//! that speaks the wire format by hand: libfabric's tagged calls exist only
//! as `unsafe` FFI, so the harness makes them itself). The engines under
//! attack are used through their safe API only.
//!
//! This module holds the harness; the attacks are in `hostile_consumers`
//! (requests an owner must check), `hostile_owners` (replies a consumer
//! must check, and owners that stall or vanish), `hostile_writers` (write
//! messages an owner must check, and a writer killed mid-PUT),
//! `hostile_write_lists` (write lists an owner must check, and list replies
//! a writer must check) and `resend_attacks`.

use std::collections::HashMap;
use std::ffi::c_void;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, BackendRegion, PeerId, RdmaError};

use crate::engine::OfiEngine;
use crate::fabric::{ADDR_UNSPEC, Completion, Fabric, ProviderContext};
use crate::key::{CAPABILITY_LEN, PackedKey};
use crate::protocol::{ListEntry, ListRequest, PROBE, REPLY_IGNORE, REQUEST_TAG, ReadRequest};
use crate::{OfiConfig, Provider};

mod hostile_consumers;
mod hostile_owners;
mod hostile_write_lists;
mod hostile_writers;
mod resend_attacks;
mod write_list_deadlines;

/// Provider context space at a stable address.
#[repr(C)]
struct Context {
    space: ProviderContext,
}

/// What a raw peer's operation ended with.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ended {
    Done { len: usize, tag: u64 },
    Failed(String),
}

/// A bare endpoint that sends and receives tagged messages of its choosing.
struct RawPeer {
    fabric: Fabric,
    /// Contexts, kept until the endpoint is closed (boxed: the provider
    /// holds their addresses).
    #[allow(clippy::vec_box)]
    contexts: Vec<Box<Context>>,
    /// Send and receive buffers, kept until the endpoint is closed (a
    /// `Vec`'s heap bytes do not move when the `Vec` does).
    buffers: Vec<Vec<u8>>,
    ended: HashMap<usize, Ended>,
}

impl RawPeer {
    fn open(config: &OfiConfig) -> RawPeer {
        RawPeer {
            fabric: Fabric::open(config).expect("a raw endpoint"),
            contexts: Vec::new(),
            buffers: Vec::new(),
            ended: HashMap::new(),
        }
    }

    fn address(&self) -> Bytes {
        self.fabric.address.clone()
    }

    fn insert(&mut self, address: &[u8]) -> u64 {
        self.fabric.insert_peer(address).expect("a peer address")
    }

    fn context(&mut self) -> *mut c_void {
        let mut context = Box::new(Context {
            space: [std::ptr::null_mut(); 8],
        });
        let at = (&raw mut context.space).cast::<c_void>();
        self.contexts.push(context);
        at
    }

    /// Sends `bytes` with `tag` to `dest`, retrying while the provider asks
    /// to wait; answers the send's context address.
    fn send(&mut self, dest: u64, tag: u64, bytes: Vec<u8>) -> usize {
        let context = self.context();
        let (ptr, len) = (bytes.as_ptr() as usize, bytes.len());
        self.buffers.push(bytes);
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            // SAFETY: the bytes and the context live in `self` until the
            // endpoint is closed in `drop`.
            let sent = unsafe {
                self.fabric
                    .tsend(ptr, len, std::ptr::null_mut(), dest, tag, context)
            };
            match sent {
                Ok(true) => return context as usize,
                Ok(false) if Instant::now() < until => self.poll(),
                other => panic!("a raw send was not posted: {other:?}"),
            }
        }
    }

    /// Sends `bytes` if the provider takes them within a second.
    fn try_send(&mut self, dest: u64, tag: u64, bytes: Vec<u8>) {
        let context = self.context();
        let (ptr, len) = (bytes.as_ptr() as usize, bytes.len());
        self.buffers.push(bytes);
        let until = Instant::now() + Duration::from_secs(1);
        while Instant::now() < until {
            // SAFETY: as in `send`.
            let sent = unsafe {
                self.fabric
                    .tsend(ptr, len, std::ptr::null_mut(), dest, tag, context)
            };
            match sent {
                Ok(false) => self.poll(),
                _ => return,
            }
        }
    }

    /// Posts a receive of `len` bytes from `src` for `tag` (bits in
    /// `ignore` ignored); answers its context address and buffer index.
    fn receive(&mut self, src: u64, tag: u64, ignore: u64, len: usize) -> (usize, usize) {
        let context = self.context();
        let mut buffer = vec![0u8; len];
        let ptr = buffer.as_mut_ptr() as usize;
        self.buffers.push(buffer);
        let index = self.buffers.len() - 1;
        // SAFETY: the buffer and the context live in `self` until the
        // endpoint is closed in `drop`; no reference to the buffer is made
        // before its completion was read.
        let posted = unsafe {
            self.fabric
                .trecv(ptr, len, std::ptr::null_mut(), src, tag, ignore, context)
        };
        assert_eq!(posted.ok(), Some(true), "a raw receive posted");
        (context as usize, index)
    }

    fn poll(&mut self) {
        let mut out = Vec::new();
        self.fabric.poll_completions(&mut out, 64);
        for completion in out {
            match completion {
                Completion::Done(context, len, tag, _) => {
                    self.ended
                        .insert(context as usize, Ended::Done { len, tag });
                }
                Completion::Failed(context, _, text) => {
                    self.ended.insert(context as usize, Ended::Failed(text));
                }
            }
        }
    }

    fn progress_for(&mut self, span: Duration) {
        let until = Instant::now() + span;
        while Instant::now() < until {
            self.poll();
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Asks the owner at `to_owner` once, in its own name, for a region that
    /// does not exist, and waits for the answer, as an engine's first read
    /// does: over tcp the owner's provider cannot name a sender before the
    /// owner inserted its address, so the first request is answered "ask
    /// again" (`Refusal::Unverified`); later ones are checked and served.
    fn introduce(&mut self, to_owner: u64, id: u64) {
        let me = self.address().to_vec();
        let (answer, _) = self.receive(to_owner, id, REPLY_IGNORE, 0);
        self.send(
            to_owner,
            REQUEST_TAG,
            forged_request(id, u64::MAX, [0; CAPABILITY_LEN], 0x1000, 8, &me),
        );
        assert!(
            matches!(self.wait(answer), Some(Ended::Done { .. })),
            "the owner answered the introduction"
        );
    }

    /// Progresses until the operation at `context` ended (or 10 s passed).
    fn wait(&mut self, context: usize) -> Option<Ended> {
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            self.poll();
            if let Some(ended) = self.ended.get(&context) {
                return Some(ended.clone());
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        None
    }
}

impl Drop for RawPeer {
    fn drop(&mut self) {
        // The endpoint first: then nothing the provider holds points into
        // the contexts or buffers.
        self.fabric.close_endpoint();
    }
}

/// Whether libfabric runs without `FI_AV_REMOVE_CLEANUP` here, in which
/// case test `exact` (its full path) was just run in a child process with
/// the variable set, and its outcome asserted: libfabric reads the
/// variable once, when it initialises. `without_leak_check` turns
/// AddressSanitizer's leak detection off in the child.
fn ran_in_child_with_connection_cleanup(exact: &str, without_leak_check: bool) -> bool {
    if std::env::var_os("FI_AV_REMOVE_CLEANUP").is_some() {
        return false;
    }
    let mut command = std::process::Command::new(std::env::current_exe().expect("the test binary"));
    command
        .args(["--exact", exact, "--nocapture", "--test-threads", "1"])
        .env("FI_AV_REMOVE_CLEANUP", "1");
    if without_leak_check {
        if let Ok(options) = std::env::var("ASAN_OPTIONS") {
            command.env("ASAN_OPTIONS", format!("{options}:detect_leaks=0"));
        }
    }
    let status = command.status().expect("the child test runs");
    assert!(status.success(), "the child test failed: {status}");
    true
}

fn config(provider: Provider) -> OfiConfig {
    let config = OfiConfig::new(provider.clone()).with_teardown_timeout(Duration::from_secs(2));
    match provider {
        Provider::Tcp => config.with_domain("lo"),
        _ => config,
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime")
}

/// A test buffer reached only through its address while registered.
struct Memory {
    raw: *mut [u8],
    len: usize,
}

impl Memory {
    fn filled(len: usize, byte: u8) -> Memory {
        Memory::holding(vec![byte; len])
    }

    /// Holds `bytes`.
    fn holding(bytes: Vec<u8>) -> Memory {
        let len = bytes.len();
        Memory {
            raw: Box::into_raw(bytes.into_boxed_slice()),
            len,
        }
    }

    fn addr(&self) -> usize {
        self.raw as *mut u8 as usize
    }

    /// Maps it on `backend`.
    fn map(&self, rt: &tokio::runtime::Runtime, backend: &crate::OfiBackend) -> BackendRegion {
        // SAFETY: the range is this test's own allocation; no reference
        // aliases it while it is registered (only its address is used), and
        // it is freed only through `free_after`, once unregistered.
        rt.block_on(unsafe { backend.map(self.addr(), self.len) })
            .expect("maps")
    }

    /// Copies its bytes out (only once no transfer can touch it).
    fn snapshot(&self) -> Vec<u8> {
        // SAFETY: the caller reads only when no read into or from this
        // range is in flight (its GETs answered, or its owner served them).
        unsafe { std::slice::from_raw_parts(self.addr() as *const u8, self.len).to_vec() }
    }

    /// Overwrites its bytes (only once no transfer can touch it).
    fn fill(&self, byte: u8) {
        // SAFETY: as `snapshot`.
        unsafe { std::ptr::write_bytes(self.addr() as *mut u8, byte, self.len) }
    }

    /// Frees it if `unregistered`; else leaks it (a transport may still
    /// use it).
    fn free_after(self, unregistered: bool) {
        if unregistered {
            // SAFETY: made by Box::into_raw; its registration is gone.
            drop(unsafe { Box::from_raw(self.raw) });
        }
    }
}

fn get(
    peer: PeerId,
    key: &Bytes,
    remote: u64,
    dst: &BackendRegion,
    offset: u64,
    len: u64,
    deadline: Duration,
) -> BackendGet {
    BackendGet {
        peer,
        remote_addr: remote,
        packed_key: key.clone(),
        local_region_id: dst.backend_region_id,
        local_offset: offset,
        len,
        deadline: Some(deadline),
    }
}

fn single(
    rt: &tokio::runtime::Runtime,
    backend: &crate::OfiBackend,
    request: BackendGet,
) -> Result<(), RdmaError> {
    // SAFETY: the destination is a `Memory` nobody touches until this GET
    // answered.
    rt.block_on(unsafe { backend.get(request) })
}

/// A request of one attacker, answered to an address it names.
fn forged_request(
    request_id: u64,
    region_id: u64,
    capability: [u8; CAPABILITY_LEN],
    address: u64,
    length: u64,
    reply_to: &[u8],
) -> Vec<u8> {
    ReadRequest {
        request_id,
        region_id,
        capability,
        address,
        length,
        reply_to: reply_to.to_vec(),
    }
    .encode()
}

/// A loopback `sockaddr_in` of `port`, laid out as `fi_getname` gives it.
fn loopback(port: u16) -> Vec<u8> {
    let mut address = vec![0u8; 16];
    address[..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
    address[2..4].copy_from_slice(&port.to_be_bytes());
    address[4..8].copy_from_slice(&[127, 0, 0, 1]);
    address
}

/// Resident memory of this process, in bytes.
fn resident() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|field| field.parse().ok())
        .expect("resident pages");
    pages * 4096
}

impl RawPeer {
    /// Posing as an owner: waits up to 10 s for one request and answers
    /// its bytes (a single read or a list).
    /// Liveness probes are skipped.
    fn take_request(&mut self) -> Vec<u8> {
        loop {
            let (context, index) =
                self.receive(ADDR_UNSPEC, REQUEST_TAG, 0, crate::protocol::RECEIVE_MAX);
            match self.wait(context) {
                Some(Ended::Done { len, .. }) if self.buffers[index][..len] == PROBE => {}
                Some(Ended::Done { len, .. }) => return self.buffers[index][..len].to_vec(),
                other => panic!("no request arrived: {other:?}"),
            }
        }
    }
}

/// Virtual size of this process, in bytes (a zeroed buffer the engine
/// allocates and never writes counts here, not in the resident size).
fn virtual_size() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
    let pages: u64 = statm
        .split_whitespace()
        .next()
        .and_then(|field| field.parse().ok())
        .expect("total pages");
    pages * 4096
}

/// The packed key of region 1 (at 0x10_0000, `len` bytes, capability all
/// nines) of the raw owner at `owner`: what a consumer is handed to read
/// from a hostile owner that answers by hand.
pub(crate) fn raw_owner_key(owner: Bytes, len: u64) -> Bytes {
    PackedKey {
        owner_served: true,
        virt_addr: false,
        region_id: 1,
        capability: [9; CAPABILITY_LEN],
        mr_key: 0,
        base: 0x10_0000,
        len,
        owner,
    }
    .encode()
}

/// A consumer engine reading from a raw hostile owner.
struct HostileOwnerSetup {
    rt: tokio::runtime::Runtime,
    owner: RawPeer,
    to_consumer: u64,
    consumer: OfiEngine,
    key: Bytes,
    dst: Memory,
    dst_region: BackendRegion,
}

impl HostileOwnerSetup {
    fn new(provider: Provider, dst_len: usize) -> HostileOwnerSetup {
        HostileOwnerSetup::with_memory(provider, Memory::filled(dst_len, 0))
    }

    /// As [`new`](Self::new), with `dst` as the consumer's registration
    /// (the source of its puts, in the write tests).
    fn with_memory(provider: Provider, dst: Memory) -> HostileOwnerSetup {
        let rt = runtime();
        let config = config(provider);
        let mut owner = RawPeer::open(&config);
        let consumer = OfiEngine::start(config).expect("consumer starts");
        consumer.add_peer(PeerId(1), owner.address()).unwrap();
        let to_consumer = owner.insert(&consumer.fabric_address());
        let key = raw_owner_key(owner.address(), 1 << 20);
        let dst_region = dst.map(&rt, &consumer.backend());
        HostileOwnerSetup {
            rt,
            owner,
            to_consumer,
            consumer,
            key,
            dst,
            dst_region,
        }
    }

    /// Starts a batch of `lens` reads into consecutive destination bytes.
    fn start(
        &self,
        lens: &[u64],
        deadline: Duration,
    ) -> tokio::task::JoinHandle<Vec<Result<(), RdmaError>>> {
        let mut offset = 0;
        let requests: Vec<BackendGet> = lens
            .iter()
            .map(|&len| {
                let request = get(
                    PeerId(1),
                    &self.key,
                    0x10_0000 + offset,
                    &self.dst_region,
                    offset,
                    len,
                    deadline,
                );
                offset += len;
                request
            })
            .collect();
        let c = self.consumer.backend();
        self.rt.spawn(async move {
            // SAFETY: nothing touches the destination until the batch
            // answered.
            unsafe { c.get_batch(requests) }.await
        })
    }

    /// Waits for a batch, progressing the raw owner meanwhile (over tcp
    /// a long reply moves only while its sender progresses).
    fn answers(
        &mut self,
        task: tokio::task::JoinHandle<Vec<Result<(), RdmaError>>>,
    ) -> Vec<Result<(), RdmaError>> {
        let until = Instant::now() + Duration::from_secs(30);
        while !task.is_finished() && Instant::now() < until {
            self.owner.progress_for(Duration::from_millis(1));
        }
        assert!(task.is_finished(), "the batch answered within 30 s");
        self.rt.block_on(task).expect("the batch task")
    }

    /// Fills the destination, lets `late` happen, waits 200 ms, and
    /// answers whether any byte changed.
    fn untouched_after(&mut self, late: impl FnOnce(&mut RawPeer, u64)) -> bool {
        self.dst.fill(0x5A);
        late(&mut self.owner, self.to_consumer);
        self.owner.progress_for(Duration::from_millis(200));
        self.dst.snapshot().iter().all(|&b| b == 0x5A)
    }

    fn finish(self) {
        let unmapped = self.rt.block_on(
            self.consumer
                .backend()
                .unmap(self.dst_region.backend_region_id),
        );
        // The engine first: a same-process shm endpoint closed under a
        // peer engine still using it is the provider's use-after-unmap.
        self.consumer.shutdown_blocking();
        drop(self.owner);
        self.dst.free_after(unmapped.is_ok());
        assert_eq!(unmapped, Ok(()));
        assert_eq!(self.consumer.live_registrations(), 0);
    }
}
