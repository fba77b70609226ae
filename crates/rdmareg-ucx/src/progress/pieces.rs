//! Owner-served tcp reads split into chunks ("pieces") of one reply fragment each.
//!
//! UCX 1.22 sends an active-message reply that is longer than one transport
//! fragment but below its rendezvous threshold as several eager fragments,
//! which the consumer's UCX gathers into a buffer of its own before the
//! reply handler sees any of it; the handler then copies the whole reply
//! again into the destination. Over tcp with this engine's 64 KiB segments
//! that is every reply of 65 521 to 273 738 bytes. A read in that range
//! asked as several reads of at most [`PIECE`] bytes gets replies that each
//! arrive in one fragment, are copied once, and stream back to back from
//! the owner.
//!
//! # Rules
//!
//! - Only owner-served reads are split: same-host copies and direct reads
//!   are one operation whatever their length.
//! - Each piece is a read of its own (its own request, reply, deadline and
//!   destination hold), so everything a single read guarantees holds for
//!   each piece; the read is answered once its last piece is (`answer`).
//! - Reads are split only while fewer than [`SPLIT_WHILE_FEWER_THAN`] reads
//!   are in flight: each piece counts against the owner's bound on
//!   unfinished replies per connection (4096 by default), and with that
//!   many reads in flight the lane is busy anyway, so the pieces would buy
//!   nothing but refusals.
//! - Only with UCX's own protocol thresholds: an engine whose operator sets
//!   the rendezvous threshold, a tcp segment size or UCX's older protocols
//!   never splits (`UcxConfig::reads_in_pieces_allowed`). With a low
//!   rendezvous threshold the pieces themselves would be received by
//!   rendezvous: five receives instead of one, each holding a slot of the
//!   owner's bound on unfinished replies until the consumer takes it.
//!   Only the consumer's own settings can be seen here: how replies travel
//!   is the owner's to decide, and an owner with other thresholds gets
//!   reads in pieces that are no faster than whole ones. (Lists are the
//!   other way round: the owner cuts its replies to fragment size by its
//!   own settings, see `gathered`.)
//! - Reads past [`LARGEST_SPLIT`] go whole: UCX receives those by
//!   rendezvous straight into the destination, with no copy to save.
//! - In a list (a batch of two reads or more), a read longer than the
//!   gathered bound ([`MAX_GATHERED_ENTRY`], 16 KiB) and at most twice it
//!   is asked in two pieces, the first of that bound, which are gathered
//!   with the list's other reads (`gathered`). Alone, such a read costs a
//!   request and a reply that fills at most half a fragment; in pieces,
//!   up to 256 KiB of reads share one request and each reply carries the
//!   pieces of several. Longer reads that fit one fragment stay whole: in
//!   short lists their requests already travel back to back, and pieces
//!   would only add reads to track. The pieces are gathered entries like
//!   any list's small reads, so this asks nothing new of the owner's
//!   protocol; each holds a place under its bound of unfinished replies,
//!   and a list's pieces are admitted together (an owner whose bound is set
//!   below twice a list's count of such reads refuses the excess as busy).
//!   A lone read goes whole: its pieces would travel in one request and one
//!   reply as the whole read does, at the cost of more reads to track.

use crate::read_list::MAX_GATHERED_ENTRY;

/// Longest reply that arrives in one fragment over 64 KiB tcp segments.
///
/// The 20-byte reply header and UCX's own share the segment
/// (`UCX_PROTO_INFO=y` shows the split).
pub(super) const ONE_FRAGMENT: usize = 65_520;
/// Largest piece: one fragment, with room to spare, and 15 pages, so that
/// every piece starts page-aligned when the read does.
pub(super) const PIECE: usize = 60 * 1024;
/// Largest read that is split: the longest reply UCX 1.22 sends eager.
///
/// That is over tcp by default (found with `UCX_PROTO_INFO=y`, as
/// [`ONE_FRAGMENT`]); longer replies go by rendezvous, straight into the
/// destination.
pub(super) const LARGEST_SPLIT: usize = 273_738;
/// Longest piece of a read of a list split to be gathered: the gathered
/// bound itself, so every piece is gathered.
pub(super) const GATHERED_PIECE: usize = MAX_GATHERED_ENTRY as usize;
/// Longest read of a list that is split to be gathered: two pieces.
pub(super) const LONGEST_GATHERED_SPLIT: usize = 2 * GATHERED_PIECE;
/// Reads in flight (pieces included) from which reads go whole: pieces then
/// add at most this many replies to an owner's count.
pub(super) const SPLIT_WHILE_FEWER_THAN: usize = 1024;

/// The chunks a read of `len` bytes is asked in, or `None` if it goes whole.
///
/// Each is `(offset, len)` within the read. `in_a_list`: the read is one of a
/// batch of two or more. Full pieces first, then what is left: a short
/// remainder is gathered with other small reads when the read is part of a
/// list (`gathered`), where it shares a request and a reply rather than
/// costing one of each.
pub(super) fn pieces(
    len: usize,
    in_a_list: bool,
) -> Option<impl ExactSizeIterator<Item = (usize, usize)>> {
    let piece = if len > ONE_FRAGMENT && len <= LARGEST_SPLIT {
        PIECE
    } else if in_a_list && len > GATHERED_PIECE && len <= LONGEST_GATHERED_SPLIT {
        GATHERED_PIECE
    } else {
        return None;
    };
    Some(
        (0..len)
            .step_by(piece)
            .map(move |offset| (offset, piece.min(len - offset))),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(len: usize) -> Option<Vec<(usize, usize)>> {
        pieces(len, false).map(Iterator::collect)
    }

    fn split_in_a_list(len: usize) -> Option<Vec<(usize, usize)>> {
        pieces(len, true).map(Iterator::collect)
    }

    #[test]
    fn reads_that_fit_one_fragment_or_go_by_rendezvous_are_not_split() {
        for len in [1, 4096, PIECE, ONE_FRAGMENT, LARGEST_SPLIT + 1, 1 << 20] {
            assert_eq!(split(len), None, "{len}");
        }
    }

    #[test]
    fn pieces_cover_the_read_exactly_in_order_each_within_one_fragment() {
        for len in [
            ONE_FRAGMENT + 1,
            64 * 1024,
            100_003,
            128 * 1024,
            200_000,
            256 * 1024,
            LARGEST_SPLIT,
        ] {
            let pieces = split(len).unwrap_or_else(|| panic!("{len} is split"));
            assert!(pieces.len() >= 2, "{len}: {pieces:?}");
            let mut next = 0;
            for &(offset, piece) in &pieces {
                assert_eq!(offset, next, "{len}: contiguous, in order");
                assert!(
                    piece > 0 && piece <= PIECE,
                    "{len}: {piece} fits a fragment"
                );
                next = offset + piece;
            }
            assert_eq!(next, len, "{len}: nothing left out");
            // Full pieces first, each starting on a page boundary of the
            // read; only the last may be shorter.
            assert!(pieces.iter().all(|(offset, _)| offset % 4096 == 0));
            assert!(
                pieces[..pieces.len() - 1]
                    .iter()
                    .all(|&(_, piece)| piece == PIECE)
            );
        }
    }

    #[test]
    fn a_256_kib_read_goes_in_four_full_pieces_and_a_gatherable_remainder() {
        let pieces = split(256 * 1024).expect("split");
        assert_eq!(pieces.len(), 5);
        assert_eq!(pieces[4], (4 * PIECE, 16 * 1024));
        // A 64 KiB read: one full piece and 4 KiB.
        assert_eq!(split(64 * 1024), Some(vec![(0, PIECE), (PIECE, 4096)]));
    }

    #[test]
    fn in_a_list_reads_of_up_to_twice_the_gathered_bound_go_in_two_gathered_pieces() {
        for len in [GATHERED_PIECE + 1, 20 * 1024 + 3, LONGEST_GATHERED_SPLIT] {
            let pieces = split_in_a_list(len).unwrap_or_else(|| panic!("{len} is split"));
            assert_eq!(
                pieces,
                vec![(0, GATHERED_PIECE), (GATHERED_PIECE, len - GATHERED_PIECE)],
                "{len}: a full gathered piece, then the rest"
            );
            assert!(
                pieces
                    .iter()
                    .all(|&(_, piece)| piece > 0 && piece <= GATHERED_PIECE)
            );
            assert_eq!(
                GATHERED_PIECE % 4096,
                0,
                "the second piece starts on a page"
            );
        }
    }

    #[test]
    fn in_a_list_gatherable_and_longer_reads_split_as_they_would_alone() {
        let stay_whole = [
            1,
            4096,
            GATHERED_PIECE,
            LONGEST_GATHERED_SPLIT + 1,
            48 * 1024,
            PIECE,
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
        for len in [
            GATHERED_PIECE + 1,
            LONGEST_GATHERED_SPLIT,
            PIECE,
            ONE_FRAGMENT,
        ] {
            assert_eq!(split(len), None, "{len}");
        }
    }
}
