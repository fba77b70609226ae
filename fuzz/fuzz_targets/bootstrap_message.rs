//! Fuzzes the decoder of the CLI's bootstrap frames, `Message::decode`, on
//! arbitrary frame bodies.
//!
//! The module lives in the `rdmareg` binary crate, which cannot be depended
//! on, so it is compiled into this target from its source file; it needs only
//! `bytes`, `rdmareg-core`, `thiserror` and `tokio`'s I/O traits.
//!
//! A decoded message must survive a round trip: its encoding carries a length
//! prefix equal to the body length, the body is as long as the input (the
//! decoder refuses trailing bytes and the encoding has no optional parts), and
//! decoding it again gives the same message. The bodies are not compared byte
//! for byte because `Done` reads any non-zero byte as `true` and writes `1`.

#![no_main]

#[allow(dead_code)] // the async send/receive half is not fuzzed here
#[path = "../../crates/rdmareg-cli/src/bootstrap.rs"]
mod bootstrap;

use bootstrap::Message;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|body: &[u8]| {
    let Ok(message) = Message::decode(body) else {
        return;
    };
    let frame = message.encode();
    let (prefix, encoded_body) = frame.split_at(4);
    let declared = u32::from_le_bytes(prefix.try_into().expect("4-byte prefix"));
    assert_eq!(
        declared as usize,
        encoded_body.len(),
        "length prefix is wrong"
    );
    assert_eq!(
        encoded_body.len(),
        body.len(),
        "re-encoding changed the size"
    );
    let again = Message::decode(encoded_body).expect("re-encoded message decodes");
    assert_eq!(again, message, "round trip changed the message");
});
