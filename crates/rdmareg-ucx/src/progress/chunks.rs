//! Which served reads and writes over tcp go in chunks of one fragment
//! each, and how they are cut.
//!
//! UCX 1.22 sends a reply longer than one tcp fragment but below its
//! rendezvous threshold (65 521 to 273 738 bytes with 64 KiB segments) as
//! several eager fragments, assembled in a buffer of its own and copied
//! again. Asked as reads of at most [`CHUNK`] bytes, each reply arrives in
//! one fragment and is copied once (`docs/operations.md`, "Chunked reads
//! over tcp").
//!
//! - Only served reads are split, each chunk a read of its own (request,
//!   reply, deadline, destination hold); the read completes once its last
//!   chunk does (`results`).
//! - Only while fewer than [`SPLIT_WHILE_FEWER_THAN`] reads are in flight:
//!   each chunk counts against the owner's bound on unfinished replies.
//! - Only with UCX's own thresholds (`UcxConfig::fragment_chunks_allowed`):
//!   with a low rendezvous threshold the chunks themselves would go by
//!   rendezvous. Only the consumer's settings are visible here.
//! - In a list of two reads or more, a read longer than
//!   [`MAX_GATHERED_ENTRY`] and at most twice it goes in two chunks, the
//!   first of that bound, batched with the list's other small reads
//!   (`read_lists`). A lone read of that size goes whole.
//!
//! # Writes
//!
//! A write is always eager (`puts`), so a PUT longer than one fragment
//! arrives in several, is assembled by the owner's UCX and copied again
//! into the registration. A PUT longer than [`SHORTEST_WRITE_SPLIT`] and
//! at most [`LONGEST_WRITE_SPLIT`] goes in chunks of [`CHUNK`] bytes, each
//! a write of its own that arrives in one fragment and is copied once.
//! The conditions: an endpoint whose active messages go over tcp (its
//! lanes are tcp, beside which only cma, which carries no active
//! messages, may stand; a write never goes by rendezvous, so cma does not
//! matter to it as it does to reads), UCX's own segment sizes, and fewer
//! than [`SPLIT_WHILE_FEWER_THAN`] writes in flight. Shorter PUTs gain
//! nothing measurable from the cut, and longer ones go in chunks of
//! `puts::WRITE_CHUNK`, so that one PUT never holds more than a few dozen
//! chunks in flight.

use crate::read_list::MAX_GATHERED_ENTRY;

/// Longest reply that arrives in one fragment over 64 KiB tcp segments.
///
/// The 20-byte reply header and UCX's own share the segment
/// (`UCX_PROTO_INFO=y` shows the split).
pub(super) const ONE_FRAGMENT: usize = 65_520;
/// Largest chunk: one fragment, with room to spare, and 15 pages, so that
/// every chunk starts page-aligned when the read does.
pub(super) const CHUNK: usize = 60 * 1024;
// A write chunk and its request header fit one fragment too.
const _: () = assert!(CHUNK + rdmareg_engine::served::wire::REQUEST_LEN <= ONE_FRAGMENT);
/// Largest read that is split: the longest reply UCX 1.22 sends eager over
/// tcp by default; longer replies go by rendezvous, straight into the
/// destination.
pub(super) const LARGEST_SPLIT: usize = 273_738;
/// Longest chunk of a list's read split to be batched: the list entry bound
/// itself, so every chunk is batched.
pub(super) const LIST_CHUNK: usize = MAX_GATHERED_ENTRY as usize;
/// Longest read of a list that is split to be batched: two chunks.
pub(super) const LONGEST_LIST_SPLIT: usize = 2 * LIST_CHUNK;
/// Reads in flight (chunks included) from which reads go whole; writes in
/// flight from which PUTs go in chunks of `puts::WRITE_CHUNK`.
pub(super) const SPLIT_WHILE_FEWER_THAN: usize = 1024;
/// PUTs of at most this many bytes are not cut into fragment-sized chunks.
pub(super) const SHORTEST_WRITE_SPLIT: usize = 256 * 1024;
/// Longest PUT cut into fragment-sized chunks: 70 of them.
pub(super) const LONGEST_WRITE_SPLIT: usize = 4 << 20;

/// The chunk length a PUT of `len` bytes goes in over an endpoint that
/// allows fragment-sized chunks, or `None` if it goes in chunks of
/// `puts::WRITE_CHUNK`.
pub(super) fn write_chunk(len: usize) -> Option<usize> {
    (len > SHORTEST_WRITE_SPLIT && len <= LONGEST_WRITE_SPLIT).then_some(CHUNK)
}

/// The chunks a read of `len` bytes is asked in, or `None` if it goes whole.
///
/// Each is `(offset, len)` within the read, full chunks first.
/// `in_a_list`: the read is one of a batch of two or more.
pub(super) fn chunks(
    len: usize,
    in_a_list: bool,
) -> Option<impl ExactSizeIterator<Item = (usize, usize)>> {
    let chunk = if len > ONE_FRAGMENT && len <= LARGEST_SPLIT {
        CHUNK
    } else if in_a_list && len > LIST_CHUNK && len <= LONGEST_LIST_SPLIT {
        LIST_CHUNK
    } else {
        return None;
    };
    Some(
        (0..len)
            .step_by(chunk)
            .map(move |offset| (offset, chunk.min(len - offset))),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(len: usize) -> Option<Vec<(usize, usize)>> {
        chunks(len, false).map(Iterator::collect)
    }

    fn split_in_a_list(len: usize) -> Option<Vec<(usize, usize)>> {
        chunks(len, true).map(Iterator::collect)
    }

    #[test]
    fn reads_that_fit_one_fragment_or_go_by_rendezvous_are_not_split() {
        for len in [1, 4096, CHUNK, ONE_FRAGMENT, LARGEST_SPLIT + 1, 1 << 20] {
            assert_eq!(split(len), None, "{len}");
        }
    }

    #[test]
    fn chunks_cover_the_read_in_order_each_within_one_fragment() {
        for len in [
            ONE_FRAGMENT + 1,
            64 * 1024,
            100_003,
            128 * 1024,
            200_000,
            256 * 1024,
            LARGEST_SPLIT,
        ] {
            let chunks = split(len).unwrap_or_else(|| panic!("{len} is split"));
            assert!(chunks.len() >= 2, "{len}: {chunks:?}");
            let mut next = 0;
            for &(offset, chunk) in &chunks {
                assert_eq!(offset, next, "{len}: contiguous, in order");
                assert!(
                    chunk > 0 && chunk <= CHUNK,
                    "{len}: {chunk} fits a fragment"
                );
                next = offset + chunk;
            }
            assert_eq!(next, len, "{len}: nothing left out");
            // Full chunks first, each starting on a page boundary of the
            // read; only the last may be shorter.
            assert!(chunks.iter().all(|(offset, _)| offset % 4096 == 0));
            assert!(
                chunks[..chunks.len() - 1]
                    .iter()
                    .all(|&(_, chunk)| chunk == CHUNK)
            );
        }
    }

    #[test]
    fn puts_over_256_kib_up_to_4_mib_are_cut_into_chunks() {
        for len in [1, CHUNK, ONE_FRAGMENT + 1, SHORTEST_WRITE_SPLIT] {
            assert_eq!(write_chunk(len), None, "{len}");
        }
        for len in [SHORTEST_WRITE_SPLIT + 1, 1 << 20, LONGEST_WRITE_SPLIT] {
            assert_eq!(write_chunk(len), Some(CHUNK), "{len}");
        }
        assert_eq!(write_chunk(LONGEST_WRITE_SPLIT + 1), None);
    }

    #[test]
    fn a_256_kib_read_goes_in_four_full_chunks_and_a_remainder() {
        let chunks = split(256 * 1024).expect("split");
        assert_eq!(chunks.len(), 5);
        assert_eq!(chunks[4], (4 * CHUNK, 16 * 1024));
        // A 64 KiB read: one full chunk and 4 KiB.
        assert_eq!(split(64 * 1024), Some(vec![(0, CHUNK), (CHUNK, 4096)]));
    }

    #[test]
    fn in_a_list_reads_up_to_twice_the_bound_go_in_two_chunks() {
        for len in [LIST_CHUNK + 1, 20 * 1024 + 3, LONGEST_LIST_SPLIT] {
            let chunks = split_in_a_list(len).unwrap_or_else(|| panic!("{len} is split"));
            assert_eq!(
                chunks,
                vec![(0, LIST_CHUNK), (LIST_CHUNK, len - LIST_CHUNK)],
                "{len}: a full list chunk, then the rest"
            );
            assert!(
                chunks
                    .iter()
                    .all(|&(_, chunk)| chunk > 0 && chunk <= LIST_CHUNK)
            );
            assert_eq!(LIST_CHUNK % 4096, 0, "the second chunk starts on a page");
        }
    }

    #[test]
    fn in_a_list_small_and_longer_reads_split_as_alone() {
        let stay_whole = [
            1,
            4096,
            LIST_CHUNK,
            LONGEST_LIST_SPLIT + 1,
            48 * 1024,
            CHUNK,
            ONE_FRAGMENT,
            LARGEST_SPLIT + 1,
            1 << 20,
        ];
        for len in stay_whole {
            assert_eq!(split_in_a_list(len), None, "{len}");
        }
        for len in [ONE_FRAGMENT + 1, 64 * 1024, 256 * 1024, LARGEST_SPLIT] {
            assert_eq!(split_in_a_list(len), split(len), "{len}");
        }
    }

    #[test]
    fn a_lone_read_that_fits_one_fragment_goes_whole_whatever_its_length() {
        for len in [LIST_CHUNK + 1, LONGEST_LIST_SPLIT, CHUNK, ONE_FRAGMENT] {
            assert_eq!(split(len), None, "{len}");
        }
    }
}
