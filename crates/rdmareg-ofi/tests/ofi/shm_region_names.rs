//! A local user cannot squat the names of an `shm` engine's regions.
//!
//! libfabric 1.17 names an `shm` endpoint's region `<pid>:<uid>:<n>`, `n`
//! counting the process's endpoints from 0, in the world-writable
//! /dev/shm, and maps a file it finds under that name. The engine names
//! its regions itself, at random (`fabric.rs`, `unguessable_shm_name`).

use crate::common;

use std::time::Duration;

use common::SeamForTestMemory;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::BackendGet;
use rdmareg_ofi::{OfiEngine, Provider};

const PAGE: usize = 4096;

/// The files another local user could pre-create in the world-writable
/// /dev/shm for this process's first endpoints under libfabric's own
/// naming (`<pid>:<uid>:<n>`), empty and writable by anyone.
fn squat_this_process_names() -> Vec<String> {
    // SAFETY: getuid takes no arguments and cannot fail.
    let uid = unsafe { libc::getuid() };
    (0..8)
        .map(|index| {
            let path = format!("/dev/shm/{}:{uid}:{index}", std::process::id());
            std::fs::write(&path, b"").expect("an empty file in /dev/shm");
            path
        })
        .collect()
}

/// Empty files under the names libfabric 1.17 would give this process's
/// `shm` regions crashed the engine with SIGBUS as it mapped one (any
/// local user can create them: /dev/shm is world-writable). Regions now
/// get random names, so two engines start over them and serve a read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_files_squatting_shm_names_do_not_stop_an_engine() {
    common::init_tracing();
    let squatted = squat_this_process_names();
    let (owner, consumer) = common::engines(Provider::Shm);
    for path in &squatted {
        let _ = std::fs::remove_file(path);
    }
    let (o, c) = (owner.backend(), consumer.backend());
    let src = vec![0x5cu8; PAGE];
    let mut dst = vec![0u8; PAGE];
    let s = o
        .map_test_memory(src.as_ptr() as usize, PAGE)
        .await
        .unwrap();
    let d = c
        .map_test_memory(dst.as_mut_ptr() as usize, PAGE)
        .await
        .unwrap();
    let read = c
        .get_into_test_memory(BackendGet {
            peer: common::OWNER,
            remote_addr: src.as_ptr() as u64,
            packed_key: s.packed_key.clone(),
            local_region_id: d.backend_region_id,
            local_offset: 0,
            len: PAGE as u64,
            deadline: Some(Duration::from_secs(20)),
        })
        .await;
    c.unmap(d.backend_region_id).await.unwrap();
    o.unmap(s.backend_region_id).await.unwrap();
    consumer.shutdown().await;
    owner.shutdown().await;
    assert_eq!(read, Ok(()));
    assert!(dst.iter().all(|&b| b == 0x5c));
}

/// An `shm` engine's address, which names its region, is `rdmareg-`, the
/// process id, `-` and 32 random hex digits, and differs between two
/// engines of one process.
#[test]
fn shm_region_names_carry_the_pid_and_128_random_bits() {
    common::init_tracing();
    let first = OfiEngine::start(common::config(Provider::Shm)).expect("starts");
    let second = OfiEngine::start(common::config(Provider::Shm)).expect("starts");
    let names = [first.fabric_address(), second.fabric_address()];
    let prefix = format!("rdmareg-{}-", std::process::id());
    for name in &names {
        let text = String::from_utf8_lossy(name);
        let random = text
            .strip_prefix(prefix.as_str())
            .unwrap_or_else(|| panic!("{text} does not start with {prefix}"))
            .trim_end_matches('\0');
        assert_eq!(random.len(), 32, "{text}");
        assert!(
            random
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "{text}"
        );
    }
    assert_ne!(names[0], names[1]);
    first.shutdown_blocking();
    second.shutdown_blocking();
}
