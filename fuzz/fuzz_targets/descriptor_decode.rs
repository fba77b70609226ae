//! Fuzzes the wire descriptor decoder, [`Descriptor::decode`] and
//! [`Descriptor::decode_prefix`], on arbitrary bytes.
//!
//! Besides "never panics", every decoded descriptor must satisfy what the
//! encoding promises: re-encoding it gives back exactly the bytes it was
//! decoded from, its range does not overflow the address space, and its
//! packed key is within the cap. The two entry points must agree: `decode`
//! succeeds exactly when `decode_prefix` consumes the whole input. Bytes
//! after a decoded prefix also drive [`Descriptor::slice`], which a consumer
//! calls with offsets it computes.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmareg_core::{Descriptor, DescriptorError, MAX_BACKEND_KEY_LEN, MAX_PACKED_KEY_LEN};

fuzz_target!(|data: &[u8]| {
    let whole = Descriptor::decode(data);
    let (descriptor, used) = match Descriptor::decode_prefix(data) {
        Ok(decoded) => decoded,
        Err(error) => {
            assert_eq!(whole, Err(error), "decode and decode_prefix disagree");
            return;
        }
    };
    check_invariants(&descriptor);
    assert!(
        used <= data.len(),
        "consumed {used} of {} bytes",
        data.len()
    );
    assert_eq!(descriptor.encoded_len(), used);
    assert_eq!(
        descriptor.encode().as_ref(),
        &data[..used],
        "re-encoding differs from the consumed bytes"
    );

    if used == data.len() {
        assert_eq!(whole.as_ref(), Ok(&descriptor));
    } else {
        assert_eq!(
            whole,
            Err(DescriptorError::TrailingBytes(data.len() - used))
        );
        check_slice(&descriptor, &data[used..]);
    }
});

/// What every descriptor, decoded or sliced, must satisfy.
fn check_invariants(descriptor: &Descriptor) {
    assert!(descriptor.addr() != 0, "null address");
    assert!(!descriptor.is_empty(), "zero length");
    assert!(
        descriptor.addr().checked_add(descriptor.len()).is_some(),
        "addr + len overflows"
    );
    let key_len = descriptor.packed_key().len();
    assert!(
        (1..=MAX_PACKED_KEY_LEN).contains(&key_len),
        "packed key of {key_len} bytes"
    );
    let backend_key = descriptor.backend_key();
    assert!((1..=MAX_BACKEND_KEY_LEN).contains(&backend_key.len()));
    assert!(backend_key.bytes().all(|b| b.is_ascii_graphic()));
}

/// Cuts a sub-range whose offset and length come from `rest`, and checks it
/// is refused exactly when it is empty or leaves the parent.
fn check_slice(parent: &Descriptor, rest: &[u8]) {
    let Some((offset, rest)) = take_u64(rest) else {
        return;
    };
    let Some((len, _)) = take_u64(rest) else {
        return;
    };
    let fits = len != 0
        && offset
            .checked_add(len)
            .is_some_and(|end| end <= parent.len());
    match parent.slice(offset, len) {
        Ok(child) => {
            assert!(fits, "slice({offset}, {len}) of {} accepted", parent.len());
            check_invariants(&child);
            assert_eq!(child.addr(), parent.addr() + offset);
            assert_eq!(child.len(), len);
            assert_eq!(child.generation(), parent.generation());
            assert_eq!(child.packed_key(), parent.packed_key());
            let wire = child.encode();
            assert_eq!(Descriptor::decode(&wire), Ok(child));
        }
        Err(_) => assert!(!fits, "slice({offset}, {len}) of {} refused", parent.len()),
    }
}

fn take_u64(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let (head, rest) = bytes.split_first_chunk::<8>()?;
    Some((u64::from_le_bytes(*head), rest))
}
