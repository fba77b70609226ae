//! Property tests: the validator never panics, every key it accepts is read
//! by the model of UCX's unpacker entirely inside the key, and every key the
//! 1.22 packer could write is accepted.

use crate::packed_key_model;

use packed_key_model::{
    DeviceSection, KeySpec, format, full_key, is_packer_shaped, model_unpack, real_keys,
};
use proptest::prelude::*;
use rdmareg_core::MAX_PACKED_KEY_LEN;
use rdmareg_ucx::packed_key::validate_packed_key;

/// The property every input must satisfy: acceptance implies the model reads
/// exactly the key and no byte past it; and a key the model reads exactly, in
/// the packer's shape, is accepted (the validator is not stricter than UCX's
/// own output).
fn check(key: &[u8]) -> Result<(), TestCaseError> {
    let verdict = validate_packed_key(&format(), key);
    let walk = model_unpack(key);
    if verdict.is_ok() {
        let parse = walk.clone().map_err(|fault| {
            TestCaseError::fail(format!("accepted key read past its end: {fault:?}"))
        })?;
        prop_assert_eq!(parse.consumed, key.len(), "accepted key with unread bytes");
    }
    let packer_shaped = matches!(&walk, Ok(parse) if is_packer_shaped(key, parse));
    if packer_shaped && key.len() <= MAX_PACKED_KEY_LEN {
        prop_assert!(verdict.is_ok(), "packer-shaped key refused: {:?}", verdict);
    }
    Ok(())
}

fn key_spec() -> impl Strategy<Value = KeySpec> {
    let entries =
        prop::collection::btree_map(0u32..64, prop::collection::vec(any::<u8>(), 0..40), 0..5)
            .prop_map(|map| map.into_iter().collect::<Vec<_>>());
    let device = prop::option::of((
        0u8..0x7F,
        any::<bool>(),
        prop::collection::btree_map(0u8..64, (any::<u8>(), any::<u8>()), 0..8),
    ))
    .prop_map(|section| {
        section.map(|(device, flush, records)| DeviceSection {
            device,
            flush,
            distances: records
                .into_iter()
                .map(|(device, (latency, bandwidth))| (device, latency, bandwidth))
                .collect(),
        })
    });
    (0u8..10, entries, device).prop_map(|(mem_type, entries, device)| KeySpec {
        mem_type,
        entries,
        device,
    })
}

/// One edit of a key: the ways a frame gets corrupted or forged.
#[derive(Debug, Clone)]
enum Mutation {
    SetByte { index: usize, value: u8 },
    Truncate { len: usize },
    Insert { index: usize, value: u8 },
    Remove { index: usize },
    Append { bytes: Vec<u8> },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(index, value)| Mutation::SetByte { index, value }),
        any::<usize>().prop_map(|len| Mutation::Truncate { len }),
        (any::<usize>(), any::<u8>()).prop_map(|(index, value)| Mutation::Insert { index, value }),
        any::<usize>().prop_map(|index| Mutation::Remove { index }),
        prop::collection::vec(any::<u8>(), 1..8).prop_map(|bytes| Mutation::Append { bytes }),
    ]
}

fn apply(key: &mut Vec<u8>, mutation: &Mutation) {
    match *mutation {
        Mutation::SetByte { index, value } if !key.is_empty() => {
            let index = index % key.len();
            key[index] = value;
        }
        Mutation::Truncate { len } => key.truncate(len % (key.len() + 1)),
        Mutation::Insert { index, value } => key.insert(index % (key.len() + 1), value),
        Mutation::Remove { index } if !key.is_empty() => {
            let index = index % key.len();
            key.remove(index);
        }
        Mutation::Append { ref bytes } => key.extend_from_slice(bytes),
        _ => {}
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic_and_accepted_ones_stay_in_bounds(
        key in prop::collection::vec(any::<u8>(), 0..(MAX_PACKED_KEY_LEN + 16)),
    ) {
        check(&key)?;
    }

    #[test]
    fn random_bytes_behind_a_plausible_header_stay_in_bounds(
        md_map in prop_oneof![Just(0u64), 1u64..16, any::<u64>()],
        mem_type in 0u8..12,
        tail in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut key = md_map.to_le_bytes().to_vec();
        key.push(mem_type);
        key.extend_from_slice(&tail);
        check(&key)?;
    }

    #[test]
    fn every_packer_shaped_key_is_accepted_and_read_to_its_end(spec in key_spec()) {
        let key = spec.build();
        prop_assert_eq!(validate_packed_key(&format(), &key), Ok(()));
        let parse = model_unpack(&key).expect("built key stays in bounds");
        prop_assert_eq!(parse.consumed, key.len());
        prop_assert_eq!(parse.md_map, spec.md_map());
        prop_assert_eq!(parse.mem_type, spec.mem_type);
    }

    #[test]
    fn mutated_real_keys_never_panic_and_accepted_ones_stay_in_bounds(
        pick in any::<prop::sample::Index>(),
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let keys = real_keys();
        let mut key = keys[pick.index(keys.len())].bytes.clone();
        for m in &mutations {
            apply(&mut key, m);
        }
        check(&key)?;
    }

    #[test]
    fn mutated_packer_shaped_keys_never_panic_and_accepted_ones_stay_in_bounds(
        spec in key_spec(),
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let mut key = spec.build();
        for m in &mutations {
            apply(&mut key, m);
        }
        check(&key)?;
    }
}

/// Every single-byte substitution of a key that has every section: 256
/// values at each position, checked exhaustively rather than sampled.
#[test]
fn every_single_byte_substitution_of_a_full_key_keeps_the_property() {
    let original = full_key();
    let mut accepted = 0usize;
    for index in 0..original.len() {
        for value in 0..=u8::MAX {
            let mut key = original.clone();
            key[index] = value;
            check(&key).unwrap_or_else(|err| panic!("byte {index} = {value:#x}: {err}"));
            accepted += usize::from(validate_packed_key(&format(), &key).is_ok());
        }
    }
    // Entry contents and distance values are free, so many substitutions
    // remain valid keys; structural bytes are not.
    assert!(
        accepted > original.len(),
        "suspiciously few accepted: {accepted}"
    );
    assert!(accepted < original.len() * 256, "everything accepted");
}
