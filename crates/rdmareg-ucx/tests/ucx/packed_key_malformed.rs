//! Hand-made malformed keys, one per way the 1.22 layout can be broken, and
//! the well-formed edge cases next to them.

use crate::packed_key_model;

use packed_key_model::{DeviceSection, KeySpec, format, full_key, model_unpack, real_keys};
use rdmareg_core::{MAX_PACKED_KEY_LEN, RdmaError};
use rdmareg_ucx::packed_key::{KeyField, PackedKeyError, validate_packed_key};

fn validate(key: &[u8]) -> Result<(), PackedKeyError> {
    validate_packed_key(&format(), key)
}

fn header(md_map: u64, mem_type: u8) -> Vec<u8> {
    let mut key = md_map.to_le_bytes().to_vec();
    key.push(mem_type);
    key
}

mod length_limits {
    use super::*;

    #[test]
    fn empty_key_is_refused() {
        assert_eq!(validate(&[]), Err(PackedKeyError::Empty));
    }

    #[test]
    fn well_formed_key_of_exactly_the_limit_is_accepted() {
        // Three full entries, then a fourth sized so the key lands on the limit.
        let mut spec = KeySpec {
            mem_type: 0,
            entries: vec![(0, vec![0; 255]), (1, vec![0; 255]), (2, vec![0; 255])],
            device: None,
        };
        let fixed = spec.build().len();
        let last = MAX_PACKED_KEY_LEN - fixed - 1;
        spec.entries.push((3, vec![0xAB; last]));
        let key = spec.build();
        assert_eq!(key.len(), MAX_PACKED_KEY_LEN);
        assert_eq!(validate(&key), Ok(()));
    }

    #[test]
    fn key_one_byte_over_the_limit_is_refused_before_parsing() {
        let key = vec![0; MAX_PACKED_KEY_LEN + 1];
        assert_eq!(
            validate(&key),
            Err(PackedKeyError::Oversized {
                len: MAX_PACKED_KEY_LEN + 1
            })
        );
    }
}

mod truncation {
    use super::*;

    #[test]
    fn every_truncation_of_every_real_key_is_refused() {
        for key in real_keys() {
            for len in 0..key.bytes.len() {
                assert!(
                    validate(&key.bytes[..len]).is_err(),
                    "{} cut to {len} bytes was accepted",
                    key.label
                );
            }
        }
    }

    #[test]
    fn every_truncation_of_a_multi_entry_key_with_distances_is_refused() {
        let key = full_key();
        assert_eq!(validate(&key), Ok(()));
        for len in 0..key.len() {
            assert!(
                validate(&key[..len]).is_err(),
                "cut to {len} bytes was accepted"
            );
        }
    }

    #[test]
    fn short_header_names_the_missing_field() {
        assert_eq!(
            validate(&[0; 8]),
            Err(PackedKeyError::Truncated {
                at: 8,
                field: KeyField::MemoryType
            })
        );
    }
}

mod memory_type {
    use super::*;

    #[test]
    fn every_defined_memory_type_is_accepted() {
        for mem_type in 0..format().memory_type_count() {
            assert_eq!(validate(&header(0, mem_type)), Ok(()), "type {mem_type}");
        }
    }

    #[test]
    fn memory_type_at_or_past_the_count_is_refused() {
        for mem_type in format().memory_type_count()..=u8::MAX {
            assert_eq!(
                validate(&header(0, mem_type)),
                Err(PackedKeyError::BadMemoryType(mem_type))
            );
        }
    }
}

mod entries {
    use super::*;

    #[test]
    fn md_map_bits_without_their_entries_are_refused() {
        // Three domains announced, one entry written, then the device byte.
        let mut key = header(0b1011, 0);
        key.extend_from_slice(&[2, 0xAA, 0xBB, 0xFF]);
        // The device byte is taken as the second entry's length (255) and
        // runs past the end.
        assert_eq!(
            validate(&key),
            Err(PackedKeyError::EntryOverrun {
                md_index: 1,
                at: 13,
                declared: 255,
                available: 0
            })
        );
        assert!(model_unpack(&key).is_err());
    }

    #[test]
    fn entry_length_running_past_the_end_is_refused() {
        let mut key = header(1, 0);
        key.extend_from_slice(&[10, 1, 2, 3]);
        assert_eq!(
            validate(&key),
            Err(PackedKeyError::EntryOverrun {
                md_index: 0,
                at: 10,
                declared: 10,
                available: 3
            })
        );
    }

    #[test]
    fn entry_declaring_one_byte_more_than_remains_is_an_overrun() {
        let mut key = header(1, 0);
        key.extend_from_slice(&[4, 1, 2, 3]);
        assert_eq!(
            validate(&key),
            Err(PackedKeyError::EntryOverrun {
                md_index: 0,
                at: 10,
                declared: 4,
                available: 3
            })
        );
        key.push(0xFF);
        // Exactly filled: the last byte is then the entry's, and the device
        // byte is missing.
        assert_eq!(
            validate(&key),
            Err(PackedKeyError::Truncated {
                at: 14,
                field: KeyField::SystemDevice
            })
        );
    }

    #[test]
    fn entries_without_the_device_byte_are_refused() {
        let mut key = header(1 << 40, 0);
        key.extend_from_slice(&[1, 0x99]);
        assert_eq!(
            validate(&key),
            Err(PackedKeyError::Truncated {
                at: 11,
                field: KeyField::SystemDevice
            })
        );
    }

    #[test]
    fn empty_entries_and_the_highest_domain_bit_are_accepted() {
        let key = KeySpec {
            mem_type: 9,
            entries: vec![(0, vec![]), (63, vec![7; 3])],
            device: None,
        }
        .build();
        assert_eq!(validate(&key), Ok(()));
    }
}

mod distance_list {
    use super::*;

    fn with_device(device_byte: u8, tail: &[u8]) -> Vec<u8> {
        let mut key = header(1, 0);
        key.extend_from_slice(&[1, 0x5A, device_byte]);
        key.extend_from_slice(tail);
        key
    }

    #[test]
    fn known_device_without_terminator_is_refused() {
        for tail in [&[][..], &[1, 2, 3], &[1, 2, 3, 4, 5, 6]] {
            assert_eq!(
                validate(&with_device(0x05, tail)),
                Err(PackedKeyError::UnboundedDistanceList { start: 12 }),
                "tail {tail:?}"
            );
        }
    }

    #[test]
    fn record_cut_short_before_the_terminator_is_refused() {
        for tail in [&[1][..], &[1, 2], &[1, 2, 3, 4]] {
            assert_eq!(
                validate(&with_device(0x05, tail)),
                Err(PackedKeyError::UnboundedDistanceList { start: 12 }),
                "tail {tail:?}"
            );
        }
    }

    #[test]
    fn terminator_only_counts_where_a_record_starts() {
        // 0xFF inside a record (latency/bandwidth bytes) does not end the list.
        assert_eq!(
            validate(&with_device(0x05, &[1, 0xFF, 0xFF])),
            Err(PackedKeyError::UnboundedDistanceList { start: 12 })
        );
        assert_eq!(validate(&with_device(0x05, &[1, 0xFF, 0xFF, 0xFF])), Ok(()));
    }

    #[test]
    fn device_index_beyond_the_device_map_is_refused() {
        assert_eq!(
            validate(&with_device(0x05, &[64, 0, 0, 0xFF])),
            Err(PackedKeyError::BadDistanceDevice { at: 12, device: 64 })
        );
        assert_eq!(validate(&with_device(0x05, &[63, 0, 0, 0xFF])), Ok(()));
    }

    #[test]
    fn records_out_of_ascending_order_or_repeated_are_refused() {
        assert_eq!(
            validate(&with_device(0x05, &[4, 0, 0, 3, 0, 0, 0xFF])),
            Err(PackedKeyError::DistanceDevicesOutOfOrder { at: 15 })
        );
        assert_eq!(
            validate(&with_device(0x05, &[4, 0, 0, 4, 0, 0, 0xFF])),
            Err(PackedKeyError::DistanceDevicesOutOfOrder { at: 15 })
        );
    }

    #[test]
    fn every_device_byte_with_and_without_flush_flag_is_accepted_when_terminated() {
        for device_byte in 0..0xFF {
            assert_eq!(
                validate(&with_device(device_byte, &[0xFF])),
                Ok(()),
                "device byte {device_byte:#x}"
            );
        }
    }

    #[test]
    fn full_device_map_of_64_records_is_accepted() {
        let key = KeySpec {
            mem_type: 1,
            entries: vec![(2, vec![1; 8])],
            device: Some(DeviceSection {
                device: 3,
                flush: false,
                distances: (0..64).map(|device| (device, 0x12, 0x34)).collect(),
            }),
        }
        .build();
        assert!(key.len() <= MAX_PACKED_KEY_LEN);
        assert_eq!(validate(&key), Ok(()));
    }
}

mod trailing_bytes {
    use super::*;

    #[test]
    fn bytes_after_a_nine_byte_key_are_refused() {
        let mut key = header(0, 0);
        key.push(0xFF);
        assert_eq!(
            validate(&key),
            Err(PackedKeyError::TrailingBytes { at: 9, extra: 1 })
        );
    }

    #[test]
    fn bytes_after_an_unknown_device_are_refused() {
        let mut key = header(1, 0);
        key.extend_from_slice(&[0, 0xFF, 0, 0, 0]);
        assert_eq!(
            validate(&key),
            Err(PackedKeyError::TrailingBytes { at: 11, extra: 3 })
        );
    }

    #[test]
    fn bytes_after_the_distance_terminator_are_refused() {
        let mut key = full_key();
        let end = key.len();
        key.push(0xFF);
        assert_eq!(
            validate(&key),
            Err(PackedKeyError::TrailingBytes { at: end, extra: 1 })
        );
    }
}

mod conversion {
    use super::*;

    #[test]
    fn every_refusal_becomes_invalid_key() {
        let refusals = [
            validate(&[]),
            validate(&[0; 3]),
            validate(&header(0, 200)),
            validate(&full_key()[..20]),
        ];
        for refusal in refusals {
            let err = refusal.expect_err("malformed key");
            assert!(matches!(RdmaError::from(err), RdmaError::InvalidKey));
        }
    }
}
