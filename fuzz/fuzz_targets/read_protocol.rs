//! Fuzzes the owner-served read protocol's decoders on arbitrary bytes: the
//! key a consumer presents, the request an owner receives, and the reply a
//! consumer receives. All three come from peers.
//!
//! Properties for every input:
//!
//! * no decoder panics;
//! * whatever a decoder accepts re-encodes to exactly the input, so nothing
//!   a peer sends is silently ignored or reinterpreted.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmareg_ucx::read_protocol::{ReadReply, ReadRequest, ServedKey};

fuzz_target!(|bytes: &[u8]| {
    if let Ok(key) = ServedKey::decode(bytes) {
        assert_eq!(&key.encode()[..], bytes, "an accepted key re-encodes to itself");
    }
    if let Ok(request) = ReadRequest::decode(bytes) {
        assert_eq!(&request.encode()[..], bytes, "an accepted request re-encodes to itself");
    }
    if let Ok(reply) = ReadReply::decode(bytes) {
        assert_eq!(&reply.encode()[..], bytes, "an accepted reply re-encodes to itself");
    }
});
