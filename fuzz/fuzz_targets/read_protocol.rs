//! Fuzzes the owner-served read protocol's decoders on arbitrary bytes: the
//! key a consumer presents (either lane), the request an owner receives, and
//! the reply a consumer receives, single and gathered (lists). All of them
//! come from peers.
//!
//! Properties for every input:
//!
//! * no decoder panics;
//! * whatever a decoder accepts re-encodes to exactly the input, so nothing
//!   a peer sends is silently ignored or reinterpreted;
//! * the one exception is a lane-1 key (the same-host key of earlier
//!   releases), which decodes on purpose to the served key it starts with:
//!   its first 28 bytes, lane byte aside, must re-encode exactly, and only
//!   its tail (mapped range and UCX key, unused when reading through the
//!   owner) is dropped;
//! * a lease key (lane 3) also decodes to a served key, read through the
//!   owner: it re-encodes exactly as a lease key.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmareg_ucx::read_list::{ListReply, ListRequest};
use rdmareg_ucx::read_protocol::{ReadKey, ReadReply, ReadRequest, ServedKey};

/// The lane byte of the same-host key of earlier releases.
const LANE_ONE: u8 = 1;

/// The lane byte of a lease key.
const LANE_LEASE: u8 = 3;

fuzz_target!(|bytes: &[u8]| {
    if let Ok(key) = ServedKey::decode(bytes) {
        assert_eq!(&key.encode()[..], bytes, "an accepted key re-encodes to itself");
    }
    match ReadKey::decode(bytes) {
        Ok(ReadKey::Served(key)) if bytes.get(3) == Some(&LANE_ONE) => {
            let encoded = key.encode();
            assert_eq!(encoded[..3], bytes[..3], "a lane-1 key keeps its magic and version");
            assert_eq!(encoded[4..], bytes[4..28], "a lane-1 key keeps its served part");
        }
        Ok(ReadKey::Served(key)) if bytes.get(3) == Some(&LANE_LEASE) => {
            assert_eq!(&key.encode_lease()[..], bytes, "an accepted lease key re-encodes to itself");
            assert_eq!(ServedKey::decode_lease(bytes), Ok(key));
        }
        Ok(ReadKey::Served(key)) => {
            assert_eq!(&key.encode()[..], bytes, "an accepted served key re-encodes to itself");
        }
        Ok(ReadKey::SameHost(key)) => {
            let encoded = key.encode().expect("an accepted same-host key encodes");
            assert_eq!(&encoded[..], bytes, "an accepted same-host key re-encodes to itself");
        }
        Ok(_) | Err(_) => {}
    }
    if let Ok(request) = ReadRequest::decode(bytes) {
        assert_eq!(&request.encode()[..], bytes, "an accepted request re-encodes to itself");
    }
    if let Ok(reply) = ReadReply::decode(bytes) {
        assert_eq!(&reply.encode()[..], bytes, "an accepted reply re-encodes to itself");
    }
    if let Ok(list) = ListRequest::decode(bytes) {
        let encoded = list.encode().expect("an accepted list request encodes");
        assert_eq!(&encoded[..], bytes, "an accepted list request re-encodes to itself");
    }
    if let Ok(list) = ListReply::decode(bytes) {
        let encoded = list.encode().expect("an accepted list reply encodes");
        assert_eq!(&encoded[..], bytes, "an accepted list reply re-encodes to itself");
    }
});
