//! Checks of remote writes (contract point 12): a put lands exactly in a
//! registration its owner mapped with write access, and nowhere else; a
//! registration without it is refused [`RdmaError::AccessDenied`] with
//! nothing written. A backend without writes must say so, and register
//! nothing when asked for write access. The owner's log of written ranges
//! (contract point 13) lists exactly what puts filled.

use rdmareg_core::{Access, BackendPut, RdmaError, WrittenRanges};

use super::BackendPair;
use super::buffer::{KitBuffer, Mapped};
use super::support::{
    FILL, GET_DEADLINE, assert_copied, kit_get, kit_put, kit_put_batch, live, source_byte,
};

/// Length of the kit's write targets.
const TARGET: usize = 8192;

/// Whether the backend writes; one that does not must refuse a writable
/// map and a put as [`RdmaError::Unsupported`], registering nothing, and
/// the check ends there.
async fn writes_supported(pair: &BackendPair) -> bool {
    if pair.capabilities.writes {
        return true;
    }
    let before = live(&*pair.owner);
    let mapped = Mapped::with_access(
        &*pair.owner,
        KitBuffer::filled(TARGET, |_| FILL),
        Some(Access::Write),
    )
    .await;
    match mapped {
        Err(RdmaError::Unsupported { .. }) => {}
        Err(other) => panic!("a backend without writes refuses as unsupported, not {other:?}"),
        Ok(mapped) => {
            let id = mapped.id();
            mapped.release(&*pair.owner).await;
            panic!("a backend without writes mapped region {id} writable");
        }
    }
    assert_eq!(
        live(&*pair.owner),
        before,
        "a refused map registered nothing"
    );
    let src = Mapped::filled(&*pair.consumer, 64, source_byte).await;
    let put = kit_put(
        &*pair.consumer,
        put_request(pair, &src, 0, src.addr(), &src, 0, 64),
    )
    .await;
    assert!(
        matches!(put, Err(RdmaError::Unsupported { .. })),
        "a backend without writes refuses a put as unsupported: {put:?}"
    );
    src.release(&*pair.consumer).await;
    false
}

/// A put of `len` bytes from `local_offset` of `source` (on the consumer)
/// to `remote_offset` of `target` (on the owner), whose key is `key_of`'s.
fn put_request(
    pair: &BackendPair,
    source: &Mapped,
    local_offset: u64,
    target_addr: u64,
    key_of: &Mapped,
    remote_offset: u64,
    len: u64,
) -> BackendPut {
    BackendPut {
        peer: pair.owner_as_seen_by_consumer,
        remote_addr: target_addr + remote_offset,
        packed_key: key_of.region.packed_key.clone(),
        local_region_id: source.id(),
        local_offset,
        len,
        deadline: Some(GET_DEADLINE),
    }
}

/// A target on the owner, filled with [`FILL`], mapped with `access`.
async fn target(pair: &BackendPair, access: Option<Access>) -> Mapped {
    match Mapped::with_access(&*pair.owner, KitBuffer::filled(TARGET, |_| FILL), access).await {
        Ok(mapped) => mapped,
        Err(e) => panic!("map of a {TARGET}-byte target with {access:?} failed: {e}"),
    }
}

/// A put into a registration mapped with write access writes exactly its
/// range with the source's bytes, leaving every other byte, and a
/// read-write registration serves the written bytes back to a GET.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn a_put_writes_exactly_its_range_of_a_writable_registration(pair: &BackendPair) {
    if !writes_supported(pair).await {
        return;
    }
    let src = Mapped::filled(&*pair.consumer, TARGET, source_byte).await;
    for access in [Access::Write, Access::ReadWrite] {
        let dst = target(pair, Some(access)).await;
        let request = put_request(pair, &src, 300, dst.addr(), &dst, 100, 4000);
        assert_eq!(kit_put(&*pair.consumer, request).await, Ok(()), "{access}");
        // The source's bytes 300.. land at 100..: `assert_copied` reads it
        // as a copy from offset 300 into offset 100.
        assert_copied(&dst.buf.snapshot(), 100, 300, 4000, "a put's target");
        if access.allows_read() {
            let back = Mapped::filled(&*pair.consumer, TARGET, |_| FILL).await;
            let mut get = super::support::get_request(pair, &dst, 100, &back, 0, 4000);
            get.packed_key = dst.region.packed_key.clone();
            assert_eq!(kit_get(&*pair.consumer, get).await, Ok(()));
            assert_copied(&back.buf.snapshot(), 0, 300, 4000, "a read of what was put");
            back.release(&*pair.consumer).await;
        }
        dst.release(&*pair.owner).await;
    }
    src.release(&*pair.consumer).await;
}

/// Memory mapped with `map` (read access) or `Access::Read` is not
/// writable: a put is refused [`RdmaError::AccessDenied`] and not a byte
/// changes; a region mapped write-only refuses a GET the same way.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn a_put_to_a_read_only_registration_is_access_denied(pair: &BackendPair) {
    if !writes_supported(pair).await {
        return;
    }
    let src = Mapped::filled(&*pair.consumer, TARGET, source_byte).await;
    for access in [None, Some(Access::Read)] {
        let dst = target(pair, access).await;
        let request = put_request(pair, &src, 0, dst.addr(), &dst, 0, 4000);
        assert_eq!(
            kit_put(&*pair.consumer, request).await,
            Err(RdmaError::AccessDenied { operation: "write" }),
            "a put to a registration mapped with {access:?}"
        );
        assert!(
            dst.buf.snapshot().iter().all(|&b| b == FILL),
            "a refused put wrote into a registration mapped with {access:?}"
        );
        dst.release(&*pair.owner).await;
    }
    let write_only = target(pair, Some(Access::Write)).await;
    let back = Mapped::filled(&*pair.consumer, TARGET, |_| FILL).await;
    let mut get = super::support::get_request(pair, &write_only, 0, &back, 0, 4000);
    get.packed_key = write_only.region.packed_key.clone();
    assert_eq!(
        kit_get(&*pair.consumer, get).await,
        Err(RdmaError::AccessDenied { operation: "read" }),
        "a GET of a write-only registration"
    );
    assert!(back.buf.snapshot().iter().all(|&b| b == FILL));
    back.release(&*pair.consumer).await;
    write_only.release(&*pair.owner).await;
    src.release(&*pair.consumer).await;
}

/// A put leaving the target registration, leaving the source mapping, or
/// of zero bytes is refused with the error the contract names, and not a
/// byte of the target changes.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn a_put_outside_either_registration_is_refused(pair: &BackendPair) {
    if !writes_supported(pair).await {
        return;
    }
    let src = Mapped::filled(&*pair.consumer, TARGET, source_byte).await;
    let dst = target(pair, Some(Access::Write)).await;
    let end = TARGET as u64;
    let mut cases = vec![
        (
            "a source range past the mapping",
            end - 100,
            0,
            200,
            RdmaError::OutOfRange,
        ),
        ("zero bytes", 0, 0, 0, RdmaError::OutOfRange),
    ];
    if pair.capabilities.remote_bounds_enforced {
        cases.push((
            "a target range past the registration",
            0,
            end - 100,
            200,
            RdmaError::OutOfRange,
        ));
    }
    for (what, local, remote, len, want) in cases {
        let request = put_request(pair, &src, local, dst.addr(), &dst, remote, len);
        assert_eq!(kit_put(&*pair.consumer, request).await, Err(want), "{what}");
        assert!(
            dst.buf.snapshot().iter().all(|&b| b == FILL),
            "{what}: a refused put wrote into the target"
        );
    }
    dst.release(&*pair.owner).await;
    src.release(&*pair.consumer).await;
}

/// A batch of puts returns one result per entry, in order, each what the
/// entry alone gets: a good entry lands while its neighbours are refused.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn a_put_batch_answers_each_entry_on_its_own(pair: &BackendPair) {
    if !writes_supported(pair).await {
        return;
    }
    let src = Mapped::filled(&*pair.consumer, TARGET, source_byte).await;
    let writable = target(pair, Some(Access::Write)).await;
    let read_only = target(pair, None).await;
    let requests = vec![
        put_request(pair, &src, 0, writable.addr(), &writable, 0, 1000),
        put_request(pair, &src, 0, read_only.addr(), &read_only, 0, 1000),
        put_request(pair, &src, 2000, writable.addr(), &writable, 2000, 1000),
        put_request(pair, &src, TARGET as u64, writable.addr(), &writable, 0, 1),
    ];
    let results = kit_put_batch(&*pair.consumer, requests).await;
    assert_eq!(
        results,
        vec![
            Ok(()),
            Err(RdmaError::AccessDenied { operation: "write" }),
            Ok(()),
            Err(RdmaError::OutOfRange),
        ]
    );
    let written = writable.buf.snapshot();
    for (i, &byte) in written.iter().enumerate() {
        let want = if i < 1000 || (2000..3000).contains(&i) {
            source_byte(i)
        } else {
            FILL
        };
        assert_eq!(byte, want, "batch target byte {i}");
    }
    assert!(read_only.buf.snapshot().iter().all(|&b| b == FILL));
    writable.release(&*pair.owner).await;
    read_only.release(&*pair.owner).await;
    src.release(&*pair.consumer).await;
}

/// The owner's log of written ranges (contract point 13) lists exactly
/// the ranges puts filled, coalesced, as offsets from the registration's
/// start; a refused put (outside the target or the source, into a
/// read-only registration) lists nothing; a take empties the log, and
/// the log ends with the registration.
///
/// # Cancel safety
/// Dropped mid-way, it leaks what it registered rather than free it.
pub async fn the_written_log_lists_exactly_the_ranges_puts_filled(pair: &BackendPair) {
    if !writes_supported(pair).await {
        return;
    }
    let owner = &*pair.owner;
    let src = Mapped::filled(&*pair.consumer, TARGET, source_byte).await;
    let dst = target(pair, Some(Access::Write)).await;
    let read_only = target(pair, None).await;
    let complete = pair.capabilities.written_log_complete;
    let taken = |id: u64| async move {
        match owner.take_written(id).await {
            Ok(taken) => taken,
            Err(e) => panic!("take_written of live region {id} failed: {e}"),
        }
    };
    // What the target's log lists; one that cannot see every write into it
    // must say so.
    let listed_only = |taken: WrittenRanges| {
        assert!(
            complete || taken.incomplete,
            "a log missing one-sided writes claims to be complete"
        );
        taken.ranges
    };
    assert_eq!(
        listed_only(taken(dst.id()).await),
        Vec::new(),
        "before any put"
    );

    let end = TARGET as u64;
    let mut refused = vec![
        (end - 100, 0, 200, RdmaError::OutOfRange),
        (0, 0, 0, RdmaError::OutOfRange),
    ];
    if pair.capabilities.remote_bounds_enforced {
        refused.push((0, end - 100, 200, RdmaError::OutOfRange));
    }
    for (local, remote, len, want) in refused {
        let request = put_request(pair, &src, local, dst.addr(), &dst, remote, len);
        assert_eq!(kit_put(&*pair.consumer, request).await, Err(want));
    }
    let request = put_request(pair, &src, 0, read_only.addr(), &read_only, 0, 64);
    assert_eq!(
        kit_put(&*pair.consumer, request).await,
        Err(RdmaError::AccessDenied { operation: "write" })
    );
    assert_eq!(
        listed_only(taken(dst.id()).await),
        Vec::new(),
        "refused puts are not listed"
    );
    assert_eq!(taken(read_only.id()).await, WrittenRanges::default());

    // Two touching puts, one inside them, one apart.
    for (offset, len) in [(100, 1000), (1100, 900), (1500, 100), (4000, 100)] {
        let request = put_request(pair, &src, offset, dst.addr(), &dst, offset, len);
        assert_eq!(kit_put(&*pair.consumer, request).await, Ok(()));
    }
    let listed = taken(dst.id()).await;
    assert!(complete || listed.incomplete);
    if complete {
        assert_eq!(
            (listed.ranges.as_slice(), listed.incomplete),
            (&[100..2000, 4000..4100][..], false),
            "the puts' ranges, coalesced"
        );
        assert!(listed.covers(100..2000) && !listed.covers(2000..2001));
    } else {
        // Only what the owner saw, and never a byte no put filled.
        let filled = [100..2000, 4000..4100];
        for range in &listed.ranges {
            assert!(
                filled
                    .iter()
                    .any(|f| f.start <= range.start && range.end <= f.end),
                "listed {range:?}, which no put filled"
            );
        }
    }
    assert_eq!(
        listed_only(taken(dst.id()).await),
        Vec::new(),
        "a second take lists nothing"
    );
    let id = dst.id();
    dst.release(owner).await;
    assert_eq!(
        owner.take_written(id).await,
        Err(RdmaError::RegionNotFound),
        "the log ends with the registration"
    );
    read_only.release(owner).await;
    src.release(&*pair.consumer).await;
}
