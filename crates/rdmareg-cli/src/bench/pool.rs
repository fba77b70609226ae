//! Pool allocation against registration: `alloc_pinned` + drop from a warm
//! pool, and the backend's `map` + `unmap` of the same size, on the same
//! backend in the same run.

use std::time::Instant;

use crate::bench::PoolRow;
use crate::cli::{BenchArgs, TransportArg};
use crate::control::Bounds;
use crate::node::{self, Node};
use crate::stats::Samples;

/// Measure every pool size over tcp (registration cost does not depend on
/// the transport when there is no RDMA memory domain).
pub async fn measure(args: &BenchArgs) -> anyhow::Result<Vec<PoolRow>> {
    let largest = *args.pool_sizes.iter().max().unwrap_or(&4096);
    let mut config = node::registry_config_for(largest.saturating_mul(4));
    // Keep every measured size in pooled arenas: a warm pool is the point.
    config.pool.dedicated_threshold_bytes = config
        .pool
        .dedicated_threshold_bytes
        .max(largest.saturating_mul(2));
    config.pool.max_arena_bytes = config.pool.max_arena_bytes.max(largest.saturating_mul(2));
    let node = Node::start(
        TransportArg::Tcp,
        Some("lo"),
        config,
        Bounds::new(&args.limits),
    )?;
    let result = async {
        let mut rows = Vec::new();
        for &size in &args.pool_sizes {
            rows.push(measure_size(&node, size, args.scale).await?);
        }
        anyhow::Ok(rows)
    }
    .await;
    let outcome = node.shutdown().await;
    let rows = result?;
    anyhow::ensure!(
        outcome.clean,
        "pool benchmark shutdown left {} registrations",
        outcome.live_registrations
    );
    Ok(rows)
}

async fn measure_size(node: &Node, size: u64, scale: f64) -> anyhow::Result<PoolRow> {
    let len = usize::try_from(size)?;
    let iterations = ((20_000.0 * scale) as usize).clamp(20, 20_000);
    let map_iterations = if size >= 16 << 20 {
        ((200.0 * scale) as usize).clamp(10, 200)
    } else {
        iterations
    };

    // Warm: the first allocation may map an arena.
    drop(node.registry.alloc_pinned(len).await?);
    let mut pool_samples = Samples::with_capacity(iterations);
    for _ in 0..iterations {
        let started = Instant::now();
        let buffer = node.registry.alloc_pinned(len).await?;
        drop(buffer);
        pool_samples.push(started.elapsed());
    }

    let backend = node.engine.backend();
    let memory = vec![0u8; len].into_boxed_slice();
    let ptr = Box::into_raw(memory);
    let mut map_samples = Samples::with_capacity(map_iterations);
    let mut failure = None;
    for _ in 0..map_iterations {
        let started = Instant::now();
        // SAFETY: `ptr` is a leaked box of `len` bytes this function owns,
        // reached only through the pointer; no GET names the registration,
        // and the box is rebuilt and freed only after a confirmed unmap (a
        // failed one leaks it).
        let region = match unsafe { backend.map(ptr.cast::<u8>() as usize, len) }.await {
            Ok(region) => region,
            Err(e) => {
                failure = Some(e);
                break;
            }
        };
        if let Err(e) = backend.unmap(region.backend_region_id).await {
            failure = Some(e);
            break;
        }
        map_samples.push(started.elapsed());
    }
    if let Some(e) = failure {
        // A failed unmap means the memory may still be registered: leak it.
        anyhow::bail!("map/unmap of {size} B failed: {e}");
    }
    // SAFETY: `ptr` came from `Box::into_raw` above, every map of it was
    // followed by a confirmed unmap, so nothing has it registered.
    drop(unsafe { Box::from_raw(ptr) });

    let pool = pool_samples
        .summary()
        .ok_or_else(|| anyhow::anyhow!("no samples"))?;
    let map = map_samples
        .summary()
        .ok_or_else(|| anyhow::anyhow!("no samples"))?;
    Ok(PoolRow {
        size,
        iterations,
        alloc_free_p50_ns: pool.p50_us * 1000.0,
        alloc_free_p99_ns: pool.p99_us * 1000.0,
        map_unmap_p50_ns: map.p50_us * 1000.0,
        map_unmap_p99_ns: map.p99_us * 1000.0,
    })
}
