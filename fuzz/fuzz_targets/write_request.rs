//! Fuzzes the decoders of a served write's request, which an owner receives
//! from any writer: the engine kit's write request header (the UCX
//! engine's), and the libfabric engine's write message (header, reply
//! address and the bytes to write, in one message).
//!
//! For every input:
//!
//! * no decoder panics;
//! * a header the kit accepts re-encodes to exactly the input;
//! * a libfabric message that decodes re-encodes, with the payload it
//!   split off, to exactly the input, and that payload is the message's
//!   tail.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmareg_engine::served::wire;
use rdmareg_ofi::protocol::WriteRequest;

fuzz_target!(|bytes: &[u8]| {
    if let Ok(write) = wire::decode_write_request(bytes) {
        assert_eq!(
            &wire::encode_write_request(&write)[..],
            bytes,
            "an accepted header re-encodes to itself"
        );
    }
    if let Some((request, payload)) = WriteRequest::decode(bytes) {
        assert!(bytes.ends_with(payload), "the payload is the message's tail");
        assert_eq!(
            request.encode_with(payload),
            bytes,
            "an accepted message re-encodes to itself"
        );
    }
});
