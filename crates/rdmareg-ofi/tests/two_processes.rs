//! Two OS processes: this binary re-executes itself as an *owner* (chosen by
//! an environment variable) that registers memory and prints its fabric
//! address, packed key and address on stdout; the test process is the
//! consumer. Covers GETs across processes over `tcp` and `shm`, and an
//! owner killed while a GET from it is in flight.
//!
//! The binary has its own `main` (no libtest harness) because it is also the
//! owner. It honours the libtest arguments test runners use: name filters
//! (substring, or equal with `--exact`) and `--list`.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::SeamForTestMemory;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::BackendGet;
use rdmareg_ofi::{OfiEngine, Provider};

const ROLE: &str = "RDMAREG_OFI_TEST_ROLE";
const PROVIDER: &str = "RDMAREG_OFI_TEST_PROVIDER";
const SIZE: &str = "RDMAREG_OFI_TEST_SIZE";

fn provider_named(name: &str) -> Provider {
    match name {
        "tcp" => Provider::Tcp,
        "shm" => Provider::Shm,
        other => panic!("unknown provider {other:?}"),
    }
}

fn pattern(i: usize) -> u8 {
    (i % 251) as u8
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Bytes {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
        .collect::<Vec<u8>>()
        .into()
}

/// The owner role: register `SIZE` bytes of the pattern, announce them,
/// serve until stdin closes, then unregister and shut down.
fn owner_main() {
    let provider = provider_named(&std::env::var(PROVIDER).expect("provider"));
    let size: usize = std::env::var(SIZE).expect("size").parse().expect("size");
    let engine = OfiEngine::start(common::config(provider)).expect("owner engine starts");
    let backend = engine.backend();
    let buf: Vec<u8> = (0..size).map(pattern).collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let region = runtime
        .block_on(backend.map_test_memory(buf.as_ptr() as usize, size))
        .expect("owner maps its buffer");
    println!(
        "READY {} {} {}",
        hex(&engine.fabric_address()),
        hex(&region.packed_key),
        buf.as_ptr() as u64
    );
    std::io::stdout().flush().unwrap();
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    runtime
        .block_on(backend.unmap(region.backend_region_id))
        .expect("owner unmaps");
    engine.shutdown_blocking();
    assert_eq!(engine.live_registrations(), 0);
    println!("DONE");
}

/// A running owner process and what it announced.
struct Owner {
    child: Child,
    address: Bytes,
    key: Bytes,
    addr: u64,
}

fn spawn_owner(provider: &str, size: usize) -> Owner {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env(ROLE, "owner")
        .env(PROVIDER, provider)
        .env(SIZE, size.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("owner process starts");
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .expect("owner announces");
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(words.first(), Some(&"READY"), "owner said {line:?}");
    Owner {
        address: unhex(words[1]),
        key: unhex(words[2]),
        addr: words[3].parse().unwrap(),
        child,
    }
}

fn get_across_processes_moves_the_right_bytes(provider: &str) {
    const SIZE_BYTES: usize = 4 << 20;
    let mut owner = spawn_owner(provider, SIZE_BYTES);
    let consumer = OfiEngine::start(common::config(provider_named(provider))).unwrap();
    consumer
        .add_peer(common::OWNER, owner.address.clone())
        .unwrap();
    let backend = consumer.backend();
    let mut dst = vec![0u8; SIZE_BYTES];
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let region = backend
            .map_test_memory(dst.as_mut_ptr() as usize, SIZE_BYTES)
            .await
            .unwrap();
        // The whole buffer, then a sub-range at an odd offset.
        for (offset, len) in [(0usize, SIZE_BYTES), (12_345, 777)] {
            let answer = backend
                .get_into_test_memory(BackendGet {
                    peer: common::OWNER,
                    remote_addr: owner.addr + offset as u64,
                    packed_key: owner.key.clone(),
                    local_region_id: region.backend_region_id,
                    local_offset: offset as u64,
                    len: len as u64,
                    deadline: Some(Duration::from_secs(20)),
                })
                .await;
            assert_eq!(answer, Ok(()), "GET of {len} bytes at {offset}");
        }
        backend.unmap(region.backend_region_id).await.unwrap();
    });
    let wrong = dst
        .iter()
        .enumerate()
        .filter(|&(i, &b)| b != pattern(i))
        .count();
    assert_eq!(wrong, 0, "bytes differing from the owner's pattern");
    consumer.shutdown_blocking();
    assert_eq!(consumer.live_registrations(), 0);
    drop(owner.child.stdin.take());
    let mut out = String::new();
    owner
        .child
        .stdout
        .as_mut()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let status = owner.child.wait().unwrap();
    assert!(
        status.success() && out.contains("DONE"),
        "owner ended {status}: {out:?}"
    );
}

/// How the first GET from an owner SIGKILLed while 64 MiB GETs from it
/// ran back to back ended, and how long after the kill.
struct KilledOwner {
    answer: Result<(), rdmareg_core::RdmaError>,
    after_kill: Duration,
}

/// 64 MiB GETs (each with `deadline`) run back to back from an owner
/// process until one fails; the owner is SIGKILLed 50 ms after the first
/// began. Then a second owner is read through the same consumer engine,
/// which shuts down with nothing registered.
fn get_from_an_owner_killed_mid_read(provider: &str, deadline: Duration) -> KilledOwner {
    const SIZE_BYTES: usize = 64 << 20;
    let mut owner = spawn_owner(provider, SIZE_BYTES);
    let consumer = OfiEngine::start(common::config(provider_named(provider))).unwrap();
    consumer
        .add_peer(common::OWNER, owner.address.clone())
        .unwrap();
    let backend = consumer.backend();
    let mut dst = vec![0u8; SIZE_BYTES];
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let region = runtime
        .block_on(backend.map_test_memory(dst.as_mut_ptr() as usize, SIZE_BYTES))
        .unwrap();
    let request = BackendGet {
        peer: common::OWNER,
        remote_addr: owner.addr,
        packed_key: owner.key.clone(),
        local_region_id: region.backend_region_id,
        local_offset: 0,
        len: SIZE_BYTES as u64,
        deadline: Some(deadline),
    };
    let (answer, after_kill) = runtime.block_on(async {
        let reads = async {
            // Bounded, in case GETs from the dead owner kept succeeding.
            let until = Instant::now() + deadline + Duration::from_secs(10);
            loop {
                let answer = backend.get_into_test_memory(request.clone()).await;
                if answer.is_err() || Instant::now() > until {
                    return (answer, Instant::now());
                }
            }
        };
        let kill = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            owner.child.kill().unwrap();
            Instant::now()
        };
        let ((answer, ended_at), killed_at) = futures::join!(reads, kill);
        (answer, ended_at.saturating_duration_since(killed_at))
    });
    let _ = owner.child.wait();
    eprintln!(
        "{provider}: GET from a killed owner answered {answer:?} {after_kill:?} after the kill"
    );

    // The same engine reads from another owner.
    let mut other = spawn_owner(provider, 4096);
    consumer
        .add_peer(rdmareg_core::PeerId(2), other.address.clone())
        .unwrap();
    let second = runtime.block_on(backend.get_into_test_memory(BackendGet {
        peer: rdmareg_core::PeerId(2),
        remote_addr: other.addr,
        packed_key: other.key.clone(),
        local_region_id: region.backend_region_id,
        local_offset: 0,
        len: 4096,
        deadline: Some(Duration::from_secs(20)),
    }));
    assert_eq!(second, Ok(()), "a read from another owner after the kill");
    assert!((0..4096).all(|i| dst[i] == pattern(i)), "its bytes landed");
    drop(other.child.stdin.take());
    let _ = other.child.wait();
    runtime
        .block_on(backend.unmap(region.backend_region_id))
        .unwrap();
    consumer.shutdown_blocking();
    assert_eq!(consumer.live_registrations(), 0);
    KilledOwner { answer, after_kill }
}

/// What a GET from an owner stopped with SIGSTOP (not killed: its
/// connection stays up) answered: by four times its deadline, and by ten
/// seconds after the owner was let run again.
struct StoppedOwner {
    within_four_deadlines: Option<Result<(), rdmareg_core::RdmaError>>,
    after_resume: Option<Result<(), rdmareg_core::RdmaError>>,
}

/// Waits (up to 5 s) until every thread of process `pid` is stopped, as
/// `/proc/<pid>/task/*/stat` reports them (state `T`).
fn wait_until_stopped(pid: libc::pid_t) {
    let all_stopped = || {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return false;
        };
        tasks.flatten().all(|task| {
            std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
                // The state follows the command name's closing parenthesis.
                stat.rsplit_once(") ")
                    .and_then(|(_, rest)| rest.chars().next())
                    .is_some_and(|state| state == 'T' || state == 't')
            })
        })
    };
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while !all_stopped() {
        assert!(
            std::time::Instant::now() < until,
            "the owner did not stop within 5 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn get_from_a_stopped_owner(provider: &str, deadline: Duration) -> StoppedOwner {
    const SIZE_BYTES: usize = 1 << 20;
    let mut owner = spawn_owner(provider, SIZE_BYTES);
    let consumer = OfiEngine::start(common::config(provider_named(provider))).unwrap();
    consumer
        .add_peer(common::OWNER, owner.address.clone())
        .unwrap();
    let backend = consumer.backend();
    let mut dst = vec![0u8; SIZE_BYTES];
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let pid = owner.child.id() as libc::pid_t;
    let result = runtime.block_on(async {
        let region = backend
            .map_test_memory(dst.as_mut_ptr() as usize, SIZE_BYTES)
            .await
            .unwrap();
        let request = BackendGet {
            peer: common::OWNER,
            remote_addr: owner.addr,
            packed_key: owner.key.clone(),
            local_region_id: region.backend_region_id,
            local_offset: 0,
            len: 4096,
            deadline: Some(deadline),
        };
        // Connect first, then stop the owner.
        assert_eq!(backend.get_into_test_memory(request.clone()).await, Ok(()));
        // SAFETY: kill takes no pointers; `pid` is our child.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        // The signal takes effect asynchronously: on a loaded machine an
        // owner thread still running could take the request and start its
        // reply before it stops, which is the stalled-reply case (its own
        // ignored test). Send the read only once every thread is stopped.
        wait_until_stopped(pid);
        let mut get = std::pin::pin!(backend.get_into_test_memory(BackendGet {
            len: SIZE_BYTES as u64,
            ..request
        }));
        let within_four_deadlines = tokio::time::timeout(deadline * 4, &mut get).await.ok();
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        let after_resume = match within_four_deadlines {
            Some(_) => None,
            None => tokio::time::timeout(Duration::from_secs(10), get)
                .await
                .ok(),
        };
        backend.unmap(region.backend_region_id).await.unwrap();
        StoppedOwner {
            within_four_deadlines,
            after_resume,
        }
    });
    drop(owner.child.stdin.take());
    let _ = owner.child.wait();
    consumer.shutdown_blocking();
    assert_eq!(consumer.live_registrations(), 0);
    result
}

/// A GET posted after its owner process died (SIGKILL, reaped), with a
/// 20 s deadline: the request cannot be delivered (over `tcp;ofi_rxm` every
/// reconnection is refused and the send waits for ever), so only the
/// engine's reachability watch ends it, with a typed error, about a second
/// later.
fn a_get_from_a_tcp_owner_that_died_fails_promptly_as_unreachable() {
    let mut owner = spawn_owner("tcp", 4096);
    let consumer = OfiEngine::start(common::config(Provider::Tcp)).unwrap();
    consumer
        .add_peer(common::OWNER, owner.address.clone())
        .unwrap();
    let backend = consumer.backend();
    let mut dst = vec![0u8; 4096];
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let region = runtime
        .block_on(backend.map_test_memory(dst.as_mut_ptr() as usize, 4096))
        .unwrap();
    let request = BackendGet {
        peer: common::OWNER,
        remote_addr: owner.addr,
        packed_key: owner.key.clone(),
        local_region_id: region.backend_region_id,
        local_offset: 0,
        len: 4096,
        deadline: Some(Duration::from_secs(20)),
    };
    // Connected first.
    assert_eq!(
        runtime.block_on(backend.get_into_test_memory(request.clone())),
        Ok(())
    );
    owner.child.kill().unwrap();
    let _ = owner.child.wait();
    std::thread::sleep(Duration::from_millis(200));
    let started = Instant::now();
    let answer = runtime.block_on(backend.get_into_test_memory(request));
    let took = started.elapsed();
    eprintln!("tcp: a GET from a dead owner answered {answer:?} after {took:?}");
    runtime
        .block_on(backend.unmap(region.backend_region_id))
        .unwrap();
    consumer.shutdown_blocking();
    assert_eq!(consumer.live_registrations(), 0);
    match &answer {
        Err(rdmareg_core::RdmaError::Backend(text)) => {
            assert!(text.contains("unreachable"), "answered {text:?}")
        }
        other => panic!("a GET from a dead owner answered {other:?}"),
    }
    assert!(
        took < Duration::from_secs(3),
        "it failed only after {took:?}"
    );
}

type TestFn = Box<dyn Fn()>;

fn main() {
    if std::env::var(ROLE).as_deref() == Ok("owner") {
        return owner_main();
    }
    common::init_tracing();
    let tests: Vec<(&str, TestFn)> = vec![
        (
            "get_across_processes_moves_the_right_bytes_over_tcp",
            Box::new(|| get_across_processes_moves_the_right_bytes("tcp")),
        ),
        (
            "get_across_processes_moves_the_right_bytes_over_shm",
            Box::new(|| get_across_processes_moves_the_right_bytes("shm")),
        ),
        (
            "a_killed_tcp_owner_fails_gets_in_flight_promptly_and_another_owner_is_still_read",
            Box::new(|| {
                // The deadline is far: only noticing the lost owner ends
                // the GET in time. Killed mid-transfer, the provider may
                // fail the read itself (a rendezvous read on the lost
                // connection); otherwise the probe finds the owner gone.
                let outcome = get_from_an_owner_killed_mid_read("tcp", Duration::from_secs(20));
                assert!(
                    matches!(outcome.answer, Err(rdmareg_core::RdmaError::Backend(_))),
                    "a GET from a killed owner answered {:?}",
                    outcome.answer
                );
                assert!(
                    outcome.after_kill < Duration::from_secs(3),
                    "the GET failed only {:?} after the kill",
                    outcome.after_kill
                );
            }),
        ),
        (
            "a_get_from_a_tcp_owner_that_died_fails_promptly_as_unreachable",
            Box::new(a_get_from_a_tcp_owner_that_died_fails_promptly_as_unreachable),
        ),
        (
            "a_killed_shm_owner_ends_a_get_in_flight_by_its_deadline_and_another_owner_is_still_read",
            Box::new(|| {
                let deadline = Duration::from_secs(3);
                let outcome = get_from_an_owner_killed_mid_read("shm", deadline);
                assert!(
                    outcome.after_kill < deadline + Duration::from_secs(3),
                    "the GET answered {:?} only {:?} after the kill",
                    outcome.answer,
                    outcome.after_kill
                );
            }),
        ),
        (
            "a_stopped_tcp_owner_times_a_get_out_at_its_deadline",
            Box::new(|| {
                // Owner-served reads: the consumer's reply receive is not yet
                // matched while the owner is stopped, so fi_cancel withdraws
                // it and the GET answers Timeout at its deadline (with the
                // one-sided fi_read of earlier builds, ofi_rxm could not
                // withdraw the read and the answer waited for the owner).
                let outcome = get_from_a_stopped_owner("tcp", Duration::from_secs(1));
                eprintln!(
                    "tcp, stopped owner: {:?} within 4 deadlines, {:?} after it resumed",
                    outcome.within_four_deadlines, outcome.after_resume
                );
                assert_eq!(
                    outcome.within_four_deadlines,
                    Some(Err(rdmareg_core::RdmaError::Timeout))
                );
            }),
        ),
    ];
    let mut filters = Vec::new();
    let (mut exact, mut list) = (false, false);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--exact" => exact = true,
            "--list" => list = true,
            "--format" | "--test-threads" | "--color" | "--logfile" => {
                let _ = args.next();
            }
            "--ignored" => return,
            other if other.starts_with('-') => {}
            other => filters.push(other.to_string()),
        }
    }
    let selects = |name: &str| {
        filters.is_empty()
            || filters.iter().any(|f| {
                if exact {
                    name == f
                } else {
                    name.contains(f.as_str())
                }
            })
    };
    let selected: Vec<_> = tests.iter().filter(|(name, _)| selects(name)).collect();
    if list {
        for (name, _) in &selected {
            println!("{name}: test");
        }
        return;
    }
    println!("\nrunning {} tests", selected.len());
    let mut failed = Vec::new();
    for (name, test) in selected {
        let started = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(test));
        let verdict = if outcome.is_ok() { "ok" } else { "FAILED" };
        println!("test {name} ... {verdict} ({:.2?})", started.elapsed());
        if outcome.is_err() {
            failed.push(*name);
        }
    }
    if failed.is_empty() {
        println!("\ntest result: ok.");
    } else {
        println!("\ntest result: FAILED. failures: {failed:?}");
        std::process::exit(101);
    }
}
