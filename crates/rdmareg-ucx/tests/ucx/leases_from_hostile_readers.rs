//! Descriptor leases against readers that do not play by the rules: raw
//! peers sending forged, foreign, repeated and malformed releases, and an
//! honest reader whose reads race the lease's expiry. The owner ends a
//! lease only on releases that name it, counts each reader once, and
//! serves no read its request reached the owner with after the expiry.

use crate::common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::raw_am::Raw;
use common::*;
use futures::FutureExt;
use rdmareg_backend::{BackendLease, RdmaBackend};
use rdmareg_core::{LeaseEnd, LeaseTerms, RdmaError};
use rdmareg_engine::notices::wire;
use rdmareg_ucx::Transport;
use rdmareg_ucx::read_protocol::{NOTICE_AM_ID, ServedKey};
use ucx_sys as sys;

/// Sends `message` on `ep` as an engine sends a notice or a release.
fn send(raw: &Raw, ep: sys::ucp_ep_h, message: &[u8]) {
    raw.send_wait(
        ep,
        NOTICE_AM_ID,
        &[],
        message,
        sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_EAGER,
    );
}

/// The release of the lease whose key is `key`, from `sender`.
fn release_of(key: &Bytes, sender: u64, sequence: u64) -> Vec<u8> {
    let lease = ServedKey::decode_lease(key).expect("a lease key");
    wire::encode_release(sender, sequence, lease.region_id, &lease.capability)
}

fn lease(
    rt: &tokio::runtime::Runtime,
    backend: &impl RdmaBackend,
    region: u64,
    readers: u32,
) -> BackendLease {
    let terms = LeaseTerms {
        readers,
        expires_at: Instant::now() + Duration::from_secs(60),
    };
    rt.block_on(backend.lease(region, terms)).expect("a lease")
}

/// Whether `lease` ended within `raw` progressing for `wait`.
fn ended(raw: &Raw, lease: &mut BackendLease, wait: Duration) -> Option<LeaseEnd> {
    let mut end = None;
    raw.progress_until(wait, |_| {
        end = (&mut lease.released).now_or_never();
        end.is_some()
    });
    end
}

/// Releases with a capability changed in one byte, naming another region,
/// of the wrong length, or sent by rendezvous end nothing; the honest
/// release after them ends the lease.
#[test]
fn forged_and_malformed_releases_end_no_lease() {
    let rt = runtime();
    let engine = tcp_engine();
    let backend = engine.backend();
    let buf = PageBuf::filled(8192, pattern);
    let region = rt.block_on(map(&backend, &buf));
    let mut leased = lease(&rt, &*backend, region.backend_region_id, 1);
    let raw = Raw::new(false);
    let ep = raw.connect(&engine.worker_address());
    let honest = release_of(&leased.packed_key, 7, 1);
    let mut forged = honest.clone();
    *forged.last_mut().unwrap() ^= 1;
    let mut other_region = honest.clone();
    other_region[24] ^= 1;
    let mut short = honest.clone();
    short.pop();
    for bad in [&forged, &other_region, &short] {
        send(&raw, ep, bad);
    }
    raw.send_wait(
        ep,
        NOTICE_AM_ID,
        &[],
        &honest,
        sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_RNDV,
    );
    assert_eq!(ended(&raw, &mut leased, Duration::from_millis(300)), None);
    send(&raw, ep, &release_of(&leased.packed_key, 7, 2));
    assert_eq!(
        ended(&raw, &mut leased, Duration::from_secs(5)),
        Some(LeaseEnd::Released)
    );
    drop(raw);
    rt.block_on(backend.unmap(region.backend_region_id))
        .unwrap();
    rt.block_on(engine.shutdown());
}

/// One reader releasing twice, or replaying its release, is one reader;
/// the same sender number from another connection is another reader. A
/// release of one lease leaves another lease of the region live.
#[test]
fn a_reader_counts_once_and_only_for_its_own_lease() {
    let rt = runtime();
    let engine = tcp_engine();
    let backend = engine.backend();
    let buf = PageBuf::filled(8192, pattern);
    let region = rt.block_on(map(&backend, &buf));
    let mut shared = lease(&rt, &*backend, region.backend_region_id, 2);
    let mut theirs = lease(&rt, &*backend, region.backend_region_id, 1);
    let (first, second) = (Raw::new(false), Raw::new(false));
    let first_ep = first.connect(&engine.worker_address());
    let second_ep = second.connect(&engine.worker_address());
    let release = release_of(&shared.packed_key, 7, 1);
    send(&first, first_ep, &release);
    send(&first, first_ep, &release);
    send(&first, first_ep, &release_of(&shared.packed_key, 7, 2));
    assert_eq!(ended(&first, &mut shared, Duration::from_millis(300)), None);
    send(&second, second_ep, &release);
    assert_eq!(
        ended(&second, &mut shared, Duration::from_secs(5)),
        Some(LeaseEnd::Released)
    );
    assert_eq!(
        ended(&first, &mut theirs, Duration::from_millis(200)),
        None,
        "no release named the other lease"
    );
    drop((first, second));
    rt.block_on(backend.unmap(region.backend_region_id))
        .unwrap();
    assert_eq!(
        (&mut theirs.released).now_or_never(),
        Some(LeaseEnd::Withdrawn),
        "the unmap ended it"
    );
    rt.block_on(engine.shutdown());
}

/// An honest reader reads under a short lease again and again while it
/// expires: every read that succeeds lands the owner's bytes, none issued
/// after the expiry succeeds, and once one is refused `LeaseExpired`,
/// every later one is.
#[test]
fn reads_racing_the_expiry_stop_at_it() {
    let rt = runtime();
    let (owner, consumer) = served_engines(Transport::Tcp);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let src = PageBuf::filled(8192, pattern);
    let dst = PageBuf::zeroed(8192);
    let src_region = rt.block_on(map(&ob, &src));
    let dst_region = rt.block_on(map(&cb, &dst));
    let expires_at = Instant::now() + Duration::from_millis(300);
    let terms = LeaseTerms {
        readers: 1,
        expires_at,
    };
    let leased = rt
        .block_on(ob.lease(src_region.backend_region_id, terms))
        .unwrap();
    let leased_descriptor = rdmareg_core::Descriptor::new(
        "ucx",
        src.addr() as u64,
        src.len() as u64,
        1,
        leased.packed_key.clone(),
    )
    .unwrap();
    let (mut served, mut refused) = (0, 0);
    loop {
        dst.fill(0);
        let issued = Instant::now();
        let request = get_request(OWNER, &leased_descriptor, &dst_region, 0, None);
        match rt.block_on(cb.get_into_test_memory(request)) {
            Ok(()) => {
                assert!(refused == 0, "a read served after one was refused");
                assert!(
                    issued < expires_at,
                    "a read issued after the expiry was served"
                );
                assert_eq!(differing_bytes(&dst.snapshot(), &src.snapshot()), 0);
                served += 1;
            }
            Err(RdmaError::LeaseExpired) => {
                assert!(
                    dst.snapshot().iter().all(|&b| b == 0),
                    "a refused read wrote"
                );
                refused += 1;
                if refused == 20 {
                    break;
                }
            }
            Err(other) => panic!("unexpected {other}"),
        }
    }
    assert!(served > 0, "no read was served before the expiry");
    rt.block_on(cb.unmap(dst_region.backend_region_id)).unwrap();
    rt.block_on(ob.unmap(src_region.backend_region_id)).unwrap();
    rt.block_on(consumer.shutdown());
    rt.block_on(owner.shutdown());
}
