//! Fuzzes the libfabric backend's owner-served read protocol on arbitrary
//! bytes: the single read request and the gathered list request an owner
//! receives from a consumer, and the gathered reply a consumer receives
//! from an owner. All of them come from peers.
//!
//! The input is a message; for the reply parser, its first byte also
//! picks how many entries (1 to 64) the list asked for, and their lengths
//! are drawn from the bytes after it. For every input:
//!
//! * no decoder panics;
//! * whatever a decoder accepts re-encodes to exactly the input;
//! * an accepted list keeps its bounds: 1 to 64 entries, each 1 to
//!   `GATHER_ENTRY_MAX` bytes, together at most `GATHER_TOTAL_MAX`, and
//!   its reply length is a status byte per entry plus those bytes;
//! * a gathered reply the parser accepts is exactly as long as its
//!   statuses and the asked lengths add up to, and every served entry's
//!   bytes lie inside it.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmareg_ofi::protocol::{
    GATHER_ENTRY_MAX, GATHER_TOTAL_MAX, ListRequest, MAX_LIST_ENTRIES, ReadRequest,
    parse_gathered,
};

fuzz_target!(|bytes: &[u8]| {
    if let Some(request) = ReadRequest::decode(bytes) {
        assert_eq!(request.encode(), bytes, "an accepted request re-encodes to itself");
    }
    if let Some(list) = ListRequest::decode(bytes) {
        assert_eq!(list.encode(), bytes, "an accepted list re-encodes to itself");
        assert!((1..=MAX_LIST_ENTRIES).contains(&list.entries.len()));
        let total: u64 = list.entries.iter().map(|e| e.length).sum();
        assert!(list.entries.iter().all(|e| (1..=GATHER_ENTRY_MAX).contains(&e.length)));
        assert!(total <= GATHER_TOTAL_MAX);
        assert_eq!(list.reply_len() as u64, list.entries.len() as u64 + total);
    }
    let Some((&count, rest)) = bytes.split_first() else {
        return;
    };
    let count = usize::from(count) % MAX_LIST_ENTRIES + 1;
    let lengths: Vec<u64> = (0..count)
        .map(|i| u64::from(rest.get(i).copied().unwrap_or(1)) + 1)
        .collect();
    if let Some(outcomes) = parse_gathered(rest, &lengths) {
        assert_eq!(outcomes.len(), count);
        let served: u64 = outcomes
            .iter()
            .zip(&lengths)
            .filter(|(outcome, _)| outcome.is_ok())
            .map(|(_, &length)| length)
            .sum();
        assert_eq!(rest.len() as u64, count as u64 + served, "the lengths add up");
        for (outcome, &length) in outcomes.iter().zip(&lengths) {
            if let Ok(at) = outcome {
                assert!(*at >= count && at + length as usize <= rest.len());
            }
        }
    }
});
