//! Property tests: the validator never panics, every address it accepts is
//! read by the model of UCX's parser entirely inside the address, and every
//! address the 1.22 packer could write is accepted.

use crate::worker_address_model;

use proptest::prelude::*;
use worker_address_model::{
    AddressSpec, DeviceSpec, IfaceSpec, Version, format, full_spec, model_unpack, real_addresses,
};

/// The property every input must satisfy: acceptance implies UCX's walk
/// reads exactly the address, no byte past it, and only indices inside the
/// tables UCX uses them on.
fn check(address: &[u8]) -> Result<(), TestCaseError> {
    if format().validate(address).is_err() {
        return Ok(());
    }
    let parse = model_unpack(address).map_err(|fault| {
        TestCaseError::fail(format!(
            "accepted address, but UCX's walk ends in {fault:?}"
        ))
    })?;
    prop_assert_eq!(
        parse.consumed,
        address.len(),
        "accepted address with unread bytes"
    );
    prop_assert!(parse.md_indices.iter().all(|&md| md < 64));
    prop_assert!(parse.lanes.iter().all(|&lane| lane < 64));
    Ok(())
}

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..max)
}

fn iface_spec() -> impl Strategy<Value = IfaceSpec> {
    (
        any::<u16>(),
        bytes(80),
        prop::collection::vec((bytes(20), 0u8..64), 0..4),
    )
        .prop_map(|(checksum, iface_addr, ep_addrs)| IfaceSpec {
            checksum,
            iface_addr,
            ep_addrs,
        })
}

fn device_spec() -> impl Strategy<Value = DeviceSpec> {
    (
        0u8..64,
        bytes(40),
        1u8..=255,
        any::<u8>(),
        prop::collection::vec(iface_spec(), 1..4),
    )
        .prop_map(
            |(md_index, dev_addr, num_paths, sys_dev, ifaces)| DeviceSpec {
                md_index,
                dev_addr,
                num_paths,
                sys_dev,
                ifaces,
            },
        )
}

fn address_spec() -> impl Strategy<Value = AddressSpec> {
    (
        prop_oneof![Just(Version::V1), Just(Version::V2)],
        any::<u64>(),
        prop::option::of(bytes(40)),
        prop::collection::vec(device_spec(), 0..4),
    )
        .prop_map(|(version, uuid, name, mut devices)| {
            if version == Version::V1 {
                // v1 has no extended forms: lengths stay within the short ones.
                for device in &mut devices {
                    device.dev_addr.truncate(31);
                    for iface in &mut device.ifaces {
                        iface.iface_addr.truncate(63);
                    }
                }
            }
            AddressSpec {
                version,
                uuid,
                name,
                devices,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_are_never_accepted_unless_ucx_reads_them_exactly(address in bytes(300)) {
        check(&address)?;
    }

    #[test]
    fn arbitrary_bytes_behind_a_real_header_are_never_accepted_unless_ucx_reads_them_exactly(
        index in any::<prop::sample::Index>(),
        tail in bytes(200),
    ) {
        let addresses = real_addresses();
        let real = &addresses[index.index(addresses.len())].bytes;
        let mut address = real[..9.min(real.len())].to_vec();
        address.extend(tail);
        check(&address)?;
    }

    #[test]
    fn corrupted_real_addresses_are_never_accepted_unless_ucx_reads_them_exactly(
        index in any::<prop::sample::Index>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let addresses = real_addresses();
        let mut address = addresses[index.index(addresses.len())].bytes.clone();
        for (at, value) in edits {
            let at = at.index(address.len());
            address[at] = value;
        }
        if truncate {
            address.truncate(cut.index(address.len()));
        }
        check(&address)?;
    }

    #[test]
    fn every_address_the_packer_could_write_is_accepted(spec in address_spec()) {
        let address = spec.build();
        prop_assert_eq!(format().validate(&address), Ok(()));
        check(&address)?;
    }

    #[test]
    fn every_truncation_of_a_packer_shaped_address_is_refused(
        spec in address_spec(),
        cut in any::<prop::sample::Index>(),
    ) {
        let address = spec.build();
        let cut = cut.index(address.len());
        prop_assert!(format().validate(&address[..cut]).is_err());
    }

    #[test]
    fn a_packer_shaped_address_with_a_byte_appended_is_refused(
        spec in address_spec(),
        extra in any::<u8>(),
    ) {
        let mut address = spec.build();
        address.push(extra);
        prop_assert!(format().validate(&address).is_err());
    }
}

#[test]
fn the_full_layouts_satisfy_the_property() {
    for version in [Version::V1, Version::V2] {
        check(&full_spec(version).build()).expect("full layout");
    }
}
