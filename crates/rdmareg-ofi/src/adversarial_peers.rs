//! Hostile peers against the owner-served protocol, built from a bare
//! endpoint of this crate's `Fabric` (the stand-in for a remote machine
//! that speaks the wire format by hand: libfabric's tagged calls exist only
//! as `unsafe` FFI, so the harness makes them itself). The engines under
//! attack are used through their safe API only.

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
                Completion::Done(context, len, tag) => {
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
        Memory {
            raw: Box::into_raw(vec![byte; len].into_boxed_slice()),
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

/// Attack: a third peer, holding a descriptor of its own, sends the owner a
/// request naming the *victim's* address as where to answer, and the id
/// the victim's next read will use (a fresh engine numbers its reads 1, 2,
/// ...). The owner sends the attacker's bytes to the victim, whose read —
/// a receive directed at the owner, with that tag — takes them. The read
/// must still answer with the bytes of the region it named.
fn a_forged_reply_address_cannot_feed_another_consumers_read(provider: Provider) {
    let rt = runtime();
    let config = config(provider.clone());
    let owner = OfiEngine::start(config.clone()).expect("owner starts");
    let victim = OfiEngine::start(config.clone()).expect("victim starts");
    victim.add_peer(PeerId(1), owner.fabric_address()).unwrap();
    let (o, v) = (owner.backend(), victim.backend());
    let wanted = Memory::filled(4096, 0x11);
    let planted = Memory::filled(4096, 0xEE);
    let dst = Memory::filled(64, 0);
    let wanted_region = wanted.map(&rt, &o);
    let planted_region = planted.map(&rt, &o);
    let dst_region = dst.map(&rt, &v);
    let planted_key = PackedKey::decode(&planted_region.packed_key).unwrap();
    let mut attacker = RawPeer::open(&config);
    let to_owner = attacker.insert(&owner.fabric_address());
    for guessed_id in 1..=4 {
        let wire = forged_request(
            guessed_id,
            planted_key.region_id,
            planted_key.capability,
            planted.addr() as u64,
            64,
            &victim.fabric_address(),
        );
        attacker.send(to_owner, REQUEST_TAG, wire);
    }
    // The owner serves them; the victim's provider holds the unasked replies.
    attacker.progress_for(Duration::from_millis(500));
    let answer = single(
        &rt,
        &v,
        get(
            PeerId(1),
            &wanted_region.packed_key,
            wanted.addr() as u64,
            &dst_region,
            0,
            64,
            Duration::from_secs(5),
        ),
    );
    let landed = dst.snapshot();
    let unmapped = [
        rt.block_on(v.unmap(dst_region.backend_region_id)),
        rt.block_on(o.unmap(wanted_region.backend_region_id)),
        rt.block_on(o.unmap(planted_region.backend_region_id)),
    ];
    drop(attacker);
    victim.shutdown_blocking();
    owner.shutdown_blocking();
    let all = unmapped.iter().all(Result::is_ok);
    dst.free_after(all);
    wanted.free_after(all);
    planted.free_after(all);
    assert_eq!(answer, Ok(()), "{provider:?}");
    assert!(
        landed.iter().all(|&b| b == 0x11),
        "{provider:?}: the victim's read landed {:x?}",
        &landed[..8]
    );
    assert!(all, "{provider:?}: unmaps {unmapped:?}");
    assert_eq!(owner.live_registrations(), 0);
    assert_eq!(victim.live_registrations(), 0);
}

#[test]
fn a_forged_reply_address_cannot_feed_another_consumers_read_over_tcp() {
    a_forged_reply_address_cannot_feed_another_consumers_read(Provider::Tcp);
}

#[test]
fn a_forged_reply_address_cannot_feed_another_consumers_read_over_shm() {
    a_forged_reply_address_cannot_feed_another_consumers_read(Provider::Shm);
}

/// A loopback `sockaddr_in` of `port`, laid out as `fi_getname` gives it.
fn loopback(port: u16) -> Vec<u8> {
    let mut address = vec![0u8; 16];
    address[..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
    address[2..4].copy_from_slice(&port.to_be_bytes());
    address[4..8].copy_from_slice(&[127, 0, 0, 1]);
    address
}

/// Attack: one peer sends as many requests as the owner keeps consumer
/// addresses for ([`MAX_SERVED_PEERS`](crate::progress::MAX_SERVED_PEERS)),
/// each naming another made-up reply address (loopback ports nobody
/// listens on) and a region that does not exist. Once the owner's refusals
/// to those addresses ended (their peers declared unreachable), a consumer
/// the owner never saw must still be served.
#[test]
fn made_up_reply_addresses_do_not_lock_later_consumers_out_of_an_owner() {
    let rt = runtime();
    let config = config(Provider::Tcp);
    let owner = OfiEngine::start(
        config
            .clone()
            .with_unreachable_after(Duration::from_millis(200)),
    )
    .expect("owner starts");
    let o = owner.backend();
    let src = Memory::filled(4096, 0x33);
    let src_region = src.map(&rt, &o);
    let mut attacker = RawPeer::open(&config);
    let to_owner = attacker.insert(&owner.fabric_address());
    let started = Instant::now();
    for i in 0..crate::progress::MAX_SERVED_PEERS as u64 {
        let reply_to = loopback(20_000 + i as u16);
        let wire = forged_request(
            i + 1,
            u64::MAX - i,
            [0; CAPABILITY_LEN],
            0x1000,
            8,
            &reply_to,
        );
        attacker.send(to_owner, REQUEST_TAG, wire);
        if i % 64 == 0 {
            attacker.poll();
        }
    }
    attacker.progress_for(Duration::from_secs(3));
    let flood = started.elapsed();
    let consumer = OfiEngine::start(config).expect("consumer starts");
    consumer
        .add_peer(PeerId(1), owner.fabric_address())
        .unwrap();
    let c = consumer.backend();
    let dst = Memory::filled(64, 0);
    let dst_region = dst.map(&rt, &c);
    let answer = single(
        &rt,
        &c,
        get(
            PeerId(1),
            &src_region.packed_key,
            src.addr() as u64,
            &dst_region,
            0,
            64,
            Duration::from_secs(3),
        ),
    );
    let landed = dst.snapshot();
    let unmapped = [
        rt.block_on(c.unmap(dst_region.backend_region_id)),
        rt.block_on(o.unmap(src_region.backend_region_id)),
    ];
    drop(attacker);
    consumer.shutdown_blocking();
    owner.shutdown_blocking();
    let all = unmapped.iter().all(Result::is_ok);
    dst.free_after(all);
    src.free_after(all);
    eprintln!(
        "flood of {} requests sent and answered in {flood:?}",
        crate::progress::MAX_SERVED_PEERS
    );
    assert_eq!(answer, Ok(()), "a new consumer's read");
    assert!(landed.iter().all(|&b| b == 0x33));
    assert!(all, "unmaps {unmapped:?}");
    assert_eq!(owner.live_registrations(), 0);
    assert_eq!(consumer.live_registrations(), 0);
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

/// Attack: one peer holding a descriptor of a 256 KiB region sends 1024
/// lists of 16 × 16 KiB entries, naming sixteen made-up reply addresses
/// (64 lists each, the per-address bound). Every list the owner serves holds a
/// 256 KiB copy until its reply's send ends, which to an address nobody
/// listens on is when the peer is declared unreachable (30 s here). The
/// owner must bound what all consumers together make it hold, not only
/// each address: here it must grow by less than 128 MiB, half of what the
/// lists ask for (measured: 244 MiB before the bound, 99 MiB with it: 64 MiB of copies
/// and the allocator's slack after).
#[test]
fn gathered_replies_to_many_reply_addresses_do_not_grow_the_owner_without_bound() {
    let rt = runtime();
    let config = config(Provider::Tcp);
    let owner = OfiEngine::start(
        config
            .clone()
            .with_unreachable_after(Duration::from_secs(30)),
    )
    .expect("owner starts");
    let o = owner.backend();
    let len = 256usize << 10;
    let src = Memory::filled(len, 0x44);
    let src_region = src.map(&rt, &o);
    let key = PackedKey::decode(&src_region.packed_key).unwrap();
    let mut attacker = RawPeer::open(&config);
    let to_owner = attacker.insert(&owner.fabric_address());
    attacker.progress_for(Duration::from_millis(200));
    let before = resident();
    let mut id = 1;
    for address in 0..16u16 {
        let reply_to = loopback(30_000 + address);
        for _ in 0..64 {
            let wire = ListRequest {
                request_id: id,
                entries: (0..16u64)
                    .map(|i| ListEntry {
                        region_id: key.region_id,
                        capability: key.capability,
                        address: src.addr() as u64 + i * (16 << 10),
                        length: 16 << 10,
                    })
                    .collect(),
                reply_to: reply_to.clone(),
            }
            .encode();
            attacker.send(to_owner, REQUEST_TAG, wire);
            id += 1;
            attacker.poll();
        }
    }
    attacker.progress_for(Duration::from_secs(2));
    let grown = resident().saturating_sub(before);
    let unmapped = rt.block_on(o.unmap(src_region.backend_region_id));
    drop(attacker);
    owner.shutdown_blocking();
    src.free_after(unmapped.is_ok());
    eprintln!("the owner's process grew by {} MiB", grown >> 20);
    assert!(grown < 128 << 20, "grew by {} MiB", grown >> 20);
    assert_eq!(unmapped, Ok(()));
    assert_eq!(owner.live_registrations(), 0);
}

/// Attack: a consumer that asks for large reads and never receives their
/// bytes holds at most the owner's bound of replies (4 here) and is refused
/// as busy past it — unless it can pass for several consumers. The same
/// endpoint named three ways (its `sockaddr_in` with different bytes in
/// the unused `sin_zero` tail) must still be one consumer. It asks 6 reads
/// under the first spelling (4 held, 2 refused), then 4 under each other
/// (all refused: it holds its 4 already), letting the refusals arrive in
/// between (refusals unreceived are bounded by the same number): 10 busy.
/// Before, each spelling was a consumer of its own, whose replies the
/// provider could not even deliver (2 busy arrived, 12 replies held).
#[test]
fn one_consumer_naming_its_address_three_ways_is_still_bounded_as_one() {
    let rt = runtime();
    let config = config(Provider::Tcp);
    let owner = OfiEngine::start(
        config
            .clone()
            .with_max_served_replies_per_peer(4)
            .with_unreachable_after(Duration::from_secs(30)),
    )
    .expect("owner starts");
    let o = owner.backend();
    let len = 1usize << 20;
    let src = Memory::filled(len, 0x55);
    let src_region = src.map(&rt, &o);
    let key = PackedKey::decode(&src_region.packed_key).unwrap();
    let mut attacker = RawPeer::open(&config);
    let to_owner = attacker.insert(&owner.fabric_address());
    let own = attacker.address().to_vec();
    let mut busy_receives = Vec::new();
    let mut id = 1;
    for (alias, asks) in [(0u8, 6), (1, 4), (2, 4)] {
        let mut reply_to = own.clone();
        reply_to[8..].fill(alias);
        for _ in 0..asks {
            let busy = crate::protocol::refusal_tag(id, crate::protocol::Refusal::Busy);
            busy_receives.push(attacker.receive(to_owner, busy, 0, 0).0);
            let wire = forged_request(
                id,
                key.region_id,
                key.capability,
                src.addr() as u64,
                len as u64,
                &reply_to,
            );
            attacker.send(to_owner, REQUEST_TAG, wire);
            id += 1;
        }
        attacker.progress_for(Duration::from_millis(500));
    }
    attacker.progress_for(Duration::from_secs(1));
    let busy = busy_receives
        .iter()
        .filter(|at| matches!(attacker.ended.get(at), Some(Ended::Done { .. })))
        .count();
    drop(attacker);
    owner.shutdown_blocking();
    let unmapped = rt.block_on(o.unmap(src_region.backend_region_id));
    src.free_after(unmapped.is_ok() && owner.live_registrations() == 0);
    assert_eq!(busy, 10, "reads refused as busy of 14");
    assert_eq!(owner.live_registrations(), 0);
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

/// Attack: a hostile owner answers each of 32 reads of 8 MiB with 8 MiB
/// and one byte more. The provider truncates each reply into the receive
/// and fails it; the read answers a typed error. The reply has arrived, so
/// nothing of it is left to take: the consumer must not keep a scratch
/// receive of 8 MiB per read for it until its teardown (256 MiB here; it
/// may grow by less than 128 MiB).
#[test]
fn overlong_replies_of_a_hostile_owner_leave_the_consumer_no_memory_behind() {
    let rt = runtime();
    let config = config(Provider::Tcp);
    let mut owner = RawPeer::open(&config);
    let consumer = OfiEngine::start(config).expect("consumer starts");
    consumer.add_peer(PeerId(1), owner.address()).unwrap();
    let c = consumer.backend();
    let len = 8usize << 20;
    let dst = Memory::filled(len, 0);
    let dst_region = dst.map(&rt, &c);
    let key = PackedKey {
        owner_served: true,
        virt_addr: false,
        region_id: 1,
        capability: [9; CAPABILITY_LEN],
        mr_key: 0,
        base: 0x10_0000,
        len: len as u64,
        owner: owner.address(),
    }
    .encode();
    let to_consumer = owner.insert(&consumer.fabric_address());
    let before = virtual_size();
    let mut answers = Vec::new();
    for _ in 0..32 {
        let read = rt.spawn({
            let c = c.clone();
            let request = get(
                PeerId(1),
                &key,
                0x10_0000,
                &dst_region,
                0,
                len as u64,
                Duration::from_secs(10),
            );
            // SAFETY: nothing touches the destination until answered.
            async move { unsafe { c.get(request) }.await }
        });
        let request = ReadRequest::decode(&owner.take_request()).expect("a single read");
        let sent = owner.send(to_consumer, request.request_id, vec![0xAB; len + 1]);
        assert!(
            matches!(owner.wait(sent), Some(Ended::Done { .. })),
            "overlong reply sent"
        );
        answers.push(rt.block_on(read).expect("the read task"));
    }
    drop(owner);
    let grown = virtual_size().saturating_sub(before);
    let unmapped = rt.block_on(c.unmap(dst_region.backend_region_id));
    consumer.shutdown_blocking();
    dst.free_after(unmapped.is_ok());
    eprintln!(
        "the consumer's process grew by {} MiB of address space",
        grown >> 20
    );
    for answer in &answers {
        assert!(
            matches!(answer, Err(RdmaError::Backend(_))),
            "answered {answer:?}"
        );
    }
    assert!(grown < 128 << 20, "grew by {} MiB", grown >> 20);
    assert_eq!(unmapped, Ok(()));
    assert_eq!(consumer.live_registrations(), 0);
}

/// Attack: a hostile owner takes 32 requests for 8 MiB and never answers.
/// Each read answers `Timeout` at its 100 ms deadline, and the consumer
/// posts a scratch receive for the late reply (so an honest owner's lease
/// would end) — which never comes. What the consumer keeps for one owner's
/// late replies must be bounded: 256 MiB here, and it may grow by less
/// than 128 MiB.
#[test]
fn an_owner_that_never_answers_cannot_make_its_consumer_hoard_scratch_memory() {
    let rt = runtime();
    let config = config(Provider::Tcp);
    let mut owner = RawPeer::open(&config);
    let consumer = OfiEngine::start(config).expect("consumer starts");
    consumer.add_peer(PeerId(1), owner.address()).unwrap();
    let c = consumer.backend();
    let len = 8usize << 20;
    let dst = Memory::filled(len, 0);
    let dst_region = dst.map(&rt, &c);
    let key = PackedKey {
        owner_served: true,
        virt_addr: false,
        region_id: 1,
        capability: [9; CAPABILITY_LEN],
        mr_key: 0,
        base: 0x10_0000,
        len: len as u64,
        owner: owner.address(),
    }
    .encode();
    let before = virtual_size();
    let mut answers = Vec::new();
    for _ in 0..32 {
        let read = rt.spawn({
            let c = c.clone();
            let request = get(
                PeerId(1),
                &key,
                0x10_0000,
                &dst_region,
                0,
                len as u64,
                Duration::from_millis(100),
            );
            // SAFETY: nothing touches the destination until answered.
            async move { unsafe { c.get(request) }.await }
        });
        ReadRequest::decode(&owner.take_request()).expect("a single read");
        answers.push(rt.block_on(read).expect("the read task"));
    }
    let grown = virtual_size().saturating_sub(before);
    let unmapped = rt.block_on(c.unmap(dst_region.backend_region_id));
    drop(owner);
    consumer.shutdown_blocking();
    dst.free_after(unmapped.is_ok());
    eprintln!(
        "the consumer's process grew by {} MiB of address space",
        grown >> 20
    );
    for answer in &answers {
        assert_eq!(answer, &Err(RdmaError::Timeout));
    }
    assert!(grown < 128 << 20, "grew by {} MiB", grown >> 20);
    assert_eq!(unmapped, Ok(()));
    assert_eq!(consumer.live_registrations(), 0);
}

/// Guard: garbage the owner must drop without an answer or harm — empty,
/// one-byte, wrong-version and truncated frames, lists of 0, 65 and 255
/// entries, a probe with a byte more, a single read of length 0 — then
/// single reads whose range wraps or is huge, refused `OutOfRange`; and a
/// list whose entries are valid, wrap, start below the region, name
/// another consumer's region with this capability, or an unknown region,
/// answered entry by entry; last a frame longer than any request. The
/// owner then still serves an honest consumer, and unmaps everything.
#[test]
fn garbage_frames_and_hostile_list_entries_get_typed_answers_and_the_owner_keeps_serving() {
    let rt = runtime();
    let config = config(Provider::Tcp);
    let owner = OfiEngine::start(config.clone()).expect("owner starts");
    let o = owner.backend();
    let granted = Memory::filled(4096, 0x66);
    let other = Memory::filled(4096, 0x77);
    let granted_region = granted.map(&rt, &o);
    let other_region = other.map(&rt, &o);
    let key = PackedKey::decode(&granted_region.packed_key).unwrap();
    let other_id = PackedKey::decode(&other_region.packed_key)
        .unwrap()
        .region_id;
    let mut attacker = RawPeer::open(&config);
    let to_owner = attacker.insert(&owner.fabric_address());
    let me = attacker.address().to_vec();
    let base = granted.addr() as u64;
    let mut garbage: Vec<Vec<u8>> = vec![
        vec![],
        vec![1],
        vec![2],
        vec![0xFF, 0, 0, 0, 0],
        vec![3; 100],
        forged_request(1, key.region_id, key.capability, base, 64, &me)[..60].to_vec(),
    ];
    for count in [0u8, 65, 255] {
        let mut list = vec![2, count, 0, 0];
        list.extend_from_slice(&7u64.to_le_bytes());
        list.extend_from_slice(&(me.len() as u16).to_le_bytes());
        list.extend(std::iter::repeat_n(0u8, 40 * usize::from(count.min(64))));
        list.extend_from_slice(&me);
        garbage.push(list);
    }
    let mut zero = forged_request(9, key.region_id, key.capability, base, 64, &me);
    zero[44..52].fill(0);
    garbage.push(zero);
    // Nothing may answer these: listen for any tag of their ids.
    let mut silent = Vec::new();
    for id in [1u64, 7, 9] {
        silent.push(attacker.receive(to_owner, id, REPLY_IGNORE, 64).0);
    }
    for frame in garbage {
        attacker.send(to_owner, REQUEST_TAG, frame);
    }
    let mut refused = Vec::new();
    for (id, address, length) in [
        (20u64, u64::MAX - 7, 16u64),
        (21, base, u64::MAX),
        (22, base + 4000, 200),
        (23, base - 1, 1),
    ] {
        refused.push(attacker.receive(to_owner, id, REPLY_IGNORE, 0).0);
        attacker.send(
            to_owner,
            REQUEST_TAG,
            forged_request(id, key.region_id, key.capability, address, length, &me),
        );
    }
    let entries = [
        (key.region_id, base, 64u64),
        (key.region_id, u64::MAX - 7, 16),
        (key.region_id, base - 64, 64),
        (other_id, other.addr() as u64, 64),
        (u64::MAX, base, 64),
        (key.region_id, base + 4096 - 16, 16),
    ];
    let list = ListRequest {
        request_id: 30,
        entries: entries
            .iter()
            .map(|&(region_id, address, length)| ListEntry {
                region_id,
                capability: key.capability,
                address,
                length,
            })
            .collect(),
        reply_to: me.clone(),
    };
    let (gathered, index) = attacker.receive(to_owner, 30, REPLY_IGNORE, list.reply_len());
    attacker.send(to_owner, REQUEST_TAG, list.encode());
    let gathered = attacker.wait(gathered);
    let refusals: Vec<Option<Ended>> = refused.iter().map(|&at| attacker.wait(at)).collect();
    attacker.progress_for(Duration::from_millis(300));
    let answered_garbage: Vec<Ended> = silent
        .iter()
        .filter_map(|at| attacker.ended.get(at).cloned())
        .collect();
    let reply = attacker.buffers[index].clone();
    // Last, a frame longer than any request: the owner's receive fails
    // (truncated) and is posted again. (Over tcp;ofi_rxm the provider then
    // loses the sender's next message on that connection — the sender's
    // own loss; other consumers are served, as below.)
    attacker.send(
        to_owner,
        REQUEST_TAG,
        vec![0x5A; crate::protocol::RECEIVE_MAX + 1000],
    );
    attacker.progress_for(Duration::from_millis(100));
    // An honest consumer is still served.
    let consumer = OfiEngine::start(config).expect("consumer starts");
    consumer
        .add_peer(PeerId(1), owner.fabric_address())
        .unwrap();
    let c = consumer.backend();
    let dst = Memory::filled(64, 0);
    let dst_region = dst.map(&rt, &c);
    let honest = single(
        &rt,
        &c,
        get(
            PeerId(1),
            &granted_region.packed_key,
            base,
            &dst_region,
            0,
            64,
            Duration::from_secs(5),
        ),
    );
    let landed = dst.snapshot();
    let unmapped = [
        rt.block_on(c.unmap(dst_region.backend_region_id)),
        rt.block_on(o.unmap(granted_region.backend_region_id)),
        rt.block_on(o.unmap(other_region.backend_region_id)),
    ];
    drop(attacker);
    consumer.shutdown_blocking();
    owner.shutdown_blocking();
    let all = unmapped.iter().all(Result::is_ok);
    dst.free_after(all);
    granted.free_after(all);
    other.free_after(all);
    assert!(
        answered_garbage.is_empty(),
        "garbage was answered: {answered_garbage:?}"
    );
    for (refusal, id) in refusals.iter().zip(20u64..) {
        match refusal {
            Some(Ended::Done { len: 0, tag }) => {
                assert_eq!(
                    crate::protocol::reply_outcome(*tag),
                    Err(RdmaError::OutOfRange),
                    "read {id}"
                );
            }
            other => panic!("read {id} answered {other:?}"),
        }
    }
    use crate::protocol::Refusal;
    let statuses = [
        0,
        Refusal::OutOfRange.status(),
        Refusal::OutOfRange.status(),
        Refusal::CapabilityMismatch.status(),
        Refusal::RegionUnknown.status(),
        0,
    ];
    assert_eq!(
        gathered,
        Some(Ended::Done {
            len: 6 + 64 + 16,
            tag: 30
        })
    );
    assert_eq!(reply[..6], statuses);
    assert!(
        reply[6..6 + 80].iter().all(|&b| b == 0x66),
        "served entries' bytes"
    );
    assert_eq!(honest, Ok(()));
    assert!(landed.iter().all(|&b| b == 0x66));
    assert!(all, "unmaps {unmapped:?}");
    assert_eq!(owner.live_registrations(), 0);
    assert_eq!(consumer.live_registrations(), 0);
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
        let rt = runtime();
        let config = config(provider);
        let mut owner = RawPeer::open(&config);
        let consumer = OfiEngine::start(config).expect("consumer starts");
        consumer.add_peer(PeerId(1), owner.address()).unwrap();
        let to_consumer = owner.insert(&consumer.fabric_address());
        let key = PackedKey {
            owner_served: true,
            virt_addr: false,
            region_id: 1,
            capability: [9; CAPABILITY_LEN],
            mr_key: 0,
            base: 0x10_0000,
            len: 1 << 20,
            owner: owner.address(),
        }
        .encode();
        let dst = Memory::filled(dst_len, 0);
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

/// Guard: a hostile owner's answers to single reads — short, a refusal
/// that carries bytes, a refusal of a reason nobody knows, none at all
/// until the deadline, and a reply sent twice — each get a typed answer;
/// after each answer the destination stays as its caller leaves it (filled,
/// then 200 ms while the owner sends the late or second reply); a message
/// tagged for a read never asked changes nothing.
fn a_hostile_owners_single_replies_get_typed_answers_and_never_land_after_them(provider: Provider) {
    use crate::protocol::{Refusal, refusal_tag};
    let mut setup = HostileOwnerSetup::new(provider.clone(), 64 << 10);
    let len = 64u64 << 10;
    let mut outcomes = Vec::new();
    let mut untouched = Vec::new();
    for case in 0..5 {
        let deadline = if case == 3 {
            Duration::from_millis(300)
        } else {
            Duration::from_secs(10)
        };
        let task = setup.start(&[len], deadline);
        let request = ReadRequest::decode(&setup.owner.take_request()).expect("a single read");
        let id = request.request_id;
        let to = setup.to_consumer;
        match case {
            0 => drop(setup.owner.send(to, id, vec![1; len as usize - 1])),
            1 => drop(
                setup
                    .owner
                    .send(to, refusal_tag(id, Refusal::OutOfRange), vec![2; 64]),
            ),
            2 => drop(setup.owner.send(
                to,
                crate::protocol::REFUSAL_BIT | (200 << 48) | id,
                vec![],
            )),
            3 => {}
            _ => drop(setup.owner.send(to, id, vec![4; len as usize])),
        }
        outcomes.push(setup.answers(task).remove(0));
        untouched.push(setup.untouched_after(|owner, to| {
            owner.send(to, id, vec![0xEE; len as usize]);
            owner.send(to, id ^ 0x5555, vec![0xEE; len as usize]);
        }));
    }
    // The consumer still reads.
    let task = setup.start(&[64], Duration::from_secs(10));
    let request = ReadRequest::decode(&setup.owner.take_request()).expect("a single read");
    setup
        .owner
        .send(setup.to_consumer, request.request_id, vec![6; 64]);
    let last = setup.answers(task).remove(0);
    let landed = setup.dst.snapshot()[..64].to_vec();
    setup.finish();
    assert!(
        matches!(&outcomes[0], Err(RdmaError::Backend(text)) if text.contains("bytes for a read of")),
        "{provider:?} short: {:?}",
        outcomes[0]
    );
    assert_eq!(
        outcomes[1],
        Err(RdmaError::OutOfRange),
        "{provider:?} refusal with bytes"
    );
    assert!(
        matches!(&outcomes[2], Err(RdmaError::Backend(text)) if text.contains("unknown reason 200")),
        "{provider:?}: {:?}",
        outcomes[2]
    );
    assert_eq!(
        outcomes[3],
        Err(RdmaError::Timeout),
        "{provider:?} no answer"
    );
    assert_eq!(outcomes[4], Ok(()), "{provider:?} a reply sent twice");
    assert_eq!(
        untouched,
        vec![true; 5],
        "{provider:?}: destination untouched after each answer"
    );
    assert_eq!(last, Ok(()));
    assert!(landed.iter().all(|&b| b == 6));
}

#[test]
fn a_hostile_owners_single_replies_get_typed_answers_and_never_land_after_them_over_tcp() {
    a_hostile_owners_single_replies_get_typed_answers_and_never_land_after_them(Provider::Tcp);
}

#[test]
fn a_hostile_owners_single_replies_get_typed_answers_and_never_land_after_them_over_shm() {
    a_hostile_owners_single_replies_get_typed_answers_and_never_land_after_them(Provider::Shm);
}

/// Known defect: over `tcp;ofi_rxm` a reply longer than the provider's
/// eager size moves by rendezvous, which only the sender's progress
/// completes. An owner (hostile, or merely wedged) that starts such a reply
/// and then never progresses holds the consumer's read past its deadline:
/// the matched receive cannot be withdrawn (`fi_cancel` does not end it),
/// the probe finds the owner reachable, so the read answers only when the
/// owner moves again or the consumer's engine shuts down — and its
/// destination region cannot be unmapped meanwhile.
#[test]
#[ignore = "known defect: over tcp;ofi_rxm a read whose rendezvous reply an owner started and then stalled is held past its deadline until the owner progresses or the consumer's engine shuts down (a matched receive cannot be cancelled)"]
fn a_read_whose_owner_stalls_mid_reply_still_answers_at_its_deadline() {
    let mut setup = HostileOwnerSetup::new(Provider::Tcp, 1 << 20);
    let task = setup.start(&[1 << 20], Duration::from_secs(1));
    let request = ReadRequest::decode(&setup.owner.take_request()).expect("a single read");
    let to = setup.to_consumer;
    setup.owner.send(to, request.request_id, vec![7; 1 << 20]);
    // The owner now stalls: five seconds without progress.
    let until = Instant::now() + Duration::from_secs(5);
    while !task.is_finished() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    let answered_in_time = task.is_finished();
    let answer = setup.answers(task).remove(0);
    setup.finish();
    assert!(
        answered_in_time,
        "no answer 4 s past the deadline (later: {answer:?})"
    );
}

/// Guard: a gathered list whose owner answers only after the list's
/// deadline answers `Timeout` for every entry, and the late reply lands
/// nowhere; (over tcp) a list in flight when the consumer's engine shuts
/// down answers `ShuttingDown` for every entry, and the destination is not
/// written after that; everything is unregistered.
fn a_late_or_abandoned_gathered_list_never_lands_after_its_answer(provider: Provider) {
    let mut setup = HostileOwnerSetup::new(provider.clone(), 4096);
    let lens = [64u64; 8];
    let task = setup.start(&lens, Duration::from_millis(300));
    let list = ListRequest::decode(&setup.owner.take_request()).expect("a list");
    let expired = setup.answers(task);
    let mut late = vec![0u8; 8];
    late.extend(std::iter::repeat_n(0xEE, 8 * 64));
    let untouched_after_timeout = setup.untouched_after(|owner, to| {
        owner.send(to, list.request_id, late);
    });
    assert_eq!(expired, vec![Err(RdmaError::Timeout); 8], "{provider:?}");
    assert!(
        untouched_after_timeout,
        "{provider:?}: a late list reply landed"
    );
    if provider == Provider::Shm {
        // A shm engine torn down with reads in flight closes its endpoint,
        // and a sender of the same process then crashes in the provider
        // (the ignored test in tests/adversarial_peers.rs): over shm this
        // half would need the owner in another process.
        setup.finish();
        return;
    }
    let task = setup.start(&lens, Duration::from_secs(10));
    let list = ListRequest::decode(&setup.owner.take_request()).expect("a list");
    setup.consumer.shutdown_blocking();
    let abandoned = setup.answers(task);
    let mut reply = vec![0u8; 8];
    reply.extend(std::iter::repeat_n(0xEE, 8 * 64));
    let untouched_after_shutdown = setup.untouched_after(|owner, to| {
        // The consumer's endpoint is gone: the provider may refuse it.
        owner.try_send(to, list.request_id, reply);
    });
    let live = setup.consumer.live_registrations();
    drop(setup.owner);
    // The engine's teardown ended the destination's registration.
    setup.dst.free_after(live == 0);
    assert_eq!(
        abandoned,
        vec![Err(RdmaError::ShuttingDown); 8],
        "{provider:?}"
    );
    assert!(
        untouched_after_shutdown,
        "{provider:?}: a reply landed after shutdown"
    );
    assert_eq!(live, 0);
}

#[test]
fn a_late_or_abandoned_gathered_list_never_lands_after_its_answer_over_tcp() {
    a_late_or_abandoned_gathered_list_never_lands_after_its_answer(Provider::Tcp);
}

#[test]
fn a_late_or_abandoned_gathered_list_never_lands_after_its_answer_over_shm() {
    a_late_or_abandoned_gathered_list_never_lands_after_its_answer(Provider::Shm);
}

/// Attack: one peer holds the owner's total of gathered replies (64 MiB)
/// by naming made-up reply addresses nobody takes replies at (held for
/// 30 s here). A consumer that takes its replies must still be served its
/// gathered list, not refused as busy for as long as the attacker likes.
#[test]
fn a_consumer_is_still_served_lists_while_other_addresses_hold_the_owners_total() {
    let rt = runtime();
    let config = config(Provider::Tcp);
    let owner = OfiEngine::start(
        config
            .clone()
            .with_unreachable_after(Duration::from_secs(30)),
    )
    .expect("owner starts");
    let o = owner.backend();
    let len = 256usize << 10;
    let src = Memory::filled(len, 0x48);
    let src_region = src.map(&rt, &o);
    let key = PackedKey::decode(&src_region.packed_key).unwrap();
    let mut attacker = RawPeer::open(&config);
    let to_owner = attacker.insert(&owner.fabric_address());
    let mut id = 1;
    // Five addresses of 256 KiB lists, then one of 16 KiB lists, fill the
    // total to within less than the consumer's list.
    for (address, entries) in [(0u16, 16u64), (1, 16), (2, 16), (3, 16), (4, 16), (5, 1)] {
        let reply_to = loopback(31_000 + address);
        for _ in 0..64 {
            let wire = ListRequest {
                request_id: id,
                entries: (0..entries)
                    .map(|i| ListEntry {
                        region_id: key.region_id,
                        capability: key.capability,
                        address: src.addr() as u64 + i * (16 << 10),
                        length: 16 << 10,
                    })
                    .collect(),
                reply_to: reply_to.clone(),
            }
            .encode();
            attacker.send(to_owner, REQUEST_TAG, wire);
            id += 1;
            attacker.poll();
        }
    }
    attacker.progress_for(Duration::from_secs(1));
    let consumer = OfiEngine::start(config).expect("consumer starts");
    consumer
        .add_peer(PeerId(1), owner.fabric_address())
        .unwrap();
    let c = consumer.backend();
    let dst = Memory::filled(16 << 10, 0);
    let dst_region = dst.map(&rt, &c);
    let requests: Vec<BackendGet> = (0..16u64)
        .map(|i| {
            get(
                PeerId(1),
                &src_region.packed_key,
                src.addr() as u64 + i * 1024,
                &dst_region,
                i * 1024,
                1024,
                Duration::from_secs(5),
            )
        })
        .collect();
    // SAFETY: nothing touches the destination until the batch answered.
    let answers = rt.block_on(unsafe { c.get_batch(requests) });
    let landed = dst.snapshot();
    let unmapped = [
        rt.block_on(c.unmap(dst_region.backend_region_id)),
        rt.block_on(o.unmap(src_region.backend_region_id)),
    ];
    drop(attacker);
    consumer.shutdown_blocking();
    owner.shutdown_blocking();
    let all = unmapped.iter().all(Result::is_ok);
    dst.free_after(all);
    src.free_after(all);
    assert_eq!(answers, vec![Ok(()); 16]);
    assert!(landed.iter().all(|&b| b == 0x48));
    assert!(all, "unmaps {unmapped:?}");
    assert_eq!(owner.live_registrations(), 0);
    assert_eq!(consumer.live_registrations(), 0);
}

/// Guard of the liveness probe over tcp (`unreachable_after` 1 s): an owner
/// that took a read's request and then stalls — its endpoint open, never
/// progressed — is not declared unreachable: the read answers `Timeout` at
/// its 2.5 s deadline. An owner whose endpoint is gone is: a read from it
/// answers the unreachable error within 5 s, not at its 20 s deadline.
#[test]
fn the_probe_spares_a_stalled_owner_and_finds_a_dead_one() {
    let mut setup = HostileOwnerSetup::new(Provider::Tcp, 64 << 10);
    let started = Instant::now();
    let task = setup.start(&[64 << 10], Duration::from_millis(2500));
    ReadRequest::decode(&setup.owner.take_request()).expect("a single read");
    while !task.is_finished() && started.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let stalled = setup.rt.block_on(task).expect("the read task");
    let stalled_after = started.elapsed();
    // The owner's endpoint goes away; a new read from it.
    let HostileOwnerSetup {
        rt,
        owner,
        consumer,
        dst,
        dst_region,
        key,
        ..
    } = setup;
    drop(owner);
    let started = Instant::now();
    let c = consumer.backend();
    let dead = single(
        &rt,
        &c,
        get(
            PeerId(1),
            &key,
            0x10_0000,
            &dst_region,
            0,
            64,
            Duration::from_secs(20),
        ),
    );
    let dead_after = started.elapsed();
    let unmapped = rt.block_on(c.unmap(dst_region.backend_region_id));
    consumer.shutdown_blocking();
    dst.free_after(unmapped.is_ok());
    eprintln!("stalled: {stalled:?} after {stalled_after:?}; dead: {dead:?} after {dead_after:?}");
    assert_eq!(stalled, vec![Err(RdmaError::Timeout)]);
    assert!(stalled_after >= Duration::from_millis(2500));
    assert!(
        matches!(&dead, Err(RdmaError::Backend(text)) if text.contains("unreachable")),
        "{dead:?}"
    );
    assert!(dead_after < Duration::from_secs(5), "{dead_after:?}");
    assert_eq!(unmapped, Ok(()));
    assert_eq!(consumer.live_registrations(), 0);
}

/// Guard: one peer floods an owner with 10 000 requests for a region that
/// does not exist and never receives the refusals (the owner holds at most
/// its bound of them and drops the rest). A consumer reading meanwhile is
/// served, each of 20 reads within 5 s, and the owner unmaps everything.
#[test]
fn a_request_flood_from_one_peer_does_not_starve_another_consumer() {
    let rt = runtime();
    let config = config(Provider::Tcp);
    let owner = OfiEngine::start(config.clone()).expect("owner starts");
    let o = owner.backend();
    let src = Memory::filled(4096, 0x4C);
    let src_region = src.map(&rt, &o);
    let consumer = OfiEngine::start(config.clone()).expect("consumer starts");
    consumer
        .add_peer(PeerId(1), owner.fabric_address())
        .unwrap();
    let c = consumer.backend();
    let dst = Memory::filled(64, 0);
    let dst_region = dst.map(&rt, &c);
    let flood = std::thread::spawn({
        let owner_address = owner.fabric_address();
        move || {
            let mut attacker = RawPeer::open(&config);
            let to_owner = attacker.insert(&owner_address);
            let me = attacker.address().to_vec();
            for id in 1..=10_000u64 {
                attacker.send(
                    to_owner,
                    REQUEST_TAG,
                    forged_request(id, u64::MAX, [0; CAPABILITY_LEN], 0x1000, 8, &me),
                );
                if id % 32 == 0 {
                    attacker.poll();
                }
            }
            attacker.progress_for(Duration::from_millis(500));
        }
    });
    let mut slowest = Duration::ZERO;
    let mut answers = Vec::new();
    for _ in 0..20 {
        let started = Instant::now();
        answers.push(single(
            &rt,
            &c,
            get(
                PeerId(1),
                &src_region.packed_key,
                src.addr() as u64,
                &dst_region,
                0,
                64,
                Duration::from_secs(5),
            ),
        ));
        slowest = slowest.max(started.elapsed());
        std::thread::sleep(Duration::from_millis(20));
    }
    let flooded = flood.join().is_ok();
    let landed = dst.snapshot();
    let unmapped = [
        rt.block_on(c.unmap(dst_region.backend_region_id)),
        rt.block_on(o.unmap(src_region.backend_region_id)),
    ];
    consumer.shutdown_blocking();
    owner.shutdown_blocking();
    let all = unmapped.iter().all(Result::is_ok);
    dst.free_after(all);
    src.free_after(all);
    eprintln!("slowest read during the flood: {slowest:?}");
    assert!(flooded, "the flooding thread");
    assert_eq!(answers, vec![Ok(()); 20]);
    assert!(slowest < Duration::from_secs(5));
    assert!(landed.iter().all(|&b| b == 0x4C));
    assert!(all, "unmaps {unmapped:?}");
    assert_eq!(owner.live_registrations(), 0);
    assert_eq!(consumer.live_registrations(), 0);
}

/// Known defect: a holder of a key asks the owner for 1 MiB in the name of
/// a bystander — another consumer engine, alive, which never asked. Over
/// tcp the reply moves by rendezvous and waits for a receive the bystander
/// never posts, so its read lease never ends: the owner's unmap of the
/// region does not answer (here, within 5 s) until the bystander's
/// connection fails or the owner shuts down. The attacker need not stay.
#[test]
#[ignore = "known defect: a reply sent to a reply address the requester made up (a live bystander that never asked) holds its read lease, and so the region's unmap, until that connection fails or the owner's teardown; the owner cannot check who sent a request (no FI_SOURCE)"]
fn an_unmap_answers_even_when_a_request_named_a_bystander_as_its_reply_address() {
    let rt = runtime();
    let config = config(Provider::Tcp);
    let owner = OfiEngine::start(config.clone()).expect("owner starts");
    let bystander = OfiEngine::start(config.clone()).expect("bystander starts");
    let o = owner.backend();
    let len = 1usize << 20;
    let src = Memory::filled(len, 0x5B);
    let src_region = src.map(&rt, &o);
    let key = PackedKey::decode(&src_region.packed_key).unwrap();
    {
        let mut attacker = RawPeer::open(&config);
        let to_owner = attacker.insert(&owner.fabric_address());
        attacker.send(
            to_owner,
            REQUEST_TAG,
            forged_request(
                1,
                key.region_id,
                key.capability,
                src.addr() as u64,
                len as u64,
                &bystander.fabric_address(),
            ),
        );
        attacker.progress_for(Duration::from_millis(300));
    }
    let unmap = rt.spawn({
        let o = o.clone();
        let id = src_region.backend_region_id;
        async move { o.unmap(id).await }
    });
    let until = Instant::now() + Duration::from_secs(5);
    while !unmap.is_finished() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
    let answered = unmap.is_finished();
    owner.shutdown_blocking();
    bystander.shutdown_blocking();
    let unmapped = rt.block_on(unmap).expect("the unmap task");
    src.free_after(unmapped.is_ok() && owner.live_registrations() == 0);
    assert!(
        answered,
        "the unmap did not answer within 5 s (at teardown: {unmapped:?})"
    );
}
