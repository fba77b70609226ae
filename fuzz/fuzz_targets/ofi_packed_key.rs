//! Fuzzes the libfabric backend's packed-key decoder
//! ([`PackedKey::decode`]) and fabric-address validator on arbitrary bytes.
//!
//! The input is a key, optionally followed by probe ranges: everything
//! after the first `52 + addr_len` bytes a key claims is read as
//! `(remote_addr, len)` pairs of little-endian `u64`s when the whole input
//! is not itself a valid key. For every input:
//!
//! * decoding never panics, and refuses with `InvalidKey` only;
//! * an accepted key is canonical: it re-encodes to exactly its bytes, and
//!   every field satisfies the layout's rules (non-zero region id and
//!   length, no overflow, no MR key on an owner-served key, an owner
//!   address of 1 to 256 bytes);
//! * a range the key accepts lies inside `[base, base + len)` and is not
//!   empty, and the target handed to `fi_read` is the address itself or
//!   its offset from `base`, as the key's flag says;
//! * the owner's address passes through every address-format check
//!   without a panic, and a string address that passes is printable text
//!   padded with NULs.

#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use rdmareg_core::RdmaError;
use rdmareg_ofi::key::{
    AddressFormat, HEADER_LEN, MAX_FABRIC_ADDRESS, PackedKey, validate_address,
};

fuzz_target!(|data: &[u8]| {
    let whole = Bytes::copy_from_slice(data);
    check(&whole, &[]);
    // A key followed by probe ranges.
    if data.len() >= HEADER_LEN {
        let claimed = HEADER_LEN + usize::from(u16::from_le_bytes([data[50], data[51]]));
        if claimed < data.len() {
            let key = Bytes::copy_from_slice(&data[..claimed]);
            let probes: Vec<(u64, u64)> = data[claimed..]
                .chunks_exact(16)
                .map(|pair| {
                    let word = |at: usize| {
                        u64::from_le_bytes(pair[at..at + 8].try_into().expect("8 bytes"))
                    };
                    (word(0), word(8))
                })
                .collect();
            check(&key, &probes);
        }
    }
});

fn check(bytes: &Bytes, probes: &[(u64, u64)]) {
    let key = match PackedKey::decode(bytes) {
        Ok(key) => key,
        Err(error) => {
            assert_eq!(error, RdmaError::InvalidKey);
            return;
        }
    };
    assert_eq!(key.encode(), *bytes, "an accepted key is canonical");
    assert_eq!(bytes.len(), HEADER_LEN + key.owner.len());
    assert!(!key.owner.is_empty() && key.owner.len() <= MAX_FABRIC_ADDRESS);
    assert_ne!(key.region_id, 0);
    assert_ne!(key.len, 0);
    let end = key.base.checked_add(key.len).expect("no overflow");
    assert!(!(key.owner_served && key.mr_key != 0));

    let edges = [
        (key.base, key.len),
        (key.base, 1),
        (end - 1, 1),
        (key.base.wrapping_sub(1), 1),
        (end, 1),
        (key.base, key.len.wrapping_add(1)),
        (u64::MAX, 1),
        (key.base, 0),
    ];
    for &(addr, len) in edges.iter().chain(probes) {
        match key.check_range(addr, len) {
            Ok(()) => {
                assert!(len > 0 && addr >= key.base, "[{addr:#x}, +{len})");
                assert!(addr.checked_add(len).is_some_and(|e| e <= end));
                let target = key.target(addr, len).expect("an accepted range");
                let expected = if key.virt_addr { addr } else { addr - key.base };
                assert_eq!(target, expected);
            }
            Err(error) => {
                assert_eq!(error, RdmaError::OutOfRange);
                assert_eq!(key.target(addr, len), Err(RdmaError::OutOfRange));
            }
        }
    }

    for format in [
        AddressFormat::SockaddrIn,
        AddressFormat::SockaddrIn6,
        AddressFormat::Str,
        AddressFormat::Opaque(key.owner.len()),
        AddressFormat::Opaque(16),
    ] {
        if validate_address(format, &key.owner).is_ok() && format == AddressFormat::Str {
            let text = key.owner.iter().position(|&b| b == 0).unwrap_or(key.owner.len());
            assert!(text > 0 && key.owner[..text].iter().all(u8::is_ascii_graphic));
            assert!(key.owner[text..].iter().all(|&b| b == 0));
        }
    }
}
