//! Fuzzes the owner-served read protocol's decoders on arbitrary bytes: the
//! key a consumer presents (either lane), the request an owner receives, and
//! the reply a consumer receives, single and gathered (lists). All of them
//! come from peers.
//!
//! Properties for every input:
//!
//! * no decoder panics;
//! * whatever a decoder accepts re-encodes to exactly the input, so nothing
//!   a peer sends is silently ignored or reinterpreted.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmareg_ucx::read_list::{ListReply, ListRequest};
use rdmareg_ucx::read_protocol::{ReadKey, ReadReply, ReadRequest, ServedKey};

fuzz_target!(|bytes: &[u8]| {
    if let Ok(key) = ServedKey::decode(bytes) {
        assert_eq!(&key.encode()[..], bytes, "an accepted key re-encodes to itself");
    }
    match ReadKey::decode(bytes) {
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
