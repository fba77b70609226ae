//! The `rdmareg demo` binary end to end: two OS processes over real UCX
//! transports and libfabric providers, the output a user reads, and the
//! exit status on failures.

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

fn rdmareg() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rdmareg"));
    command.env_remove("RUST_LOG");
    command
}

fn run(args: &[&str]) -> Output {
    rdmareg().args(args).output().expect("rdmareg runs")
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn assert_clean_demo(output: &Output, transport: &str, ranges: u32) {
    let (stdout, stderr) = text(output);
    assert!(output.status.success(), "demo failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!("verification passed: {ranges} ranges")),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("transport        {transport}")),
        "{stdout}"
    );
    assert!(
        stdout.contains("owner backend registrations left: 0"),
        "{stdout}"
    );
    assert!(
        stdout.contains("consumer backend registrations left: 0"),
        "{stdout}"
    );
    assert!(
        stdout.contains("[owner] owner shut down: backend holds 0 registrations"),
        "{stdout}"
    );
    assert!(stdout.contains("GET latency p99"), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.trim_start().starts_with("as lists") && l.contains(" bytes in ")),
        "every range was also moved as a transfer list: {stdout}"
    );
}

#[test]
fn demo_over_tcp_verifies_every_byte_and_leaves_zero_registrations() {
    let output = run(&[
        "demo",
        "--transport",
        "tcp",
        "--size",
        "256K",
        "--count",
        "6",
        "--plain",
    ]);
    assert_clean_demo(&output, "tcp", 6);
}

#[test]
fn demo_over_shm_verifies_every_byte_and_leaves_zero_registrations() {
    let output = run(&[
        "demo",
        "--transport",
        "shm",
        "--size",
        "1M",
        "--count",
        "5",
        "--plain",
    ]);
    assert_clean_demo(&output, "shm", 5);
}

#[test]
fn demo_over_shm_with_every_read_served_by_the_owner_verifies_every_byte() {
    let output = run(&[
        "demo",
        "--transport",
        "shm-served",
        "--size",
        "1M",
        "--count",
        "5",
        "--plain",
    ]);
    assert_clean_demo(&output, "shm-served", 5);
}

/// `--write` pushes a pattern into as many writable ranges of the owner as
/// it reads, over tcp and shared memory: the owner finds every written
/// range right in its own memory, and the consumer reads each back right.
#[test]
fn demo_with_write_verifies_the_written_ranges_on_both_sides() {
    for transport in ["tcp", "shm"] {
        let output = run(&[
            "demo",
            "--write",
            "--transport",
            transport,
            "--size",
            "1M",
            "--count",
            "4",
            "--plain",
        ]);
        assert_clean_demo(&output, transport, 8);
        let (stdout, _) = text(&output);
        assert!(
            stdout.contains(
                "[owner] 4 of 4 written ranges checked by the owner in its own memory, 0 differing"
            ),
            "{transport}: {stdout}"
        );
        assert!(
            stdout
                .lines()
                .any(|l| l.trim_start().starts_with("written          4 ranges")),
            "{transport}: {stdout}"
        );
    }
}

#[test]
fn demo_over_libfabric_tcp_verifies_every_byte_and_leaves_zero_registrations() {
    let output = run(&[
        "demo",
        "--backend",
        "ofi",
        "--provider",
        "tcp",
        "--size",
        "256K",
        "--count",
        "6",
        "--plain",
    ]);
    assert_clean_demo(&output, "ofi-tcp", 6);
}

#[test]
fn demo_over_libfabric_shm_verifies_every_byte_and_leaves_zero_registrations() {
    let output = run(&[
        "demo",
        "--backend",
        "ofi",
        "--provider",
        "shm",
        "--size",
        "1M",
        "--count",
        "5",
        "--plain",
    ]);
    assert_clean_demo(&output, "ofi-shm", 5);
}

#[test]
fn a_provider_without_the_ofi_backend_is_a_usage_error() {
    let output = run(&["demo", "--provider", "shm"]);
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(2), "{stdout}\n{stderr}");
    assert!(stderr.contains("--backend ofi"), "{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
}

#[test]
fn demo_with_unaligned_odd_sizes_still_verifies() {
    let output = run(&["demo", "--size", "4097", "--count", "3", "--plain"]);
    assert_clean_demo(&output, "tcp", 3);
}

#[test]
fn separate_owner_and_consumer_processes_meet_over_listen_and_connect() {
    let mut owner = rdmareg()
        .args([
            "demo",
            "--listen",
            "127.0.0.1:0",
            "--size",
            "64K",
            "--count",
            "4",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("owner starts");
    let mut lines = BufReader::new(owner.stdout.take().unwrap()).lines();
    let first = lines.next().expect("owner prints").expect("readable");
    let address = first
        .strip_prefix("owner listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
        .to_owned();
    let consumer = run(&[
        "demo",
        "--connect",
        &address,
        "--size",
        "64K",
        "--count",
        "4",
        "--plain",
    ]);
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = owner.wait().expect("owner exits");
    let (stdout, stderr) = text(&consumer);
    assert!(consumer.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("verification passed: 4 ranges"), "{stdout}");
    assert!(status.success(), "owner failed: {rest:?}");
    assert!(
        rest.iter()
            .any(|l| l == "owner shut down: backend holds 0 registrations"),
        "{rest:?}"
    );
}

#[test]
fn an_unreachable_owner_is_one_clear_line_and_exit_status_one() {
    // Port 1 on loopback: nothing listens there.
    let started = std::time::Instant::now();
    let output = run(&["demo", "--connect", "127.0.0.1:1"]);
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(1), "{stdout}\n{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains("cannot reach the owner at 127.0.0.1:1"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked") && !stderr.contains("backtrace"));
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// Serves one bootstrap offer carrying `worker_address` and a one-page
/// range, then holds the connection until the consumer closes it. Returns
/// the address to `--connect` to.
fn fake_owner(worker_address: Vec<u8>) -> String {
    use std::io::{Read as _, Write as _};

    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let address = listener.local_addr().expect("bound address").to_string();
    std::thread::spawn(move || {
        let Ok((mut stream, _)) = listener.accept() else {
            return;
        };
        let descriptor = rdmareg_core::Descriptor::new(
            "ucx",
            0x7f00_0000_0000,
            4096,
            1,
            bytes::Bytes::from_static(&[0; 9]),
        )
        .expect("a valid descriptor");
        // An offer whose one range's label is its CRC32.
        let frame = rdmareg::Offer::new(
            bytes::Bytes::from(worker_address),
            [(0u32.to_le_bytes().to_vec(), descriptor)],
        )
        .encode()
        .expect("an offer within the limits");
        let _ = stream.write_all(&frame);
        let _ = stream.read_to_end(&mut Vec::new());
    });
    address
}

#[test]
fn a_fake_owner_with_a_malformed_worker_address_is_one_clear_line_and_exit_status_one() {
    // Address version 2 in the first byte: UCX 1.22 aborted the consumer
    // (SIGABRT) on it before worker addresses were validated.
    let mut forged = vec![0x22];
    forged.extend_from_slice(&[0x5A; 47]);
    for worker_address in [forged, vec![0x20; 64]] {
        let owner = fake_owner(worker_address);
        let output = rdmareg()
            // The test counts stderr's lines: a developer's own `UCX_*`
            // variables that UCX does not know would each add a warning.
            .env("UCX_WARN_UNUSED_ENV_VARS", "n")
            .args(["demo", "--transport", "tcp", "--connect", &owner])
            .output()
            .expect("rdmareg runs");
        let (stdout, stderr) = text(&output);
        assert_eq!(output.status.code(), Some(1), "{stdout}\n{stderr}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{stderr}");
        assert!(
            lines[0].contains("malformed peer worker address"),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked") && !stderr.contains("backtrace"));
    }
}

#[test]
fn bad_arguments_exit_with_status_two_and_say_what_is_wrong() {
    for (args, expected) in [
        (
            &["demo", "--size", "0"][..],
            "size must be at least one byte",
        ),
        (&["demo", "--size", "12Q"][..], "is not a size"),
        (
            &["demo", "--transport", "carrier-pigeon"][..],
            "invalid value 'carrier-pigeon'",
        ),
        (&["demo", "--count", "0"][..], "--count"),
        (&["demo", "--listen", "not-an-address"][..], "--listen"),
        (
            &[
                "demo",
                "--listen",
                "127.0.0.1:0",
                "--connect",
                "127.0.0.1:1",
            ][..],
            "cannot be used with",
        ),
        (
            &["demo", "--get-deadline", "0s"][..],
            "a duration must be positive",
        ),
        (
            &["demo", "--teardown-timeout", "soon"][..],
            "is not a duration",
        ),
        (&["demo", "--accept-timeout", "5s"][..], "--listen"),
        (&["frobnicate"][..], "unrecognized subcommand"),
    ] {
        let output = run(args);
        let (_, stderr) = text(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn an_owner_whose_consumer_vanishes_after_the_offer_says_so_and_shuts_down_clean() {
    let mut owner = rdmareg()
        .args([
            "demo",
            "--listen",
            "127.0.0.1:0",
            "--size",
            "64K",
            "--count",
            "4",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("owner starts");
    let mut lines = BufReader::new(owner.stdout.take().unwrap()).lines();
    let first = lines.next().expect("owner prints").expect("readable");
    let address = first
        .strip_prefix("owner listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
        .to_owned();
    // A consumer that takes the offer (the frame's length prefix is enough)
    // and then disappears: the owner sees the connection close or reset.
    let mut consumer = std::net::TcpStream::connect(&address).expect("connects");
    let mut prefix = [0u8; 4];
    std::io::Read::read_exact(&mut consumer, &mut prefix).expect("the offer arrives");
    drop(consumer);
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let output = owner.wait_with_output().expect("owner exits");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{rest:?}\n{stderr}");
    assert!(
        rest.iter()
            .any(|l| l == "owner shut down: backend holds 0 registrations"),
        "{rest:?}"
    );
    // UCX's own log lines (e.g. about unused UCX_* variables) aside.
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.contains(" UCX ")).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].starts_with("rdmareg: lost the consumer") && lines[0].contains("its connection"),
        "{stderr}"
    );
}

#[test]
fn a_consumer_whose_owner_never_offers_gives_up_with_one_line() {
    // Something that accepts the connection and then says nothing, as an
    // owner behind a cut link would.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("binds");
    let address = silent.local_addr().unwrap().to_string();
    let holder = std::thread::spawn(move || silent.accept().map(|(stream, _)| stream));
    let output = run(&["demo", "--connect", &address, "--get-deadline", "500ms"]);
    drop(holder.join());
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(1), "{stdout}\n{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains(&format!(
            "lost the owner at {address} before its offer: no word from it"
        )),
        "{stderr}"
    );
}

/// The binary lets a libfabric tcp engine end a read a stalled owner holds
/// (it runs with `FI_AV_REMOVE_CLEANUP=1` unless told otherwise), and a
/// value the caller set is left alone: the consumer's engine says which at
/// start.
#[test]
fn demo_over_libfabric_tcp_can_reset_a_stalled_owner_unless_the_caller_said_no() {
    for (value, expected) in [(None, true), (Some("0"), false)] {
        let mut command = rdmareg();
        command.args([
            "-v",
            "demo",
            "--backend",
            "ofi",
            "--provider",
            "tcp",
            "--size",
            "64K",
            "--count",
            "2",
            "--plain",
        ]);
        match value {
            Some(value) => command.env("FI_AV_REMOVE_CLEANUP", value),
            None => command.env_remove("FI_AV_REMOVE_CLEANUP"),
        };
        let output = command.output().expect("rdmareg runs");
        let (stdout, stderr) = text(&output);
        assert!(output.status.success(), "demo failed:\n{stdout}\n{stderr}");
        let started: Vec<&str> = stderr
            .lines()
            .filter(|line| line.contains("ofi engine started"))
            .collect();
        assert!(!started.is_empty(), "the consumer's engine: {stderr}");
        for line in started {
            assert!(
                line.contains(&format!("resets_stalled_connections={expected}")),
                "FI_AV_REMOVE_CLEANUP={value:?}: {line}"
            );
        }
    }
}
