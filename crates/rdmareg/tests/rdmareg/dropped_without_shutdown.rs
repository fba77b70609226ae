//! An `Rdma` dropped without `shutdown()`, or with its `shutdown()`
//! cancelled, leaks what is still registered; the drop says which in a
//! warning. A shut-down `Rdma`, or one with nothing registered, drops
//! silently.

use std::fmt::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdmareg::registry::RdmaConfig;
use rdmareg::{Config, Rdma, Transport};

fn config() -> Config {
    Config::new()
        .with_transport(Transport::Tcp)
        .with_net_devices("lo")
        .with_registry(RdmaConfig::default().with_shutdown_budget(Duration::from_secs(5)))
}

/// Every event's level and fields, as text.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<String>>>);

impl Recorder {
    fn warnings_of_a_drop(&self) -> Vec<String> {
        self.warnings_containing("without shutdown()")
    }

    fn warnings_containing(&self, text: &str) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|line| line.starts_with("WARN") && line.contains(text))
            .cloned()
            .collect()
    }
}

struct Fields(String);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }
}

impl tracing::Subscriber for Recorder {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = Fields(event.metadata().level().to_string());
        event.record(&mut fields);
        self.0.lock().unwrap().push(fields.0);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// An `Rdma` over tcp with one 4 KiB region registered.
async fn started_with_a_region() -> (Rdma, rdmareg::RegionGuard) {
    let rdma = Rdma::start(config()).expect("starts");
    let region = rdma
        .register_owned(vec![7u8; 4096].into_boxed_slice())
        .await
        .expect("registers");
    (rdma, region)
}

/// A region still registered when its `Rdma` is dropped is leaked: the
/// drop warns, naming the bytes the registry still counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_rdma_warns_of_the_registered_bytes() {
    let (rdma, region) = started_with_a_region().await;
    let registered = rdma.stats().registered_bytes;
    assert!(registered >= 4096);
    let recorder = Recorder::default();
    tracing::subscriber::with_default(recorder.clone(), || drop(rdma));
    let warnings = recorder.warnings_of_a_drop();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains(&format!("registered_bytes={registered}")),
        "{warnings:?}"
    );
    // The region's memory stays leaked: nothing confirmed its unmap.
    drop(region);
}

/// After `shutdown()` the `Rdma` is gone without a warning of a drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shut_down_rdma_drops_without_a_warning() {
    let rdma = Rdma::start(config()).expect("starts");
    let recorder = Recorder::default();
    let _default = tracing::subscriber::set_default(recorder.clone());
    let summary = rdma.shutdown().await;
    assert!(summary.is_clean(), "{summary:?}");
    assert_eq!(recorder.warnings_of_a_drop(), Vec::<String>::new());
    assert!(
        recorder
            .0
            .lock()
            .unwrap()
            .iter()
            .any(|line| line.contains("rdmareg shut down")),
        "the recorder saw the shutdown's own event"
    );
}

/// A `shutdown()` dropped before its end (here after one poll, its sweep
/// waiting for an unmap) leaves the memory still registered leaked; the
/// drop says the shutdown was cut short, not that it was never called.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_shutdown_warns_that_it_did_not_finish() {
    use futures::FutureExt;
    let (rdma, region) = started_with_a_region().await;
    let recorder = Recorder::default();
    let polled_once =
        tracing::subscriber::with_default(recorder.clone(), || rdma.shutdown().now_or_never());
    assert!(
        polled_once.is_none(),
        "the sweep waits for the region's unmap"
    );
    let cut_short = recorder.warnings_containing("dropped before it finished");
    assert_eq!(cut_short.len(), 1, "{:?}", recorder.0.lock().unwrap());
    assert_eq!(recorder.warnings_of_a_drop(), Vec::<String>::new());
    drop(region);
}

/// With nothing registered a dropped `Rdma` leaks nothing, and says
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rdma_with_nothing_registered_drops_quietly() {
    let rdma = Rdma::start(config()).expect("starts");
    assert_eq!(rdma.stats().registered_bytes, 0);
    let recorder = Recorder::default();
    tracing::subscriber::with_default(recorder.clone(), || drop(rdma));
    assert_eq!(recorder.warnings_containing("leaked"), Vec::<String>::new());
}
