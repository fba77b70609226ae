//! Worker addresses packed by a real UCX 1.22.0
//! (`fixtures/real_worker_addresses_ucx_1_22.txt`, written by
//! `fixtures/gen_worker_addresses.c`, which also had UCX create an endpoint
//! from each one placed at a page end).

use crate::worker_address_model;

use worker_address_model::{Version, format, model_unpack, real_addresses};

#[test]
fn every_real_address_is_accepted() {
    let addresses = real_addresses();
    assert!(
        addresses.len() >= 100,
        "fixture file lost addresses: {}",
        addresses.len()
    );
    for address in addresses {
        assert_eq!(
            format().validate(&address.bytes),
            Ok(()),
            "{} refused",
            address.label
        );
    }
}

#[test]
fn every_real_address_is_read_by_the_model_exactly_to_its_end() {
    for address in real_addresses() {
        let parse = model_unpack(&address.bytes)
            .unwrap_or_else(|fault| panic!("{}: model failed: {fault:?}", address.label));
        assert_eq!(parse.consumed, address.bytes.len(), "{}", address.label);
        assert!(parse.interfaces > 0, "{}", address.label);
    }
}

#[test]
fn the_fixtures_cover_both_feature_sets_every_transport_setting_and_both_versions() {
    let addresses = real_addresses();
    for needle in [
        "rma/",
        "am/",
        "/tcp/",
        "/tcp_cma_invalidate/",
        "/shm/",
        "/lo/",
        "/all/",
        "/v1/",
        "/v2/",
        "/v1_debug/",
    ] {
        assert!(
            addresses.iter().any(|a| a.label.contains(needle)),
            "no real address for {needle}"
        );
    }
}

#[test]
fn addresses_are_v2_exactly_where_the_owner_asked_for_it() {
    for address in real_addresses() {
        let parse = model_unpack(&address.bytes).expect("real address parses");
        let expected = if address.label.contains("/v2/") {
            Version::V2
        } else {
            Version::V1
        };
        assert_eq!(parse.version, expected, "{}", address.label);
    }
}

#[test]
fn only_debug_info_addresses_carry_a_worker_name() {
    for address in real_addresses() {
        let flags = match address.bytes[0] & 0x0F {
            0 => address.bytes[0] >> 4,
            _ => address.bytes[1],
        };
        assert_eq!(
            flags & 0x1 != 0,
            address.label.contains("_debug"),
            "{}",
            address.label
        );
        assert_ne!(flags & 0x2, 0, "{} has no UUID flag", address.label);
    }
}
