//! The README's quickstart, compiled and run by CI. `readme_shows_this_quickstart`
//! keeps the README's copy identical to the body below.

use std::time::Duration;

use rdmareg_core::{Descriptor, PeerId};
use rdmareg_registry::{RdmaConfig, RdmaRegistry};
use rdmareg_ucx::{Transport, UcxConfig, UcxEngine};
use tokio::runtime::Handle;

type Error = Box<dyn std::error::Error>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart() -> Result<(), Error> {
    // QUICKSTART BEGIN
    let ucx = UcxConfig::default()
        .with_transport(Transport::SameHost)
        .with_net_devices("lo");

    // Owner: register memory and describe it.
    let owner_engine = UcxEngine::start(ucx.clone())?;
    let owner = RdmaRegistry::new(
        owner_engine.backend(),
        RdmaConfig::default(),
        Handle::current(),
    )?;
    let payload = b"hello, remote memory".to_vec().into_boxed_slice();
    let region = owner.register_owned(payload).await.map_err(|e| e.error)?;
    // Send these two to the consumer (over your own control channel).
    let address = owner_engine.worker_address();
    let wire = region.descriptor()?.encode();

    // Consumer: learn the owner's address, GET into a pinned buffer.
    let consumer_engine = UcxEngine::start(ucx)?;
    let consumer = RdmaRegistry::new(
        consumer_engine.backend(),
        RdmaConfig::default(),
        Handle::current(),
    )?;
    let owner_peer = PeerId(1);
    consumer_engine.add_peer(owner_peer, address)?;
    let descriptor = Descriptor::decode(&wire)?;
    let mut buffer = consumer.alloc_pinned(descriptor.len() as usize).await?;
    consumer.get(owner_peer, &descriptor, &mut buffer).await?;
    assert_eq!(&buffer[..], b"hello, remote memory");
    drop(buffer);

    // Release: the owner gets its buffer back once the unmap is confirmed.
    let (payload, _drained) = region
        .unregister_owned(Duration::from_secs(5))
        .await
        .map_err(|e| e.error)?;
    assert_eq!(&payload[..5], b"hello");

    // Shut down in order: registry sweep, engine teardown, then release
    // whatever survived on the backend's word that nothing is registered.
    for (registry, engine) in [(consumer, consumer_engine), (owner, owner_engine)] {
        let swept = registry.shutdown(Duration::from_secs(5)).await;
        engine.shutdown().await;
        swept.finish_after_backend_teardown();
        assert_eq!(engine.live_registrations(), Some(0));
    }
    // QUICKSTART END
    Ok(())
}

#[test]
fn readme_shows_this_quickstart() {
    let source = include_str!("quickstart.rs");
    let body = between(source, "// QUICKSTART BEGIN\n", "    // QUICKSTART END");
    let expected: String = body
        .lines()
        .map(|line| line.strip_prefix("    ").unwrap_or(line))
        .map(|line| format!("{line}\n"))
        .collect();
    let readme = include_str!("../../README.md");
    let shown = between(readme, "<!-- quickstart -->\n```rust\n", "```\n");
    assert!(
        shown.contains(&expected),
        "README.md's quickstart differs from tests/tests/quickstart.rs; copy the body over"
    );
}

fn between<'a>(text: &'a str, start: &str, end: &str) -> &'a str {
    let from = text.find(start).expect("start marker") + start.len();
    let to = from + text[from..].find(end).expect("end marker");
    &text[from..to]
}
