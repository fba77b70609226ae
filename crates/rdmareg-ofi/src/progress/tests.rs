//! The progress thread's own tests: request ids, and owners facing
//! consumers that never receive their replies.

use rdmareg_backend::RdmaBackend;

use super::*;
use crate::engine::OfiEngine;
use crate::fabric::ADDR_UNSPEC;
use crate::key::PackedKey;
use crate::protocol::{
    BUSY_TEXT, ListEntry, ListRequest, NOTICE_TAG, RECEIVE_MAX, REPLY_IGNORE, REQUEST_ID_MASK,
    REQUEST_TAG, ReadRequest, Refusal, refusal_code, refusal_tag, reply_outcome,
};
use crate::{OfiConfig, Provider};

/// Request ids come from a secret permutation of a counter: distinct,
/// non-zero, below 2⁴⁸, and not the counter itself (a fresh engine's
/// first ids are not 1, 2, 3, which any peer could guess).
#[test]
fn request_ids_are_distinct_below_2_48_and_not_the_counter() {
    let permutation = RequestIdPermutation::new();
    let ids: Vec<u64> = (1..=100_000u64).map(|n| permutation.permute(n)).collect();
    let distinct: std::collections::HashSet<u64> = ids.iter().copied().collect();
    assert_eq!(distinct.len(), ids.len(), "a permutation repeats no id");
    assert!(ids.iter().all(|&id| id <= REQUEST_ID_MASK));
    let fixed = ids.iter().zip(1u64..).filter(|(id, n)| *id == n).count();
    assert!(fixed < 2, "{fixed} ids equal their counter");
    let other = RequestIdPermutation::new();
    let same = (1..=1000u64)
        .filter(|&n| other.permute(n) == permutation.permute(n))
        .count();
    assert!(same < 2, "two engines share {same} of their first 1000 ids");
}

/// A bare endpoint that speaks the protocol by hand: it asks for reads
/// and never posts a receive for their bytes, only for busy refusals.
struct RawConsumer {
    fabric: Fabric,
    owner: u64,
    /// Receive and send contexts, kept until the endpoint is closed.
    /// Boxed: the provider holds their addresses, so they must not move
    /// when the vector grows.
    #[allow(clippy::vec_box)]
    contexts: Vec<Box<OpContext>>,
    /// Request bytes, kept until the endpoint is closed.
    wires: Vec<Vec<u8>>,
    /// Busy-refusal receive contexts, by address.
    busy_receives: HashMap<usize, u64>,
    busy: Vec<u64>,
}

impl RawConsumer {
    fn new(config: &OfiConfig, owner: &[u8]) -> RawConsumer {
        let mut fabric = Fabric::open(config).expect("raw endpoint");
        let owner = fabric.insert_peer(owner).expect("owner address");
        RawConsumer {
            fabric,
            owner,
            contexts: Vec::new(),
            wires: Vec::new(),
            busy_receives: HashMap::new(),
            busy: Vec::new(),
        }
    }

    fn context(&mut self) -> *mut c_void {
        let mut context = Box::new(OpContext {
            space: [std::ptr::null_mut(); 8],
        });
        let at = (&raw mut context.space).cast::<c_void>();
        self.contexts.push(context);
        at
    }

    /// Asks the owner once for a region that does not exist and waits
    /// for the reply, as an engine's first read does: over tcp the
    /// owner's provider cannot name a sender before the owner inserted
    /// its address, so the first request gets "ask again"
    /// (`Refusal::Unverified`); later ones are checked and served.
    fn introduce(&mut self, id: u64) {
        let receive = self.context();
        // SAFETY: a zero-length receive; its context lives in
        // `contexts` until the fabric (and its endpoint) is dropped.
        let posted = unsafe {
            self.fabric.trecv(
                0,
                0,
                std::ptr::null_mut(),
                self.owner,
                id,
                REPLY_IGNORE,
                receive,
            )
        };
        assert_eq!(posted.ok(), Some(true), "introduction receive posted");
        let wire = ReadRequest {
            request_id: id,
            region_id: u64::MAX,
            capability: [0; CAPABILITY_LEN],
            address: 0x1000,
            length: 8,
            reply_to: self.fabric.address.to_vec(),
        }
        .encode();
        self.send_request(id, wire);
        let until = Instant::now() + Duration::from_secs(5);
        let mut out = Vec::new();
        while Instant::now() < until {
            self.fabric.poll_completions(&mut out, 64);
            if out
                .drain(..)
                .any(|c| matches!(c, Completion::Done(at, ..) if at == receive))
            {
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        panic!("the owner never replied to the introduction");
    }

    /// Asks for `length` bytes at `address` as read `id`, listening only
    /// for a busy refusal of it.
    fn ask(&mut self, key: &PackedKey, address: u64, length: u64, id: u64) {
        let wire = ReadRequest {
            request_id: id,
            region_id: key.region_id,
            capability: key.capability,
            address,
            length,
            reply_to: self.fabric.address.to_vec(),
        }
        .encode();
        self.send_request(id, wire);
    }

    /// Asks for `count` entries of `length` bytes from `address` on as
    /// list `id`, listening only for a busy refusal of it.
    fn ask_list(&mut self, key: &PackedKey, address: u64, length: u64, count: u64, id: u64) {
        let wire = ListRequest {
            request_id: id,
            entries: (0..count)
                .map(|i| ListEntry {
                    region_id: key.region_id,
                    capability: key.capability,
                    address: address + i * length,
                    length,
                })
                .collect(),
            reply_to: self.fabric.address.to_vec(),
        }
        .encode();
        self.send_request(id, wire);
    }

    /// Sends request bytes of request `id`, listening only for a busy
    /// refusal of it.
    fn send_request(&mut self, id: u64, wire: Vec<u8>) {
        let receive = self.context();
        // SAFETY: a zero-length receive; its context lives in
        // `contexts` until the fabric (and its endpoint) is dropped.
        let posted = unsafe {
            self.fabric.trecv(
                0,
                0,
                std::ptr::null_mut(),
                self.owner,
                refusal_tag(id, Refusal::Busy),
                0,
                receive,
            )
        };
        assert_eq!(posted.ok(), Some(true), "busy receive posted");
        self.busy_receives.insert(receive as usize, id);
        self.send_tagged(REQUEST_TAG, wire);
    }

    /// Sends `wire` with `tag` to the owner.
    fn send_tagged(&mut self, tag: u64, wire: Vec<u8>) {
        let send = self.context();
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            // SAFETY: the bytes and the context live in `wires` and
            // `contexts` until the fabric is dropped.
            let sent = unsafe {
                self.fabric.tsend(
                    wire.as_ptr() as usize,
                    wire.len(),
                    std::ptr::null_mut(),
                    self.owner,
                    tag,
                    send,
                )
            };
            match sent {
                Ok(true) => break,
                // The provider asks to wait (connecting): progress.
                Ok(false) if Instant::now() < until => self.progress_for(Duration::from_millis(1)),
                other => panic!("message not sent: {other:?}"),
            }
        }
        self.wires.push(wire);
    }

    /// Progresses for `span`, recording busy refusals.
    fn progress_for(&mut self, span: Duration) {
        let until = Instant::now() + span;
        let mut out = Vec::new();
        while Instant::now() < until {
            self.fabric.poll_completions(&mut out, 64);
            for completion in out.drain(..) {
                if let Completion::Done(context, _, tag, _) = completion {
                    if self.busy_receives.contains_key(&(context as usize)) {
                        assert_eq!(reply_outcome(tag), Err(RdmaError::backend(BUSY_TEXT)));
                        self.busy.push(tag & REQUEST_ID_MASK);
                    }
                }
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

impl Drop for RawConsumer {
    fn drop(&mut self) {
        // The endpoint first: then nothing the provider holds points
        // into the contexts or the request bytes.
        self.fabric.close_endpoint();
    }
}

/// An owner over tcp whose consumers may each have 4 replies unfinished,
/// serving a 1 MiB source of 7s, and a raw consumer connected to it.
struct BoundedOwner {
    rt: tokio::runtime::Runtime,
    owner: OfiEngine,
    backend: crate::OfiBackend,
    /// Reached only through its raw pointer (`source_addr`) while
    /// registered; the test frees it only once its registration is gone
    /// (its unmap returned `Ok`, or the owner's teardown ended it).
    source: *mut [u8],
    source_addr: usize,
    len: usize,
    region: rdmareg_core::BackendRegion,
    key: PackedKey,
    raw: RawConsumer,
}

impl BoundedOwner {
    fn new() -> BoundedOwner {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let config = OfiConfig::new(Provider::Tcp)
            .with_domain("lo")
            .with_teardown_timeout(Duration::from_secs(2))
            .with_max_served_replies_per_peer(4);
        let owner = OfiEngine::start(config.clone()).expect("owner starts");
        let backend = owner.backend();
        let len = 1usize << 20;
        let source = Box::into_raw(vec![7u8; len].into_boxed_slice());
        let source_addr = source as *mut u8 as usize;
        // SAFETY: the range is this test's own allocation, no reference
        // aliases it while it is registered (only `source_addr` names it),
        // and the tests free it only once its registration is gone.
        let region = rt
            .block_on(unsafe { backend.map(source_addr, len) })
            .expect("maps");
        let key = PackedKey::decode(&region.packed_key).expect("its own key");
        let raw = RawConsumer::new(&config, &owner.fabric_address());
        BoundedOwner {
            rt,
            owner,
            backend,
            source,
            source_addr,
            len,
            region,
            key,
            raw,
        }
    }
}

/// A consumer that sends an owner (reply bound 4) eight lists whose
/// 32 KiB replies it never receives gets four of them held and the other
/// four refused as busy: list replies are bounded per consumer as single
/// replies are, and hold no lease (the source's unmap returns while they
/// are held).
#[test]
fn unreceived_list_replies_are_bounded_and_hold_no_lease() {
    let BoundedOwner {
        rt,
        owner,
        backend,
        source,
        source_addr,
        len: _,
        region,
        key,
        mut raw,
    } = BoundedOwner::new();
    for id in 1..=8 {
        raw.ask_list(&key, source_addr as u64, 16 << 10, 2, id);
    }
    raw.progress_for(Duration::from_secs(2));
    let busy = raw.busy.len();
    let unmapped = rt.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(5),
            backend.unmap(region.backend_region_id),
        )
        .await
    });
    if matches!(unmapped, Ok(Ok(()))) {
        // SAFETY: made by Box::into_raw above; its registration is gone.
        drop(unsafe { Box::from_raw(source) });
    }
    drop(raw);
    owner.shutdown_blocking();
    assert_eq!(busy, 4, "busy refusals of the eight lists");
    assert!(
        matches!(unmapped, Ok(Ok(()))),
        "the unmap returned while list replies were held: {unmapped:?}"
    );
    assert_eq!(owner.live_registrations(), 0);
}

/// A bare endpoint posing as an owner: it takes one request and
/// replies with bytes of its choosing.
struct RawOwner {
    fabric: Fabric,
    request: Box<[u8; RECEIVE_MAX]>,
    /// Receive and send contexts, kept until the endpoint is closed.
    #[allow(clippy::vec_box)]
    contexts: Vec<Box<OpContext>>,
    /// Reply bytes, kept until the endpoint is closed.
    replies: Vec<Vec<u8>>,
}

impl RawOwner {
    fn new(config: &OfiConfig) -> RawOwner {
        let mut owner = RawOwner {
            fabric: Fabric::open(config).expect("raw endpoint"),
            request: Box::new([0u8; RECEIVE_MAX]),
            contexts: Vec::new(),
            replies: Vec::new(),
        };
        let context = owner.context();
        let data = owner.request.as_mut_ptr() as usize;
        // SAFETY: the buffer and the context live in `self` until the
        // fabric (and its endpoint) is closed in `drop`.
        let posted = unsafe {
            owner.fabric.trecv(
                data,
                RECEIVE_MAX,
                std::ptr::null_mut(),
                ADDR_UNSPEC,
                REQUEST_TAG,
                0,
                context,
            )
        };
        assert_eq!(posted.ok(), Some(true), "request receive posted");
        owner
    }

    fn context(&mut self) -> *mut c_void {
        let mut context = Box::new(OpContext {
            space: [std::ptr::null_mut(); 8],
        });
        let at = (&raw mut context.space).cast::<c_void>();
        self.contexts.push(context);
        at
    }

    /// Waits up to five seconds for a list request.
    fn take_list(&mut self) -> ListRequest {
        let until = Instant::now() + Duration::from_secs(5);
        let mut out = Vec::new();
        while Instant::now() < until {
            self.fabric.poll_completions(&mut out, 16);
            for completion in out.drain(..) {
                if let Completion::Done(_, len, REQUEST_TAG, _) = completion {
                    return ListRequest::decode(&self.request[..len]).expect("a list request");
                }
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        panic!("no list request arrived");
    }

    /// Sends `reply` with tag `tag` to `to` and progresses a while.
    fn reply(&mut self, to: u64, tag: u64, reply: Vec<u8>) {
        let context = self.context();
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            // SAFETY: the bytes and the context live in `self` until
            // the fabric is closed.
            let sent = unsafe {
                self.fabric.tsend(
                    reply.as_ptr() as usize,
                    reply.len(),
                    std::ptr::null_mut(),
                    to,
                    tag,
                    context,
                )
            };
            match sent {
                Ok(true) => break,
                Ok(false) if Instant::now() < until => {
                    let mut out = Vec::new();
                    self.fabric.poll_completions(&mut out, 16);
                }
                other => panic!("reply not sent: {other:?}"),
            }
        }
        self.replies.push(reply);
        let mut out = Vec::new();
        let until = Instant::now() + Duration::from_millis(300);
        while Instant::now() < until {
            self.fabric.poll_completions(&mut out, 16);
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

impl Drop for RawOwner {
    fn drop(&mut self) {
        self.fabric.close_endpoint();
    }
}

/// A hostile owner replies to a list with a reply whose length fits the
/// consumer's receive but not what its statuses and the asked lengths add
/// up to (it says entry 1 is refused, yet sends its bytes): every entry
/// fails with a typed error and no byte is written.
#[test]
fn a_list_reply_that_does_not_add_up_writes_nothing() {
    for provider in [Provider::Tcp, Provider::Shm] {
        // A worker thread runs the batch while this thread plays the owner.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let mut config = OfiConfig::new(provider.clone());
        if provider == Provider::Tcp {
            config = config.with_domain("lo");
        }
        let mut raw = RawOwner::new(&config);
        let consumer = OfiEngine::start(config).expect("consumer starts");
        consumer
            .add_peer(PeerId(1), raw.fabric.address.clone())
            .expect("the raw owner's address");
        let key = crate::adversarial_peers::raw_owner_key(raw.fabric.address.clone(), 4096);
        let backend = consumer.backend();
        let mut dst = vec![0u8; 3 * 64];
        // SAFETY: `dst` outlives its registration (unmapped below, or
        // the engine shut down) and is read only after the batch
        // completed.
        let region = rt
            .block_on(unsafe { backend.map(dst.as_mut_ptr() as usize, dst.len()) })
            .expect("maps");
        let requests: Vec<BackendGet> = (0..3u64)
            .map(|i| BackendGet {
                peer: PeerId(1),
                remote_addr: 0x10_0000 + 64 * i,
                packed_key: key.clone(),
                local_region_id: region.backend_region_id,
                local_offset: 64 * i,
                len: 64,
                deadline: Some(Duration::from_secs(10)),
            })
            .collect();
        let batch = rt.spawn({
            let backend = backend.clone();
            // SAFETY: as above: nothing touches `dst` until the batch
            // completed.
            async move { unsafe { backend.get_batch(requests) }.await }
        });
        let list = raw.take_list();
        assert_eq!(list.entries.len(), 3, "{provider:?}: one list of three");
        let to = raw
            .fabric
            .insert_peer(&list.reply_to)
            .expect("the consumer's address");
        let mut reply = vec![0, refusal_code(Refusal::OutOfRange), 0];
        reply.extend(std::iter::repeat_n(0xEE, 3 * 64));
        raw.reply(to, list.request_id, reply);
        let results = rt.block_on(batch).expect("the batch task");
        rt.block_on(backend.unmap(region.backend_region_id))
            .expect("unmaps");
        consumer.shutdown_blocking();
        drop(raw);
        assert_eq!(results.len(), 3);
        for result in &results {
            assert!(
                matches!(result, Err(RdmaError::Backend(text)) if text.contains("does not add up")),
                "{provider:?}: returned {result:?}"
            );
        }
        assert!(dst.iter().all(|&b| b == 0), "{provider:?}: bytes written");
        assert_eq!(consumer.live_registrations(), 0);
    }
}

/// A consumer that asks an owner (bound 4) for eight large reads and
/// never receives their bytes holds four replies open and gets the
/// other four refused as busy. The held replies keep the region's
/// leases, so its unmap waits — on `tcp;ofi_rxm` even after the
/// consumer's endpoint is gone (the provider does not fail those sends)
/// — and returns `Ok` once the owner's teardown ended them.
#[test]
fn a_consumer_that_never_receives_holds_at_most_the_bound_and_is_refused_busy_past_it() {
    let BoundedOwner {
        rt,
        owner,
        backend,
        source,
        source_addr,
        len,
        region,
        key,
        mut raw,
    } = BoundedOwner::new();
    raw.introduce(100);
    for id in 1..=8 {
        raw.ask(&key, source_addr as u64, len as u64, id);
    }
    raw.progress_for(Duration::from_secs(2));
    let mut busy = raw.busy.clone();
    busy.sort_unstable();
    // The unmap waits for the four leases while the consumer lives.
    let unmap = {
        let backend = backend.clone();
        let id = region.backend_region_id;
        rt.spawn(async move { backend.unmap(id).await })
    };
    raw.progress_for(Duration::from_millis(300));
    let returned_while_held = unmap.is_finished();
    drop(raw);
    std::thread::sleep(Duration::from_secs(2));
    let returned_after_consumer_left = unmap.is_finished();
    owner.shutdown_blocking();
    let unmapped =
        rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), unmap).await });
    let live = owner.live_registrations();
    if matches!(unmapped, Ok(Ok(Ok(())))) && live == 0 {
        // SAFETY: made by Box::into_raw above; its registration is gone.
        drop(unsafe { Box::from_raw(source) });
    }
    eprintln!(
        "busy {busy:?}; unmap returned while held: {returned_while_held}, \
         2 s after the consumer left: {returned_after_consumer_left}; after teardown: {unmapped:?}"
    );
    assert_eq!(busy.len(), 4, "busy refusals: {busy:?}");
    assert!(
        !returned_while_held,
        "the unmap returned while replies were held"
    );
    assert!(
        matches!(unmapped, Ok(Ok(Ok(())))),
        "the leases ended at teardown: {unmapped:?}"
    );
    assert_eq!(live, 0);
}

/// Notices from a raw peer that break the rules: bytes that are no
/// notice, a message longer than any notice (which the provider truncates
/// into the owner's receive) and a replayed number are dropped and
/// counted; the well-formed notices around them arrive, in order.
#[test]
fn malformed_oversized_and_replayed_notices_are_counted() {
    use futures::StreamExt;
    use rdmareg_backend::notices::wire;

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let config = OfiConfig::new(Provider::Tcp)
        .with_domain("lo")
        .with_teardown_timeout(Duration::from_secs(2));
    let owner = OfiEngine::start(config.clone()).expect("owner starts");
    let backend = owner.backend();
    let mut notices = backend.notices().expect("notices");
    let mut raw = RawConsumer::new(&config, &owner.fabric_address());
    let notice = |sequence, bytes: &[u8]| wire::encode(7, sequence, bytes).unwrap();
    let mut oversized = notice(2, &[1; 4096]);
    oversized.extend_from_slice(&[0; 1000]);
    raw.send_tagged(NOTICE_TAG, notice(1, b"first"));
    raw.send_tagged(NOTICE_TAG, vec![1, 2, 3]);
    raw.send_tagged(NOTICE_TAG, notice(1, b"replayed"));
    raw.send_tagged(NOTICE_TAG, notice(3, b"second"));
    raw.send_tagged(NOTICE_TAG, oversized);
    let mut got = Vec::new();
    let until = Instant::now() + Duration::from_secs(5);
    while got.len() < 2 && Instant::now() < until {
        raw.progress_for(Duration::from_millis(5));
        let next = rt.block_on(async {
            tokio::time::timeout(Duration::from_millis(5), notices.next()).await
        });
        if let Ok(Some(notice)) = next {
            got.push(notice.bytes);
        }
    }
    let until = Instant::now() + Duration::from_secs(5);
    while backend.notice_drops().expect("counted").malformed < 2 && Instant::now() < until {
        raw.progress_for(Duration::from_millis(5));
    }
    let drops = backend.notice_drops().expect("counted");
    drop(raw);
    owner.shutdown_blocking();
    assert_eq!(got, [&b"first"[..], &b"second"[..]]);
    assert_eq!((drops.malformed, drops.replayed), (2, 1), "{drops:?}");
}

/// Releases from a raw peer that break the rules end no lease: a forged
/// capability (the lease's with one bit flipped, or the registration's
/// own), the lease's capability under another region, a release cut
/// short, and a reader's release replayed; none reaches the notice stream.
/// A two-reader lease stays live through all of them and one honest
/// release, and ends at a second reader's.
#[test]
fn a_release_with_a_forged_capability_ends_no_lease() {
    use futures::{FutureExt, StreamExt};
    use rdmareg_backend::notices::wire;
    use rdmareg_core::{LeaseEnd, LeaseTerms};

    for provider in [Provider::Tcp, Provider::Shm] {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut config =
            OfiConfig::new(provider.clone()).with_teardown_timeout(Duration::from_secs(2));
        if provider == Provider::Tcp {
            config = config.with_domain("lo");
        }
        let owner = OfiEngine::start(config.clone()).expect("owner starts");
        let backend = owner.backend();
        let mut notices = backend.notices().expect("notices");
        let source = Box::into_raw(vec![5u8; 4096].into_boxed_slice());
        // SAFETY: the range is this test's own allocation, no reference
        // aliases it while it is registered (only its address is used),
        // and it is freed only once its registration is gone.
        let region = rt
            .block_on(unsafe { backend.map(source as *mut u8 as usize, 4096) })
            .expect("maps");
        let terms = LeaseTerms {
            readers: 2,
            expires_at: Instant::now() + Duration::from_secs(60),
        };
        let mut lease = rt
            .block_on(backend.lease(region.backend_region_id, terms))
            .expect("a lease");
        let key = PackedKey::decode_lease(&lease.packed_key).expect("a lease key");
        let own = PackedKey::decode(&region.packed_key).expect("the region's key");
        let mut flipped = key.capability;
        flipped[15] ^= 1;
        let mut raw = RawConsumer::new(&config, &owner.fabric_address());
        let release = |sender, sequence, region, capability: &[u8; CAPABILITY_LEN]| {
            wire::encode_release(sender, sequence, region, capability)
        };
        raw.send_tagged(NOTICE_TAG, release(7, 1, key.region_id, &flipped));
        raw.send_tagged(NOTICE_TAG, release(7, 2, key.region_id, &own.capability));
        raw.send_tagged(
            NOTICE_TAG,
            release(7, 3, key.region_id + 1, &key.capability),
        );
        let mut cut = release(7, 4, key.region_id, &key.capability);
        cut.pop();
        raw.send_tagged(NOTICE_TAG, cut);
        // One honest reader, twice: it counts once.
        raw.send_tagged(NOTICE_TAG, release(8, 1, key.region_id, &key.capability));
        raw.send_tagged(NOTICE_TAG, release(8, 2, key.region_id, &key.capability));
        // A notice after them: once it arrived, the owner handled them all
        // (one connection, handled in order).
        raw.send_tagged(NOTICE_TAG, wire::encode(8, 3, b"after").unwrap());
        let mut got = Vec::new();
        let until = Instant::now() + Duration::from_secs(5);
        while got.is_empty() && Instant::now() < until {
            raw.progress_for(Duration::from_millis(5));
            let next = rt.block_on(async {
                tokio::time::timeout(Duration::from_millis(5), notices.next()).await
            });
            if let Ok(Some(notice)) = next {
                got.push(notice.bytes);
            }
        }
        let live_after_forgeries = (&mut lease.released).now_or_never().is_none();
        raw.send_tagged(NOTICE_TAG, release(9, 1, key.region_id, &key.capability));
        let mut ended = None;
        let until = Instant::now() + Duration::from_secs(5);
        while ended.is_none() && Instant::now() < until {
            raw.progress_for(Duration::from_millis(5));
            ended = rt.block_on(async {
                tokio::time::timeout(Duration::from_millis(5), &mut lease.released)
                    .await
                    .ok()
            });
        }
        let unmapped = rt.block_on(backend.unmap(region.backend_region_id));
        if unmapped.is_ok() {
            // SAFETY: made by Box::into_raw above; its registration is gone.
            drop(unsafe { Box::from_raw(source) });
        }
        drop(raw);
        owner.shutdown_blocking();
        assert_eq!(
            got,
            [&b"after"[..]],
            "{provider:?}: only the notice arrived"
        );
        assert!(
            live_after_forgeries,
            "{provider:?}: forged, cut and replayed releases ended the lease"
        );
        assert_eq!(
            ended,
            Some(LeaseEnd::Released),
            "{provider:?}: the second reader's release"
        );
        assert_eq!(unmapped, Ok(()));
        assert_eq!(owner.live_registrations(), 0);
    }
}
