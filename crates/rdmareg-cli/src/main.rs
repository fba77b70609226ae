//! `rdmareg`: the command-line face of rdmareg.
//!
//! - `rdmareg demo` — an owner and a consumer process move registered memory
//!   with GETs over UCX (`--transport`) or libfabric (`--backend ofi
//!   --provider tcp|shm`), verify every byte and shut down in order.
//! - `rdmareg serve` / `rdmareg fetch` — owners publish registered memory by
//!   name in etcd under leases; consumers resolve, GET and verify it, and drop
//!   an owner the moment its lease vanishes.
//! - `rdmareg bench` — GET latency and bandwidth through the registry against
//!   `ucx_perftest` from the same UCX, the libfabric lanes beside them, and
//!   pool allocation against map+unmap.
//!
//! Errors are reported as one line on stderr; the exit status is 0 on
//! success, 1 when the run failed (verification, shutdown, an unreachable
//! or lost peer) and 2 for bad arguments.
//!
//! Standard output carries only the command's own report, which scripts
//! read: UCX's log (its warnings and errors) goes to standard error. UCX
//! picks its log stream once, when the library is loaded — before `main`
//! runs — from `UCX_LOG_FILE`, and without it writes to standard output.
//! So when `UCX_LOG_FILE` is unset the binary first replaces itself with
//! itself, same arguments, with `UCX_LOG_FILE=stderr` (see
//! [`set_library_environment`]); a value the caller set is left alone.
//!
//! The same re-run sets `FI_AV_REMOVE_CLEANUP=1` when it is unset, so that
//! a libfabric tcp engine can end a read a stalled owner holds past its
//! deadline (`OfiEngine::resets_stalled_connections`).
//! libfabric reads that variable once, when it initialises.

mod bench;
mod bootstrap;
mod cli;
mod control;
mod demo;
mod discovery;
mod metrics;
mod node;
mod owner_process;
mod pattern;
mod stats;

use std::io::IsTerminal as _;
use std::os::unix::process::CommandExt as _;
use std::process::{Command, ExitCode};

use clap::Parser;

/// The UCX variable naming where its log goes (a path, `stdout` or
/// `stderr`; empty or unset means standard output).
const UCX_LOG_FILE: &str = "UCX_LOG_FILE";

/// The libfabric parameter that makes removing a peer's address close its
/// `ofi_rxm` connection: the only way libfabric 1.17 ends a receive a
/// stalled sender holds (see `docs/ofi.md`, "Hostile peers").
const FI_AV_REMOVE_CLEANUP: &str = "FI_AV_REMOVE_CLEANUP";

/// What the binary runs with unless the caller set it (see
/// [`set_library_environment`]).
const LIBRARY_ENVIRONMENT: [(&str, &str); 2] =
    [(UCX_LOG_FILE, "stderr"), (FI_AV_REMOVE_CLEANUP, "1")];

fn main() -> ExitCode {
    if let Some(problem) = set_library_environment() {
        eprintln!(
            "rdmareg: warning: {problem}; UCX may log to standard output, and libfabric tcp reads held by a stalled owner end only with the owner"
        );
    }
    restore_default_termination_signals();
    let mut cli = cli::Cli::parse();
    if let cli::Command::Demo(args) = &mut cli.command {
        // `--backend ofi --provider P` is the lane `ofi-P`: settle it once,
        // so the owner process is started on the same lane.
        match args.lane() {
            Ok(lane) => args.transport = lane,
            Err(message) => {
                use clap::CommandFactory as _;
                cli::Cli::command()
                    .error(clap::error::ErrorKind::ArgumentConflict, message)
                    .exit()
            }
        }
    }
    init_logging(cli.verbose);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("rdmareg: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        cli::Command::Demo(args) => runtime.block_on(demo::run(args)),
        cli::Command::Bench(args) => runtime.block_on(bench::run(args)),
        cli::Command::Serve(args) => runtime.block_on(discovery::serve::run(args)),
        cli::Command::Fetch(args) => runtime.block_on(discovery::fetch::run(args)),
        cli::Command::BenchOwner(args) => runtime.block_on(bench::run_owner(args)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rdmareg: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Gives SIGINT and SIGTERM back their default action, before anything of
/// this program handles them.
///
/// libfabric links the PSM libraries (`libpsm2`, `libinfinipath`), whose
/// load-time constructors install their own handlers for SIGINT, SIGTERM
/// and the fault signals: print a backtrace, then end the process. Tokio's
/// signal handling (which `serve` and `fetch` use to withdraw their names
/// and shut down in order) calls a handler it finds installed after its
/// own, so a SIGTERM would end the process before the orderly shutdown
/// could run. Measured: `rdmareg serve` died silently on SIGTERM once the
/// binary linked libfabric. The fault signals keep their handlers.
fn restore_default_termination_signals() {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: `signal` is a valid signal number and `SIG_DFL` a valid
        // disposition; this runs at the start of `main`, before this
        // program starts a thread or installs a handler of its own, so no
        // handler of ours is replaced.
        unsafe { libc::signal(signal, libc::SIG_DFL) };
    }
}

fn init_logging(verbose: u8) {
    // At the default level the engine's per-peer warnings (a GET past its
    // deadline, a failed endpoint) stay quiet: the command reports a lost
    // peer itself, in one line. `-v` shows them.
    let default = match verbose {
        0 => "warn,rdmareg_ucx::progress::peers=error",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

/// Sets the variables of [`LIBRARY_ENVIRONMENT`] the caller left unset:
/// replaces this process with a fresh run of the same binary and
/// arguments with them added, and does not return. Returns `None` when
/// every one is set (nothing to do), or else why the re-run failed (the
/// process then carries on as it is).
///
/// - `UCX_LOG_FILE=stderr` sends UCX's log to standard error. Setting it
///   from here would be too late: the UCX libraries are loaded with the
///   binary, and their constructors have opened the log on standard output
///   before `main` starts. The new image reads the variable when it loads
///   them.
/// - `FI_AV_REMOVE_CLEANUP=1` lets libfabric close one peer's connection.
///   libfabric reads it when it first initialises, later than this; but
///   changing the environment of a running process is sound only while no
///   other thread can read it, which a library constructor may already
///   have started. The new image starts with the variable instead.
///
/// The new image keeps the process id, so signals, the parent's wait and
/// the owner process the demo spawns (which inherits the variables) are
/// unaffected. A value the caller set, even empty or `0`, is left alone.
fn set_library_environment() -> Option<String> {
    let missing: Vec<(&str, &str)> = LIBRARY_ENVIRONMENT
        .into_iter()
        .filter(|(name, _)| std::env::var_os(name).is_none())
        .collect();
    if missing.is_empty() {
        return None;
    }
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return Some(format!("cannot find this executable to re-run it: {e}")),
    };
    let mut args = std::env::args_os();
    let mut command = Command::new(&exe);
    if let Some(arg0) = args.next() {
        command.arg0(arg0);
    }
    // `exec` returns only on failure.
    let error = command.args(args).envs(missing.iter().copied()).exec();
    let names: Vec<&str> = missing.iter().map(|(name, _)| *name).collect();
    Some(format!(
        "cannot re-run {} with {} set: {error}",
        exe.display(),
        names.join(" and ")
    ))
}
