//! What the progress thread and its submitters both read about the engine's
//! life: whether teardown has begun, how many registrations the thread holds,
//! and what teardown could not release.
//!
//! The registration count moves only on the transport's own successful
//! register and deregister calls, so zero after teardown means every region
//! was really released (the backend contract's `live_registrations`).
//!
//! After teardown has finished, an unmap is completed here instead of by the
//! thread (which is gone): `Ok` for every id but those teardown failed to
//! deregister, because an id that names nothing returns `Ok` (the contract's
//! idempotent unmap), while a region teardown could not release is still
//! registered as far as anyone can tell and returns
//! [`RdmaError::ShuttingDown`].

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use rdmareg_core::RdmaError;

use crate::doorbell::Doorbell;

/// Shared state of one engine's life.
#[derive(Debug)]
pub struct Lifecycle {
    doorbell: Doorbell,
    closed: AtomicBool,
    live_registrations: AtomicUsize,
    still_registered_after_teardown: OnceLock<HashSet<u64>>,
}

impl Lifecycle {
    /// The life of a `driver` engine ("ucx", "ofi") about to start its
    /// progress thread: raises the process's open-file limit (once per
    /// process, see [`open_files`](crate::open_files)), since peers'
    /// connections cost it descriptors, and opens the thread's doorbell.
    ///
    /// # Errors
    /// [`RdmaError::Backend`] when the doorbell's eventfd cannot be created.
    pub fn starting(driver: &str) -> Result<Arc<Lifecycle>, RdmaError> {
        if let Err(err) = crate::open_files::raise_open_file_limit() {
            tracing::warn!(error = %err, "cannot read the open-file limit");
        }
        let doorbell = Doorbell::new().map_err(|e| {
            RdmaError::backend_caused_by(format!("{driver}: creating the doorbell eventfd"), e)
        })?;
        Ok(Arc::new(Lifecycle::new(doorbell)))
    }

    /// The life of an engine that is starting, woken through `doorbell`.
    pub fn new(doorbell: Doorbell) -> Lifecycle {
        Lifecycle {
            doorbell,
            closed: AtomicBool::new(false),
            live_registrations: AtomicUsize::new(0),
            still_registered_after_teardown: OnceLock::new(),
        }
    }

    /// The progress thread's doorbell.
    pub fn doorbell(&self) -> &Doorbell {
        &self.doorbell
    }

    /// Whether teardown has begun: submitters refuse new work from then on.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Marks teardown begun (idempotent).
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    /// Registrations the thread holds now.
    pub fn live_registrations(&self) -> usize {
        self.live_registrations.load(Ordering::SeqCst)
    }

    /// Call after the transport registered a region.
    pub fn registered(&self) {
        self.live_registrations.fetch_add(1, Ordering::SeqCst);
    }

    /// Call after the transport deregistered a region.
    pub fn deregistered(&self) {
        // Saturating: a driver bug must not wrap the count to "huge", nor
        // pass unnoticed.
        let before =
            self.live_registrations
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    Some(n.saturating_sub(1))
                });
        if before == Ok(0) {
            tracing::error!("a deregistration was counted with no registration live");
        }
    }

    /// Records the end of teardown: `still_registered` are the region ids it
    /// could not deregister. Later calls are ignored.
    pub fn finish_teardown(&self, still_registered: impl IntoIterator<Item = u64>) {
        let _ = self
            .still_registered_after_teardown
            .set(still_registered.into_iter().collect());
    }

    /// Whether teardown has finished.
    pub fn is_torn_down(&self) -> bool {
        self.still_registered_after_teardown.get().is_some()
    }

    /// The result of an unmap of `id` once teardown has finished (module
    /// docs); `None` while the thread still runs.
    pub fn unmap_after_teardown(&self, id: u64) -> Option<Result<(), RdmaError>> {
        let still = self.still_registered_after_teardown.get()?;
        Some(if still.contains(&id) {
            Err(RdmaError::ShuttingDown)
        } else {
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lifecycle() -> Lifecycle {
        Lifecycle::new(Doorbell::new().unwrap())
    }

    #[test]
    fn unmaps_are_the_threads_until_teardown_finished() {
        let life = lifecycle();
        life.close();
        assert_eq!(life.unmap_after_teardown(7), None);
        life.finish_teardown([3]);
        assert_eq!(life.unmap_after_teardown(7), Some(Ok(())));
        assert_eq!(
            life.unmap_after_teardown(3),
            Some(Err(RdmaError::ShuttingDown)),
            "a region teardown could not release is not reported gone"
        );
    }

    #[test]
    fn the_registration_count_never_wraps() {
        let life = lifecycle();
        life.registered();
        life.deregistered();
        life.deregistered();
        assert_eq!(life.live_registrations(), 0);
    }
}
