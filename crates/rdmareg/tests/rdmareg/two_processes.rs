//! The code of `docs/guide-two-processes.md` is `examples/two_processes.rs`:
//! this runs its owner and consumer against each other over TCP (in one
//! process here; `cargo run -p rdmareg --example two_processes` runs them as
//! two), and checks that the guide shows the example's code as it is.

#[allow(dead_code)] // its `main` and `both` are for `cargo run`
#[path = "../../examples/two_processes.rs"]
mod example;

use tokio::net::TcpListener;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guides_consumer_reads_what_its_owner_offered() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let owner = tokio::spawn(example::owner(listener));
    let greeting = example::consumer(&addr).await.expect("the consumer");
    assert_eq!(greeting, b"hello from the owner");
    owner.await.unwrap().expect("the owner");
}

#[test]
fn the_guide_shows_the_examples_code_as_it_is() {
    let source = include_str!("../../examples/two_processes.rs");
    let guide = include_str!("../../../../docs/guide-two-processes.md");
    let mut rest = source;
    let mut shown = 0;
    while let Some(start) = rest.find("// GUIDE BEGIN ") {
        let from = start + rest[start..].find('\n').unwrap() + 1;
        let to = from + rest[from..].find("// GUIDE END").unwrap();
        let snippet = &rest[from..to];
        assert!(
            guide.contains(&format!("```rust\n{snippet}```\n")),
            "docs/guide-two-processes.md lacks this part of examples/two_processes.rs \
             as a code block of its own:\n{snippet}"
        );
        shown += 1;
        rest = &rest[to..];
    }
    assert_eq!(shown, 3);
    for import in source
        .lines()
        .filter(|line| line.starts_with("use rdmareg"))
    {
        assert!(guide.contains(import), "the guide lacks `{import}`");
    }
}
