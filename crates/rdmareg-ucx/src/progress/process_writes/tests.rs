//! Tests of the kernel copies into a process: this process stands for the
//! owner.

use super::*;
use crate::owner_process::this_process_token;

fn this_process() -> OwnerProcess {
    OwnerProcess::this_process()
}

#[test]
fn a_write_lands_whole_in_the_owner() {
    let _ = this_process_token();
    let source: Vec<u8> = (0..=255u8).cycle().take(3 * 4096 + 17).collect();
    let mut target = vec![0u8; source.len()];
    // SAFETY: `source` is ours and readable across the call.
    let written = unsafe {
        copy_into_process(
            &this_process(),
            target.as_mut_ptr() as u64,
            source.as_ptr(),
            source.len(),
        )
    };
    assert_eq!(written, Ok(()));
    assert_eq!(target, source);
}

#[test]
fn a_write_to_another_token_writes_nothing() {
    let _ = this_process_token();
    let source = [7u8; 64];
    let mut target = [0u8; 64];
    let stranger = this_process().with_token([0x5A; TOKEN_LEN]);
    // SAFETY: as above.
    let written = unsafe {
        copy_into_process(
            &stranger,
            target.as_mut_ptr() as u64,
            source.as_ptr(),
            source.len(),
        )
    };
    assert!(written.is_err_and(|err| err.is_gone()));
    assert_eq!(target, [0u8; 64]);
}

#[test]
fn a_batch_lands_and_an_unwritable_entry_fails_alone() {
    let _ = this_process_token();
    let sources: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i + 1; 5000]).collect();
    let mut targets = vec![vec![0u8; 5000]; 3];
    let mut entries: Vec<WriteEntry> = sources
        .iter()
        .zip(&mut targets)
        .map(|(source, target)| WriteEntry {
            remote_addr: target.as_mut_ptr() as u64,
            source: source.as_ptr(),
            len: source.len(),
        })
        .collect();
    entries.insert(
        1,
        WriteEntry {
            remote_addr: 8,
            source: sources[0].as_ptr(),
            len: 64,
        },
    );
    // SAFETY: every source is ours and readable across the call.
    let outcomes = unsafe { copy_batch_into_process(&this_process(), &entries) };
    assert_eq!(
        outcomes,
        [Ok(()), Err(CopyError(libc::EFAULT)), Ok(()), Ok(())]
    );
    assert_eq!(targets, sources);
}

/// An entry the kernel stops inside (its second page is not writable)
/// fails after its writable part was written, without the loop
/// spinning on it, and the entry after it still lands.
#[test]
fn an_entry_stopped_inside_fails_and_the_next_still_lands() {
    let _ = this_process_token();
    // SAFETY: a fresh anonymous mapping of two pages, the second made
    // inaccessible; unmapped at the end of the test.
    let pages = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            8192,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(pages, libc::MAP_FAILED);
    // SAFETY: the second page of the mapping above, inside it.
    let second_page = unsafe { pages.cast::<u8>().add(4096) };
    // SAFETY: changes the protection of that page only, which nothing
    // refers to.
    let protected = unsafe { libc::mprotect(second_page.cast(), 4096, libc::PROT_NONE) };
    assert_eq!(protected, 0);
    let source = vec![7u8; 8192];
    let mut after = vec![0u8; 4096];
    let entries = [
        WriteEntry {
            remote_addr: pages as u64,
            source: source.as_ptr(),
            len: 8192,
        },
        WriteEntry {
            remote_addr: after.as_mut_ptr() as u64,
            source: source.as_ptr(),
            len: 4096,
        },
    ];
    // SAFETY: every source is ours and readable across the call.
    let outcomes = unsafe { copy_batch_into_process(&this_process(), &entries) };
    assert_eq!(outcomes, [Err(CopyError(libc::EFAULT)), Ok(())]);
    assert_eq!(after, vec![7u8; 4096]);
    // SAFETY: the first page is readable; the mapping is unmapped once.
    unsafe {
        assert!(
            std::slice::from_raw_parts(pages.cast::<u8>(), 4096)
                .iter()
                .all(|&b| b == 7)
        );
        libc::munmap(pages, 8192);
    }
}

/// A page-aligned buffer of `len` bytes (a whole number of pages)
/// filled with `fill`, so tests choose page offsets exactly.
fn pages(len: usize, fill: u8) -> Vec<u8> {
    let mut buffer = vec![fill; len + PAGE];
    let skip = buffer.as_ptr().align_offset(PAGE);
    buffer.drain(..skip);
    buffer.truncate(len);
    buffer
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
}

/// Whether each planned range starts at its target's page offset, and
/// inside `stage`.
fn staged(call: &Call, stage: &[u8]) -> Vec<bool> {
    let stage = stage.as_ptr_range();
    call.local
        .iter()
        .zip(&call.remote)
        .map(|(local, remote)| {
            let from = local.iov_base as *const u8;
            stage.contains(&from) && (from as usize ^ remote.iov_base as usize) & (PAGE - 1) == 0
        })
        .collect()
}

/// An entry of at least a page whose source and target differ in page
/// offset is planned from the stage at the target's offset, in pieces no
/// larger than the stage, the first call stopping inside it; an entry
/// whose offsets match, or shorter than a page, is planned from its own
/// source.
#[test]
fn mismatched_offsets_are_copied_from_the_stage() {
    let source = pages(4 * PAGE + 3 * STAGE_BYTES, 1);
    let target = pages(source.len(), 0);
    let base = target.as_ptr() as u64;
    let entries = [
        WriteEntry {
            remote_addr: base + 64,
            source: source.as_ptr(),
            len: 5000,
        },
        WriteEntry {
            remote_addr: base + 2 * PAGE as u64 + 16,
            source: source[PAGE + 16..].as_ptr(),
            len: 100,
        },
        WriteEntry {
            remote_addr: base + 2 * PAGE as u64 + 200,
            source: source[3..].as_ptr(),
            len: PAGE - 1,
        },
        WriteEntry {
            remote_addr: base + 4 * PAGE as u64 + 5,
            source: source[7..].as_ptr(),
            len: 2 * STAGE_BYTES,
        },
    ];
    let mut stage = Vec::new();
    let mut call = Call::with_capacity(4);
    // SAFETY: every source lies inside `source`.
    unsafe { call.plan(&entries, 0, 0, Some(&mut stage)) };
    assert_eq!(staged(&call, &stage), [true, false, false, true]);
    assert_eq!(call.local[1].iov_base as *const u8, entries[1].source);
    assert_eq!(call.local[2].iov_base as *const u8, entries[2].source);
    assert!(call.local[3].iov_len < entries[3].len);
    assert!(call.local[3].iov_len <= STAGE_BYTES + PAGE);
    // SAFETY: the planned ranges lie inside `stage` and `source`.
    let copied = unsafe {
        std::slice::from_raw_parts(call.local[3].iov_base as *const u8, call.local[3].iov_len)
    };
    assert_eq!(copied, &source[7..7 + copied.len()]);

    // The next call starts where this one stopped, staged again.
    let done = call.local[3].iov_len;
    // SAFETY: as above.
    unsafe { call.plan(&entries, 3, done, Some(&mut stage)) };
    assert_eq!(staged(&call, &stage), [true]);
    // SAFETY: as above.
    let copied = unsafe {
        std::slice::from_raw_parts(call.local[0].iov_base as *const u8, call.local[0].iov_len)
    };
    assert_eq!(copied, &source[7 + done..7 + done + copied.len()]);
}

/// Writes whose source and target differ in page offset land exactly,
/// short ones and ones several stages long, and no byte around them
/// changes.
#[test]
fn a_source_at_another_page_offset_lands_whole() {
    let _ = this_process_token();
    for (source_offset, target_offset, len) in [
        (0, 16, 1),
        (16, 0, 4095),
        (1, 4000, 4097),
        (0, 16, STAGE_BYTES),
        (4000, 1, STAGE_BYTES + PAGE + 1),
        (16, 100, 5 * STAGE_BYTES + 123),
    ] {
        let source = pattern(source_offset + len, 0x3C);
        let source = {
            let mut aligned = pages(source.len().next_multiple_of(PAGE), 0);
            aligned[..source.len()].copy_from_slice(&source);
            aligned
        };
        let mut target = pages((target_offset + len + 1).next_multiple_of(PAGE), 0xEE);
        // SAFETY: the source range lies inside `source`.
        let written = unsafe {
            copy_into_process(
                &this_process(),
                target.as_mut_ptr() as u64 + target_offset as u64,
                source[source_offset..].as_ptr(),
                len,
            )
        };
        assert_eq!(written, Ok(()), "{source_offset} {target_offset} {len}");
        assert_eq!(
            &target[target_offset..target_offset + len],
            &source[source_offset..source_offset + len]
        );
        assert!(target[..target_offset].iter().all(|&b| b == 0xEE));
        assert!(target[target_offset + len..].iter().all(|&b| b == 0xEE));
    }
}

/// A staged entry the kernel stops inside (its second page is not
/// writable) fails after its writable part landed, and the entry
/// after it still lands.
#[test]
fn a_staged_entry_stopped_inside_fails_and_the_next_still_lands() {
    let _ = this_process_token();
    // SAFETY: a fresh anonymous mapping of two pages, the second made
    // inaccessible; unmapped at the end of the test.
    let mapping = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            2 * PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(mapping, libc::MAP_FAILED);
    // SAFETY: the second page of the mapping above, inside it.
    let second_page = unsafe { mapping.cast::<u8>().add(PAGE) };
    // SAFETY: changes the protection of that page only, which nothing
    // refers to.
    let protected = unsafe { libc::mprotect(second_page.cast(), PAGE, libc::PROT_NONE) };
    assert_eq!(protected, 0);
    let source = pages(3 * PAGE, 7);
    let mut after = pages(PAGE, 0);
    let entries = [
        WriteEntry {
            remote_addr: mapping as u64 + 16,
            source: source.as_ptr(),
            len: 2 * PAGE - 16,
        },
        WriteEntry {
            remote_addr: after.as_mut_ptr() as u64 + 1,
            source: source.as_ptr(),
            len: PAGE - 1,
        },
    ];
    // SAFETY: every source is ours and readable across the call.
    let outcomes = unsafe { copy_batch_into_process(&this_process(), &entries) };
    assert_eq!(outcomes, [Err(CopyError(libc::EFAULT)), Ok(())]);
    assert_eq!(after[0], 0);
    assert!(after[1..].iter().all(|&b| b == 7));
    // SAFETY: the first page is readable; the mapping is unmapped once.
    unsafe {
        let first = std::slice::from_raw_parts(mapping.cast::<u8>(), PAGE);
        assert!(first[..16].iter().all(|&b| b == 0));
        assert!(first[16..].iter().all(|&b| b == 7));
        libc::munmap(mapping, 2 * PAGE);
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// A batch of entries at any page offsets on either side, some
    /// staged and some not, some empty, lands exactly: each target
    /// slot holds its own source bytes and nothing between slots
    /// changes.
    #[test]
    fn any_batch_of_offsets_lands_exactly(
        shapes in proptest::collection::vec(
            (0usize..PAGE, 0usize..PAGE, 0usize..3 * STAGE_BYTES),
            1..24,
        ),
    ) {
        let _ = this_process_token();
        let slot = |len: usize| (PAGE + len + 1).next_multiple_of(PAGE);
        let total: usize = shapes.iter().map(|&(_, _, len)| slot(len)).sum();
        let source = {
            let mut buffer = pages(total, 0);
            buffer.copy_from_slice(&pattern(total, 0x5A));
            buffer
        };
        let mut target = pages(total, 0xEE);
        let mut entries = Vec::new();
        let mut expected = vec![0xEE; total];
        let mut base = 0;
        for &(source_offset, target_offset, len) in &shapes {
            let from = base + source_offset;
            let to = base + target_offset;
            entries.push(WriteEntry {
                remote_addr: target.as_mut_ptr() as u64 + to as u64,
                source: source[from..].as_ptr(),
                len,
            });
            expected[to..to + len].copy_from_slice(&source[from..from + len]);
            base += slot(len);
        }
        // SAFETY: every source range lies inside `source`.
        let outcomes = unsafe { copy_batch_into_process(&this_process(), &entries) };
        proptest::prop_assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
        proptest::prop_assert!(target == expected);
    }
}

#[test]
fn a_write_to_an_unmapped_address_fails() {
    let _ = this_process_token();
    let source = [7u8; 64];
    // SAFETY: as above; the kernel checks the target address.
    let written = unsafe { copy_into_process(&this_process(), 8, source.as_ptr(), 64) };
    assert_eq!(written, Err(CopyError(libc::EFAULT)));
}

/// An anonymous read-write mapping of `len` bytes filled with `fill`.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn new(len: usize, fill: u8) -> Mapping {
        // SAFETY: a fresh anonymous mapping.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        // SAFETY: inside the mapping.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), fill, len) };
        Mapping {
            ptr: ptr.cast(),
            len,
        }
    }
    fn protect(&self, page: usize, prot: i32) {
        // SAFETY: a page inside the mapping.
        let rc = unsafe { libc::mprotect(self.ptr.add(page * PAGE).cast(), PAGE, prot) };
        assert_eq!(rc, 0);
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: the whole mapping, readable once every page is.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Runs `entries` as the function would, with `plan` alone, assuming
/// each call is written whole: how many calls the batch takes.
fn calls_needed(entries: &[WriteEntry]) -> usize {
    let mut stage = Vec::new();
    let mut call = Call::with_capacity(MAX_VECTORS);
    let (mut next, mut written_of_next, mut calls) = (0, 0, 0);
    while next < entries.len() {
        // SAFETY: plan only reads sources the tests made readable.
        unsafe { call.plan(entries, next, written_of_next, Some(&mut stage)) };
        calls += 1;
        let mut left: usize = call.local.iter().map(|v| v.iov_len).sum::<usize>() + written_of_next;
        while next < entries.len() && left >= entries[next].len {
            left -= entries[next].len;
            next += 1;
        }
        written_of_next = left;
    }
    calls
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Like `any_batch_of_offsets_lands_exactly`, but some entries
    /// have one unwritable page somewhere in their target range: those
    /// fail with EFAULT, their bytes before that page land, nothing
    /// after it or around any entry changes, and every other entry
    /// lands.
    #[test]
    fn unwritable_pages_fail_only_their_entries(
        shapes in proptest::collection::vec(
            (0usize..PAGE, 0usize..PAGE, 1usize..3 * STAGE_BYTES, proptest::option::weighted(0.3, 0usize..1000)),
            1..24,
        ),
    ) {
        let _ = this_process_token();
        let slot = |len: usize| (PAGE + len + 1).next_multiple_of(PAGE);
        let total: usize = shapes.iter().map(|&(_, _, len, _)| slot(len)).sum();
        let source = pattern(total + PAGE, 0x5A);
        let target = Mapping::new(total, 0xEE);
        let mut expected = vec![0xEEu8; total];
        let mut expected_outcomes = Vec::new();
        let mut entries = Vec::new();
        let mut bad_pages = Vec::new();
        let mut base = 0;
        for &(source_offset, target_offset, len, bad) in &shapes {
            let from = base + source_offset;
            let to = base + target_offset;
            entries.push(WriteEntry {
                // SAFETY: inside the mapping.
                remote_addr: unsafe { target.ptr.add(to) } as u64,
                source: source[from..].as_ptr(),
                len,
            });
            let end = match bad {
                Some(k) => {
                    let first = to / PAGE;
                    let last = (to + len - 1) / PAGE;
                    let page = first + k % (last - first + 1);
                    bad_pages.push(page);
                    expected_outcomes.push(Err(CopyError(libc::EFAULT)));
                    (page * PAGE).max(to)
                }
                None => {
                    expected_outcomes.push(Ok(()));
                    to + len
                }
            };
            expected[to..end].copy_from_slice(&source[from..from + (end - to)]);
            base += slot(len);
        }
        for &page in &bad_pages {
            target.protect(page, libc::PROT_NONE);
        }
        // SAFETY: every source range lies inside `source`.
        let outcomes = unsafe { copy_batch_into_process(&this_process(), &entries) };
        for &page in &bad_pages {
            target.protect(page, libc::PROT_READ | libc::PROT_WRITE);
        }
        proptest::prop_assert_eq!(outcomes, expected_outcomes);
        let differs = target.bytes().iter().zip(&expected).position(|(a, b)| a != b);
        proptest::prop_assert!(differs.is_none(), "first difference at {:?}", differs);
    }
}

/// More entries than one call may name, small and large, staged,
/// direct and empty, some unwritable: each lands or fails alone.
#[test]
fn more_entries_than_one_call_land_or_fail_alone() {
    let _ = this_process_token();
    let count = 3 * MAX_VECTORS + 17;
    let slot = 2 * PAGE;
    let source = pattern(count * slot + PAGE, 0x33);
    let target = Mapping::new(count * slot, 0xEE);
    let mut expected = vec![0xEEu8; count * slot];
    let mut entries = Vec::new();
    let mut want = Vec::new();
    let mut bad = Vec::new();
    for i in 0..count {
        let base = i * slot;
        let (source_offset, target_offset) = match i % 4 {
            0 => (16, 16), // direct
            1 => (0, 16),  // staged
            2 => (i % PAGE, (i * 7) % PAGE),
            _ => (100, 3000), // staged, crosses a page
        };
        let len = match i % 5 {
            0 => 1,
            1 => 64,
            2 => PAGE - 16,
            3 => 1000,
            _ => 0,
        };
        let unwritable = i % 97 == 5 && len > 0;
        let to = base + target_offset;
        let from = base + source_offset;
        entries.push(WriteEntry {
            // SAFETY: inside the mapping.
            remote_addr: unsafe { target.ptr.add(to) } as u64,
            source: source[from..].as_ptr(),
            len,
        });
        if unwritable {
            bad.push(to / PAGE);
            want.push(Err(CopyError(libc::EFAULT)));
        } else {
            expected[to..to + len].copy_from_slice(&source[from..from + len]);
            want.push(Ok(()));
        }
    }
    for &page in &bad {
        target.protect(page, libc::PROT_NONE);
    }
    // SAFETY: every source range lies inside `source`.
    let outcomes = unsafe { copy_batch_into_process(&this_process(), &entries) };
    for &page in &bad {
        target.protect(page, libc::PROT_READ | libc::PROT_WRITE);
    }
    assert_eq!(outcomes, want);
    assert!(target.bytes() == expected.as_slice());
}

/// A staged piece that ends exactly at the stage's end ends its call after
/// the direct and empty entries behind it, before the next staged one;
/// the next call goes on from there and every entry lands.
#[test]
fn a_piece_filling_the_stage_ends_its_call() {
    let _ = this_process_token();
    // Allocate this thread's stage with a staged write (offsets 0 and 1).
    let warm_source = pages(2 * PAGE, 1);
    let mut warm_target = pages(2 * PAGE, 0);
    // SAFETY: ours and readable.
    let warmed = unsafe {
        copy_into_process(
            &this_process(),
            warm_target[1..].as_mut_ptr() as u64,
            warm_source.as_ptr(),
            PAGE,
        )
    };
    assert_eq!(warmed, Ok(()));
    let stage_len = STAGE_BYTES + PAGE;
    let base = STAGE.with(|stage| {
        assert_eq!(stage.borrow().len(), stage_len);
        stage.borrow().as_ptr() as usize
    });
    let target = Mapping::new(8 * STAGE_BYTES, 0xEE);
    let source = pattern(8 * STAGE_BYTES, 0x77);
    for first_offset in [0usize, 1, 16, 4095] {
        target.protect(0, libc::PROT_READ | libc::PROT_WRITE);
        // SAFETY: whole mapping.
        unsafe { std::ptr::write_bytes(target.ptr, 0xEE, target.len) };
        let t0 = target.ptr as usize + first_offset;
        let at = (t0.wrapping_sub(base)) & (PAGE - 1);
        let len0 = stage_len - at;
        let src0 = if (source.as_ptr() as usize ^ t0) & (PAGE - 1) == 0 {
            1
        } else {
            0
        };
        let mut entries = vec![WriteEntry {
            remote_addr: t0 as u64,
            source: source[src0..].as_ptr(),
            len: len0,
        }];
        let mut to = first_offset + len0 + 100;
        let mut from = len0 + 10;
        for (k, len) in [(0usize, 500usize), (1, 0), (2, 5000), (3, 6000), (4, 1)] {
            let target_addr = target.ptr as usize + to;
            let mut src = from;
            let want_direct = k == 0;
            let aligned = (source[src..].as_ptr() as usize ^ target_addr) & (PAGE - 1) == 0;
            if want_direct != aligned {
                // Adjust the source to get (mis)alignment as wanted.
                let delta =
                    (target_addr.wrapping_sub(source[src..].as_ptr() as usize)) & (PAGE - 1);
                src += if want_direct { delta } else { 1 };
            }
            entries.push(WriteEntry {
                remote_addr: target_addr as u64,
                source: source[src..].as_ptr(),
                len,
            });
            to += len + 777;
            from = src + len + 3;
        }
        // The plan ends the first call after the direct and empty entries.
        let mut call = Call::with_capacity(8);
        STAGE.with(|stage| {
            let mut stage = stage.borrow_mut();
            // SAFETY: sources inside `source`.
            unsafe { call.plan(&entries, 0, 0, Some(&mut stage)) };
            let lens: Vec<usize> = call.local.iter().map(|v| v.iov_len).collect();
            assert_eq!(lens, [len0, 500, 0], "offset {first_offset}");
            assert_eq!(call.local[0].iov_base as usize + len0, base + stage_len);
            assert_eq!(call.local[1].iov_base as *const u8, entries[1].source);
        });
        let mut expected = vec![0xEEu8; target.len];
        for entry in &entries {
            let to = entry.remote_addr as usize - target.ptr as usize;
            let from = entry.source as usize - source.as_ptr() as usize;
            expected[to..to + entry.len].copy_from_slice(&source[from..from + entry.len]);
        }
        // SAFETY: sources inside `source`.
        let outcomes = unsafe { copy_batch_into_process(&this_process(), &entries) };
        assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
        assert!(
            target.bytes() == expected.as_slice(),
            "offset {first_offset}"
        );
        assert_eq!(STAGE.with(|stage| stage.borrow().as_ptr() as usize), base);
    }
}

/// Threads writing staged entries at once each use their own stage: every
/// write lands exactly, nothing around it changes.
#[test]
fn threads_writing_at_once_stage_apart() {
    let _ = this_process_token();
    let handles: Vec<_> = (0..4u8)
        .map(|t| {
            std::thread::spawn(move || {
                for round in 0..200usize {
                    let len = 1 + (round * 977 + t as usize * 131) % (2 * STAGE_BYTES);
                    let source = pattern(len + 7, t ^ round as u8);
                    let mut target = vec![0xEEu8; len + 64];
                    // SAFETY: ours and readable.
                    let written = unsafe {
                        copy_into_process(
                            &OwnerProcess::this_process(),
                            target[13..].as_mut_ptr() as u64,
                            source[7..].as_ptr(),
                            len,
                        )
                    };
                    assert_eq!(written, Ok(()));
                    assert_eq!(&target[13..13 + len], &source[7..7 + len]);
                    assert!(target[..13].iter().all(|&b| b == 0xEE));
                    assert!(target[13 + len..].iter().all(|&b| b == 0xEE));
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
}

/// A batch of as many 64-byte entries as one call may name, at scattered
/// targets whose page offsets differ from their sources', goes in one
/// call: entries shorter than a page are not staged, so they cannot fill
/// the stage with the gaps each staged entry may leave before it.
#[test]
fn small_mismatched_entries_share_one_call() {
    let count = MAX_VECTORS;
    let source = vec![1u8; count * 64 + PAGE];
    let target = vec![0u8; count * PAGE + PAGE];
    let mut entries = Vec::new();
    for i in 0..count {
        // Scattered 64-byte targets (as slots of a table), sources
        // packed: offsets differ for all but a few.
        let to = i * PAGE + (i * 1237) % (PAGE - 64);
        entries.push(WriteEntry {
            remote_addr: target[to..].as_ptr() as u64,
            source: source[i * 64..].as_ptr(),
            len: 64,
        });
    }
    let calls = calls_needed(&entries);
    assert_eq!(calls, 1, "{count} x 64 B entries take {calls} calls");
}

/// One window of [`aliased`] mappings.
const WINDOW: usize = 64 << 20;

/// `windows` consecutive mappings of one memfd of WINDOW bytes
/// (filled by `fill`), so gigabytes cost WINDOW of memory.
fn aliased(windows: usize, writable: bool, fill: impl Fn(usize) -> u8) -> (*mut u8, Vec<u8>) {
    // SAFETY: plain system calls on fresh descriptors and mappings.
    unsafe {
        let fd = libc::memfd_create(c"process-writes-test".as_ptr(), 0);
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, WINDOW as i64), 0);
        let contents: Vec<u8> = (0..WINDOW).map(&fill).collect();
        assert_eq!(
            libc::pwrite(fd, contents.as_ptr().cast(), WINDOW, 0),
            WINDOW as isize
        );
        let base = libc::mmap(
            std::ptr::null_mut(),
            windows * WINDOW,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        );
        assert_ne!(base, libc::MAP_FAILED);
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        for w in 0..windows {
            let at = libc::mmap(
                base.cast::<u8>().add(w * WINDOW).cast(),
                WINDOW,
                prot,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                0,
            );
            assert_ne!(at, libc::MAP_FAILED);
        }
        libc::close(fd);
        (base.cast(), contents)
    }
}

/// One call holding staged pieces and direct entries of 1.25 GiB each is
/// more than the kernel copies in one call (2 GiB less a page): it stops
/// inside the second large entry, the next call resumes there, and every
/// entry lands exactly. The large ranges are windows of one 64 MiB memfd
/// mapped again and again, so the test needs little memory.
#[test]
fn a_short_count_past_two_gib_resumes_amid_pieces() {
    let _ = this_process_token();
    let p = |i: usize| ((i / 7) as u8) ^ (i as u8).rotate_left(3);
    let (source, source_contents) = aliased(44, false, p);
    let (target1, _) = aliased(22, true, |_| 0xEE);
    let (target2, _) = aliased(22, true, |_| 0xEE);
    let small_source: Vec<u8> = (0..200_000).map(|i| (i % 253) as u8).collect();
    let mut a = vec![0xEEu8; 6000];
    let mut c = vec![0xEEu8; 30000];
    let mut d = vec![0xEEu8; 8192 * 2];
    let mut e = [0xEEu8; 10];
    let big = 5 * (1usize << 28) + 4321; // 1.25 GiB and some
    let s1 = 16 + 3 * PAGE;
    let s2 = (s1 + big).next_multiple_of(PAGE) + PAGE + 16;
    let t_off = 16;
    let d_src = {
        // a source at d's page offset
        let d_addr = d[100..].as_ptr() as usize;
        let mut k = 0;
        while (small_source[k..].as_ptr() as usize ^ d_addr) & (PAGE - 1) != 0 {
            k += 1;
        }
        k
    };
    // SAFETY: addresses inside the mappings made above.
    let entries = unsafe {
        [
            WriteEntry {
                remote_addr: a[1..].as_mut_ptr() as u64,
                source: small_source[2..].as_ptr(),
                len: 5000,
            },
            WriteEntry {
                remote_addr: target1.add(t_off) as u64,
                source: source.add(s1),
                len: big,
            },
            WriteEntry {
                remote_addr: c[3..].as_mut_ptr() as u64,
                source: small_source[5..].as_ptr(),
                len: 20000,
            },
            WriteEntry {
                remote_addr: target2.add(t_off) as u64,
                source: source.add(s2),
                len: big,
            },
            WriteEntry {
                remote_addr: d[100..].as_mut_ptr() as u64,
                source: small_source[d_src..].as_ptr(),
                len: 3000,
            },
            WriteEntry {
                remote_addr: e[1..].as_mut_ptr() as u64,
                source: small_source[9..].as_ptr(),
                len: 1,
            },
        ]
    };
    // The first call holds every entry, more than MAX_RW_COUNT bytes.
    {
        let mut call = Call::with_capacity(8);
        let mut stage = Vec::new();
        // SAFETY: every source is readable.
        unsafe { call.plan(&entries, 0, 0, Some(&mut stage)) };
        let shape: Vec<(usize, bool)> = call
            .local
            .iter()
            .map(|v| {
                (
                    v.iov_len,
                    stage.as_ptr_range().contains(&(v.iov_base as *const u8)),
                )
            })
            .collect();
        assert_eq!(
            shape,
            [
                (5000, true),
                (big, false),
                (20000, true),
                (big, false),
                (3000, false),
                (1, false)
            ]
        );
    }
    // SAFETY: every source is readable.
    let outcomes = unsafe { copy_batch_into_process(&OwnerProcess::this_process(), &entries) };
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");
    assert_eq!(&a[1..5001], &small_source[2..5002]);
    assert!(a[0] == 0xEE && a[5001..].iter().all(|&b| b == 0xEE));
    assert_eq!(&c[3..20003], &small_source[5..20005]);
    assert!(c[..3].iter().all(|&b| b == 0xEE) && c[20003..].iter().all(|&b| b == 0xEE));
    assert_eq!(&d[100..3100], &small_source[d_src..d_src + 3000]);
    assert_eq!(e[1], small_source[9]);
    assert!(e[0] == 0xEE && e[2..].iter().all(|&b| b == 0xEE));
    // Each big target window holds, by its last write, the source
    // shifted by (source offset - target offset).
    for (target, s) in [(target1, s1), (target2, s2)] {
        // SAFETY: the first window of the target mapping.
        let window = unsafe { std::slice::from_raw_parts(target, WINDOW) };
        let shift = (s - t_off) % WINDOW;
        let bad = (0..WINDOW).find(|&k| window[k] != source_contents[(k + shift) % WINDOW]);
        assert_eq!(bad, None, "target at source offset {s}");
    }
    // SAFETY: the three mappings made above, unmapped once; nothing
    // refers to them any more.
    unsafe {
        libc::munmap(source.cast(), 44 * WINDOW);
        libc::munmap(target1.cast(), 22 * WINDOW);
        libc::munmap(target2.cast(), 22 * WINDOW);
    }
}

/// An empty entry at the start of a call whose first byte is unwritable
/// is still written (by definition); only the entry that failed fails.
#[test]
fn an_empty_entry_before_an_unwritable_one_lands() {
    let _ = this_process_token();
    let source = [7u8; 64];
    let mut fine = [0u8; 64];
    let entries = [
        WriteEntry {
            remote_addr: fine.as_mut_ptr() as u64,
            source: source.as_ptr(),
            len: 0,
        },
        WriteEntry {
            remote_addr: 8,
            source: source.as_ptr(),
            len: 64,
        },
    ];
    // SAFETY: every source is ours and readable.
    let outcomes = unsafe { copy_batch_into_process(&OwnerProcess::this_process(), &entries) };
    assert_eq!(outcomes, [Ok(()), Err(CopyError(libc::EFAULT))]);
}
