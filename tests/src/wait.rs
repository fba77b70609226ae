//! Bounded waits on the real clock: the UCX progress threads run on their
//! own, so tests cannot pause time, and a hang must fail rather than stall
//! the suite.

use std::future::Future;
use std::time::{Duration, Instant};

/// Await `future`, failing the test if it takes longer than `limit`.
pub async fn within<F: Future>(limit: Duration, what: &str, future: F) -> F::Output {
    match tokio::time::timeout(limit, future).await {
        Ok(output) => output,
        Err(_) => panic!("did not finish within {limit:?}: {what}"),
    }
}

/// Poll `condition` every millisecond until it holds, failing the test if it
/// still does not after `limit`.
pub async fn eventually(limit: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let start = Instant::now();
    while !condition() {
        if start.elapsed() > limit {
            panic!("still not true after {limit:?}: {what}");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
