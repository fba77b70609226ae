//! Keys packed by a real UCX 1.22.0 (`fixtures/real_keys_ucx_1_22.txt`), and
//! the forged variants `fixtures/gen_keys.c` unpacked at a page end.

use crate::packed_key_model;

use packed_key_model::{format, model_unpack, real_key_with_entries, real_keys};
use rdmareg_ucx::packed_key::{PackedKeyError, PackedKeyFormat, validate_packed_key};

mod accepted {
    use super::*;

    #[test]
    fn every_real_key_is_accepted() {
        let keys = real_keys();
        assert!(keys.len() >= 30, "fixture file lost keys: {}", keys.len());
        for key in keys {
            assert_eq!(
                validate_packed_key(&format(), &key.bytes),
                Ok(()),
                "{} refused",
                key.label
            );
        }
    }

    #[test]
    fn every_real_key_is_read_by_the_model_exactly_to_its_end() {
        for key in real_keys() {
            let parse = model_unpack(&key.bytes)
                .unwrap_or_else(|fault| panic!("{}: model read past end: {fault:?}", key.label));
            assert_eq!(parse.consumed, key.bytes.len(), "{}", key.label);
        }
    }

    #[test]
    fn registered_host_memory_keys_are_nine_bytes_with_an_empty_map() {
        let host: Vec<_> = real_keys()
            .into_iter()
            .filter(|key| !key.label.contains("ucx_allocated") || key.label.starts_with("tcp"))
            .collect();
        assert!(!host.is_empty());
        for key in host {
            assert_eq!(key.bytes, [0; 9], "{}", key.label);
        }
    }

    #[test]
    fn shared_memory_segments_give_keys_with_one_entry_and_an_unknown_device() {
        let key = real_key_with_entries();
        let parse = model_unpack(&key.bytes).expect("real key stays in bounds");
        assert_eq!(parse.md_map.count_ones(), 1, "{}", key.label);
        assert_eq!(parse.device_byte, Some(0xFF), "{}", key.label);
        assert_eq!(validate_packed_key(&format(), &key.bytes), Ok(()));
    }
}

mod forged_from_a_real_key {
    use super::*;

    /// The real key with its system-device byte replaced, plus `tail`.
    fn forged(device: u8, tail: &[u8]) -> Vec<u8> {
        let mut key = real_key_with_entries().bytes;
        *key.last_mut().expect("non-empty") = device;
        key.extend_from_slice(tail);
        key
    }

    #[test]
    fn known_device_without_terminator_is_refused() {
        // UCX 1.22 faulted on this key when it ended at a page boundary.
        let key = forged(0x00, &[]);
        assert_eq!(
            validate_packed_key(&format(), &key),
            Err(PackedKeyError::UnboundedDistanceList { start: key.len() })
        );
        assert!(model_unpack(&key).is_err());
    }

    #[test]
    fn known_device_with_bare_terminator_is_accepted() {
        // UCX 1.22 unpacked this key at a page boundary without fault.
        let key = forged(0x00, &[0xFF]);
        assert_eq!(validate_packed_key(&format(), &key), Ok(()));
        assert_eq!(model_unpack(&key).map(|p| p.consumed), Ok(key.len()));
    }

    #[test]
    fn flush_flag_with_one_record_and_terminator_is_accepted() {
        // UCX 1.22 unpacked this key at a page boundary without fault.
        let key = forged(0x80, &[0x01, 0x20, 0x30, 0xFF]);
        assert_eq!(validate_packed_key(&format(), &key), Ok(()));
        assert_eq!(model_unpack(&key).map(|p| p.consumed), Ok(key.len()));
    }
}

mod versions {
    use super::*;

    #[test]
    fn unknown_ucx_versions_have_no_format() {
        assert!(PackedKeyFormat::for_ucx_version(1, 22).is_some());
        for (major, minor) in [(1, 19), (1, 20), (1, 21), (1, 23), (2, 0), (0, 0)] {
            assert!(
                PackedKeyFormat::for_ucx_version(major, minor).is_none(),
                "{major}.{minor} must be refused"
            );
        }
    }
}
