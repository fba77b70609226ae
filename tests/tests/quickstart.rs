//! The README's quickstart, compiled and run by CI. `readme_shows_this_quickstart`
//! keeps the README's copy identical to the body below, `use` lines included.

use std::time::Duration;

use rdmareg::{Config, Descriptor, PeerId, Rdma, Transport};

type Error = Box<dyn std::error::Error>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart() -> Result<(), Error> {
    // QUICKSTART BEGIN
    let config = Config::new()
        .with_transport(Transport::SameHost)
        .with_net_devices("lo");

    // Owner: register memory and describe it.
    let owner = Rdma::start(config.clone())?;
    let payload = b"hello, remote memory".to_vec().into_boxed_slice();
    let region = owner.register_owned(payload).await?;
    // Send these two to the consumer (over your own control channel).
    let address = owner.worker_address();
    let wire = region.descriptor()?.encode();

    // Consumer: learn the owner's address, GET into a pinned buffer.
    let consumer = Rdma::start(config)?;
    let owner_peer = PeerId(1);
    consumer.add_peer(owner_peer, address)?;
    let descriptor = Descriptor::decode(&wire)?;
    let mut buffer = consumer.alloc_pinned(descriptor.len() as usize).await?;
    consumer.get(owner_peer, &descriptor, &mut buffer).await?;
    assert_eq!(&buffer[..], b"hello, remote memory");
    drop(buffer);

    // Release: the owner gets its buffer back once the unmap is confirmed.
    let (payload, _drained) = region.unregister_owned(Duration::from_secs(5)).await?;
    assert_eq!(&payload[..5], b"hello");

    // Shut down: registry sweep, engine teardown and the release of
    // survivors, in order, in one call that reports what it did.
    for side in [consumer, owner] {
        let summary = side.shutdown().await;
        assert!(summary.is_clean(), "{summary:?}");
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
    for import in source
        .lines()
        .take_while(|line| !line.starts_with("type Error"))
        .filter(|line| line.starts_with("use "))
    {
        assert!(
            shown.lines().any(|line| line == import),
            "README.md's quickstart lacks `{import}`"
        );
    }
}

fn between<'a>(text: &'a str, start: &str, end: &str) -> &'a str {
    let from = text.find(start).expect("start marker") + start.len();
    let to = from + text[from..].find(end).expect("end marker");
    &text[from..to]
}
