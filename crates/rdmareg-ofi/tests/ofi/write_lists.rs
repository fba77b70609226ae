//! Write lists end to end over `tcp;ofi_rxm` and `shm`: a batch's puts of
//! at most 64 KiB travel to each owner as write lists. Batches mixing them
//! with large puts, across two owners, with puts an owner refuses among
//! them, land exactly the accepted puts, each put answering what it
//! answers alone, and each owner's written log lists exactly them; an
//! unmap racing write lists answers and nothing lands after it; a writer
//! shut down with lists in flight answers every put.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{OWNER, SeamForTestMemory};
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{Access, BackendPut, BackendRegion, PeerId, RdmaError, WrittenLog};
use rdmareg_ofi::key::PackedKey;
use rdmareg_ofi::{OfiEngine, Provider};

/// How the writer names the second owner.
const SECOND_OWNER: PeerId = PeerId(2);
/// The writer's source.
const SRC_LEN: usize = 1 << 20;
/// The first owner's writable registration.
const A_LEN: usize = 1 << 20;
/// The second owner's writable registration.
const B_LEN: usize = 256 << 10;
/// The first owner's read-only registration.
const RO_LEN: usize = 128 << 10;
/// What the read-only registration holds throughout.
const READ_ONLY: u8 = 0x17;

fn source_byte(offset: usize) -> u8 {
    (offset % 251) as u8 ^ 0x5C
}

fn put(
    peer: PeerId,
    key: &Bytes,
    remote_addr: u64,
    src: &BackendRegion,
    offset: u64,
    len: u64,
) -> BackendPut {
    BackendPut {
        peer,
        remote_addr,
        packed_key: key.clone(),
        local_region_id: src.backend_region_id,
        local_offset: offset,
        len,
        deadline: Some(Duration::from_secs(5)),
    }
}

/// Where a put of the mixed batches goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// The first owner's writable registration.
    A,
    /// The second owner's writable registration.
    B,
    /// The first owner's read-only registration.
    ReadOnly,
    /// A registration of the first owner, unmapped before the batch.
    Unmapped,
    /// The first owner's writable registration, under a key whose
    /// capability was changed.
    Forged,
    /// The first owner's writable registration, under a key that claims
    /// twice its length (so the writer's own check of the range passes).
    Stretched,
}

/// A put of a mixed batch: `len` source bytes from `src` to `remote` (an
/// offset in its target), and what it must answer.
#[derive(Debug, Clone)]
struct Planned {
    target: Target,
    remote: u64,
    src: u64,
    len: u64,
    answer: Result<(), RdmaError>,
}

fn ok(target: Target, remote: u64, src: u64, len: u64) -> Planned {
    Planned {
        target,
        remote,
        src,
        len,
        answer: Ok(()),
    }
}

fn refused(target: Target, remote: u64, src: u64, len: u64, error: RdmaError) -> Planned {
    Planned {
        answer: Err(error),
        ..ok(target, remote, src, len)
    }
}

/// A writer and two owners: what the writer puts from, what the owners
/// hold, and what their writable registrations must hold.
struct Owners {
    owner_a: OfiEngine,
    owner_b: OfiEngine,
    writer: OfiEngine,
    src: Vec<u8>,
    s: BackendRegion,
    a: Vec<u8>,
    a_region: BackendRegion,
    b: Vec<u8>,
    b_region: BackendRegion,
    read_only: Vec<u8>,
    ro_region: BackendRegion,
    unmapped_key: Bytes,
    /// The unmapped registration's first byte, as an address in the owner.
    unmapped_base: u64,
    forged_key: Bytes,
    stretched_key: Bytes,
    expected_a: Vec<u8>,
    expected_b: Vec<u8>,
}

impl Owners {
    async fn new(provider: Provider) -> Owners {
        let (owner_a, writer) = common::engines(provider.clone());
        let owner_b = OfiEngine::start(common::config(provider)).expect("owner starts");
        writer
            .add_peer(SECOND_OWNER, owner_b.fabric_address())
            .expect("the writer records the second owner");
        let (o, p, w) = (owner_a.backend(), owner_b.backend(), writer.backend());
        let src: Vec<u8> = (0..SRC_LEN).map(source_byte).collect();
        let s = w
            .map_test_memory(src.as_ptr() as usize, SRC_LEN)
            .await
            .unwrap();
        let mut a = vec![0u8; A_LEN];
        let a_region = o
            .map_test_memory_with_access(a.as_mut_ptr() as usize, A_LEN, Access::ReadWrite)
            .await
            .unwrap();
        let mut b = vec![0u8; B_LEN];
        let b_region = p
            .map_test_memory_with_access(b.as_mut_ptr() as usize, B_LEN, Access::Write)
            .await
            .unwrap();
        let read_only = vec![READ_ONLY; RO_LEN];
        let ro_region = o
            .map_test_memory(read_only.as_ptr() as usize, RO_LEN)
            .await
            .unwrap();
        let gone = vec![0u8; 4096];
        let gone_region = o
            .map_test_memory_with_access(gone.as_ptr() as usize, 4096, Access::Write)
            .await
            .unwrap();
        o.unmap(gone_region.backend_region_id).await.unwrap();
        let mut forged = PackedKey::decode(&a_region.packed_key).unwrap();
        forged.capability[0] ^= 1;
        let mut stretched = PackedKey::decode(&a_region.packed_key).unwrap();
        stretched.len *= 2;
        Owners {
            owner_a,
            owner_b,
            writer,
            src,
            s,
            a,
            a_region,
            b,
            b_region,
            read_only,
            ro_region,
            unmapped_key: gone_region.packed_key,
            unmapped_base: gone.as_ptr() as u64,
            forged_key: forged.encode(),
            stretched_key: stretched.encode(),
            expected_a: vec![0; A_LEN],
            expected_b: vec![0; B_LEN],
        }
    }

    /// The put `planned` describes.
    fn put(&self, planned: &Planned) -> BackendPut {
        let (peer, key, base) = match planned.target {
            Target::A => (OWNER, &self.a_region.packed_key, self.a.as_ptr() as u64),
            Target::B => (
                SECOND_OWNER,
                &self.b_region.packed_key,
                self.b.as_ptr() as u64,
            ),
            Target::ReadOnly => (
                OWNER,
                &self.ro_region.packed_key,
                self.read_only.as_ptr() as u64,
            ),
            Target::Unmapped => (OWNER, &self.unmapped_key, self.unmapped_base),
            Target::Forged => (OWNER, &self.forged_key, self.a.as_ptr() as u64),
            Target::Stretched => (OWNER, &self.stretched_key, self.a.as_ptr() as u64),
        };
        let remote = base + planned.remote;
        put(peer, key, remote, &self.s, planned.src, planned.len)
    }

    /// Puts `plan` as one batch and checks it: each put answers what it
    /// was planned to; each writable registration holds exactly the
    /// accepted puts' bytes over what it held; each owner's log lists
    /// exactly the accepted puts; the read-only registration is untouched.
    async fn run(&mut self, what: &str, plan: &[Planned]) {
        let requests: Vec<BackendPut> = plan.iter().map(|planned| self.put(planned)).collect();
        let answers = self
            .writer
            .backend()
            .put_batch_from_test_memory(requests)
            .await;
        let (mut log_a, mut log_b) = (WrittenLog::default(), WrittenLog::default());
        for planned in plan.iter().filter(|planned| planned.answer.is_ok()) {
            let (expected, log) = match planned.target {
                Target::A => (&mut self.expected_a, &mut log_a),
                Target::B => (&mut self.expected_b, &mut log_b),
                other => panic!("{other:?} accepts no put"),
            };
            let (at, src, len) = (
                planned.remote as usize,
                planned.src as usize,
                planned.len as usize,
            );
            expected[at..at + len].copy_from_slice(&self.src[src..src + len]);
            log.record(planned.remote..planned.remote + planned.len);
        }
        let written_a = self
            .owner_a
            .backend()
            .take_written(self.a_region.backend_region_id)
            .await;
        let written_b = self
            .owner_b
            .backend()
            .take_written(self.b_region.backend_region_id)
            .await;
        for (index, (planned, answer)) in plan.iter().zip(&answers).enumerate() {
            assert_eq!(answer, &planned.answer, "{what}: put {index}: {planned:?}");
        }
        let wrong_a = (0..A_LEN).find(|&at| self.a[at] != self.expected_a[at]);
        assert_eq!(
            wrong_a, None,
            "{what}: first wrong byte of the first owner's"
        );
        let wrong_b = (0..B_LEN).find(|&at| self.b[at] != self.expected_b[at]);
        assert_eq!(
            wrong_b, None,
            "{what}: first wrong byte of the second owner's"
        );
        assert_eq!(written_a, Ok(log_a.take()), "{what}: the first owner's log");
        assert_eq!(
            written_b,
            Ok(log_b.take()),
            "{what}: the second owner's log"
        );
        assert!(
            self.read_only.iter().all(|&b| b == READ_ONLY),
            "{what}: the read-only registration changed"
        );
    }

    /// Puts each put of `plan` alone: each answers as planned.
    async fn run_alone(&self, what: &str, plan: &[Planned]) {
        let w = self.writer.backend();
        for (index, planned) in plan.iter().enumerate() {
            let answer = w.put_from_test_memory(self.put(planned)).await;
            assert_eq!(
                answer, planned.answer,
                "{what}: put {index} alone: {planned:?}"
            );
        }
    }

    async fn finish(self) {
        let unmapped = [
            self.owner_a
                .backend()
                .unmap(self.a_region.backend_region_id)
                .await,
            self.owner_a
                .backend()
                .unmap(self.ro_region.backend_region_id)
                .await,
            self.owner_b
                .backend()
                .unmap(self.b_region.backend_region_id)
                .await,
            self.writer.backend().unmap(self.s.backend_region_id).await,
        ];
        self.writer.shutdown().await;
        self.owner_a.shutdown().await;
        self.owner_b.shutdown().await;
        assert_eq!(unmapped, [Ok(()), Ok(()), Ok(()), Ok(())]);
        for engine in [&self.writer, &self.owner_a, &self.owner_b] {
            assert_eq!(engine.live_registrations(), 0);
        }
    }
}

/// Batches mixing puts of 1 B to 64 KiB (which travel as write lists),
/// puts over 64 KiB and over a write chunk (which do not), two owners in
/// turn, and puts refused among them: to a read-only registration (small
/// and large), under a forged key, to a registration unmapped before,
/// past the end of a registration (refused by the writer itself, or, under
/// a key that claims more than the registration, by the owner). Each
/// put answers what it answers alone, with its typed error; the writable
/// registrations hold exactly the accepted puts' bytes, and each owner's
/// written log lists exactly them. A second batch of 70 small puts to one
/// owner (more than one list holds) with puts to the other and a refused
/// one among them does the same.
async fn mixed_batches_land_exactly(provider: Provider) {
    use Target::{A, B, Forged, ReadOnly, Stretched, Unmapped};
    let mut owners = Owners::new(provider.clone()).await;
    let denied = || RdmaError::AccessDenied { operation: "write" };
    let first = [
        ok(A, 0, 0, 8),
        ok(B, 0, 3, 16),
        refused(ReadOnly, 0, 0, 64, denied()),
        ok(A, 100, 50, 4096),
        refused(Unmapped, 0, 0, 32, RdmaError::RegionNotFound),
        ok(A, 0x1_0000, 7, 64 << 10),
        ok(B, 0x1000, 9, 20_000),
        refused(Forged, 0x9_0000, 0, 32, RdmaError::RegionNotFound),
        ok(A, 0x2_0000, 11, (64 << 10) + 1),
        refused(A, A_LEN as u64 - 8, 0, 16, RdmaError::OutOfRange),
        refused(Stretched, A_LEN as u64 - 8, 0, 16, RdmaError::OutOfRange),
        ok(A, 0x4_0000, 13, 300_000),
        refused(ReadOnly, 0, 0, 100_000, denied()),
        ok(B, 0x8000, 100, 1),
        ok(A, 0xF_0000, 999, 1),
    ];
    owners
        .run(&format!("{provider:?}, first batch"), &first)
        .await;
    let mut second: Vec<Planned> = (0..70).map(|i| ok(B, i * 1000, i * 7, 1000)).collect();
    second.insert(10, ok(A, 0x8_0000, 1, 500));
    second.insert(40, refused(ReadOnly, 0x100, 0, 8, denied()));
    second.insert(
        50,
        refused(Stretched, A_LEN as u64, 0, 8, RdmaError::OutOfRange),
    );
    second.insert(60, ok(A, 0x8_1000, 2, 64 << 10));
    owners
        .run(&format!("{provider:?}, second batch"), &second)
        .await;
    owners.run_alone(&format!("{provider:?}"), &first).await;
    owners.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_batches_land_exactly_the_accepted_puts_over_tcp() {
    mixed_batches_land_exactly(Provider::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_batches_land_exactly_the_accepted_puts_over_shm() {
    mixed_batches_land_exactly(Provider::Shm).await;
}

/// Batches of 64 puts of 4 KiB (write lists as full as an owner's write
/// receive takes) into one registration race its unmap, back to back,
/// each batch from another place of the source so its bytes differ from
/// the last one's. The unmap answers `Ok` within 5 s; every put answers
/// `Ok` or `RegionNotFound`; a batch put after the unmap answered is
/// refused whole; and no byte of the target changes after the unmap
/// answered.
async fn unmap_racing_lists_answers(provider: Provider) {
    const LEN: usize = 256 << 10;
    const PUT_LEN: u64 = 4096;
    let (owner, writer) = common::engines(provider.clone());
    let (o, w) = (owner.backend(), writer.backend());
    let src: Vec<u8> = (0..2 * LEN).map(source_byte).collect();
    let s = w
        .map_test_memory(src.as_ptr() as usize, 2 * LEN)
        .await
        .unwrap();
    let mut dst = vec![0u8; LEN];
    let d = o
        .map_test_memory_with_access(dst.as_mut_ptr() as usize, LEN, Access::Write)
        .await
        .unwrap();
    let batch = |round: u64| -> Vec<BackendPut> {
        (0..LEN as u64 / PUT_LEN)
            .map(|i| {
                let at = i * PUT_LEN;
                put(
                    OWNER,
                    &d.packed_key,
                    dst.as_ptr() as u64 + at,
                    &s,
                    round + at,
                    PUT_LEN,
                )
            })
            .collect()
    };
    let before = w.put_batch_from_test_memory(batch(0)).await;
    assert_eq!(before, vec![Ok(()); batch(0).len()], "{provider:?}");
    let unmapped = AtomicBool::new(false);
    let racing = async {
        let mut rounds = Vec::new();
        let until = Instant::now() + Duration::from_secs(10);
        for round in 1.. {
            // (Past 10 s the unmap failed to answer: the check below says so.)
            let after_unmap = unmapped.load(Ordering::Acquire) || Instant::now() > until;
            rounds.push((
                after_unmap,
                w.put_batch_from_test_memory(batch(round)).await,
            ));
            if after_unmap {
                break;
            }
        }
        rounds
    };
    let unmap = async {
        tokio::time::sleep(Duration::from_millis(2)).await;
        let answer =
            tokio::time::timeout(Duration::from_secs(5), o.unmap(d.backend_region_id)).await;
        // A copy, taken the moment the unmap answered.
        let at_unmap = dst.clone();
        unmapped.store(true, Ordering::Release);
        (answer, at_unmap)
    };
    let (rounds, (answer, at_unmap)) = futures::join!(racing, unmap);
    // Let any straggler arrive before looking again.
    tokio::time::sleep(Duration::from_millis(200)).await;
    w.unmap(s.backend_region_id).await.unwrap();
    writer.shutdown().await;
    owner.shutdown().await;
    eprintln!("{provider:?}: {} batches raced the unmap", rounds.len());
    assert_eq!(
        answer,
        Ok(Ok(())),
        "{provider:?}: the unmap answered within 5 s"
    );
    for (after_unmap, answers) in &rounds {
        for answer in answers {
            assert!(
                matches!(answer, Ok(()) | Err(RdmaError::RegionNotFound)),
                "{provider:?}: a racing put: {answer:?}"
            );
        }
        if *after_unmap {
            assert!(
                answers
                    .iter()
                    .all(|answer| answer == &Err(RdmaError::RegionNotFound)),
                "{provider:?}: a batch put after the unmap answered: {answers:?}"
            );
        }
    }
    assert!(
        dst == at_unmap,
        "{provider:?}: bytes landed after the unmap answered"
    );
    assert_eq!(owner.live_registrations(), 0);
    assert_eq!(writer.live_registrations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmap_racing_write_lists_lands_nothing_after_over_tcp() {
    unmap_racing_lists_answers(Provider::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmap_racing_write_lists_lands_nothing_after_over_shm() {
    unmap_racing_lists_answers(Provider::Shm).await;
}

/// Four tasks put batches of 64 puts of 1 KiB (one write list each) back
/// to back, and once four batches answered the writer's engine is shut
/// down under the rest: the shutdown ends within 20 s, and every put
/// answers within 10 s, `Ok` or `ShuttingDown`. The owner then still
/// unmaps its registration.
async fn shutdown_answers_every_listed_put(provider: Provider) {
    const LEN: usize = 64 << 10;
    let (owner, writer) = common::engines(provider.clone());
    let (o, w) = (owner.backend(), writer.backend());
    let src: Vec<u8> = (0..LEN).map(source_byte).collect();
    let s = w.map_test_memory(src.as_ptr() as usize, LEN).await.unwrap();
    let mut dst = vec![0u8; LEN];
    let d = o
        .map_test_memory_with_access(dst.as_mut_ptr() as usize, LEN, Access::Write)
        .await
        .unwrap();
    let requests: Vec<BackendPut> = (0..64)
        .map(|i| {
            let at = i * 1024;
            put(OWNER, &d.packed_key, dst.as_ptr() as u64 + at, &s, at, 1024)
        })
        .collect();
    let answered = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let (w, requests, answered) = (w.clone(), requests.clone(), Arc::clone(&answered));
            tokio::spawn(async move {
                let mut batches = Vec::new();
                loop {
                    let answers = w.put_batch_from_test_memory(requests.clone()).await;
                    answered.fetch_add(1, Ordering::AcqRel);
                    let shutting_down = answers.contains(&Err(RdmaError::ShuttingDown));
                    batches.push(answers);
                    if shutting_down {
                        return batches;
                    }
                }
            })
        })
        .collect();
    while answered.load(Ordering::Acquire) < 4 {
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    let shut = tokio::time::timeout(Duration::from_secs(20), writer.shutdown()).await;
    let mut batches = Vec::new();
    for task in tasks {
        let ended = tokio::time::timeout(Duration::from_secs(10), task).await;
        batches.push(ended.map(|joined| joined.expect("the batch task")));
    }
    let unmapped = o.unmap(d.backend_region_id).await;
    owner.shutdown().await;
    assert!(
        shut.is_ok(),
        "{provider:?}: the shutdown did not end within 20 s"
    );
    for ended in &batches {
        let Ok(batches) = ended else {
            panic!("{provider:?}: a batch did not answer within 10 s");
        };
        for answer in batches.iter().flatten() {
            assert!(
                matches!(answer, Ok(()) | Err(RdmaError::ShuttingDown)),
                "{provider:?}: {answer:?}"
            );
        }
    }
    assert_eq!(unmapped, Ok(()));
    assert_eq!(owner.live_registrations(), 0);
    assert_eq!(writer.live_registrations(), 0);
    drop((src, dst));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_mid_write_lists_answers_every_put_over_tcp() {
    shutdown_answers_every_listed_put(Provider::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_mid_write_lists_answers_every_put_over_shm() {
    shutdown_answers_every_listed_put(Provider::Shm).await;
}
