//! `cargo xtask fuzz [TARGET|all] [--secs N]`: run the coverage-guided fuzz
//! targets of `fuzz/` with cargo-fuzz (libFuzzer), each for a fixed time,
//! and report what libFuzzer measured and any crash it found.
//!
//! The targets exercise the decoders that read bytes from peers (the wire
//! descriptor, the UCX packed remote key and worker address validators, the
//! libfabric backend's packed key, the CLI's bootstrap frames, ...). They are the `[[bin]]` entries of `fuzz/Cargo.toml`, read
//! at run time, so a new target is picked up without touching this task.
//! `fuzz/` is its own cargo workspace, excluded from the main one.
//!
//! # Requirements
//!
//! cargo-fuzz builds with `-Zsanitizer=address` and libFuzzer's coverage
//! instrumentation, nightly compiler flags. The task runs them on the stable
//! toolchain that runs it, with `RUSTC_BOOTSTRAP=1`, so no nightly toolchain
//! is needed. A missing cargo-fuzz is installed with
//! `cargo install cargo-fuzz --locked`. UCX and libfabric are provisioned
//! first, as for the other tasks: the packed-key and worker-address targets
//! link `rdmareg-ucx`, and the fuzz crate links `rdmareg-ofi`.
//! The fuzz build goes to `fuzz/build/` in the build directory
//! (`target/`, or `CARGO_TARGET_DIR` when set).
//!
//! # Corpora
//!
//! The committed seeds in `fuzz/corpus/<target>/` are valid inputs written by
//! the real encoders (`fuzz/examples/write_seeds.rs`). libFuzzer writes every
//! input it finds interesting into the *first* corpus directory it is given,
//! so the task passes `target/fuzz/corpus/<target>/` first and the seeds
//! second: runs grow the untracked working corpus and never touch the
//! committed one. Crash inputs go to `fuzz/artifacts/<target>/`.
//!
//! # In CI
//!
//! `cargo xtask ci` runs every target for [`CI_SECONDS`] ([`smoke`]): a smoke
//! run that catches a decoder that crashes on shallow inputs and a target
//! that no longer builds. The deeper search is this task with a longer
//! `--secs`, by hand or on a schedule.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

use crate::util::{Context, Result, bail, build_dir, cargo, run, target_dir, workspace_root};
use crate::{ofi, ucx};

/// Seconds per target when `--secs` is not given.
const DEFAULT_SECONDS: u64 = 30;

/// Seconds per target in `cargo xtask ci`.
pub const CI_SECONDS: u64 = 10;

/// What to fuzz and for how long.
#[derive(Debug, PartialEq, Eq)]
struct Options {
    targets: Vec<String>,
    seconds: u64,
}

/// `cargo xtask fuzz`.
pub fn run_task(args: &[String]) -> Result<()> {
    let options = parse_args(args, &targets()?)?;
    fuzz(&options)
}

/// Every target for [`CI_SECONDS`]: the CI smoke run.
pub fn smoke() -> Result<()> {
    fuzz(&Options {
        targets: targets()?,
        seconds: CI_SECONDS,
    })
}

fn fuzz(options: &Options) -> Result<()> {
    use crate::native::{self, Need};
    native::ensure(&[native::BUILD, &[Need::CargoFuzz]].concat())?;
    let ucx = ucx::ensure()?;
    eprintln!(
        "using UCX {} at {}",
        ucx.describe_version(),
        ucx.prefix.display()
    );
    let ofi = ofi::find()?;
    eprintln!(
        "using libfabric {}.{} ({})",
        ofi.api.0, ofi.api.1, ofi.origin
    );

    let mut reports = Vec::with_capacity(options.targets.len());
    for target in &options.targets {
        println!("\n==> fuzzing {target} for {} s", options.seconds);
        let report = fuzz_one(target, options.seconds)?;
        println!("<== {target}: {}", report.outcome);
        reports.push(report);
    }

    println!("\nfuzz results ({} s per target):", options.seconds);
    for report in &reports {
        println!("  {report}");
    }
    let failures: Vec<&Report> = reports
        .iter()
        .filter(|report| !matches!(report.outcome, Outcome::Clean))
        .collect();
    if failures.is_empty() {
        println!("fuzz: no crash in {} target(s)", reports.len());
        return Ok(());
    }
    let mut message = format!("fuzzing failed in {} target(s):", failures.len());
    for report in failures {
        message.push_str(&format!("\n  {}: {}", report.target, report.outcome));
        if let Outcome::Crashed { artifact } = &report.outcome {
            message.push_str(&format!(
                "\n    reproduce: RUSTC_BOOTSTRAP=1 cargo fuzz run {} {}",
                report.target,
                artifact.display()
            ));
        }
    }
    bail!("{message}")
}

/// The fuzz targets: the `name` of every `[[bin]]` of `fuzz/Cargo.toml`, in
/// the order `all` runs them.
fn targets() -> Result<Vec<String>> {
    let path = workspace_root().join("fuzz/Cargo.toml");
    let manifest =
        std::fs::read_to_string(&path).context(format!("cannot read {}", path.display()))?;
    let names = bin_names(&manifest);
    if names.is_empty() {
        bail!("{} declares no [[bin]] fuzz targets", path.display());
    }
    Ok(names)
}

/// The `name`s of the `[[bin]]` tables of a manifest. A line-level reading,
/// enough for the fuzz manifest: one `key = value` per line, tables as
/// `[[bin]]` headers (not inline arrays).
fn bin_names(manifest: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut in_bin = false;
    for line in manifest.lines() {
        let line = line.trim();
        if line.starts_with('#') {
            continue;
        }
        if line.starts_with('[') {
            let header: String = line.chars().filter(|c| !c.is_whitespace()).collect();
            in_bin = header.starts_with("[[bin]]");
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        if in_bin && key.trim() == "name" {
            let value = value.split('#').next().unwrap_or_default().trim();
            let name = value.trim_matches(|c| c == '"' || c == '\'');
            if !name.is_empty() {
                names.push(name.to_string());
            }
        }
    }
    names
}

/// Parses `[TARGET|all] [--secs N]` (`--seconds` is the same option).
fn parse_args(args: &[String], known: &[String]) -> Result<Options> {
    const USAGE: &str = "usage: cargo xtask fuzz [TARGET|all] [--secs N]";
    let mut target: Option<&str> = None;
    let mut seconds = DEFAULT_SECONDS;
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        let seconds_value = if arg == "--secs" || arg == "--seconds" {
            let Some(value) = rest.next() else {
                bail!("`{arg}` needs a value");
            };
            Some(value.as_str())
        } else {
            arg.strip_prefix("--secs=")
                .or_else(|| arg.strip_prefix("--seconds="))
        };
        if let Some(value) = seconds_value {
            seconds = match value.parse::<u64>() {
                Ok(n) if n > 0 => n,
                _ => bail!("`--secs` takes a positive whole number (got `{value}`)"),
            };
        } else if arg.starts_with('-') {
            bail!("unknown option `{arg}`; {USAGE}");
        } else if let Some(first) = target {
            bail!("one target at a time (got `{first}` and `{arg}`); use `all` for every target");
        } else {
            target = Some(arg);
        }
    }
    let targets = match target {
        None | Some("all") => known.to_vec(),
        Some(name) if known.iter().any(|known| known == name) => vec![name.to_string()],
        Some(name) => bail!(
            "unknown fuzz target `{name}`; targets: {}, or all",
            known.join(", ")
        ),
    };
    Ok(Options { targets, seconds })
}

/// A `cargo` command of the running toolchain in the workspace root, allowed
/// the nightly flags cargo-fuzz passes.
fn fuzz_cargo<const N: usize>(args: [&str; N]) -> Command {
    let mut cmd = cargo(args);
    cmd.env("RUSTC_BOOTSTRAP", "1");
    cmd
}

/// Installs cargo-fuzz when `cargo fuzz` is not available.
pub fn ensure_cargo_fuzz() -> Result<()> {
    let available = fuzz_cargo(["fuzz", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    if available {
        return Ok(());
    }
    eprintln!("cargo-fuzz is missing; installing it");
    run(&mut cargo(["install", "cargo-fuzz", "--locked"]))
}

/// How one target's run ended.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// The time ran out without a finding.
    Clean,
    /// libFuzzer saved an input that crashed, leaked, timed out or ran out
    /// of memory.
    Crashed {
        /// Where the input was written.
        artifact: PathBuf,
    },
    /// cargo-fuzz failed without libFuzzer reporting an input.
    Failed {
        /// Its exit status.
        status: String,
    },
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Clean => f.write_str("no crash"),
            Outcome::Crashed { artifact } => {
                write!(f, "CRASH, input saved to {}", artifact.display())
            }
            Outcome::Failed { status } => write!(f, "FAILED ({status}) without a saved input"),
        }
    }
}

/// One target's result.
struct Report {
    target: String,
    stats: Stats,
    outcome: Outcome,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |value: Option<u64>| value.map_or_else(|| "?".to_string(), |v| v.to_string());
        let verdict = match self.outcome {
            Outcome::Clean => "ok",
            Outcome::Crashed { .. } => "CRASH",
            Outcome::Failed { .. } => "FAILED",
        };
        write!(
            f,
            "{:<20} {verdict:<6} runs {:>10}  exec/s {:>7}  cov {:>5}  ft {:>6}  corpus {:>5}",
            self.target,
            show(self.stats.runs),
            show(self.stats.execs_per_sec),
            show(self.stats.cov),
            show(self.stats.features),
            show(self.stats.corpus_units),
        )
    }
}

/// Runs one target for `seconds`, echoing libFuzzer's output as it comes.
fn fuzz_one(target: &str, seconds: u64) -> Result<Report> {
    let seeds = workspace_root().join("fuzz/corpus").join(target);
    let working = target_dir().join("fuzz/corpus").join(target);
    std::fs::create_dir_all(&working).context(format!("cannot create {}", working.display()))?;

    let mut cmd = fuzz_cargo(["fuzz", "run", target]);
    cmd.arg("--target-dir")
        .arg(build_dir().join("fuzz/build"))
        .arg(&working)
        .arg(&seeds)
        .arg("--")
        .arg(format!("-max_total_time={seconds}"))
        .arg("-print_final_stats=1")
        .stderr(Stdio::piped());
    eprintln!("$ {}", describe(&cmd));
    let mut child = cmd
        .spawn()
        .context(format!("cannot start cargo fuzz for {target}"))?;
    let stderr = child.stderr.take().expect("stderr is piped");
    let mut stats = Stats::default();
    let mut echo = std::io::stderr().lock();
    for line in BufReader::new(stderr).split(b'\n') {
        let line = line.context("reading cargo fuzz output")?;
        let line = String::from_utf8_lossy(&line);
        // Echo failures (a closed terminal) must not stop the run.
        let _ = writeln!(echo, "{line}");
        stats.observe(&line);
    }
    drop(echo);
    let status = child.wait().context("waiting for cargo fuzz")?;
    let outcome = judge(status, &stats);
    if matches!(outcome, Outcome::Failed { .. }) && stats.runs.is_none() && stats.cov.is_none() {
        // Nothing was fuzzed: a build failure, which every other target
        // would hit as well.
        bail!(
            "cargo fuzz run {target} failed ({status}) before fuzzing started; see its output above"
        );
    }
    Ok(Report {
        target: target.to_string(),
        stats,
        outcome,
    })
}

fn judge(status: ExitStatus, stats: &Stats) -> Outcome {
    match (&stats.artifact, status.success()) {
        (Some(artifact), _) => Outcome::Crashed {
            artifact: artifact.clone(),
        },
        (None, true) => Outcome::Clean,
        (None, false) => Outcome::Failed {
            status: status.to_string(),
        },
    }
}

/// The command line of `cmd`, for echoing.
fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|part| part.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// What libFuzzer reported, taken from its output lines. Later lines win:
/// the final `DONE` line and the `stat::` block close a clean run.
#[derive(Debug, Default, PartialEq, Eq)]
struct Stats {
    /// Executions (`stat::number_of_executed_units`, or the `#N` counter).
    runs: Option<u64>,
    /// Executions per second (`stat::average_exec_per_sec`, or `exec/s:`).
    execs_per_sec: Option<u64>,
    /// Coverage points (`cov:`).
    cov: Option<u64>,
    /// Features (`ft:`), libFuzzer's finer coverage measure.
    features: Option<u64>,
    /// Inputs in the in-memory corpus (`corp: N/...`).
    corpus_units: Option<u64>,
    /// The input libFuzzer saved (`Test unit written to PATH`).
    artifact: Option<PathBuf>,
}

impl Stats {
    fn observe(&mut self, line: &str) {
        if let Some((_, path)) = line.split_once("Test unit written to ") {
            self.artifact = Some(Path::new(path.trim()).to_path_buf());
        } else if let Some(rest) = line.strip_prefix("stat::") {
            let Some((key, value)) = rest.split_once(':') else {
                return;
            };
            let Ok(value) = value.trim().parse::<u64>() else {
                return;
            };
            match key {
                "number_of_executed_units" => self.runs = Some(value),
                "average_exec_per_sec" => self.execs_per_sec = Some(value),
                _ => {}
            }
        } else if let Some(rest) = line.strip_prefix('#') {
            // `#4096\tpulse  cov: 62 ft: 96 corp: 12/160b lim: 43 exec/s: 2048 rss: 31Mb`
            let mut words = rest.split_whitespace();
            let Some(Ok(runs)) = words.next().map(str::parse::<u64>) else {
                return;
            };
            let mut saw_coverage = false;
            while let Some(word) = words.next() {
                let value = words.clone().next();
                let number = |v: Option<&str>| {
                    v.and_then(|v| v.split('/').next())
                        .and_then(|v| v.parse::<u64>().ok())
                };
                match word {
                    "cov:" => {
                        saw_coverage = true;
                        self.cov = number(value).or(self.cov);
                    }
                    "ft:" => self.features = number(value).or(self.features),
                    "corp:" => self.corpus_units = number(value).or(self.corpus_units),
                    "exec/s:" => self.execs_per_sec = number(value).or(self.execs_per_sec),
                    _ => {}
                }
            }
            if saw_coverage {
                self.runs = Some(runs);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn known() -> Vec<String> {
        args(&[
            "descriptor_decode",
            "packed_key_validate",
            "bootstrap_message",
        ])
    }

    mod arguments {
        use super::*;

        #[test]
        fn no_arguments_run_every_target_for_the_default_time() {
            let options = parse_args(&[], &known()).unwrap();
            assert_eq!(options.targets, known());
            assert_eq!(options.seconds, DEFAULT_SECONDS);
        }

        #[test]
        fn all_and_a_duration_are_accepted_in_every_spelling() {
            for list in [
                &["all", "--secs", "5"][..],
                &["--secs=5", "all"][..],
                &["all", "--seconds", "5"][..],
                &["--seconds=5"][..],
            ] {
                let options = parse_args(&args(list), &known()).unwrap();
                assert_eq!(options.targets, known(), "{list:?}");
                assert_eq!(options.seconds, 5, "{list:?}");
            }
        }

        #[test]
        fn a_named_target_runs_alone() {
            let options = parse_args(&args(&["packed_key_validate"]), &known()).unwrap();
            assert_eq!(options.targets, ["packed_key_validate"]);
        }

        #[test]
        fn unknown_targets_and_options_are_refused_with_the_target_list() {
            let err = parse_args(&args(&["nope"]), &known())
                .unwrap_err()
                .to_string();
            assert!(err.contains("descriptor_decode"), "{err}");
            assert!(parse_args(&args(&["--fast"]), &known()).is_err());
            let two = args(&["descriptor_decode", "bootstrap_message"]);
            assert!(parse_args(&two, &known()).is_err());
        }

        #[test]
        fn a_duration_must_be_a_positive_number() {
            for bad in [
                &["--secs"][..],
                &["--secs", "0"],
                &["--secs=abc"],
                &["--seconds"],
            ] {
                assert!(
                    parse_args(&args(bad), &known()).is_err(),
                    "{bad:?} accepted"
                );
            }
        }
    }

    mod manifest {
        use super::*;

        #[test]
        fn every_bin_table_names_a_target_in_file_order() {
            let manifest = r#"
# A comment naming [[bin]] and name = "not_this"
[package]
name = "rdmareg-fuzz"

[dependencies]
libfuzzer-sys = "0.4"

[[bin]]
name = "first" # trailing comment
path = "fuzz_targets/first.rs"

[ [bin] ]
path = "fuzz_targets/second.rs"
name='second'

[profile.release]
debug = 1

[[ bin ]]
name = "third"
"#;
            assert_eq!(bin_names(manifest), ["first", "second", "third"]);
        }

        #[test]
        fn a_manifest_without_bins_has_no_targets() {
            assert!(bin_names("[package]\nname = \"x\"\n").is_empty());
        }
    }

    mod libfuzzer_output {
        use super::*;

        fn observe_all(lines: &[&str]) -> Stats {
            let mut stats = Stats::default();
            for line in lines {
                stats.observe(line);
            }
            stats
        }

        #[test]
        fn a_clean_run_reports_the_final_counters() {
            let stats = observe_all(&[
                "INFO: Seed: 1234",
                "#2\tINITED cov: 40 ft: 41 corp: 13/1402b exec/s: 0 rss: 30Mb",
                "#4096\tpulse  cov: 62 ft: 96 corp: 20/1600b lim: 43 exec/s: 2048 rss: 31Mb",
                "#8000\tNEW    cov: 63 ft: 99 corp: 21/1623b lim: 43 exec/s: 2000 rss: 31Mb L: 23/43 MS: 2 ChangeBit-CMP-",
                "#1500000\tDONE   cov: 64 ft: 101 corp: 22/1700b lim: 1100 exec/s: 24590 rss: 60Mb",
                "Done 1500000 runs in 61 second(s)",
                "stat::number_of_executed_units: 1500123",
                "stat::average_exec_per_sec:     24592",
                "stat::new_units_added:          9",
            ]);
            assert_eq!(
                stats,
                Stats {
                    runs: Some(1_500_123),
                    execs_per_sec: Some(24_592),
                    cov: Some(64),
                    features: Some(101),
                    corpus_units: Some(22),
                    artifact: None,
                }
            );
        }

        #[test]
        fn a_crash_reports_the_saved_input() {
            let stats = observe_all(&[
                "#77\tNEW    cov: 50 ft: 60 corp: 5/90b lim: 4 exec/s: 0 rss: 30Mb L: 3/3 MS: 1 InsertByte-",
                "==123== ERROR: libFuzzer: deadly signal",
                "artifact_prefix='/w/fuzz/artifacts/descriptor_decode/'; Test unit written to /w/fuzz/artifacts/descriptor_decode/crash-0a1b",
            ]);
            assert_eq!(
                stats.artifact.as_deref(),
                Some(Path::new("/w/fuzz/artifacts/descriptor_decode/crash-0a1b"))
            );
            assert_eq!(stats.cov, Some(50));
            assert_eq!(stats.runs, Some(77));
        }

        #[test]
        fn unrelated_lines_change_nothing() {
            let stats = observe_all(&[
                "   Compiling rdmareg-core v0.1.0",
                "#![no_main]",
                "#12 READ units: 13",
                "stat::slowest_unit_time_sec: 0",
            ]);
            assert_eq!(stats, Stats::default());
        }
    }

    mod layout {
        use super::*;

        #[test]
        fn every_target_has_a_source_and_seeds() {
            let fuzz = workspace_root().join("fuzz");
            for target in targets().unwrap() {
                assert!(
                    fuzz.join("fuzz_targets")
                        .join(format!("{target}.rs"))
                        .is_file(),
                    "{target} has no source"
                );
                let seeds = std::fs::read_dir(fuzz.join("corpus").join(&target))
                    .unwrap_or_else(|e| panic!("{target} has no seed corpus: {e}"))
                    .count();
                assert!(seeds > 0, "{target} has an empty seed corpus");
            }
        }

        #[test]
        fn every_target_source_is_listed() {
            let dir = workspace_root().join("fuzz/fuzz_targets");
            for entry in std::fs::read_dir(dir).unwrap() {
                let name = entry.unwrap().file_name();
                let name = name.to_string_lossy();
                let stem = name.strip_suffix(".rs").unwrap_or(&name);
                assert!(
                    targets().unwrap().iter().any(|target| target == stem),
                    "{stem} is not a [[bin]] of fuzz/Cargo.toml"
                );
            }
        }
    }
}
