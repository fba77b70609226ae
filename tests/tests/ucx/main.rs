//! The registry over the real UCX backend: two engines and two registries in
//! one process, on the loopback interface.
//!
//! The scenario bodies live in `tests/registry/` and are shared with the
//! libfabric suite (`tests/ofi/`); each runs here once per UCX transport
//! ([`per_lane!`]): `Transport::Tcp`, where the owner's progress thread
//! serves every GET, and `Transport::SameHost`, where cma moves the data
//! one-sidedly.
//!
//! - `end_to_end` — registered bytes arrive intact, whole and in slices.
//! - `shutdown_order` — registry sweep, engine teardown, release; guards
//!   dropped without unregister.
//! - `teardown_mid_get` — an engine torn down under a transfer (run in child
//!   processes).
//! - `misuse` — refused descriptors, keys and sizes are typed errors.
//! - `cancelled_get` — a dropped GET surrenders its buffer; shutdown waits.
//! - `leaks` — soak with leak checks; the budget's refusals.
//! - `reposted_lists` (UCX only) — a list posted again reuses its requests
//!   and the engine's copy plan.
//! - `writes` — PUTs at every size, in lists, racing an unregister;
//!   read-only registrations never written.
//! - `write_attacks` — safe-code attacks on PUTs (also over libfabric tcp).

/// Turns each `async fn name(lane: Lane)` into the tests `name::over_tcp`
/// and `name::over_same_host`; `per_lane!(isolated name)` does the same for
/// a scenario run in a child process.
macro_rules! per_lane {
    (isolated $($scenario:ident),+ $(,)?) => {$(
        rdmareg_tests::lane_tests!(isolated $scenario,
            over_tcp => rdmareg_ucx::Transport::Tcp,
            over_same_host => rdmareg_ucx::Transport::SameHost,
        );
    )+};
    ($($scenario:ident),+ $(,)?) => {$(
        rdmareg_tests::lane_tests!($scenario,
            over_tcp => rdmareg_ucx::Transport::Tcp,
            over_same_host => rdmareg_ucx::Transport::SameHost,
        );
    )+};
}

/// As [`per_lane!`] for a scenario reading stale descriptors: every lane
/// refuses them (the same-host direct lane through the owner's release
/// table).
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
// UCX only: the engine's copy plans.
mod reposted_lists;
// Attacks on PUTs, over the UCX lanes and libfabric tcp.
mod write_attacks;
