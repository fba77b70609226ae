//! `cargo xtask sim`: run the engine kit's deterministic simulators over
//! many seeds, in an optimised build.
//!
//! The simulators are tests of `rdmareg-engine` whose names contain `sim::`;
//! they read which seeds to run from `RDMAREG_SIM_FIRST_SEED` and
//! `RDMAREG_SIM_SEEDS`. A failure prints its seed; `--seed S` replays
//! exactly that one.
//!
//! ```text
//! cargo xtask sim                      the first 10,000 seeds
//! cargo xtask sim --seeds N [--from S] N seeds from S (default 0)
//! cargo xtask sim --random N           N seeds from a start drawn from the clock (printed)
//! cargo xtask sim --seed S             replay one seed
//! ```
//!
//! CI runs the fixed first 10,000 and a random batch ([`ci_run`]), so every
//! run checks the same ground and some new ground.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::util::{Result, bail, cargo, run};

/// Seeds of the fixed set.
pub const FIXED_SEEDS: u64 = 10_000;
/// Seeds of CI's random batch.
pub const CI_RANDOM_SEEDS: u64 = 20_000;

/// `cargo xtask sim`.
pub fn run_task(args: &[String]) -> Result<()> {
    let mut first = 0u64;
    let mut count = FIXED_SEEDS;
    let mut random = false;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| -> Result<u64> {
            let Some(text) = args.next() else {
                bail!("{name} needs a number");
            };
            text.parse()
                .map_err(|_| crate::util::Error::msg(format!("{name}: `{text}` is not a number")))
        };
        match arg.as_str() {
            "--seeds" => count = value("--seeds")?,
            "--from" => first = value("--from")?,
            "--seed" => {
                first = value("--seed")?;
                count = 1;
            }
            "--random" => {
                count = value("--random")?;
                random = true;
            }
            other => bail!("unknown argument `{other}` (see the usage of `cargo xtask sim`)"),
        }
    }
    if random {
        first = clock_seed();
    }
    seeds(first, count)
}

/// The CI step: the fixed seeds, then a random batch.
pub fn ci_run() -> Result<()> {
    seeds(0, FIXED_SEEDS)?;
    seeds(clock_seed(), CI_RANDOM_SEEDS)
}

/// Runs `count` seeds from `first`.
fn seeds(first: u64, count: u64) -> Result<()> {
    eprintln!(
        "sim: seeds {first}..{} (replay one with `cargo xtask sim --seed S`)",
        first.saturating_add(count)
    );
    let mut command = cargo([
        "test",
        "-p",
        "rdmareg-engine",
        "--release",
        "--lib",
        "sim::",
    ]);
    command
        .env("RDMAREG_SIM_FIRST_SEED", first.to_string())
        .env("RDMAREG_SIM_SEEDS", count.to_string());
    run(&mut command)
}

/// A start seed from the clock, below 2^48 so that it reads easily.
fn clock_seed() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos % (1 << 48)
}
