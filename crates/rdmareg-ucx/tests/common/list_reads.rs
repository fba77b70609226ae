//! What the entries of a list read from a [`Scene`](super::scene::Scene)'s
//! source, as the tests of list replies from an owner engine ask them:
//! entry `i` at an odd offset of its own, spread over the source; the
//! bytes it must land; the requests of a list of [`Slots`]; the two
//! maximal lists; and a list posted as one batch with the destination's
//! bytes taken as the answers came.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::sync::Arc;
use std::time::Duration;

use rdmareg_core::{BackendGet, Descriptor};
use rdmareg_ucx::UcxBackend;

use super::list_scene::{Answers, KIB, Slots, scatter_lens};
use super::scene::SOURCE_LEN;
use super::{OWNER, SeamForTestMemory};

/// Where entry `i` of a list reads in the source: odd offsets, spread out.
pub fn src_offset(i: usize) -> usize {
    7 + (i * 12_289) % (SOURCE_LEN - 32 * KIB)
}

/// What entry `i` of length `len` reads from a source whose bytes are
/// `want`.
pub fn wanted(want: &[u8], i: usize, len: usize) -> Vec<u8> {
    want[src_offset(i)..src_offset(i) + len].to_vec()
}

/// The requests of the list of `slots` from `source`, entry `i` at
/// [`src_offset`]`(i)`, due in `deadline(i)`.
pub fn requests_from(
    slots: &Slots,
    source: &Descriptor,
    deadline: impl Fn(usize) -> Option<Duration>,
) -> Vec<BackendGet> {
    (0..slots.lens.len())
        .map(|i| {
            slots.request(
                i,
                OWNER,
                source.addr() + src_offset(i) as u64,
                source.packed_key(),
                deadline(i),
            )
        })
        .collect()
}

/// The `n`th of the two maximal lists, by turns: 64 × 4 KiB, 16 × 16 KiB.
pub fn maximal_list(n: usize) -> Vec<usize> {
    if n % 2 == 0 {
        scatter_lens()
    } else {
        vec![16 * KIB; 16]
    }
}

/// Posts `requests` as one batch, and returns the answers with the
/// destination as it was when they came (taken before anything else
/// touches it).
pub async fn batch_with_snapshot(
    cb: &Arc<UcxBackend>,
    slots: &Slots,
    requests: Vec<BackendGet>,
) -> (Answers, Vec<u8>) {
    let answers = cb.get_batch_into_test_memory(requests).await;
    (answers, slots.buf.snapshot())
}
