//! What the tests of a list's reads asked in two gathered pieces share,
//! whether a raw owner or an owner engine answers them: the gathered
//! bound, which lengths go in pieces, and how a destination is judged once
//! its batch answered (each entry `Ok` with exactly its bytes or holding
//! only bytes its owner sent for it, nothing outside the entries, nothing
//! landing afterwards).

#![allow(dead_code)] // Each test binary uses its own subset.

use rdmareg_ucx::read_list::MAX_GATHERED_ENTRY;

use super::list_scene::{Answers, SCRIBBLE, Slots};
use super::{PageBuf, differing_bytes};

/// The gathered bound: the first piece's length.
pub const BOUND: usize = MAX_GATHERED_ENTRY as usize;

/// Whether a list's read of `len` bytes goes in pieces over tcp.
pub fn pieced(len: usize) -> bool {
    (BOUND + 1..=2 * BOUND).contains(&len) || (65_521..=273_738).contains(&len)
}

/// Checks that no byte of `snapshot` outside the entries of `slots` is set.
pub fn assert_guards(slots: &Slots, snapshot: &[u8], what: &str) {
    let mut inside = vec![false; snapshot.len()];
    for i in 0..slots.lens.len() {
        inside[slots.range(i)].iter_mut().for_each(|b| *b = true);
    }
    let outside = snapshot
        .iter()
        .zip(&inside)
        .filter(|&(&b, &entry)| !entry && b != 0)
        .count();
    assert_eq!(
        outside, 0,
        "{what}: {outside} bytes landed outside every entry"
    );
}

/// Judges `snapshot`, the destination when `answers` came: an `Ok` entry
/// holds exactly `want(i)`; an entry answered with an error holds at each
/// byte nothing or `owned(i)`'s byte there (what its owner sent for it);
/// no byte outside the entries is set. Returns how many were `Ok`.
pub fn judge(
    slots: &Slots,
    snapshot: &[u8],
    answers: &Answers,
    want: impl Fn(usize) -> Vec<u8>,
    owned: impl Fn(usize) -> Vec<u8>,
    what: &str,
) -> usize {
    assert_eq!(
        answers.len(),
        slots.lens.len(),
        "{what}: one answer per entry"
    );
    let mut ok = 0;
    for (i, answer) in answers.iter().enumerate() {
        let landed = &snapshot[slots.range(i)];
        let len = slots.lens[i];
        if answer.is_ok() {
            ok += 1;
            let wrong = differing_bytes(landed, &want(i));
            assert_eq!(
                wrong, 0,
                "{what}: entry {i} ({len} B) Ok with {wrong} wrong bytes"
            );
        } else {
            let owned = owned(i);
            let foreign = (0..len)
                .filter(|&k| landed[k] != 0 && owned.get(k) != Some(&landed[k]))
                .count();
            assert_eq!(
                foreign, 0,
                "{what}: entry {i} ({len} B) answered {answer:?} holds {foreign} foreign bytes"
            );
        }
    }
    assert_guards(slots, snapshot, what);
    ok
}

/// Bytes of `buf` that are no longer [`SCRIBBLE`].
pub fn unscribbled(buf: &PageBuf) -> usize {
    buf.snapshot().iter().filter(|&&b| b != SCRIBBLE).count()
}
