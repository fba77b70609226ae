//! Peer fabric addresses are untrusted bytes: checked against the
//! provider's address format before they reach the address vector.

use crate::common;

use bytes::Bytes;
use rdmareg_core::{PeerId, RdmaError};
use rdmareg_ofi::{OfiEngine, Provider};

fn refuses(engine: &OfiEngine, address: &[u8]) -> bool {
    matches!(
        engine.add_peer(PeerId(9), Bytes::copy_from_slice(address)),
        Err(RdmaError::InvalidWorkerAddress(_))
    )
}

#[test]
fn tcp_engines_refuse_addresses_that_are_not_ipv4_socket_addresses() {
    common::init_tracing();
    let engine = OfiEngine::start(common::config(Provider::Tcp)).unwrap();
    let good = engine.fabric_address();
    assert_eq!(good.len(), 16, "tcp on lo speaks sockaddr_in");
    assert!(refuses(&engine, b""));
    assert!(refuses(&engine, &good[..15]));
    assert!(refuses(&engine, &[good.as_ref(), &[0]].concat()));
    assert!(refuses(&engine, &[0xFFu8; 16]), "wrong address family");
    assert!(refuses(&engine, &[7u8; 300]));
    assert_eq!(engine.add_peer(PeerId(1), good), Ok(()));
    engine.shutdown_blocking();
}

#[test]
fn shm_engines_refuse_addresses_that_are_not_printable_strings() {
    common::init_tracing();
    let engine = OfiEngine::start(common::config(Provider::Shm)).unwrap();
    let good = engine.fabric_address();
    assert!(refuses(&engine, b"\0"));
    assert!(refuses(&engine, b"fi_shm://\x01\x02"));
    assert!(refuses(&engine, b"fi_shm://1\0junk"));
    assert!(refuses(&engine, &[b'a'; 300]));
    assert_eq!(engine.add_peer(PeerId(1), good), Ok(()));
    engine.shutdown_blocking();
}
