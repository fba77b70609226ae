//! `cargo xtask asan`: the registry, UCX, libfabric and integration suites under
//! AddressSanitizer, on the stable toolchain.
//!
//! # How the build is instrumented
//!
//! `-Zsanitizer=address` is a nightly flag; `RUSTC_BOOTSTRAP=1` lets the
//! stable compiler accept it. The standard library is the prebuilt,
//! uninstrumented one (`-Zbuild-std` is not available here), so the
//! sanitizer is a target modifier the linked crates disagree on;
//! `-Cunsafe-allow-abi-mismatch=sanitizer` accepts that. What is lost is
//! only the checking of accesses made *inside* std's own code; every access
//! our crates and their dependencies make is checked, allocations anywhere
//! (UCX included) go through ASan's allocator, and `memcpy` and friends
//! called from UCX's C code are checked by ASan's interceptors.
//!
//! `--target <host>` is explicit so that `RUSTFLAGS` reach only the target
//! crates, not build scripts and proc-macros. The build has its own target
//! directory (`asan/` in the build directory: `target/asan`, or below
//! `CARGO_TARGET_DIR`) so it never invalidates the normal one.
//!
//! # What it sees
//!
//! Every access by our code, and by UCX's C code through the functions ASan
//! intercepts: an owner that frees a registered buffer under a tcp GET is
//! reported as a heap-use-after-free in `memcpy` under
//! `ucp_rma_sw_pack_get_reply`. Copies the kernel or a NIC makes are
//! invisible to it: over cma (`SameHost`, shared memory) the same bug reads
//! freed memory through `process_vm_readv` and ASan says nothing; only the
//! tests' own byte checks can catch it there.
//!
//! Tests that re-execute their own binary as a second process (the
//! `two_processes` owner, the integration suite's `isolated` scenarios) run
//! the same instrumented executable, and a sanitizer report in the child
//! fails the parent test (the child exits non-zero).
//!
//! # Leak detection
//!
//! LeakSanitizer is on. UCX itself reports no leaks in these suites, so no
//! UCX suppression is needed; `.ci/lsan.supp` is passed anyway and documents
//! the rule for adding one. The one deliberate exception is
//! [`LEAKS_BY_DESIGN`]: registry tests over the loopback that end with memory
//! still registered. The registry then leaks that memory on purpose (freeing
//! memory whose unmap was never confirmed could hand pinned pages back to
//! the allocator), so LeakSanitizer rightly reports it. Those tests run in a
//! second pass with leak detection off; everything else ASan checks still
//! applies to them.
//!
//! A test that **fails** in the first pass — panics before it shuts its
//! registry down — gets the same kind of report on top of its panic: the
//! registry it abandoned leaks what it still held, by design. Such a report
//! is a consequence of the failure, not a second finding: it follows the
//! panic, the leaked blocks were allocated by the registry (`pool::map_arena`
//! for arenas, the caller for owned buffers), and the registry logged an
//! `arena pages leaked` or `owned buffer leaked` error for each. Measured:
//! a test that registers a 64 KiB owned buffer, reads it into a pool buffer
//! over tcp and then panics reports the 4 MiB pool arena. Fix the panic; only a leak
//! report in a test that passed is a leak to look into. With every test
//! passing, the three suites report no leak outside [`LEAKS_BY_DESIGN`]
//! (113 registry tests, 328 UCX and integration tests, leak detection on
//! for all).
//!
//! # Exclusions
//!
//! Tests that cannot run under ASan at all are listed in [`CANNOT_RUN`], by
//! name and with the reason, and are left out of both passes. Test binaries
//! that run no unsafe code, where ASan can find nothing Rust does not
//! already check, are listed in [`SAFE_ONLY`] by their module of the
//! `rdmareg-ucx` test binary. Tests marked `#[ignore]`
//! stay ignored, as in the normal run.
//!
//! The run uses nextest's `ci` profile (`.config/nextest.toml`), as the
//! test step does: six test threads, the deadline-bound tests alone.

use std::process::Command;

use crate::ucx;
use crate::util::{Error, Result, bail, build_dir, cargo, probe, run, workspace_root};

/// The packages whose tests run: the registry (over the loopback), the UCX
/// engine and backend, the libfabric engine and backend (its owner-served
/// use-after-free test among them), and the workspace integration tests
/// (the registry scenarios over UCX and over libfabric).
const PACKAGES: &[&str] = &[
    "rdmareg-registry",
    "rdmareg-ucx",
    "rdmareg-ofi",
    "rdmareg-tests",
];

/// Compiler flags of the instrumented build.
const RUSTFLAGS: &str = "-Zsanitizer=address -Cunsafe-allow-abi-mismatch=sanitizer";

/// AddressSanitizer runtime options, before `detect_leaks`.
///
/// - `halt_on_error=1` (the default, stated): the first report ends the
///   process with a non-zero status, so the test fails.
/// - `handle_abort=1`: a UCX assertion (`abort()`) prints a stack trace.
const ASAN_OPTIONS: &str = "halt_on_error=1:handle_abort=1";

/// A test named by its nextest binary id and its full test name.
struct Named {
    binary: &'static str,
    test: &'static str,
}

impl Named {
    /// The nextest filterset matching exactly this test.
    fn filter(&self) -> String {
        format!("(binary_id({}) & test(={}))", self.binary, self.test)
    }
}

/// Tests that cannot run under ASan, with the reason; they run in the normal
/// test step. (`#[ignore]`d tests stay ignored, as in the normal run: the
/// owner-abort test of the integration suite is ignored for a UCX abort, not
/// for the sanitizer.)
const CANNOT_RUN: &[(Named, &str)] = &[
    (
        ofi_unit(
            "adversarial_peers::hostile_consumers::gathered_replies_to_many_reply_addresses_do_not_grow_the_owner_without_bound",
        ),
        MEASURES_MEMORY,
    ),
    (
        ofi_unit(
            "adversarial_peers::hostile_owners::overlong_replies_of_a_hostile_owner_leave_the_consumer_no_memory_behind",
        ),
        MEASURES_MEMORY,
    ),
    (
        ofi_unit(
            "adversarial_peers::hostile_owners::an_owner_that_never_answers_cannot_make_its_consumer_hoard_scratch_memory",
        ),
        MEASURES_MEMORY,
    ),
    (
        ofi_unit(
            "adversarial_peers::hostile_consumers::made_up_reply_addresses_do_not_lock_later_consumers_out_of_an_owner",
        ),
        "its owner must work through a flood of 4096 requests before a later read's 3 s \
         deadline, and under ASan on a loaded machine it did not (the read timed out once)",
    ),
];

/// Modules of the `rdmareg-ucx` test binary ([`UCX_TESTS`]) left out
/// because they run no unsafe code: property and
/// table tests of the UCX wire-format validators (worker addresses, packed
/// keys, read lists) against a Rust model of UCX's parser, with no engine
/// and no FFI. Those validators and models contain no `unsafe` (a test
/// checks it), so Rust's own checks already cover every access ASan would;
/// the fuzz step runs the same validators under ASan besides. They run in
/// the normal test step.
const SAFE_ONLY: &[&str] = &[
    "worker_address_props",
    "worker_address_malformed",
    "worker_address_real",
    "packed_key_props",
    "packed_key_malformed",
    "packed_key_real",
    "read_list_props",
];

/// The sources [`SAFE_ONLY`] rests on: the validators and the models.
#[cfg(test)]
const SAFE_ONLY_SOURCES: &[&str] = &[
    "crates/rdmareg-ucx/src/worker_address.rs",
    "crates/rdmareg-ucx/src/packed_key.rs",
    "crates/rdmareg-ucx/src/read_list.rs",
    "crates/rdmareg-ucx/tests/worker_address_model/mod.rs",
    "crates/rdmareg-ucx/tests/packed_key_model/mod.rs",
];

/// The nextest binary id of `rdmareg-ucx`'s integration tests.
const UCX_TESTS: &str = "rdmareg-ucx::ucx";

/// The nextest filterset of every test in a module of [`SAFE_ONLY`].
fn safe_only() -> String {
    format!(
        "(binary_id({UCX_TESTS}) & test(/^({})::/))",
        SAFE_ONLY.join("|")
    )
}

/// Why the memory-bound tests are in [`CANNOT_RUN`].
const MEASURES_MEMORY: &str = "it bounds how much the process's memory grows, and ASan's \
     allocator (redzones, a quarantine of freed blocks, shadow memory) inflates that growth \
     past any bound an uninstrumented process keeps (151 MiB against 128 MiB measured)";

/// Why every entry of [`LEAKS_BY_DESIGN`] is there.
const LEAK_REASON: &str = "the test ends with memory still registered with the loopback (a \
     guard, pool arena or owned buffer never unregistered, or a registry never shut down), or \
     asserts the leak itself; the registry then leaks that memory on purpose, counted in \
     `leaked_bytes`, because freeing memory whose unmap was never confirmed could hand pinned \
     pages back to the allocator";

/// Printed when the leak-detecting pass fails (see the module docs).
const FAILED_TEST_LEAKS: &str = "a LeakSanitizer report in a test that also panicked is the \
     registry's deliberate leak of what the failed test never unregistered (logged as \
     `arena pages leaked` or `owned buffer leaked`); fix the panic first";

/// Registry tests whose leaks are the registry's designed behaviour (see
/// [`LEAK_REASON`]). They run with leak detection off; all other ASan checks
/// still apply. A registry test that shuts its registries down cleanly does
/// not belong here.
const LEAKS_BY_DESIGN: &[Named] = &[
    // Assert the leak itself.
    unit("pool::memory::tests::registered_memory_is_leaked_and_counted_unless_confirmed"),
    unit("region::owned::tests::registered_buffer_is_leaked_and_counted_not_freed"),
    suite("pool::arena_pages_never_confirmed_unmapped_are_leaked_loudly_not_freed"),
    suite(
        "rollbacks::a_rollback_dropped_with_its_runtime_leaks_the_arena_pages_instead_of_freeing_them",
    ),
    // End with guards, arenas or owned buffers still registered.
    suite(
        "adversarial_lending::a_cancelled_describe_keeps_its_granules_until_its_rollback_unmapped_them",
    ),
    suite("adversarial_lending::a_cancelled_describe_whose_rollback_finishes_leaks_nothing"),
    suite(
        "adversarial_lending::a_cancelled_describe_whose_rollback_unmap_is_refused_leaks_its_granules_and_counts_them",
    ),
    suite(
        "adversarial_lending::a_describe_admitted_before_shutdown_finishes_inside_the_drain_and_settles_after_it",
    ),
    suite(
        "adversarial_lending::a_described_buffer_held_across_shutdown_loses_its_key_at_teardown_and_leaks_nothing",
    ),
    suite(
        "adversarial_lending::a_freed_described_buffer_whose_unmap_dies_with_its_runtime_stays_charged_and_counts_its_leak",
    ),
    suite(
        "adversarial_lending::a_withdrawal_whose_unmap_dies_with_its_runtime_keeps_the_key_charged_and_counts_its_leak",
    ),
    suite(
        "adversarial_lending::a_withdrawn_and_re_described_buffer_answers_its_old_descriptor_with_a_typed_error",
    ),
    suite("bounded_waits::shutdown_spends_one_budget_on_the_drain_and_the_unmaps_together"),
    suite("bounded_waits::a_region_the_backend_unmaps_after_the_shutdown_budget_is_no_survivor"),
    suite(
        "bounded_waits::unregister_returns_within_its_timeout_while_a_get_reads_the_region_and_names_the_transfer",
    ),
    suite(
        "bounded_waits::unregister_owned_past_its_timeout_is_a_timeout_and_the_buffer_is_released_later",
    ),
    suite("describe::a_cancelled_describe_frees_the_buffer_and_leaves_nothing_registered"),
    suite("describe::a_cancelled_withdrawal_frees_the_buffer_only_after_its_unmap"),
    suite(
        "describe::a_described_buffer_withdrawn_is_unreadable_by_its_old_descriptors_and_writable_again",
    ),
    suite("describe::a_pool_buffers_descriptor_grants_only_that_buffer"),
    suite("describe::describing_a_surrendered_buffer_is_refused_and_gives_it_back"),
    suite("describe::withdrawing_during_shutdown_is_refused_and_keeps_the_buffer_described"),
    suite(
        "describe::withdrawing_waits_for_the_unmap_and_a_refused_unmap_keeps_the_buffer_described",
    ),
    suite("describe::freeing_a_described_buffer_unmaps_its_key_before_its_memory_serves_another"),
    suite("describe::guard_describes_the_whole_region_and_its_sub_ranges"),
    suite("describe::handles_are_shareable_and_every_future_can_be_spawned"),
    suite("describe::registering_the_same_memory_again_gets_a_new_generation"),
    suite("model::registry_matches_its_model_under_random_interleavings"),
    suite("pool::an_arena_shrinks_to_what_is_left_of_the_budget"),
    suite("pool::buffers_have_exactly_the_requested_length_and_whole_granules_of_space"),
    suite("pool::empty_pooled_arenas_are_kept_when_reclaim_is_off"),
    suite("pool::empty_pooled_arenas_are_reclaimed_down_to_the_retention_floor"),
    suite("pool::pooled_arenas_grow_geometrically_and_saturate_at_the_maximum"),
    suite("pool::space_freed_by_a_dropped_buffer_is_reused"),
    suite("pool::try_alloc_never_maps"),
    suite("shutdown::shutdown_is_bounded_by_its_budget_and_then_unmaps_regardless"),
    suite("shutdown::shutdown_waits_for_transfers_in_flight"),
    suite("transfer::dropped_get_keeps_the_destination_slot_until_the_transfer_finishes"),
    suite("transfer::get_copies_the_described_bytes_into_the_buffer"),
    suite("transfer::get_into_lands_a_sub_range_at_an_offset"),
    suite("transfer::get_of_an_unregistered_remote_range_fails_and_returns_the_buffer"),
    suite("transfer::get_past_its_deadline_times_out_and_returns_the_buffer"),
    suite("transfer::get_refuses_a_descriptor_of_another_backend"),
    suite("transfer::get_refuses_a_range_that_does_not_fit_the_destination"),
    suite("transfer::a_get_carries_the_registry_deadline_not_the_backend_default"),
    suite("metrics::counters_follow_registrations_gets_and_errors"),
];

/// A unit test of the libfabric backend's library.
const fn ofi_unit(test: &'static str) -> Named {
    Named {
        binary: "rdmareg-ofi",
        test,
    }
}

/// A unit test of the registry library.
const fn unit(test: &'static str) -> Named {
    Named {
        binary: "rdmareg-registry",
        test,
    }
}

/// A test of the registry's integration suite (`tests/registry/`).
const fn suite(test: &'static str) -> Named {
    Named {
        binary: "rdmareg-registry::registry",
        test,
    }
}

/// `cargo xtask asan`.
pub fn run_task(args: &[String]) -> Result<()> {
    if let Some(extra) = args.first() {
        bail!("`cargo xtask asan` takes no arguments (got `{extra}`)");
    }
    use crate::native::{self, Need};
    native::ensure(&[native::BUILD, &[Need::Etcd, Need::Nextest]].concat())?;
    let ucx = ucx::ensure()?;
    eprintln!(
        "using UCX {} at {}",
        ucx.describe_version(),
        ucx.prefix.display()
    );
    let host = host_triple()?;
    for (test, reason) in CANNOT_RUN {
        eprintln!(
            "not run under ASan: {} {}: {reason}",
            test.binary, test.test
        );
    }
    eprintln!(
        "not run under ASan: the tests of {UCX_TESTS} in {}: they run no unsafe code \
         (wire-format validators against a model, no engine, no FFI)",
        SAFE_ONLY.join(", ")
    );
    let excluded = format!(
        "{} | {}",
        any_of(CANNOT_RUN.iter().map(|(test, _)| test)),
        safe_only()
    );
    let by_design = any_of(LEAKS_BY_DESIGN.iter());

    println!("\n==> ASan, leak detection on");
    run(&mut nextest(
        &host,
        true,
        &format!("not ({by_design}) & not ({excluded})"),
    ))
    .map_err(|e| Error::msg(format!("{e}\n{FAILED_TEST_LEAKS}")))?;

    println!(
        "\n==> ASan, leak detection off for {} registry tests that leak by design: {LEAK_REASON}",
        LEAKS_BY_DESIGN.len()
    );
    run(&mut nextest(
        &host,
        false,
        &format!("({by_design}) & not ({excluded})"),
    ))?;
    println!("asan: no sanitizer report");
    Ok(())
}

/// `a | b | ...` of the tests' filters; `none()` when there are none.
fn any_of<'a>(tests: impl Iterator<Item = &'a Named>) -> String {
    let filters: Vec<String> = tests.map(Named::filter).collect();
    if filters.is_empty() {
        "none()".to_string()
    } else {
        filters.join(" | ")
    }
}

/// The instrumented `cargo nextest run` of [`PACKAGES`], selecting the tests
/// of `filter`.
fn nextest(host: &str, detect_leaks: bool, filter: &str) -> Command {
    let target = build_dir().join("asan");
    let mut cmd = cargo([
        "nextest",
        "run",
        "--no-fail-fast",
        "--all-features",
        "--profile",
        "ci",
    ]);
    for package in PACKAGES {
        cmd.args(["--package", package]);
    }
    cmd.args(["--target", host])
        .arg("--target-dir")
        .arg(&target)
        .args(["-E", filter])
        .env("RUSTC_BOOTSTRAP", "1")
        .env("RUSTFLAGS", RUSTFLAGS)
        // Takes precedence over RUSTFLAGS when set; a caller's would win.
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env(
            "ASAN_OPTIONS",
            format!("{ASAN_OPTIONS}:detect_leaks={}", u8::from(detect_leaks)),
        )
        .env(
            "LSAN_OPTIONS",
            format!(
                "suppressions={}:print_suppressions=0",
                workspace_root().join(".ci/lsan.supp").display()
            ),
        );
    cmd
}

/// The host's target triple, from `rustc -vV`.
fn host_triple() -> Result<String> {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let Some(version) = probe(Command::new(rustc).arg("-vV")) else {
        bail!("`rustc -vV` failed; cannot tell the host target triple");
    };
    match version.lines().find_map(|line| line.strip_prefix("host: ")) {
        Some(host) => Ok(host.trim().to_string()),
        None => bail!("`rustc -vV` names no host triple:\n{version}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_name_one_test_of_one_binary_exactly() {
        let named = suite("pool::try_alloc_never_maps");
        assert_eq!(
            named.filter(),
            "(binary_id(rdmareg-registry::registry) & test(=pool::try_alloc_never_maps))"
        );
    }

    #[test]
    fn an_empty_list_matches_no_test() {
        assert_eq!(any_of([].iter()), "none()");
        let two = [unit("a"), suite("b")];
        assert_eq!(
            any_of(two.iter()),
            "(binary_id(rdmareg-registry) & test(=a)) | \
             (binary_id(rdmareg-registry::registry) & test(=b))"
        );
    }

    #[test]
    fn every_test_left_out_of_leak_detection_exists_in_the_registry_sources() {
        let registry = workspace_root().join("crates/rdmareg-registry");
        for named in LEAKS_BY_DESIGN {
            let (module, name) = named.test.rsplit_once("::").unwrap();
            let file = if named.binary == "rdmareg-registry" {
                let module = module.strip_suffix("::tests").unwrap();
                registry.join("src").join(module.replace("::", "/") + ".rs")
            } else {
                registry
                    .join("tests/registry")
                    .join(module.replace("::", "/") + ".rs")
            };
            let source = std::fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            assert!(
                source.contains(&format!("fn {name}(")),
                "{} names no test {name}: update LEAKS_BY_DESIGN",
                file.display()
            );
        }
    }

    #[test]
    fn modules_left_out_as_safe_only_exist_and_have_no_unsafe() {
        let root = workspace_root();
        for module in SAFE_ONLY {
            let file = root.join(format!("crates/rdmareg-ucx/tests/ucx/{module}.rs"));
            let source = std::fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            assert!(!source.contains("unsafe"), "{} has unsafe", file.display());
        }
        for file in SAFE_ONLY_SOURCES {
            let source =
                std::fs::read_to_string(root.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
            assert!(
                !source.contains("unsafe"),
                "{file} has unsafe: its tests belong under ASan again"
            );
        }
    }

    #[test]
    fn the_suppression_file_exists() {
        assert!(workspace_root().join(".ci/lsan.supp").is_file());
    }
}
