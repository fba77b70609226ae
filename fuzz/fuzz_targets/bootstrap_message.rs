//! Fuzzes the decoders of offer frames: the facade's `rdmareg::Offer::decode`
//! and the CLI's bootstrap `Message::decode` built on it, on arbitrary frame
//! bodies.
//!
//! The CLI's module lives in the `rdmareg` binary crate, which cannot be
//! depended on, so it is compiled into this target from its source file.
//!
//! A decoded offer must survive a round trip byte for byte: its encoding has
//! no optional parts and the decoder refuses trailing bytes, so the body it
//! encodes to is the input. A decoded CLI message must too, up to `Done`,
//! which reads any non-zero byte as `true` and writes `1`: its encoding
//! carries a length prefix equal to the body length, the body is as long as
//! the input, and decoding it again gives the same message.

#![no_main]

#[allow(dead_code)] // the async send/receive half is not fuzzed here
#[path = "../../crates/rdmareg-cli/src/bootstrap.rs"]
mod bootstrap;

use bootstrap::Message;
use libfuzzer_sys::fuzz_target;
use rdmareg::Offer;

fn prefix(frame: &[u8]) -> (usize, &[u8]) {
    let (prefix, body) = frame.split_at(4);
    let declared = u32::from_le_bytes(prefix.try_into().expect("4-byte prefix"));
    assert_eq!(declared as usize, body.len(), "length prefix is wrong");
    (declared as usize, body)
}

fuzz_target!(|body: &[u8]| {
    if let Ok(offer) = Offer::decode(body) {
        let frame = offer.encode().expect("a decoded offer encodes");
        let (_, encoded_body) = prefix(&frame);
        assert_eq!(encoded_body, body, "an offer's round trip changed its bytes");
    }
    let Ok(message) = Message::decode(body) else {
        return;
    };
    let frame = message.encode().expect("a decoded message encodes");
    let (_, encoded_body) = prefix(&frame);
    assert_eq!(
        encoded_body.len(),
        body.len(),
        "re-encoding changed the size"
    );
    let again = Message::decode(encoded_body).expect("re-encoded message decodes");
    assert_eq!(again, message, "round trip changed the message");
});
