//! The same-host direct lane for writes: a PUT copied into the owner's
//! process (`process_vm_writev`) under its release table's lock, without
//! asking the owner's engine.
//!
//! These pin down what such a write checks instead of the owner (the key's
//! range, the release slot under its lock), that an unmap waits for a
//! writer holding the lock and not for one that died, and that what the
//! key does not grant goes to the owner, which refuses it.

use crate::common;

use std::time::Duration;

use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{Access, BackendRegion, RdmaError};
use rdmareg_ucx::read_protocol::ReadKey;
use rdmareg_ucx::{EngineAddress, Transport};

/// Bytes before the first slot of a release table, and bytes per slot:
/// the layout a same-host writer locks (`release_table`, "Writers").
const TABLE_HEADER: i64 = 64;
const SLOT_BYTES: i64 = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writable_registration_gets_a_writable_same_host_key() {
    let (owner, consumer) = engines(Transport::SameHost);
    let ob = owner.backend();
    let buf = PageBuf::zeroed(8192);
    for access in [Access::Write, Access::ReadWrite] {
        let region = map_writable(&ob, &buf, access).await;
        let key = same_host_key(&region.packed_key);
        assert_eq!(key.access, access);
        assert_eq!((key.region_addr, key.region_len), (buf.addr() as u64, 8192));
        assert_eq!(ob.unmap(region.backend_region_id).await, Ok(()));
    }
    let read_only = map(&ob, &buf).await;
    assert_eq!(same_host_key(&read_only.packed_key).access, Access::Read);
    assert_eq!(ob.unmap(read_only.backend_region_id).await, Ok(()));
    consumer.shutdown().await;
    owner.shutdown().await;
}

/// The last 8 bytes of the capability are the part no release slot holds:
/// the owner would refuse a write that presents them altered, the direct
/// lane does not ask it. That this write lands shows it went one-sided;
/// every byte lands where the key says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_host_put_is_copied_without_asking_the_owner() {
    let (owner, consumer) = engines(Transport::SameHost);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let target = PageBuf::zeroed(3 << 20);
    let src = PageBuf::filled(target.len(), pattern);
    let region = map_writable(&ob, &target, Access::Write).await;
    let src_region = map(&cb, &src).await;
    let request = put_request(
        &src_region,
        0,
        target.addr() as u64,
        forged_capability_tail(&region.packed_key),
        src.len(),
    );
    assert_eq!(put(&cb, request).await, Ok(()));
    assert!(target.snapshot() == src.snapshot(), "every byte landed");
    // Through the owner the same key is refused.
    let served = same_host_key(&forged_capability_tail(&region.packed_key)).served;
    let request = put_request(
        &src_region,
        0,
        target.addr() as u64,
        bytes::Bytes::copy_from_slice(&served.encode()),
        4096,
    );
    assert_eq!(put(&cb, request).await, Err(RdmaError::RegionNotFound));
    assert_eq!(ob.unmap(region.backend_region_id).await, Ok(()));
    consumer.shutdown().await;
    owner.shutdown().await;
}

/// After the owner unmapped the registration and reused the memory, a PUT
/// with the old descriptor fails `RegionNotFound` and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_writable_descriptor_writes_nothing() {
    let (owner, consumer) = engines(Transport::SameHost);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let target = PageBuf::zeroed(8192);
    let src = PageBuf::filled(8192, pattern);
    let region = map_writable(&ob, &target, Access::ReadWrite).await;
    let src_region = map(&cb, &src).await;
    let key = region.packed_key.clone();
    assert_eq!(ob.unmap(region.backend_region_id).await, Ok(()));
    target.fill(0x3C);
    let request = put_request(&src_region, 0, target.addr() as u64, key, src.len());
    assert_eq!(put(&cb, request).await, Err(RdmaError::RegionNotFound));
    assert!(
        target.snapshot().iter().all(|&b| b == 0x3C),
        "the memory's new contents are untouched"
    );
    consumer.shutdown().await;
    owner.shutdown().await;
}

/// A key whose mapped range was altered to cover memory beside the
/// registration names no live slot: the release tag binds the range, so
/// the write is refused before a byte is copied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_with_an_altered_range_writes_nothing() {
    let (owner, consumer) = engines(Transport::SameHost);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let memory = PageBuf::zeroed(3 * 4096);
    let beside = memory.addr() as u64;
    let registered = PageBuf::zeroed(4096);
    let src = PageBuf::filled(4096, pattern);
    let region = map_writable(&ob, &registered, Access::Write).await;
    let src_region = map(&cb, &src).await;
    let mut key = same_host_key(&region.packed_key);
    key.region_addr = beside;
    key.region_len = memory.len() as u64;
    let forged = bytes::Bytes::from(key.encode().unwrap());
    let request = put_request(&src_region, 0, beside + 4096, forged, 4096);
    assert_eq!(put(&cb, request).await, Err(RdmaError::RegionNotFound));
    assert!(memory.snapshot().iter().all(|&b| b == 0));
    assert!(registered.snapshot().iter().all(|&b| b == 0));
    assert_eq!(ob.unmap(region.backend_region_id).await, Ok(()));
    consumer.shutdown().await;
    owner.shutdown().await;
}

/// A PUT past the end of the key's range is not copied; the owner refuses
/// it and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_past_the_keys_range_is_refused_by_the_owner() {
    let (owner, consumer) = engines(Transport::SameHost);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let memory = PageBuf::zeroed(2 * 4096);
    let src = PageBuf::filled(4096, pattern);
    // SAFETY: as in `map_writable`: the first page of `memory`.
    let region = unsafe { ob.map_with_access(memory.addr(), 4096, Access::Write) }
        .await
        .unwrap();
    let src_region = map(&cb, &src).await;
    let request = put_request(
        &src_region,
        0,
        memory.addr() as u64 + 2048,
        region.packed_key.clone(),
        4096,
    );
    assert_eq!(put(&cb, request).await, Err(RdmaError::OutOfRange));
    assert!(memory.snapshot().iter().all(|&b| b == 0));
    assert_eq!(ob.unmap(region.backend_region_id).await, Ok(()));
    consumer.shutdown().await;
    owner.shutdown().await;
}

/// Where a writer finds `region`'s lock: the owner's release table (its
/// descriptor in the owner's process) and the byte range of its slot.
fn slot_lock_of(owner: &rdmareg_ucx::UcxEngine, region: &BackendRegion) -> (String, i64) {
    let address = EngineAddress::decode(&owner.worker_address()).unwrap();
    let table = address.release_table.expect("a release table is published");
    let slot = same_host_key(&region.packed_key).release_slot;
    (
        format!("/proc/{}/fd/{}", std::process::id(), table.fd),
        TABLE_HEADER + i64::from(slot) * SLOT_BYTES,
    )
}

/// An open-file-description read lock on `[start, start + 8)` of the file
/// `fd`, as a same-host writer takes it; `false` if refused.
fn lock_slot(fd: libc::c_int, start: i64, kind: libc::c_int) -> bool {
    // SAFETY: `flock` is plain data; all-zero is valid and `l_pid` must be
    // 0 for open-file-description locks.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = start;
    lock.l_len = SLOT_BYTES;
    // SAFETY: a valid record, and a descriptor the caller holds open.
    unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &lock) == 0 }
}

/// A writer that took the slot's lock before the unmap (and so may be
/// mid-write) holds the unmap up; once it lets go, the unmap answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmap_waits_for_a_writer_holding_the_slot() {
    use std::os::fd::AsRawFd as _;
    let (owner, consumer) = engines(Transport::SameHost);
    let ob = owner.backend();
    let target = PageBuf::zeroed(4096);
    let region = map_writable(&ob, &target, Access::Write).await;
    let (path, start) = slot_lock_of(&owner, &region);
    let table = std::fs::File::open(&path).expect("the owner's table opens");
    assert!(lock_slot(table.as_raw_fd(), start, libc::F_RDLCK));
    let unmap = ob.unmap(region.backend_region_id);
    let mut unmap = std::pin::pin!(unmap);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut unmap)
            .await
            .is_err(),
        "the unmap answered under a writer's lock"
    );
    assert!(lock_slot(table.as_raw_fd(), start, libc::F_UNLCK));
    let answered = tokio::time::timeout(Duration::from_secs(5), unmap).await;
    assert_eq!(answered.expect("the unmap answers once let go"), Ok(()));
    drop(table);
    consumer.shutdown().await;
    owner.shutdown().await;
}

/// A writer that died holding the lock holds nothing: the kernel drops a
/// lock with its holder's last descriptor, and the unmap answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_killed_holding_the_slot_holds_no_unmap_up() {
    let (owner, consumer) = engines(Transport::SameHost);
    let ob = owner.backend();
    let target = PageBuf::zeroed(4096);
    let region = map_writable(&ob, &target, Access::Write).await;
    let (path, start) = slot_lock_of(&owner, &region);
    let path = std::ffi::CString::new(path).unwrap();
    let mut report = [0 as libc::c_int; 2];
    // SAFETY: a valid two-element array for the pipe's ends.
    assert_eq!(unsafe { libc::pipe(report.as_mut_ptr()) }, 0);
    // SAFETY: the child only makes async-signal-safe calls (open, fcntl,
    // write, pause, _exit) before it is killed.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork");
    if child == 0 {
        // SAFETY: async-signal-safe calls on values prepared before fork.
        unsafe {
            let fd = libc::open(path.as_ptr(), libc::O_RDONLY);
            let locked = fd >= 0 && lock_slot(fd, start, libc::F_RDLCK);
            let byte = [u8::from(locked)];
            libc::write(report[1], byte.as_ptr().cast(), 1);
            loop {
                libc::pause();
            }
        }
    }
    let mut byte = [0u8];
    // SAFETY: reads one byte into `byte` from the pipe's read end.
    let read = unsafe { libc::read(report[0], byte.as_mut_ptr().cast(), 1) };
    assert_eq!((read, byte[0]), (1, 1), "the child took the slot's lock");
    let unmap = ob.unmap(region.backend_region_id);
    let mut unmap = std::pin::pin!(unmap);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut unmap)
            .await
            .is_err(),
        "the unmap answered under a writer's lock"
    );
    // SAFETY: signals and reaps the child forked above.
    unsafe {
        libc::kill(child, libc::SIGKILL);
        libc::waitpid(child, std::ptr::null_mut(), 0);
        libc::close(report[0]);
        libc::close(report[1]);
    }
    let answered = tokio::time::timeout(Duration::from_secs(5), unmap).await;
    assert_eq!(answered.expect("the unmap answers"), Ok(()));
    consumer.shutdown().await;
    owner.shutdown().await;
}

/// A key that grants writes only is never read one-sided: the read goes
/// to the owner, which refuses it, and nothing arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_only_key_is_never_read_on_the_direct_lane() {
    let (owner, consumer) = engines(Transport::SameHost);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let target = PageBuf::filled(4096, pattern);
    let dst = PageBuf::zeroed(4096);
    let region = map_writable(&ob, &target, Access::Write).await;
    let dst_region = map(&cb, &dst).await;
    let request = get_request(OWNER, &describe(&target, &region), &dst_region, 0, None);
    assert_eq!(
        cb.get_into_test_memory(request).await,
        Err(RdmaError::AccessDenied { operation: "read" })
    );
    assert!(dst.snapshot().iter().all(|&b| b == 0));
    assert_eq!(ob.unmap(region.backend_region_id).await, Ok(()));
    consumer.shutdown().await;
    owner.shutdown().await;
}

/// The owner never sees a direct write, so the written log of a
/// registration same-host peers may write one-sided always says it is
/// incomplete, and lists nothing it did not serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directly_writable_registrations_log_says_incomplete() {
    let (owner, consumer) = engines(Transport::SameHost);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let target = PageBuf::zeroed(8192);
    let src = PageBuf::filled(8192, pattern);
    let region = map_writable(&ob, &target, Access::Write).await;
    let src_region = map(&cb, &src).await;
    let request = put_request(
        &src_region,
        0,
        target.addr() as u64,
        region.packed_key.clone(),
        4096,
    );
    assert_eq!(put(&cb, request).await, Ok(()));
    let taken = ob.take_written(region.backend_region_id).await.unwrap();
    assert!(taken.incomplete, "{taken:?}");
    assert!(
        taken.ranges.is_empty(),
        "the owner served nothing: {taken:?}"
    );
    assert_eq!(ob.unmap(region.backend_region_id).await, Ok(()));
    consumer.shutdown().await;
    owner.shutdown().await;
}

/// An owner with direct writes off issues no writable same-host key: a
/// readable and writable registration gets a read-only one (reads stay
/// one-sided), a write-only one a served key, and every PUT is served and
/// logged whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_without_direct_writes_serves_and_logs_each_put() {
    let (owner, consumer) =
        engines_with(config(Transport::SameHost).with_same_host_direct_writes(false));
    let (ob, cb) = (owner.backend(), consumer.backend());
    let target = PageBuf::zeroed(8192);
    let src = PageBuf::filled(8192, pattern);
    let both = map_writable(&ob, &target, Access::ReadWrite).await;
    assert_eq!(same_host_key(&both.packed_key).access, Access::Read);
    let write_only = map_writable(&ob, &src, Access::Write).await;
    assert!(matches!(
        ReadKey::decode(&write_only.packed_key),
        Ok(ReadKey::Served(_))
    ));
    assert_eq!(ob.unmap(write_only.backend_region_id).await, Ok(()));
    let src_region = map(&cb, &src).await;
    let request = put_request(
        &src_region,
        0,
        target.addr() as u64,
        both.packed_key.clone(),
        4096,
    );
    assert_eq!(put(&cb, request).await, Ok(()));
    assert!(target.snapshot()[..4096] == src.snapshot()[..4096]);
    let taken = ob.take_written(both.backend_region_id).await.unwrap();
    assert_eq!(taken.ranges, vec![0u64..4096]);
    assert!(!taken.incomplete);
    assert_eq!(ob.unmap(both.backend_region_id).await, Ok(()));
    consumer.shutdown().await;
    owner.shutdown().await;
}

/// Once the progress thread has published the owner's process, a PUT of
/// at most the caller-copy limit is written on the caller's own thread;
/// its bytes land, a stale key still writes nothing, and larger PUTs go to
/// the thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_put_is_written_on_the_callers_thread() {
    let (owner, consumer) = engines(Transport::SameHost);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let target = PageBuf::zeroed(1 << 20);
    let src = PageBuf::filled(target.len(), pattern);
    let region = map_writable(&ob, &target, Access::Write).await;
    let src_region = map(&cb, &src).await;
    let at = target.addr() as u64;
    // The first goes to the thread, which publishes the owner's process.
    for _ in 0..3 {
        let request = put_request(&src_region, 0, at, region.packed_key.clone(), 4096);
        assert_eq!(put(&cb, request).await, Ok(()));
    }
    assert!(consumer.writes_made_on_caller_threads() >= 1);
    assert!(target.snapshot()[..4096] == src.snapshot()[..4096]);
    let before = consumer.writes_made_on_caller_threads();
    let request = put_request(&src_region, 0, at, region.packed_key.clone(), 1 << 20);
    assert_eq!(put(&cb, request).await, Ok(()));
    assert_eq!(
        consumer.writes_made_on_caller_threads(),
        before,
        "1 MiB is the thread's"
    );
    assert!(target.snapshot() == src.snapshot());
    assert_eq!(ob.unmap(region.backend_region_id).await, Ok(()));
    target.fill(0x3C);
    let request = put_request(&src_region, 0, at, region.packed_key.clone(), 4096);
    assert_eq!(put(&cb, request).await, Err(RdmaError::RegionNotFound));
    assert!(target.snapshot().iter().all(|&b| b == 0x3C));
    consumer.shutdown().await;
    owner.shutdown().await;
}

/// A batch of PUTs to two registrations, one of them unregistered before
/// the batch: the live one's PUTs land (in one vectored copy), the stale
/// one's fail `RegionNotFound` and write nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_writes_its_live_targets_and_refuses_a_stale_one() {
    let (owner, consumer) = engines(Transport::SameHost);
    let (ob, cb) = (owner.backend(), consumer.backend());
    let live = PageBuf::zeroed(8 * 4096);
    let stale = PageBuf::zeroed(4096);
    let src = PageBuf::filled(8 * 4096, pattern);
    let live_region = map_writable(&ob, &live, Access::Write).await;
    let stale_region = map_writable(&ob, &stale, Access::Write).await;
    let src_region = map(&cb, &src).await;
    let stale_key = stale_region.packed_key.clone();
    assert_eq!(ob.unmap(stale_region.backend_region_id).await, Ok(()));
    let mut requests = Vec::new();
    for block in 0..8u64 {
        requests.push(put_request(
            &src_region,
            block * 4096,
            live.addr() as u64 + block * 4096,
            live_region.packed_key.clone(),
            4096,
        ));
    }
    requests.insert(
        3,
        put_request(&src_region, 0, stale.addr() as u64, stale_key, 4096),
    );
    // SAFETY: every source is a `PageBuf` mapped on the consumer, alive
    // until after the batch answered; nothing writes it.
    let results = unsafe { cb.put_batch(requests) }.await;
    let mut want = vec![Ok(()); 9];
    want[3] = Err(RdmaError::RegionNotFound);
    assert_eq!(results, want);
    assert!(live.snapshot() == src.snapshot());
    assert!(stale.snapshot().iter().all(|&b| b == 0));
    assert_eq!(ob.unmap(live_region.backend_region_id).await, Ok(()));
    consumer.shutdown().await;
    owner.shutdown().await;
}
