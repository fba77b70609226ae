//! Hand-made malformed worker addresses, one per way the 1.22 layout can be
//! broken, the well-formed edge cases next to them, and exhaustive
//! corruptions of the real addresses.

use crate::worker_address_model;

use rdmareg_core::RdmaError;
use rdmareg_ucx::worker_address::{AddressField, MAX_WORKER_ADDRESS_LEN, WorkerAddressError};
use worker_address_model::{
    AddressSpec, DeviceSpec, IfaceSpec, ModelFault, Version, format, full_spec, model_unpack,
    real_addresses,
};

fn validate(address: &[u8]) -> Result<(), WorkerAddressError> {
    format().validate(address)
}

/// Acceptance must mean UCX's walk stays inside the address, ends exactly at
/// its end, and yields indices inside UCX's tables.
fn assert_accepted_is_safe(address: &[u8], what: &str) {
    if validate(address).is_err() {
        return;
    }
    let parse = model_unpack(address)
        .unwrap_or_else(|fault| panic!("{what}: accepted, but UCX's walk ends in {fault:?}"));
    assert_eq!(parse.consumed, address.len(), "{what}: unread bytes");
    assert!(parse.md_indices.iter().all(|&md| md < 64), "{what}");
    assert!(parse.lanes.iter().all(|&lane| lane < 64), "{what}");
}

/// A spec with one device of one interface: the smallest real-shaped address.
fn small_spec(version: Version) -> AddressSpec {
    AddressSpec {
        version,
        uuid: 42,
        name: None,
        devices: vec![DeviceSpec {
            md_index: 0,
            dev_addr: vec![1, 2],
            num_paths: 1,
            sys_dev: 0xFF,
            ifaces: vec![IfaceSpec {
                checksum: 0xcf19,
                iface_addr: vec![3, 4],
                ep_addrs: vec![],
            }],
        }],
    }
}

/// Offset of the first device record of an address built without a name.
fn first_device(version: Version) -> usize {
    match version {
        Version::V1 => 9,
        Version::V2 => 10,
    }
}

mod well_formed {
    use super::*;

    #[test]
    fn every_section_of_the_layout_present_is_accepted_in_both_versions() {
        for version in [Version::V1, Version::V2] {
            let address = full_spec(version).build();
            assert_eq!(validate(&address), Ok(()), "{version:?}");
            assert_eq!(
                model_unpack(&address).map(|p| p.consumed),
                Ok(address.len())
            );
        }
    }

    #[test]
    fn an_address_without_devices_is_accepted() {
        for version in [Version::V1, Version::V2] {
            let mut spec = small_spec(version);
            spec.devices.clear();
            assert_eq!(validate(&spec.build()), Ok(()), "{version:?}");
        }
    }

    #[test]
    fn the_largest_short_form_lengths_are_accepted_in_v1() {
        let mut spec = small_spec(Version::V1);
        spec.devices[0].dev_addr = vec![0; 31];
        spec.devices[0].ifaces[0].iface_addr = vec![0; 63];
        assert_eq!(validate(&spec.build()), Ok(()));
    }

    #[test]
    fn the_largest_memory_domain_index_is_accepted() {
        let mut spec = small_spec(Version::V2);
        spec.devices[0].md_index = 63;
        assert_eq!(validate(&spec.build()), Ok(()));
    }
}

mod header {
    use super::*;

    #[test]
    fn empty_address_is_refused() {
        assert_eq!(validate(&[]), Err(WorkerAddressError::Empty));
    }

    #[test]
    fn address_over_the_limit_is_refused_before_parsing() {
        let address = vec![0x20; MAX_WORKER_ADDRESS_LEN + 1];
        assert_eq!(
            validate(&address),
            Err(WorkerAddressError::Oversized {
                len: MAX_WORKER_ADDRESS_LEN + 1
            })
        );
    }

    #[test]
    fn every_address_version_but_v1_and_v2_is_refused() {
        let mut address = small_spec(Version::V1).build();
        for version in 2..16u8 {
            address[0] = 0x20 | version;
            assert_eq!(
                validate(&address),
                Err(WorkerAddressError::UnknownVersion(version))
            );
            assert_eq!(model_unpack(&address), Err(ModelFault::Abort));
        }
    }

    #[test]
    fn undefined_v2_header_flags_are_refused() {
        let mut address = small_spec(Version::V2).build();
        address[1] |= 0x10;
        assert_eq!(
            validate(&address),
            Err(WorkerAddressError::UnexpectedHeaderFlags { flags: 0x12 })
        );
    }

    #[test]
    fn an_address_without_the_uuid_flag_is_refused() {
        let mut address = small_spec(Version::V2).build();
        address[1] = 0;
        assert_eq!(
            validate(&address),
            Err(WorkerAddressError::MissingWorkerUuid)
        );
    }

    #[test]
    fn a_worker_name_longer_than_the_address_is_an_overrun() {
        let mut address = vec![0x30];
        address.extend_from_slice(&[0; 8]);
        address.extend_from_slice(&[200, b'x']);
        assert_eq!(
            validate(&address),
            Err(WorkerAddressError::Overrun {
                field: AddressField::WorkerName,
                at: 10,
                declared: 200,
                available: 1
            })
        );
    }
}

mod devices {
    use super::*;

    #[test]
    fn an_extended_memory_domain_index_is_refused() {
        // v2 writes 0x7F and the index in the next byte only for indices of
        // 127 and more, which no 64-bit memory-domain map has.
        let mut address = small_spec(Version::V2).build();
        let at = first_device(Version::V2);
        address[at] = 0x7F;
        address.insert(at + 1, 5);
        assert_eq!(
            validate(&address),
            Err(WorkerAddressError::BadValue {
                field: AddressField::MemoryDomain,
                at: at + 1,
                value: 5
            })
        );
    }

    #[test]
    fn an_extended_length_that_fits_the_short_form_is_refused() {
        let mut address = small_spec(Version::V2).build();
        let at = first_device(Version::V2) + 1;
        address[at] |= 0x1F;
        address.insert(at + 1, 2);
        assert_eq!(
            validate(&address),
            Err(WorkerAddressError::BadValue {
                field: AddressField::DeviceAddressLength,
                at: at + 1,
                value: 2
            })
        );
    }

    #[test]
    fn a_path_count_below_two_is_refused() {
        let mut address = small_spec(Version::V1).build();
        let at = first_device(Version::V1) + 1;
        address[at] |= 0x40;
        address.insert(at + 1, 1);
        assert_eq!(
            validate(&address),
            Err(WorkerAddressError::BadValue {
                field: AddressField::PathCount,
                at: at + 1,
                value: 1
            })
        );
    }

    #[test]
    fn an_unknown_system_device_written_out_is_refused() {
        let mut address = small_spec(Version::V1).build();
        let at = first_device(Version::V1) + 1;
        address[at] |= 0x20;
        address.insert(at + 1, 0xFF);
        assert_eq!(
            validate(&address),
            Err(WorkerAddressError::BadValue {
                field: AddressField::SystemDevice,
                at: at + 1,
                value: 0xFF
            })
        );
    }

    #[test]
    fn a_device_without_transports_in_v2_is_refused() {
        let mut address = small_spec(Version::V2).build();
        address[first_device(Version::V2)] |= 0x80;
        assert!(matches!(
            validate(&address),
            Err(WorkerAddressError::MisplacedVersionMarker(_))
        ));
    }

    #[test]
    fn a_device_without_transports_before_the_last_is_refused() {
        let mut address = small_spec(Version::V1).build();
        let marker = address.len() - 2;
        address.splice(marker..marker, [0x80, 0x00]);
        assert!(matches!(
            validate(&address),
            Err(WorkerAddressError::MisplacedVersionMarker(_))
        ));
    }

    #[test]
    fn a_version_marker_with_extension_bits_is_refused() {
        let mut address = small_spec(Version::V1).build();
        let marker = address.len() - 2;
        address[marker] = 0x80 | 0x16;
        assert!(matches!(
            validate(&address),
            Err(WorkerAddressError::MisplacedVersionMarker(_))
        ));
    }
}

mod interfaces {
    use super::*;

    /// Offset of the first interface's attributes in `small_spec(version)`.
    fn attributes(version: Version) -> usize {
        first_device(version) + 2 + 2 + 2
    }

    #[test]
    fn a_non_positive_or_non_finite_v1_bandwidth_is_refused() {
        for bandwidth in [0.0f32, -1.0, f32::NAN, f32::INFINITY] {
            let mut address = small_spec(Version::V1).build();
            let at = attributes(Version::V1);
            address[at + 4..at + 8].copy_from_slice(&bandwidth.to_le_bytes());
            assert!(
                matches!(
                    validate(&address),
                    Err(WorkerAddressError::BadInterfaceAttributes { .. })
                ),
                "{bandwidth}"
            );
        }
    }

    #[test]
    fn undefined_capability_bits_are_refused_in_both_versions() {
        let mut v1 = small_spec(Version::V1).build();
        let at = attributes(Version::V1);
        v1[at + 12..at + 16].copy_from_slice(&(1u32 << 25).to_le_bytes());
        assert!(matches!(
            validate(&v1),
            Err(WorkerAddressError::BadInterfaceAttributes { .. })
        ));
        let mut v2 = small_spec(Version::V2).build();
        let at = attributes(Version::V2);
        v2[at + 7] = 0x04;
        assert!(matches!(
            validate(&v2),
            Err(WorkerAddressError::BadInterfaceAttributes { .. })
        ));
    }

    #[test]
    fn a_lane_byte_with_bit_6_is_refused() {
        let mut spec = small_spec(Version::V1);
        spec.devices[0].ifaces[0].ep_addrs = vec![(vec![9; 4], 0)];
        let mut address = spec.build();
        let lane = address.len() - 3;
        address[lane] |= 0x40;
        assert!(matches!(
            validate(&address),
            Err(WorkerAddressError::BadValue {
                field: AddressField::LaneIndex,
                ..
            })
        ));
    }

    #[test]
    fn more_interfaces_than_ucx_parses_are_refused() {
        let mut spec = small_spec(Version::V2);
        let iface = spec.devices[0].ifaces[0].clone();
        spec.devices[0].ifaces = vec![iface; 129];
        let address = spec.build();
        assert!(matches!(
            validate(&address),
            Err(WorkerAddressError::TooMany { limit: 128, .. })
        ));
        assert_eq!(model_unpack(&address), Err(ModelFault::Refused));
        spec.devices[0].ifaces.truncate(128);
        assert_eq!(validate(&spec.build()), Ok(()));
    }

    #[test]
    fn more_endpoint_addresses_than_ucx_parses_are_refused() {
        let mut spec = small_spec(Version::V1);
        spec.devices[0].ifaces[0].ep_addrs = (0..65).map(|lane| (vec![], lane % 64)).collect();
        let address = spec.build();
        assert!(matches!(
            validate(&address),
            Err(WorkerAddressError::TooMany { limit: 64, .. })
        ));
        spec.devices[0].ifaces[0].ep_addrs.truncate(64);
        assert_eq!(validate(&spec.build()), Ok(()));
    }

    #[test]
    fn an_interface_address_longer_than_the_rest_is_an_overrun() {
        let mut address = small_spec(Version::V1).build();
        let at = attributes(Version::V1) + 16;
        address[at] = 0x80 | 0x3E;
        assert!(matches!(
            validate(&address),
            Err(WorkerAddressError::Overrun {
                field: AddressField::InterfaceAddress,
                ..
            })
        ));
    }
}

mod real_addresses_corrupted {
    use super::*;

    #[test]
    fn every_truncation_of_every_real_address_is_refused() {
        for address in real_addresses() {
            for cut in 0..address.bytes.len() {
                let short = &address.bytes[..cut];
                assert!(
                    validate(short).is_err(),
                    "{} cut to {cut} bytes accepted",
                    address.label
                );
                if cut > 0 {
                    assert!(
                        matches!(model_unpack(short), Err(ModelFault::ReadPastEnd { .. })),
                        "{} cut to {cut}: UCX would stay inside it",
                        address.label
                    );
                }
            }
        }
    }

    #[test]
    fn every_truncation_of_the_full_layouts_is_refused() {
        for version in [Version::V1, Version::V2] {
            let address = full_spec(version).build();
            for cut in 0..address.len() {
                assert!(validate(&address[..cut]).is_err(), "{version:?} cut {cut}");
            }
        }
    }

    #[test]
    fn every_value_of_byte_0_is_refused_unless_it_still_reads_as_a_whole_address() {
        for address in real_addresses() {
            for value in 0..=255u8 {
                let mut bytes = address.bytes.clone();
                bytes[0] = value;
                let what = format!("{} with byte 0 = {value:#04x}", address.label);
                if value & 0x0F > 1 {
                    assert_eq!(
                        validate(&bytes),
                        Err(WorkerAddressError::UnknownVersion(value & 0x0F)),
                        "{what}"
                    );
                }
                assert_accepted_is_safe(&bytes, &what);
            }
        }
    }

    #[test]
    fn every_single_bit_flip_of_every_real_address_is_safe() {
        let mut accepted = 0;
        let mut total = 0;
        for address in real_addresses() {
            for at in 0..address.bytes.len() {
                for bit in 0..8 {
                    let mut bytes = address.bytes.clone();
                    bytes[at] ^= 1 << bit;
                    let what = format!("{} with bit {bit} of byte {at} flipped", address.label);
                    assert_accepted_is_safe(&bytes, &what);
                    total += 1;
                    accepted += usize::from(validate(&bytes).is_ok());
                }
            }
        }
        // Flips inside UUIDs, names and transport addresses stay well formed;
        // flips in the structure do not.
        assert!(accepted > 0 && accepted < total, "{accepted} of {total}");
    }

    #[test]
    fn random_64_byte_addresses_never_pass_unless_structurally_whole() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..20_000 {
            let bytes: Vec<u8> = (0..64)
                .map(|_| {
                    state ^= state >> 12;
                    state ^= state << 25;
                    state ^= state >> 27;
                    (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
                })
                .collect();
            assert_accepted_is_safe(&bytes, &format!("{bytes:02x?}"));
        }
    }
}

#[test]
fn a_refusal_becomes_invalid_worker_address_carrying_the_reason() {
    let err = validate(&[0x2F]).unwrap_err();
    let text = err.to_string();
    assert_eq!(
        RdmaError::from(err),
        RdmaError::InvalidWorkerAddress(text.clone())
    );
    assert!(text.contains("version 15"), "{text}");
}
