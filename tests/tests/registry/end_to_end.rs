//! Bytes the owner registers — external memory, an owned buffer, pool
//! buffers — arrive intact in the consumer's pinned buffers, whole and in
//! sub-ranges, at the destination offsets asked for. Descriptors travel as
//! their wire encoding, as they would between processes.

use std::time::Duration;

use bytes::Bytes;
use rdmareg_registry::{DescribedBuf, Descriptor, RegionGuard, UnregisterOutcome};
use rdmareg_tests::{
    ExternalMemory, KIB, Lane, MIB, OWNER, Pair, assert_all, assert_same_bytes, expected, fill,
    patterned, registry_config,
};

/// Byte a destination is pre-filled with, to show what a GET did not touch.
const UNTOUCHED: u8 = 0xA5;

/// The consumer's end of the wire.
fn receive(wire: &Bytes) -> Descriptor {
    Descriptor::decode(wire).expect("the consumer decodes what the owner encoded")
}

/// Something the owner exposes: its wire descriptor, and which stretch of
/// which pattern it holds.
struct Source {
    name: &'static str,
    wire: Bytes,
    seed: u8,
    pattern_start: usize,
}

impl Source {
    fn len(&self) -> usize {
        receive(&self.wire).len() as usize
    }
}

fn region_source(name: &'static str, guard: &RegionGuard, seed: u8, start: usize) -> Source {
    Source {
        name,
        wire: guard.descriptor().expect("a describable region").encode(),
        seed,
        pattern_start: start,
    }
}

fn pool_source(name: &'static str, buf: &DescribedBuf, seed: u8) -> Source {
    Source {
        name,
        wire: buf.descriptor().encode(),
        seed,
        pattern_start: 0,
    }
}

per_lane!(
    whole_regions_and_pool_buffers_arrive_intact,
    sub_ranges_arrive_at_the_destination_offsets_asked_for,
);

async fn whole_regions_and_pool_buffers_arrive_intact(lane: Lane) {
    let mut config = registry_config();
    // Low enough that a dedicated arena is cheap to fill and check.
    config.pool.dedicated_threshold_bytes = 2 * MIB as u64;
    let pair = Pair::start(lane.clone(), config);
    let owner = &pair.owner.registry;
    let consumer = &pair.consumer.registry;

    // External memory, registered from an unaligned address to an unaligned
    // end: the pattern's position 17 is the region's first byte.
    let mut external = ExternalMemory::patterned(2 * MIB + 8 * KIB, 1);
    let external_len = external.len() - 17 - 5;
    let external_guard = external
        .register(owner, 17, external_len)
        .await
        .expect("external registration");
    let owned_guard = owner
        .register_owned(patterned(MIB + 333, 2))
        .await
        .expect("owned registration");
    // Pool buffers of odd sizes share an arena at different offsets; the
    // large one gets a dedicated arena.
    let mut pool_bufs = Vec::new();
    for (len, seed) in [(5000, 3), (MIB + 1, 4), (1, 5), (2 * MIB + 5, 6)] {
        let mut buf = owner.alloc_pinned(len).await.expect("owner pool buffer");
        fill(&mut buf, seed);
        let buf = buf.describe().await.expect("a describable buffer");
        pool_bufs.push((buf, seed));
    }
    assert!(
        pool_bufs[3].0.is_dedicated(),
        "2 MiB + 5 reaches the dedicated threshold"
    );
    assert!(!pool_bufs[0].0.is_dedicated());

    let mut sources = vec![
        region_source("external region", &external_guard, 1, 17),
        region_source("owned region", &owned_guard, 2, 0),
    ];
    let names = [
        "5000 B pool buffer",
        "1 MiB + 1 pool buffer",
        "1 B pool buffer",
        "dedicated buffer",
    ];
    for ((buf, seed), name) in pool_bufs.iter().zip(names) {
        sources.push(pool_source(name, buf, *seed));
    }

    let mut generations = Vec::new();
    for source in &sources {
        let descriptor = receive(&source.wire);
        assert_eq!(
            descriptor.backend_key(),
            lane.backend_key(),
            "{}",
            source.name
        );
        assert_eq!(
            descriptor.encode(),
            source.wire,
            "{}: re-encoding is stable",
            source.name
        );
        generations.push(descriptor.generation());

        let mut dst = consumer
            .alloc_pinned(source.len())
            .await
            .expect("consumer pool buffer");
        dst.fill(UNTOUCHED);
        consumer
            .get(OWNER, &descriptor, &mut dst)
            .await
            .unwrap_or_else(|e| panic!("GET of the {}: {e}", source.name));
        assert_same_bytes(
            source.name,
            &dst,
            &expected(source.seed, source.pattern_start, source.len()),
        );
    }
    // Every registration has its own generation — a described pool buffer
    // too: its descriptor carries its own registration, never its arena's.
    assert_ne!(generations[0], generations[1]);
    assert_ne!(generations[1], generations[2]);
    assert_ne!(
        generations[2], generations[3],
        "two described buffers of the first arena are two registrations"
    );
    assert_ne!(
        generations[2], generations[5],
        "the dedicated arena is its own registration"
    );

    // Being read remotely changed nothing on the owner's side.
    let seen = external_guard
        .watch()
        .read(|view| view.to_vec())
        .expect("a registered region is readable");
    assert_same_bytes(
        "owner's view of its external memory",
        &seen,
        &expected(1, 17, external_len),
    );
    for (buf, seed) in &pool_bufs {
        assert_same_bytes("owner's pool buffer", buf, &expected(*seed, 0, buf.len()));
    }
    let (buffer, outcome) = owned_guard
        .unregister_owned(Duration::from_secs(1))
        .await
        .expect("the owned buffer comes back");
    assert_eq!(outcome, UnregisterOutcome::Drained);
    assert_same_bytes(
        "owned buffer handed back",
        &buffer,
        &patterned(MIB + 333, 2),
    );
    assert_eq!(
        external_guard.unregister(Duration::from_secs(1)).await,
        Ok(UnregisterOutcome::Drained)
    );
    assert!(external.is_released());
    drop(pool_bufs);
    pair.shut_down(Duration::from_secs(5)).await;
}

async fn sub_ranges_arrive_at_the_destination_offsets_asked_for(lane: Lane) {
    let pair = Pair::start(lane, registry_config());
    let owner = &pair.owner.registry;
    let consumer = &pair.consumer.registry;

    let mut external = ExternalMemory::patterned(2 * MIB + 3, 7);
    let external_len = external.len();
    let external_guard = external
        .register(owner, 0, external_len)
        .await
        .expect("external registration");
    let owned_len = MIB + 4 * KIB + 3;
    let owned_guard = owner
        .register_owned(patterned(owned_len, 8))
        .await
        .expect("owned registration");
    // A pool buffer that does not start its arena.
    let _spacer = owner.alloc_pinned(3 * KIB).await.expect("spacer");
    let mut pool_buf = owner
        .alloc_pinned(2 * MIB)
        .await
        .expect("owner pool buffer");
    fill(&mut pool_buf, 9);
    let pool_buf = pool_buf.describe().await.expect("a describable buffer");

    // (offset, length) inside each source.
    let ranges = |len: usize| {
        [
            (0, 1),
            (1, 1),
            (4095, 1),
            (4095, 4096),
            (4096, 4 * KIB),
            (3, MIB),
            (len - 1, 1),
            (len - MIB - 1, MIB),
        ]
    };
    // The destination offsets cycle through these; 0 uses `get`.
    let dst_offsets = [0, 1, 4095, 777, 4096 + 3];
    let mut dst = consumer
        .alloc_pinned(MIB + 8 * KIB)
        .await
        .expect("consumer pool buffer");

    let mut round = 0;
    for (name, len, seed) in [
        ("external region", external_len, 7),
        ("owned region", owned_len, 8),
        ("pool buffer", 2 * MIB, 9),
    ] {
        for (offset, sub_len) in ranges(len) {
            let (from_owner, whole) = match name {
                "external region" => (
                    external_guard.descriptor_range(offset as u64, sub_len as u64),
                    external_guard.descriptor(),
                ),
                "owned region" => (
                    owned_guard.descriptor_range(offset as u64, sub_len as u64),
                    owned_guard.descriptor(),
                ),
                _ => (
                    pool_buf.descriptor_range(offset as u64, sub_len as u64),
                    Ok(pool_buf.descriptor()),
                ),
            };
            let wire = from_owner.expect("an in-range sub-descriptor").encode();
            let descriptor = receive(&wire);
            // The consumer cutting the whole descriptor gets the same thing.
            let cut_here = receive(&whole.expect("whole descriptor").encode())
                .slice(offset as u64, sub_len as u64)
                .expect("an in-range slice");
            assert_eq!(descriptor, cut_here, "{name} [{offset}, +{sub_len})");

            let dst_offset = dst_offsets[round % dst_offsets.len()];
            round += 1;
            dst.fill(UNTOUCHED);
            let result = if dst_offset == 0 {
                consumer.get(OWNER, &descriptor, &mut dst).await
            } else {
                consumer
                    .get_into(OWNER, &descriptor, &mut dst, dst_offset)
                    .await
            };
            let what = format!("{name} [{offset}, +{sub_len}) into offset {dst_offset}");
            result.unwrap_or_else(|e| panic!("{what}: {e}"));
            let end = dst_offset + sub_len;
            assert_all(&format!("{what}: before"), &dst[..dst_offset], UNTOUCHED);
            assert_same_bytes(
                &what,
                &dst[dst_offset..end],
                &expected(seed, offset, sub_len),
            );
            assert_all(&format!("{what}: after"), &dst[end..], UNTOUCHED);
        }
    }

    owned_guard
        .unregister_owned(Duration::from_secs(1))
        .await
        .expect("owned unregister");
    external_guard
        .unregister(Duration::from_secs(1))
        .await
        .expect("external unregister");
    assert!(external.is_released());
    drop((dst, pool_buf));
    pair.shut_down(Duration::from_secs(5)).await;
}
