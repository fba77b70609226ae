//! What describing a pool buffer costs: one backend map and one unmap of its
//! 4 KiB, over UCX. Ignored by default (a measurement, not a check); run with
//! `cargo nextest run -p rdmareg-tests --test describe_cost --run-ignored only --no-capture`.

use std::time::{Duration, Instant};

use rdmareg_tests::fixture::{Side, registry_config};
use rdmareg_ucx::Transport;

const ROUNDS: u32 = 2_000;

async fn describe_and_free(transport: Transport) -> (Duration, Duration) {
    let side = Side::start(transport, registry_config());
    // Warm the pool: the arena is mapped once, outside the measurement.
    drop(side.registry.alloc_pinned(4096).await.expect("warm-up"));
    let backend = side.engine.backend();
    let buf = side.registry.alloc_pinned(4096).await.expect("buffer");
    let ptr = buf.as_ptr() as usize;
    let started = Instant::now();
    for _ in 0..ROUNDS {
        // SAFETY: the range is the pool buffer `buf`, alive until after the
        // loop, which registers it a second time only for reads (no GET
        // names this registration) and unmaps it before the next round.
        let region = unsafe { backend.map(ptr, 4096) }.await.expect("map");
        backend
            .unmap(region.backend_region_id)
            .await
            .expect("unmap");
    }
    let raw = started.elapsed() / ROUNDS;
    drop(buf);
    let started = Instant::now();
    for _ in 0..ROUNDS {
        let buf = side.registry.alloc_pinned(4096).await.expect("buffer");
        let described = buf.describe().await.expect("describe");
        drop(described);
        // Freeing unmaps in the background; wait for it so rounds do not
        // pile up.
        while side.engine_live() > 1 {
            tokio::task::yield_now().await;
        }
    }
    let whole = started.elapsed() / ROUNDS;
    drop(side.registry.shutdown(Duration::from_secs(5)).await);
    side.engine.shutdown().await;
    (raw, whole)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; run explicitly"]
async fn describing_a_pool_buffer_costs_one_map_and_one_unmap() {
    for transport in [Transport::Tcp, Transport::SameHost] {
        let (raw, whole) = describe_and_free(transport.clone()).await;
        println!(
            "{transport:?}: backend map+unmap of 4 KiB {raw:?}; alloc + describe + free (unmap confirmed) {whole:?}"
        );
    }
}
