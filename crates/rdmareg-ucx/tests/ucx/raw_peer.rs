//! A hostile peer speaking raw UCX cannot write or read an owner's memory.
//!
//! The peer builds its own context *with* `UCP_FEATURE_RMA`, creates an
//! endpoint to the worker address the engine hands out, unpacks a
//! well-formed UCX key, and sends an emulated PUT and an emulated GET aimed
//! at a registered region and at memory the owner never registered. A worker
//! with RMA would serve both from whatever address the header names; the
//! engine's worker has no RMA, so UCX installed no handler for them and they
//! are dropped. The owner's bytes stay as they were, nothing of the owner
//! comes back, and the owner keeps serving its real consumer.
//!
//! An engine with the same-host direct-read lane exposes a second address,
//! of a context that does have RMA. It is attacked too: a peer without a
//! shared-memory transport cannot even create an endpoint to it, and a
//! same-host peer's emulated PUT and GET over shared-memory messaging are
//! never executed, because the engine never progresses the worker behind
//! that address. (A same-user peer with its own cma lane writes with
//! `process_vm_writev`, which the kernel grants whatever a library does.)

use crate::common;

use std::ffi::c_void;
use std::ptr;
use std::time::{Duration, Instant};

use common::attacked_memory::AttackedMemory;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_ucx::{EngineAddress, Transport};
use ucx_sys as sys;

/// How long the peer waits for an operation the owner should never answer.
const PATIENCE: Duration = Duration::from_millis(400);

/// A bare UCP context, worker and endpoint, driven from the test thread.
struct RawPeer {
    context: sys::ucp_context_h,
    worker: sys::ucp_worker_h,
    ep: sys::ucp_ep_h,
    rkey: sys::ucp_rkey_h,
    /// Whether the endpoint has peer error handling (and may be
    /// force-closed).
    error_handling: bool,
}

fn is_err(ptr: sys::ucs_status_ptr_t) -> bool {
    (ptr as usize) >= (sys::UCS_ERR_LAST as isize as usize)
}

impl RawPeer {
    /// Connects to `address` over `tls` with RMA enabled; shared-memory
    /// lanes refuse peer error handling, so it is on only with tcp. `Err`
    /// carries UCX's status when no endpoint can be created.
    fn connect(tls: &str, address: &[u8]) -> Result<RawPeer, sys::ucs_status_t> {
        let error_handling = tls.split(',').any(|t| t == "tcp");
        let (context, worker) =
            raw_context_and_worker(tls, sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_AM);
        let ep_params = sys::ucp_ep_params_t {
            field_mask: u64::from(
                sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
            ),
            address: address.as_ptr().cast(),
            err_mode: if error_handling {
                sys::UCP_ERR_HANDLING_MODE_PEER
            } else {
                sys::UCP_ERR_HANDLING_MODE_NONE
            },
            ..Default::default()
        };
        let mut ep: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: live worker; the address is the engine's own, well formed.
        let status = unsafe { sys::ucp_ep_create(worker, &ep_params, &mut ep) };
        if status != sys::UCS_OK {
            // SAFETY: the worker and context made above, released once.
            unsafe {
                sys::ucp_worker_destroy(worker);
                sys::ucp_cleanup(context);
            }
            return Err(status);
        }
        // The key every tcp or shared-memory registration packs to.
        let key = [0u8; 9];
        let mut rkey: sys::ucp_rkey_h = ptr::null_mut();
        // SAFETY: live endpoint; a well-formed 9-byte key.
        let status = unsafe { sys::ucp_ep_rkey_unpack(ep, key.as_ptr().cast(), &mut rkey) };
        assert_eq!(status, sys::UCS_OK, "raw peer key");
        Ok(RawPeer {
            context,
            worker,
            ep,
            rkey,
            error_handling,
        })
    }

    /// Progresses until `request` completes or [`PATIENCE`] passes; returns
    /// whether it completed (successfully or not).
    fn wait(&self, request: sys::ucs_status_ptr_t) -> bool {
        if request.is_null() || is_err(request) {
            return true;
        }
        let start = Instant::now();
        while start.elapsed() < PATIENCE {
            // SAFETY: live worker on this thread.
            unsafe { sys::ucp_worker_progress(self.worker) };
            // SAFETY: a live request of this worker.
            if unsafe { sys::ucp_request_check_status(request.cast()) } != sys::UCS_INPROGRESS {
                return true;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        false
    }

    /// This peer's packed worker address.
    fn address(&self) -> Vec<u8> {
        let mut address: *mut sys::ucp_address_t = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live worker; out-pointers valid; the buffer is copied and
        // released once.
        unsafe {
            let status = sys::ucp_worker_get_address(self.worker, &mut address, &mut len);
            assert_eq!(status, sys::UCS_OK);
            let bytes = std::slice::from_raw_parts(address.cast::<u8>(), len).to_vec();
            sys::ucp_worker_release_address(self.worker, address);
            bytes
        }
    }

    /// Sends an active message `id` with `header` and `payload`, with the
    /// reply flag, and waits for it to leave.
    fn send_active_message(&self, id: u32, header: &[u8], payload: &[u8]) {
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_COPY_HEADER,
            ..Default::default()
        };
        // SAFETY: live endpoint; header copied; payload outlives the wait.
        let sent = unsafe {
            sys::ucp_am_send_nbx(
                self.ep,
                id,
                header.as_ptr().cast(),
                header.len(),
                payload.as_ptr().cast(),
                payload.len(),
                &param,
            )
        };
        self.wait(sent);
    }

    /// Progresses the worker for `time`.
    fn progress_for(&self, time: Duration) {
        let start = Instant::now();
        while start.elapsed() < time {
            // SAFETY: live worker on this thread.
            unsafe { sys::ucp_worker_progress(self.worker) };
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Emulated PUT of `bytes` to `remote` followed by a flush.
    fn put(&self, remote: u64, bytes: &[u8]) {
        let param = sys::ucp_request_param_t::default();
        // SAFETY: live endpoint and key; `bytes` outlives the wait below
        // (and the endpoint is force-closed before it goes).
        let put = unsafe {
            sys::ucp_put_nbx(
                self.ep,
                bytes.as_ptr().cast(),
                bytes.len(),
                remote,
                self.rkey,
                &param,
            )
        };
        self.wait(put);
        // SAFETY: live endpoint.
        let flush = unsafe { sys::ucp_ep_flush_nbx(self.ep, &param) };
        self.wait(flush);
    }

    /// Emulated GET of `len` bytes at `remote` into a zeroed buffer.
    fn get(&self, remote: u64, into: &mut [u8]) {
        let param = sys::ucp_request_param_t::default();
        // SAFETY: live endpoint and key; `into` outlives the peer's endpoint
        // (the caller drops the peer first).
        let get = unsafe {
            sys::ucp_get_nbx(
                self.ep,
                into.as_mut_ptr().cast::<c_void>(),
                into.len(),
                remote,
                self.rkey,
                &param,
            )
        };
        self.wait(get);
    }
}

impl Drop for RawPeer {
    fn drop(&mut self) {
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        };
        // SAFETY: live key and endpoint, each released once; the forced
        // close cancels the requests the owner never answered. Without
        // error handling a forced close is not allowed: the worker's
        // destruction then takes the endpoint and its requests down.
        unsafe {
            sys::ucp_rkey_destroy(self.rkey);
            if !self.error_handling {
                sys::ucp_worker_destroy(self.worker);
                sys::ucp_cleanup(self.context);
                return;
            }
            let close = sys::ucp_ep_close_nbx(self.ep, &param);
            if !close.is_null() && !is_err(close) {
                while sys::ucp_request_check_status(close.cast()) == sys::UCS_INPROGRESS {
                    sys::ucp_worker_progress(self.worker);
                }
                sys::ucp_request_free(close.cast());
            }
            sys::ucp_worker_destroy(self.worker);
            sys::ucp_cleanup(self.context);
        }
    }
}

/// Runs the attack against an engine of `transport` from a peer on `tls`.
async fn attack(transport: Transport, tls: &str) {
    let (owner, consumer) = engines(transport.clone());
    let memory = AttackedMemory::map_on(&owner, 4096).await;

    let exposed = EngineAddress::decode(&owner.worker_address()).expect("an engine address");
    let direct_lane_expected = !matches!(transport, Transport::Tcp);
    assert_eq!(
        exposed.direct.is_some(),
        direct_lane_expected,
        "direct-read lane of a {transport:?} engine"
    );
    let targets = [
        ("serving", Some(exposed.serving)),
        ("direct", exposed.direct),
    ];
    let shared_memory_peer = tls.split(',').any(|t| t == "posix" || t == "sysv");
    for (which, address) in targets {
        let Some(address) = address else { continue };
        let tls_owned = tls.to_owned();
        let (registered_addr, unregistered_addr) = (
            memory.registered.addr() as u64,
            memory.unregistered.addr() as u64,
        );
        let stolen = tokio::task::spawn_blocking(move || {
            let peer = RawPeer::connect(&tls_owned, &address).ok()?;
            let evil = vec![0xEEu8; 4096];
            peer.put(registered_addr, &evil);
            peer.put(unregistered_addr, &evil);
            let mut from_registered = vec![0u8; 4096];
            let mut from_unregistered = vec![0u8; 4096];
            peer.get(registered_addr, &mut from_registered);
            peer.get(unregistered_addr, &mut from_unregistered);
            drop(peer);
            Some((from_registered, from_unregistered))
        })
        .await
        .expect("the raw peer ran");

        match (which, &stolen) {
            ("serving", reached) => assert_eq!(
                reached.is_some(),
                tls.split(',').any(|t| t == "tcp")
                    || matches!(
                        transport,
                        Transport::SharedMemoryNoErrorHandling | Transport::Auto
                    ),
                "a raw {tls} peer reaching the serving address of a {transport:?} owner"
            ),
            ("direct", None) => assert!(
                !shared_memory_peer,
                "a same-host shared-memory peer should reach the direct address (and be ignored)"
            ),
            ("direct", Some(_)) => assert!(
                shared_memory_peer,
                "a raw {tls} peer reached the direct-read address of a {transport:?} owner"
            ),
            _ => {}
        }
        if let Some(stolen) = stolen {
            assert!(
                stolen.0.iter().all(|&b| b == 0) && stolen.1.iter().all(|&b| b == 0),
                "a raw GET to the {which} address returned owner bytes over {transport:?} from {tls}"
            );
        }
        assert!(
            memory.registered.snapshot() == memory.want,
            "a raw PUT to the {which} address changed a registered region over {transport:?} from {tls}"
        );
        assert!(
            memory.unregistered.snapshot() == memory.want,
            "a raw PUT to the {which} address changed unregistered memory over {transport:?} from {tls}"
        );
    }

    // The owner still serves its real consumer.
    memory
        .assert_owner_still_serves_then_shut_down(owner, consumer, &transport)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_tcp_peer_can_neither_write_nor_read_a_tcp_owner() {
    attack(Transport::Tcp, "tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_tcp_peer_can_neither_write_nor_read_a_same_host_owner() {
    attack(Transport::SameHost, "tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_tcp_peer_can_neither_write_nor_read_an_auto_owner() {
    attack(Transport::Auto, "tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_shared_memory_peer_can_neither_write_nor_read_a_shared_memory_owner() {
    // The peer's own cma lane would write with process_vm_writev, which the
    // kernel grants any process of the same user whatever a library does;
    // what is tested here is the emulated path over shared-memory messaging.
    attack(Transport::SharedMemoryNoErrorHandling, "posix,sysv").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_shared_memory_peer_can_neither_write_nor_read_an_auto_owner() {
    attack(Transport::Auto, "posix,sysv").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_shared_memory_peer_can_neither_write_nor_read_a_same_host_owner() {
    // As above: the emulated path over shared-memory messaging, aimed at
    // both addresses of an engine with the direct-read lane.
    attack(Transport::SameHost, "posix,sysv").await;
}

/// A peer the consumer also reads from cannot answer a read the consumer
/// sent to *another* owner: request ids are a counter a peer can guess, so
/// the consumer accepts a reply only on the endpoint its request went out
/// on. Owner A here is silent (it never answers); peer B sends replies for
/// the first request ids with its own bytes. The read must time out with
/// its destination untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_from_another_peer_never_lands_in_a_read() {
    use rdmareg_core::{BackendGet, PeerId, RdmaError};
    use rdmareg_ucx::read_protocol::{READ_REPLY_AM_ID, ReadReply, ReplyStatus, ServedKey};

    init_tracing();
    let consumer = rdmareg_ucx::UcxEngine::start(config(Transport::Tcp)).expect("consumer");
    let cb = consumer.backend();
    let address = consumer.worker_address();
    // Raw UCX handles stay on the thread that made them.
    let (addresses_tx, addresses) = std::sync::mpsc::channel();
    let (go, go_rx) = std::sync::mpsc::channel::<()>();
    let (stop, stop_rx) = std::sync::mpsc::channel::<()>();
    let peers = std::thread::spawn(move || {
        let silent_owner = RawPeer::connect("tcp", &address).expect("raw peer endpoint");
        let forger = RawPeer::connect("tcp", &address).expect("raw peer endpoint");
        addresses_tx
            .send((silent_owner.address(), forger.address()))
            .unwrap();
        // Both peers progress all along: the silent owner completes its
        // wireup but has no handler for read requests, so it never answers.
        let progress_both = |time: Duration| {
            let start = Instant::now();
            while start.elapsed() < time {
                silent_owner.progress_for(Duration::from_millis(1));
                forger.progress_for(Duration::from_millis(1));
            }
        };
        while go_rx.try_recv().is_err() {
            progress_both(Duration::from_millis(5));
        }
        // Let the request go out, then answer every id it could have.
        progress_both(Duration::from_millis(200));
        let evil = vec![0xEEu8; 4096];
        for request_id in 1..=16 {
            let reply = ReadReply {
                request_id,
                status: ReplyStatus::Served,
                length: 4096,
            };
            forger.send_active_message(READ_REPLY_AM_ID, &reply.encode(), &evil);
        }
        while stop_rx.try_recv().is_err() {
            progress_both(Duration::from_millis(5));
        }
    });
    let (owner_address, forger_address) = addresses.recv().expect("raw peers started");
    consumer
        .add_peer(PeerId(1), bytes::Bytes::from(owner_address))
        .expect("owner A");
    consumer
        .add_peer(PeerId(2), bytes::Bytes::from(forger_address))
        .expect("peer B");
    let dst = PageBuf::zeroed(4096);
    let dst_region = map(&cb, &dst).await;
    let key = ServedKey {
        region_id: 1,
        capability: [1; 16],
    };
    let request = BackendGet {
        peer: PeerId(1),
        remote_addr: 0x10_000,
        packed_key: bytes::Bytes::copy_from_slice(&key.encode()),
        local_region_id: dst_region.backend_region_id,
        local_offset: 0,
        len: 4096,
        deadline: Some(Duration::from_millis(1500)),
    };
    let read = tokio::spawn({
        let cb = cb.clone();
        async move { cb.get_into_test_memory(request).await }
    });
    go.send(()).unwrap();
    let outcome = read.await.expect("the read task");
    stop.send(()).unwrap();
    tokio::task::spawn_blocking(move || peers.join())
        .await
        .expect("join")
        .expect("the raw peers ran");
    assert_eq!(
        outcome,
        Err(RdmaError::Timeout),
        "a forged reply finished the read"
    );
    assert!(
        dst.snapshot().iter().all(|&b| b == 0),
        "forged bytes landed in the destination"
    );
    assert_eq!(cb.unmap(dst_region.backend_region_id).await, Ok(()));
    consumer.shutdown().await;
}
