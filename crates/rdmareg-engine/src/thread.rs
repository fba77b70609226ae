//! Starting a progress thread, and joining it within a deadline.
//!
//! A driver's thread creates its transport objects itself (they never leave
//! it), so [`ProgressThread::start`] waits for the thread to report either
//! what it created ([`Ready::started`]) or why it could not; a thread that
//! exits without reporting is an error too, never a hang.
//!
//! Joining is bounded: a transport wedged inside a call must not wedge the
//! caller's shutdown with it. A thread that does not finish by the deadline
//! is left detached and said so in the log.

use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use rdmareg_core::RdmaError;

/// How the thread reports that it started (or failed to).
#[derive(Debug)]
pub struct Ready<I> {
    sender: Sender<Result<I, RdmaError>>,
}

impl<I> Ready<I> {
    /// The thread is running; `info` goes back to the starter.
    pub fn started(self, info: I) {
        let _ = self.sender.send(Ok(info));
    }

    /// The thread could not start; it should return after this.
    pub fn failed(self, error: RdmaError) {
        let _ = self.sender.send(Err(error));
    }
}

/// A running progress thread.
#[derive(Debug)]
pub struct ProgressThread {
    name: String,
    handle: Mutex<Option<JoinHandle<()>>>,
}

impl ProgressThread {
    /// Spawns `body` on a thread called `name` and waits until it reports
    /// through its [`Ready`].
    ///
    /// # Errors
    /// The thread's own error when it reports one; [`RdmaError::Backend`]
    /// when the thread cannot be spawned or exits without reporting.
    pub fn start<I, F>(name: &str, body: F) -> Result<(ProgressThread, I), RdmaError>
    where
        I: Send + 'static,
        F: FnOnce(Ready<I>) + Send + 'static,
    {
        let (sender, receiver) = crossbeam_channel::bounded(1);
        let handle = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || body(Ready { sender }))
            .map_err(|e| {
                RdmaError::backend_caused_by(format!("{name}: spawning the progress thread"), e)
            })?;
        let info = match receiver.recv() {
            Ok(Ok(info)) => info,
            Ok(Err(err)) => {
                let _ = handle.join();
                return Err(err);
            }
            Err(_) => {
                let _ = handle.join();
                return Err(RdmaError::backend(format!(
                    "{name}: the progress thread exited while starting"
                )));
            }
        };
        let thread = ProgressThread {
            name: name.to_owned(),
            handle: Mutex::new(Some(handle)),
        };
        Ok((thread, info))
    }

    /// Whether the thread was joined already.
    pub fn is_joined(&self) -> bool {
        self.lock().is_none()
    }

    /// Joins the thread once it has finished, waiting until `deadline`.
    /// True if it was joined (now or before); false if it is still running
    /// at the deadline, in which case it is left for a later call.
    pub fn join_by(&self, deadline: Instant) -> bool {
        let mut guard = self.lock();
        let Some(handle) = guard.take() else {
            return true;
        };
        while !handle.is_finished() {
            if Instant::now() >= deadline {
                tracing::error!(
                    thread = %self.name,
                    "the progress thread did not finish tearing down in time; leaving it detached"
                );
                *guard = Some(handle);
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if handle.join().is_err() {
            tracing::error!(thread = %self.name, "the progress thread panicked");
        }
        true
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<JoinHandle<()>>> {
        match self.handle.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_started_thread_reports_its_info() {
        let (thread, info) = ProgressThread::start("kit-test", |ready| ready.started(42)).unwrap();
        assert_eq!(info, 42);
        assert!(thread.join_by(Instant::now() + Duration::from_secs(5)));
        assert!(thread.is_joined());
    }

    #[test]
    fn a_failed_start_is_the_threads_error() {
        let err =
            ProgressThread::start::<(), _>("kit-test", |ready| ready.failed(RdmaError::InvalidKey))
                .unwrap_err();
        assert_eq!(err, RdmaError::InvalidKey);
    }

    #[test]
    fn a_thread_that_exits_silently_is_an_error() {
        let err = ProgressThread::start::<(), _>("kit-test", drop).unwrap_err();
        assert!(matches!(err, RdmaError::Backend(text) if text.contains("exited while starting")));
    }

    #[test]
    fn a_wedged_thread_is_not_waited_for_past_the_deadline() {
        let (release, wedged) = crossbeam_channel::bounded::<()>(1);
        let (thread, ()) = ProgressThread::start("kit-test", move |ready| {
            ready.started(());
            let _ = wedged.recv();
        })
        .unwrap();
        assert!(!thread.join_by(Instant::now() + Duration::from_millis(20)));
        release.send(()).unwrap();
        assert!(thread.join_by(Instant::now() + Duration::from_secs(5)));
    }
}
