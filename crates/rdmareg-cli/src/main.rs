//! `rdmareg`: the command-line face of rdmareg (`demo`, `serve`/`fetch`,
//! `bench`; see `--help`).
//!
//! Errors are one line on stderr; the exit status is 0 on success, 1 when
//! the run failed and 2 for bad arguments. Standard output carries only the
//! command's report: the binary re-runs itself with `UCX_LOG_FILE=stderr`
//! and `FI_AV_REMOVE_CLEANUP=1` when they are unset
//! ([`set_library_environment`], `docs/operations.md`).

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

/// The UCX variable naming where its log goes (unset: standard output).
const UCX_LOG_FILE: &str = "UCX_LOG_FILE";

/// The libfabric parameter that makes removing a peer's address close its
/// `ofi_rxm` connection, ending a receive a stalled sender holds
/// (`docs/ofi.md`, "Hostile peers").
const FI_AV_REMOVE_CLEANUP: &str = "FI_AV_REMOVE_CLEANUP";

/// What the binary runs with unless the caller set it.
const LIBRARY_ENVIRONMENT: [(&str, &str); 2] =
    [(UCX_LOG_FILE, "stderr"), (FI_AV_REMOVE_CLEANUP, "1")];

fn main() -> ExitCode {
    if let Some(problem) = set_library_environment() {
        eprintln!(
            "rdmareg: warning: {problem}; UCX may log to standard output, and libfabric tcp reads held by a stalled owner end only with the owner"
        );
    }
    rdmareg_ofi::restore_default_termination_signals();
    let mut cli = cli::Cli::parse();
    if let cli::Command::Demo(args) = &mut cli.command {
        // `--backend ofi --provider P` is lane `ofi-P`, for the owner too.
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

fn init_logging(verbose: u8) {
    // By default the engine's per-peer warnings stay quiet: the command
    // reports a lost peer itself. `-v` shows them.
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

/// Sets the variables of [`LIBRARY_ENVIRONMENT`] the caller left unset by
/// replacing this process with a run of the same binary and arguments with
/// them added; does not return unless every one is set (`None`) or the
/// re-run failed (why; the process carries on).
///
/// Setting them in-process would be too late for UCX, whose constructors
/// open the log before `main`, and unsound for libfabric's, since changing
/// the environment races any thread a library constructor started. The new
/// image keeps the process id; a value the caller set is left alone.
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
