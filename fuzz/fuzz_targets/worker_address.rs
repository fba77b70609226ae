//! Fuzzes [`WorkerAddressFormat::validate`] with the UCX 1.22 layout on
//! arbitrary bytes.
//!
//! The oracle is the model of UCX's parser shared with the crate's property
//! tests (`crates/rdmareg-ucx/tests/worker_address_model`): it walks an
//! address the way `ucp_address_unpack` does for `ucp_ep_create`, driven only
//! by the bytes, and reports the first read past the address's end or the
//! assertion UCX would abort on. For every input:
//!
//! * validation returns (never panics);
//! * an accepted address is walked entirely inside its bytes, the walk ends
//!   exactly at its end, and every memory-domain and lane index it yields is
//!   inside the 64-entry tables UCX uses them on;
//! * the padded copy for `ucp_ep_create` exists exactly for accepted
//!   addresses and starts with them;
//! * the engine-address envelope around it never panics, and accepts only
//!   what re-encodes to the input (a bare UCP address passes through as the
//!   serving address), with both inner addresses validated like the above.
//!   The one exception is the envelope's documented loss: a version-1
//!   process identity (no token) is read past and dropped, so that envelope
//!   re-encodes without it.
//!
//! [`WorkerAddressFormat::validate`]: rdmareg_ucx::worker_address::WorkerAddressFormat::validate

#![no_main]

#[path = "../../crates/rdmareg-ucx/tests/worker_address_model/mod.rs"]
mod worker_address_model;

use libfuzzer_sys::fuzz_target;
use rdmareg_ucx::EngineAddress;
use rdmareg_ucx::worker_address::{ENDPOINT_PADDING, MAX_WORKER_ADDRESS_LEN};
use worker_address_model::{format, model_unpack};

/// Version 1 of the envelope with its flag for a process identity.
const VERSION_WITHOUT_TOKEN: u8 = 1;
const FLAG_PROCESS: u8 = 0x02;
const PROCESS_LEN_WITHOUT_TOKEN: usize = 28;

/// What an accepted envelope encodes back to: itself, except that a
/// version-1 process identity is dropped (flag cleared, its 28 bytes gone).
fn canonical_envelope(address: &[u8]) -> Vec<u8> {
    let mut expected = address.to_vec();
    if expected[2] == VERSION_WITHOUT_TOKEN && expected[3] & FLAG_PROCESS != 0 {
        expected[3] &= !FLAG_PROCESS;
        expected.truncate(expected.len() - PROCESS_LEN_WITHOUT_TOKEN);
    }
    expected
}

fuzz_target!(|address: &[u8]| {
    if let Ok(envelope) = EngineAddress::decode(address) {
        if address.starts_with(b"RW") {
            let encoded = envelope
                .encode()
                .expect("an envelope that decoded carries addresses that encode");
            assert_eq!(
                &encoded[..],
                &canonical_envelope(address)[..],
                "an accepted envelope re-encodes to itself"
            );
        } else {
            assert_eq!(&envelope.serving[..], address, "a bare address passes through");
        }
        if let Ok(checked) = EngineAddress::decode_for_endpoints(address, &format()) {
            assert!(format().validate(&envelope.serving).is_ok());
            assert!(checked.serving.starts_with(&envelope.serving));
            if let Some(direct) = &envelope.direct {
                assert!(format().validate(direct).is_ok());
            }
        }
    }
    let verdict = format().validate(address);
    let copy = format().copy_for_endpoint(address);
    assert_eq!(verdict.is_ok(), copy.is_ok(), "validate and copy disagree");

    if verdict.is_ok() {
        let parse = match model_unpack(address) {
            Ok(parse) => parse,
            Err(fault) => panic!("accepted address, but UCX's walk ends in {fault:?}"),
        };
        assert_eq!(
            parse.consumed,
            address.len(),
            "accepted address has unread bytes"
        );
        assert!(parse.md_indices.iter().all(|&md| md < 64), "{parse:?}");
        assert!(parse.lanes.iter().all(|&lane| lane < 64), "{parse:?}");
        assert!(address.len() <= MAX_WORKER_ADDRESS_LEN);
        let copy = copy.expect("accepted");
        assert_eq!(copy.len(), address.len() + ENDPOINT_PADDING);
        assert_eq!(&copy[..address.len()], address);
    }
});
