//! `rdmareg`: the command-line face of rdmareg.
//!
//! - `rdmareg demo` — an owner and a consumer process move registered memory
//!   with one-sided GETs over UCX, verify every byte and shut down in order.
//! - `rdmareg serve` / `rdmareg fetch` — owners publish registered memory by
//!   name in etcd under leases; consumers resolve, GET and verify it, and drop
//!   an owner the moment its lease vanishes.
//! - `rdmareg bench` — GET latency and bandwidth through the registry against
//!   `ucx_perftest` from the same UCX, and pool allocation against map+unmap.
//!
//! Errors are reported as one line on stderr; the exit status is 0 on
//! success, 1 when the run failed (verification, shutdown, an unreachable
//! or lost peer) and 2 for bad arguments.

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
use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
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
