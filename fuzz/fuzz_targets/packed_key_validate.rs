//! Fuzzes [`validate_packed_key`] with the UCX 1.22 layout on arbitrary bytes.
//!
//! The oracle is the model of UCX's unpacker shared with the crate's property
//! tests (`crates/rdmareg-ucx/tests/packed_key_model`): it walks a key the
//! way `ucp_ep_rkey_unpack` does, driven only by the bytes, and reports the
//! first read past the key's end. Two properties must hold for every input:
//!
//! * an accepted key is walked entirely inside its bytes, and the walk ends
//!   exactly at its end (UCX reads nothing outside it and leaves nothing
//!   unread);
//! * a key the walk reads exactly and that UCX 1.22's packer could have
//!   written is accepted (the validator refuses no real key).

#![no_main]

#[path = "../../crates/rdmareg-ucx/tests/packed_key_model/mod.rs"]
mod packed_key_model;

use libfuzzer_sys::fuzz_target;
use packed_key_model::{format, is_packer_shaped, model_unpack};
use rdmareg_core::MAX_PACKED_KEY_LEN;
use rdmareg_ucx::packed_key::validate_packed_key;

fuzz_target!(|key: &[u8]| {
    let verdict = validate_packed_key(&format(), key);
    let walk = model_unpack(key);

    if verdict.is_ok() {
        let parse = match &walk {
            Ok(parse) => parse,
            Err(fault) => panic!("accepted key makes UCX read past its end: {fault:?}"),
        };
        assert_eq!(parse.consumed, key.len(), "accepted key has unread bytes");
        assert!(key.len() <= MAX_PACKED_KEY_LEN);
    }

    let packer_shaped = matches!(&walk, Ok(parse) if is_packer_shaped(key, parse));
    if packer_shaped && key.len() <= MAX_PACKED_KEY_LEN {
        assert!(
            verdict.is_ok(),
            "key UCX's packer could write is refused: {verdict:?}"
        );
    }
});
