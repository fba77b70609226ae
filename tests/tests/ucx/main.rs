//! The registry over the real UCX backend: two engines and two registries in
//! one process, on the loopback interface.
//!
//! Scenarios that are cheap run once per transport ([`per_transport!`]):
//! `Transport::Tcp`, where the owner's progress thread serves every GET, and
//! `Transport::SameHost`, where cma moves the data one-sidedly.
//!
//! - `end_to_end` — registered bytes arrive intact, whole and in slices.
//! - `shutdown_order` — registry sweep, engine teardown, release; guards
//!   dropped without unregister.
//! - `teardown_mid_get` — an engine torn down under a transfer (run in child
//!   processes).
//! - `misuse` — refused descriptors, keys and sizes are typed errors.
//! - `cancelled_get` — a dropped GET surrenders its buffer; shutdown waits.
//! - `leaks` — soak with leak checks; the budget's refusals.

use std::time::Duration;

/// Longest any one scenario may run before it counts as hung. Scenarios
/// take well under two seconds on an idle two-core machine; the margin is
/// for machines shared with other builds.
pub const SCENARIO_LIMIT: Duration = Duration::from_secs(20);

/// Turns `async fn name(transport: Transport)` into the tests
/// `name::over_tcp` and `name::over_same_host`, each bounded by
/// [`SCENARIO_LIMIT`].
macro_rules! per_transport {
    ($($scenario:ident),+ $(,)?) => {$(
        mod $scenario {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn over_tcp() {
                rdmareg_tests::within(
                    crate::SCENARIO_LIMIT,
                    concat!(stringify!($scenario), " over tcp"),
                    super::$scenario(rdmareg_ucx::Transport::Tcp),
                )
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn over_same_host() {
                rdmareg_tests::within(
                    crate::SCENARIO_LIMIT,
                    concat!(stringify!($scenario), " over same-host"),
                    super::$scenario(rdmareg_ucx::Transport::SameHost),
                )
                .await;
            }
        }
    )+};
}

mod cancelled_get;
mod end_to_end;
mod leaks;
mod misuse;
mod shutdown_order;
mod teardown_mid_get;
