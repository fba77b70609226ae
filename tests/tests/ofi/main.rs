//! The registry over the real libfabric backend (`rdmareg-ofi`): two engines
//! and two registries in one process, through the same scenario bodies as
//! the UCX suite (`tests/registry/`).
//!
//! Each scenario runs once per tested provider ([`per_lane!`]):
//! `Provider::Tcp` (`tcp;ofi_rxm` on the `lo` domain) and `Provider::Shm`,
//! both with owner-served reads, the default on these providers.
//!
//! The registry crate is the same as over UCX: it sees the engine only as
//! `Arc<dyn RdmaBackend>` and knows no backend by name.
//!
//! `teardown_mid_get` over `shm` is what found that libfabric's `shm`
//! provider shares the region of an endpoint with the other endpoints of
//! the same process, so an engine must not close its endpoint while
//! another `shm` engine of the process may still reach it (see the
//! `rdmareg_ofi` fabric module: such endpoints are parked until the last
//! `shm` engine of the process closes).

/// Turns each `async fn name(lane: Lane)` into the tests `name::over_tcp`
/// and `name::over_shm`; `per_lane!(isolated name)` does the same for a
/// scenario run in a child process.
macro_rules! per_lane {
    (isolated $($scenario:ident),+ $(,)?) => {$(
        rdmareg_tests::lane_tests!(isolated $scenario,
            over_tcp => rdmareg_ofi::Provider::Tcp,
            over_shm => rdmareg_ofi::Provider::Shm,
        );
    )+};
    ($($scenario:ident),+ $(,)?) => {$(
        rdmareg_tests::lane_tests!($scenario,
            over_tcp => rdmareg_ofi::Provider::Tcp,
            over_shm => rdmareg_ofi::Provider::Shm,
        );
    )+};
}

/// As [`per_lane!`] for a scenario reading stale descriptors (every lane
/// here refuses them).
macro_rules! per_lane_refusing_stale_descriptors {
    ($scenario:ident) => {
        per_lane!($scenario);
    };
}

#[path = "../registry/adversarial_lending.rs"]
mod adversarial_lending;
#[path = "../registry/cancelled_get.rs"]
mod cancelled_get;
#[path = "../registry/end_to_end.rs"]
mod end_to_end;
#[path = "../registry/leaks.rs"]
mod leaks;
#[path = "../registry/misuse.rs"]
mod misuse;
#[path = "../registry/shutdown_order.rs"]
mod shutdown_order;
#[path = "../registry/teardown_mid_get.rs"]
mod teardown_mid_get;
#[path = "../registry/writes.rs"]
mod writes;
