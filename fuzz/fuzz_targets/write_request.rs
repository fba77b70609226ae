//! Fuzzes the decoders of a served write's request, which an owner receives
//! from any writer: the engine kit's write request header and write list
//! header (the UCX engine's), and the libfabric engine's write message and
//! write list message (header, reply address and the bytes to write, in
//! one message).
//!
//! For every input:
//!
//! * no decoder panics;
//! * a header the kit accepts re-encodes to exactly the input;
//! * a libfabric message that decodes re-encodes, with the payload it
//!   split off, to exactly the input, and that payload is the message's
//!   tail;
//! * an accepted write list has 1 to 64 entries.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmareg_engine::served::wire;
use rdmareg_ofi::protocol::{MAX_LIST_ENTRIES, WriteListRequest, WriteRequest};

fuzz_target!(|bytes: &[u8]| {
    if let Ok(write) = wire::decode_write_request(bytes) {
        assert_eq!(
            &wire::encode_write_request(&write)[..],
            bytes,
            "an accepted header re-encodes to itself"
        );
    }
    if let Ok(writes) = wire::decode_write_list_request(bytes) {
        assert!((1..=wire::MAX_LIST_ENTRIES).contains(&writes.len()));
        assert_eq!(
            wire::encode_write_list_request(&writes).as_deref(),
            Some(bytes),
            "an accepted list header re-encodes to itself"
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
    if let Some((list, payload)) = WriteListRequest::decode(bytes) {
        assert!((1..=MAX_LIST_ENTRIES).contains(&list.entries.len()));
        assert!(bytes.ends_with(payload), "the payload is the list's tail");
        assert_eq!(
            list.encode_with(payload),
            bytes,
            "an accepted list re-encodes to itself"
        );
    }
});
