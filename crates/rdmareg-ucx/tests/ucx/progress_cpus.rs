//! `UcxConfig::progress_cpus`: the progress thread runs on the CPUs it was
//! given, reads still work from there, and a set the kernel cannot honour
//! fails the start with a typed error instead of an engine on any CPU.
//!
//! Each test counts the progress threads of the whole process, so each runs
//! in a process of its own (`in_own_process`): under `cargo test`, engines
//! of other tests of this binary would otherwise be counted.

use crate::common;

use common::*;
use rdmareg_backend::own_process::in_own_process;
use rdmareg_core::RdmaError;
use rdmareg_ucx::{Transport, UcxEngine};

/// The `Cpus_allowed_list` of every thread of this process named like the
/// progress thread.
fn progress_threads_cpus() -> Vec<String> {
    let mut found = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let task = task.unwrap().path();
        let Ok(name) = std::fs::read_to_string(task.join("comm")) else {
            continue; // The thread ended meanwhile.
        };
        if name.trim() != "rdmareg-ucx" {
            continue;
        }
        let Ok(status) = std::fs::read_to_string(task.join("status")) else {
            continue;
        };
        if let Some(line) = status.lines().find(|l| l.starts_with("Cpus_allowed_list:")) {
            found.push(line["Cpus_allowed_list:".len()..].trim().to_owned());
        }
    }
    found
}

/// The CPUs this process may run on, as the kernel lists them.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: an all-zero `cpu_set_t` is a valid empty set for the kernel
    // to fill; pid 0 is this thread.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live mask of the size passed.
    let status =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    assert_eq!(status, 0, "sched_getaffinity");
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: every index is below the set's size.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect()
}

#[test]
fn the_progress_thread_runs_on_the_cpus_it_was_given_and_serves_reads_from_there() {
    in_own_process(|| {
        let allowed = allowed_cpus();
        let last = *allowed.last().expect("at least one CPU");
        assert!(progress_threads_cpus().is_empty(), "no engine yet");
        let (owner, consumer) = engines_with(config(Transport::Tcp).with_progress_cpus([last]));
        let cpus = progress_threads_cpus();
        assert_eq!(
            cpus,
            vec![last.to_string(), last.to_string()],
            "both progress threads pinned"
        );

        // A read still goes through, served and consumed on that CPU.
        let runtime = runtime();
        runtime.block_on(async {
            let (ob, cb) = (owner.backend(), consumer.backend());
            let src = PageBuf::filled(8192, pattern);
            let dst = PageBuf::zeroed(8192);
            let src_region = map(&ob, &src).await;
            let dst_region = map(&cb, &dst).await;
            let desc = describe(&src, &src_region);
            let request = get_request(OWNER, &desc, &dst_region, 0, None);
            assert_eq!(cb.get_into_test_memory(request).await, Ok(()));
            assert_eq!(dst.snapshot(), src.snapshot());
            consumer.shutdown().await;
            owner.shutdown().await;
        });
    });
}

#[test]
fn a_cpu_set_the_kernel_refuses_fails_the_start_with_a_typed_error() {
    in_own_process(|| {
        let allowed = allowed_cpus();
        // The highest number the mask holds, unless this machine has it.
        let absent = (0..libc::CPU_SETSIZE as usize)
            .rev()
            .find(|cpu| !allowed.contains(cpu))
            .expect("a machine with fewer than 1024 CPUs");
        let err = UcxEngine::start(config(Transport::Tcp).with_progress_cpus([absent]))
            .expect_err("an engine pinned to no usable CPU must not start");
        match err {
            RdmaError::Backend(text) => assert!(
                text.contains("pinning the progress thread"),
                "the error says what failed: {text}"
            ),
            other => panic!("expected a backend error, got {other:?}"),
        }
        assert!(
            progress_threads_cpus().is_empty(),
            "the refused engine's thread is gone"
        );
    });
}

#[test]
fn an_empty_or_out_of_range_cpu_set_is_refused_before_anything_starts() {
    in_own_process(|| {
        for cpus in [vec![], vec![0, 1 << 20]] {
            let err = UcxEngine::start(config(Transport::Tcp).with_progress_cpus(cpus.clone()))
                .err()
                .unwrap_or_else(|| panic!("{cpus:?} must be refused"));
            assert!(
                matches!(&err, RdmaError::Backend(text) if text.contains("invalid engine configuration")),
                "{cpus:?}: {err:?}"
            );
        }
        assert!(progress_threads_cpus().is_empty());
    });
}
