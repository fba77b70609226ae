//! A one-way latch: starts open, is released once, and every waiter (present
//! or future) then resolves.
//!
//! It carries a region's `deregistered()` and the registry's "shutdown has
//! begun"; releasing twice is harmless.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

/// Resolves every waiter once [`release`](Self::release) has been called.
#[derive(Debug, Default)]
pub(crate) struct Latch {
    released: AtomicBool,
    notify: Notify,
}

impl Latch {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Release the latch. Returns whether this call was the one that did it.
    pub(crate) fn release(&self) -> bool {
        let first = !self.released.swap(true, Ordering::SeqCst);
        if first {
            self.notify.notify_waiters();
        }
        first
    }

    pub(crate) fn is_released(&self) -> bool {
        self.released.load(Ordering::SeqCst)
    }

    /// Resolve once the latch is released.
    ///
    /// # Cancel safety
    /// Cancel-safe: it only observes.
    pub(crate) async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_released() {
                return;
            }
            notified.await;
        }
    }
}

/// An owned future waiting on a latch, so it can be returned by value and
/// outlive the object that handed it out.
pub(crate) async fn wait_owned<T, F>(owner: Arc<T>, latch: F)
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> &Latch + Send + 'static,
{
    latch(&owner).wait().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn waiters_before_and_after_release_all_resolve() {
        let latch = Arc::new(Latch::new());
        let early = tokio::spawn(wait_owned(Arc::clone(&latch), |l: &Latch| l));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!early.is_finished());
        assert!(latch.release());
        assert!(!latch.release());
        early.await.unwrap();
        tokio::time::timeout(Duration::from_millis(1), latch.wait())
            .await
            .expect("a released latch resolves at once");
        assert!(latch.is_released());
    }
}
