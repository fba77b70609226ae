//! Tearing a consumer down — registry sweep, engine teardown, release —
//! while a large GET into its memory is in flight: the consumer ends with
//! nothing registered and its arena released, and the owner, a separate
//! party, keeps serving other consumers.
//!
//! These scenarios run in a child process ([`isolated`]) on every lane: if UCX aborts the
//! process, one test fails instead of the whole binary. Two UCX 1.22 aborts
//! are behind them:
//!
//! - same-host: `arbiter.c: Assertion 'ucs_arbiter_group_is_empty(group)'
//!   failed`, raised by `ucp_worker_destroy` when the consumer's engine was
//!   destroyed with a cma GET still queued inside UCX. The engine now drains
//!   GETs before it closes endpoints and destroys the worker.
//! - tcp: `ucp_request.inl: Fatal: unexpected error: Endpoint timeout`,
//!   raised in the *owner's* progress loop while it still sends the emulated
//!   GET's reply to a consumer whose connection was reset. UCX has no error
//!   path there; the engine's drain and idle wait make the consumer's own
//!   teardown wait for the reply, but a consumer that cannot wait (killed,
//!   or out of teardown time on a loaded machine) still takes the owner down.
//!
//! Whether a round really tears down *under* the transfer depends on timing
//! (a 128 MiB cma GET takes ~10 ms); each round records whether the sweep
//! found the destination arena still busy, and the scenario requires at
//! least one such round.

use std::time::Duration;

use rdmareg_registry::{Descriptor, RdmaError};
use rdmareg_tests::isolated::runtime;
use rdmareg_tests::{
    Lane, MIB, OWNER, SCENARIO_LIMIT, Side, assert_all, eventually, isolated, registry_config,
    within,
};
use rdmareg_ucx::Transport;

/// Consumers torn down mid-GET, one after another, against one owner: at
/// least this many rounds, and more (up to [`MAX_ROUNDS`], while time is
/// left) until one tore a consumer down with its GET in flight, which a
/// stalled test thread can miss.
const ROUNDS: usize = 5;
const MAX_ROUNDS: usize = 20;

per_lane!(isolated a_consumer_torn_down_mid_get_is_released_and_the_owner_keeps_serving);

fn a_consumer_torn_down_mid_get_is_released_and_the_owner_keeps_serving(
    test_path: &str,
    lane: Lane,
) {
    // Tens of milliseconds of transfer on every lane.
    let size = match lane {
        Lane::Ucx(Transport::SameHost) => 128 * MIB,
        _ => 64 * MIB,
    };
    isolated(test_path, || {
        runtime().block_on(within(
            SCENARIO_LIMIT,
            &format!("teardown mid-GET over {lane:?}"),
            consumers_torn_down_mid_get(lane.clone(), size),
        ));
    });
}

async fn consumers_torn_down_mid_get(lane: Lane, size: usize) {
    rdmareg_tests::init_tracing();
    let owner = Side::start(lane.clone(), registry_config());
    let source = owner
        .registry
        .register_owned(vec![0x77; size].into_boxed_slice())
        .await
        .expect("owned registration");
    let wire = source.descriptor().expect("descriptor").encode();

    let mut exercised = 0;
    let started = std::time::Instant::now();
    let mut round = 0;
    while round < ROUNDS
        || (exercised == 0 && round < MAX_ROUNDS && started.elapsed() < SCENARIO_LIMIT / 2)
    {
        round += 1;
        let consumer = Side::start(lane.clone(), registry_config());
        consumer
            .engine
            .add_peer(OWNER, owner.engine.address())
            .expect("add peer");
        let descriptor = Descriptor::decode(&wire).expect("decodes");
        let mut dst = consumer
            .registry
            .alloc_pinned(size)
            .await
            .expect("destination");
        let registry = consumer.registry.clone();
        let transfer = tokio::spawn(async move {
            let result = registry.get(OWNER, &descriptor, &mut dst).await;
            (result, dst)
        });
        eventually(Duration::from_secs(1), "the transfer was admitted", || {
            consumer.registry.stats().transfers_in_flight == 1 || transfer.is_finished()
        })
        .await;

        let report = consumer.shut_down(Duration::from_millis(1)).await;
        // 1 when the sweep found the arena still under the transfer (its
        // unmap then goes on past the budget, and may be confirmed by the
        // engine's teardown before the release).
        let busy = report.arenas_surviving + report.arenas_unmap_pending;
        assert!(busy <= 1, "round {round}: {report:?}");
        exercised += busy;
        assert!(
            report.released
                && report.regions_released_after_teardown == 0
                && report.arenas_released_after_teardown <= busy
                && report.backend_live == Some(0),
            "round {round}: {report:?}"
        );
        assert_eq!(consumer.engine_live(), 0, "round {round}");
        let (result, dst) = within(Duration::from_secs(5), "the transfer task", transfer)
            .await
            .expect("the transfer task ran");
        assert!(
            matches!(result, Ok(()) | Err(RdmaError::ShuttingDown)),
            "round {round}: the transfer landed or teardown answered it: {result:?}"
        );
        drop(dst);

        // The owner is unaffected: another consumer reads from it.
        let fresh = Side::start(lane.clone(), registry_config());
        fresh
            .engine
            .add_peer(OWNER, owner.engine.address())
            .expect("add peer");
        let tail = Descriptor::decode(&wire)
            .unwrap()
            .slice((size - 4096) as u64, 4096)
            .unwrap();
        let mut buf = fresh.registry.alloc_pinned(4096).await.expect("buffer");
        within(
            Duration::from_secs(5),
            "a GET from the owner after the teardown",
            fresh.registry.get(OWNER, &tail, &mut buf),
        )
        .await
        .unwrap_or_else(|e| panic!("round {round}: the owner stopped serving: {e}"));
        assert_all("the owner's bytes", &buf, 0x77);
        drop(buf);
        fresh.shut_down(Duration::from_secs(5)).await;
        assert_eq!(fresh.engine_live(), 0);
    }

    assert!(
        exercised >= 1,
        "no round tore the consumer down while its GET was in flight"
    );
    source
        .unregister(Duration::from_secs(1))
        .await
        .expect("owner unregisters");
    let report = owner.shut_down(Duration::from_secs(5)).await;
    assert!(report.drained, "{report:?}");
    assert!(
        report.released && report.backend_live == Some(0),
        "{report:?}"
    );
    assert_eq!(owner.engine_live(), 0);
}
