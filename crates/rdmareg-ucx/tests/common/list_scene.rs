//! Where the entries of a read list land: one destination buffer per list,
//! every entry in its own range between guard bytes, judged entry by entry
//! once the list answered, and watched afterwards for bytes landing after
//! an error answer.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, PeerId, RdmaError};
use rdmareg_ucx::UcxBackend;
use rdmareg_ucx::read_list::MAX_LIST_ENTRIES;

use super::{PageBuf, differing_bytes, map};

pub const KIB: usize = 1024;
/// Bytes between two entries' destinations (and before the first and
/// after the last), which no read may touch.
pub const GUARD: usize = 4096 + 7;
/// What a destination is overwritten with once its read answered an error.
pub const SCRIBBLE: u8 = 0xEE;
/// Long enough for any straggling reply of a list.
pub const WATCH: Duration = Duration::from_millis(100);

/// A batch's answers, one per read.
pub type Answers = Vec<Result<(), RdmaError>>;

/// 64 reads of 4 KiB: the bench's scatter list, five fragment replies.
pub fn scatter_lens() -> Vec<usize> {
    vec![4 * KIB; MAX_LIST_ENTRIES]
}

/// The destinations of one list: entry `i` of `lens[i]` bytes at its own
/// offset, with [`GUARD`] bytes around each.
/// Unmaps `region` on `consumer` (it must answer `Ok` within 5 s), shuts
/// the consumer down and checks it holds no registration.
pub fn unmap_and_shut_down(
    rt: &tokio::runtime::Runtime,
    consumer: &rdmareg_ucx::UcxEngine,
    region: u64,
) {
    let backend = consumer.backend();
    let unmapped = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), backend.unmap(region)).await
    });
    assert_eq!(unmapped, Ok(Ok(())), "the destination unmaps");
    rt.block_on(consumer.shutdown());
    assert_eq!(consumer.live_registrations(), Some(0));
}

pub struct Slots {
    pub buf: Arc<PageBuf>,
    /// The destination's registration on the consumer.
    pub region: u64,
    pub lens: Vec<usize>,
    offsets: Vec<usize>,
}

impl Slots {
    /// Maps the destinations of a list of `lens` on `cb`.
    pub async fn new(cb: &UcxBackend, lens: &[usize]) -> Slots {
        let mut offsets = Vec::with_capacity(lens.len());
        let mut at = GUARD;
        for &len in lens {
            offsets.push(at);
            at += len + GUARD;
        }
        let buf = Arc::new(PageBuf::zeroed(at));
        let region = map(cb, &buf).await.backend_region_id;
        Slots {
            buf,
            region,
            lens: lens.to_vec(),
            offsets,
        }
    }

    pub fn range(&self, i: usize) -> std::ops::Range<usize> {
        self.offsets[i]..self.offsets[i] + self.lens[i]
    }

    /// Entry `i` as a read of `packed_key`'s owner at `remote_addr`, due
    /// in `deadline`.
    pub fn request(
        &self,
        i: usize,
        peer: PeerId,
        remote_addr: u64,
        packed_key: &Bytes,
        deadline: Option<Duration>,
    ) -> BackendGet {
        BackendGet {
            peer,
            remote_addr,
            packed_key: packed_key.clone(),
            local_region_id: self.region,
            local_offset: self.offsets[i] as u64,
            len: self.lens[i] as u64,
            deadline,
        }
    }

    /// Judges `snapshot` (the buffer when `answers` came): an `Ok` entry
    /// holds exactly `want(i)`, an entry answered with an error holds none
    /// of its bytes, and no guard byte is set. Returns how many were `Ok`.
    pub fn judge(
        &self,
        snapshot: &[u8],
        answers: &[Result<(), RdmaError>],
        want: impl Fn(usize) -> Vec<u8>,
        what: &str,
    ) -> usize {
        assert_eq!(
            answers.len(),
            self.lens.len(),
            "{what}: one answer per entry"
        );
        let mut ok = 0;
        for (i, answer) in answers.iter().enumerate() {
            let landed = &snapshot[self.range(i)];
            match answer {
                Ok(()) => {
                    ok += 1;
                    let wrong = differing_bytes(landed, &want(i));
                    assert_eq!(
                        wrong, 0,
                        "{what}: entry {i} answered Ok with {wrong} wrong bytes"
                    );
                }
                Err(err) => {
                    let set = landed.iter().filter(|&&b| b != 0).count();
                    assert_eq!(
                        set, 0,
                        "{what}: entry {i} answered {err:?} yet holds {set} landed bytes"
                    );
                }
            }
        }
        self.assert_guards(snapshot, what);
        ok
    }

    fn assert_guards(&self, snapshot: &[u8], what: &str) {
        let mut at = 0;
        for i in 0..self.lens.len() {
            let outside = snapshot[at..self.offsets[i]]
                .iter()
                .filter(|&&b| b != 0)
                .count();
            assert_eq!(
                outside, 0,
                "{what}: {outside} bytes landed before entry {i}"
            );
            at = self.offsets[i] + self.lens[i];
        }
        let outside = snapshot[at..].iter().filter(|&&b| b != 0).count();
        assert_eq!(
            outside, 0,
            "{what}: {outside} bytes landed after the last entry"
        );
    }

    /// Overwrites the ranges of the entries answered with an error with
    /// [`SCRIBBLE`]: they are the caller's again. Returns those entries.
    pub fn scribble_failed(&self, answers: &[Result<(), RdmaError>]) -> Vec<usize> {
        let failed: Vec<usize> = (0..answers.len())
            .filter(|&i| answers[i].is_err())
            .collect();
        for &i in &failed {
            let range = self.range(i);
            // SAFETY: the entry answered, so by the backend's contract
            // nothing writes its range any more; the range lies inside the
            // buffer, which this test reaches only through raw pointers.
            unsafe {
                std::ptr::write_bytes(
                    (self.buf.addr() + range.start) as *mut u8,
                    SCRIBBLE,
                    range.len(),
                );
            }
        }
        failed
    }

    /// Checks that every entry of `failed` (as [`Slots::scribble_failed`]
    /// returned) still holds only [`SCRIBBLE`]: nothing landed after its
    /// error answer.
    pub fn assert_unchanged_since_scribbled(&self, failed: &[usize], what: &str) {
        let now = self.buf.snapshot();
        let changed: Vec<usize> = failed
            .iter()
            .copied()
            .filter(|&i| now[self.range(i)].iter().any(|&b| b != SCRIBBLE))
            .collect();
        assert_eq!(
            changed,
            Vec::<usize>::new(),
            "{what}: entries written after their error answer"
        );
    }
}
