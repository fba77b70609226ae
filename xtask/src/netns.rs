//! `cargo xtask netns`: `rdmareg demo` across two hosts, simulated by two
//! network namespaces joined by a veth pair, and what happens when one side
//! is lost.
//!
//! The owner's namespace has 10.77.0.1/24, the consumer's 10.77.0.2/24; the
//! namespaces (named after this process's id, so parallel runs do not
//! collide) hold nothing else, so the traffic stays between them, and a
//! guard deletes them when the task ends, failed or not. Four scenarios run
//! with a 2 s GET deadline and a 1 s teardown bound:
//!
//! 1. the demo passes across the namespaces;
//! 2. the owner's link goes down mid-transfer: both sides exit non-zero
//!    with one line each, within the bound, with no registrations left;
//! 3. the owner is stopped (`SIGSTOP`): the consumer's GET times out and it
//!    exits within the bound (the owner is then killed);
//! 4. the consumer is killed (`SIGKILL`): the owner reports it and shuts
//!    down clean.
//!
//! For 2–4 the owner's side of the link is shaped to 200 Mbit/s with `tc`, so
//! the transfer is certainly still running when the fault is injected.
//!
//! The bound checked is the one the command documents — the GET deadline,
//! plus a side's shutdown (four teardown bounds), plus its 3 s of slack —
//! plus [`LOAD_MARGIN`] for a loaded two-core machine. Measured times are
//! printed. Needs root and iproute2 (installed with apt-get if missing).

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use crate::util::{Context, Result, bail, build_dir, cargo, probe, run};

const OWNER_ADDRESS: &str = "10.77.0.1";
const CONSUMER_ADDRESS: &str = "10.77.0.2";
const PORT: u16 = 7473;
const GET_DEADLINE: Duration = Duration::from_secs(2);
const TEARDOWN: Duration = Duration::from_secs(1);
/// The command's own slack (`control::SLACK` in rdmareg-cli).
const COMMAND_SLACK: Duration = Duration::from_secs(3);
/// Extra time allowed on top of the documented bound for a loaded machine.
const LOAD_MARGIN: Duration = Duration::from_secs(5);
/// How long into the transfer a fault is injected.
const FAULT_AFTER: Duration = Duration::from_millis(1500);
/// Longest any process of a scenario may live before the harness kills it.
const HARD_LIMIT: Duration = Duration::from_secs(90);

/// The documented bound on reporting a lost peer.
fn lost_peer_bound() -> Duration {
    GET_DEADLINE + TEARDOWN * 4 + COMMAND_SLACK
}

/// `cargo xtask netns [--release]`.
pub fn run_task(args: &[String]) -> Result<()> {
    let release = match args {
        [] => false,
        [flag] if flag == "--release" => true,
        _ => bail!("usage: cargo xtask netns [--release]"),
    };
    ensure_root()?;
    crate::native::ensure(&[crate::native::BUILD, &[crate::native::Need::Iproute2]].concat())?;
    let binary = build(release)?;
    let namespaces = Namespaces::create()?;
    println!(
        "netns: owner {} ({OWNER_ADDRESS}), consumer {} ({CONSUMER_ADDRESS})",
        namespaces.owner, namespaces.consumer
    );
    let mut failures = Vec::new();
    let scenarios: [(&str, Scenario); 4] = [
        ("demo across the namespaces passes", demo_passes),
        (
            "link cut mid-transfer: both sides report it and exit",
            link_cut,
        ),
        (
            "owner stopped: the consumer times out and exits",
            owner_stopped,
        ),
        (
            "consumer killed: the owner reports it and shuts down clean",
            consumer_killed,
        ),
    ];
    for (name, scenario) in scenarios {
        println!("\n--> {name}");
        let started = Instant::now();
        match scenario(&namespaces, &binary) {
            Ok(()) => println!("<-- ok in {:.1} s", started.elapsed().as_secs_f64()),
            Err(e) => {
                println!("<-- FAILED: {e}");
                failures.push(name);
            }
        }
        namespaces.reset_link()?;
    }
    if !failures.is_empty() {
        bail!("netns scenarios failed: {}", failures.join("; "));
    }
    println!("\nnetns: all 4 scenarios passed");
    Ok(())
}

type Scenario = fn(&Namespaces, &Path) -> Result<()>;

/// Whether `line` is a `tracing` log line: an RFC 3339 UTC timestamp, then
/// a level.
fn is_tracing_line(line: &str) -> bool {
    let Some((timestamp, rest)) = line.split_once(' ') else {
        return false;
    };
    let level = rest.trim_start();
    timestamp.len() >= 20
        && timestamp.as_bytes()[..4].iter().all(u8::is_ascii_digit)
        && timestamp.ends_with('Z')
        && ["TRACE ", "DEBUG ", "INFO ", "WARN ", "ERROR "]
            .iter()
            .any(|l| level.starts_with(l))
}

pub(crate) fn ensure_root() -> Result<()> {
    let uid = probe(Command::new("id").arg("-u")).unwrap_or_default();
    if uid.trim() != "0" {
        bail!(
            "`cargo xtask netns` creates network namespaces and needs root \
             (run it as root, as CI does, or with sudo)"
        );
    }
    Ok(())
}

pub fn ensure_iproute2() -> Result<()> {
    let has = |tool: &str| probe(Command::new(tool).arg("-V")).is_some();
    if has("ip") && has("tc") {
        return Ok(());
    }
    eprintln!("netns: `ip`/`tc` missing; installing iproute2");
    crate::native::apt_install(&["iproute2"])?;
    if !(has("ip") && has("tc")) {
        bail!("iproute2 was installed but `ip`/`tc` still cannot be run");
    }
    Ok(())
}

/// Build the `rdmareg` binary and return its path.
pub(crate) fn build(release: bool) -> Result<PathBuf> {
    let mut command = cargo(["build", "--package", "rdmareg-cli", "--bin", "rdmareg"]);
    if release {
        command.arg("--release");
    }
    run(&mut command)?;
    let binary = build_dir()
        .join(if release { "release" } else { "debug" })
        .join("rdmareg");
    if !binary.is_file() {
        bail!("built, but {} is not there", binary.display());
    }
    Ok(binary)
}

/// Runs `ip` (or `tc`) with `args`, failing with its stderr.
pub(crate) fn ip(tool: &str, args: &[&str]) -> Result<()> {
    let output = Command::new(tool)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context(format!("cannot run `{tool}`"))?;
    if !output.status.success() {
        bail!(
            "`{tool} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// Two namespaces joined by a veth pair; deleted on drop.
struct Namespaces {
    owner: String,
    consumer: String,
    owner_link: String,
    consumer_link: String,
}

impl Namespaces {
    fn create() -> Result<Namespaces> {
        let id = std::process::id();
        let namespaces = Namespaces {
            owner: format!("rdmareg-{id}-owner"),
            consumer: format!("rdmareg-{id}-consumer"),
            // Interface names have at most 15 bytes.
            owner_link: format!("rv{id}o"),
            consumer_link: format!("rv{id}c"),
        };
        // From here on, the guard deletes whatever was created.
        ip("ip", &["netns", "add", &namespaces.owner])?;
        ip("ip", &["netns", "add", &namespaces.consumer])?;
        ip(
            "ip",
            &[
                "link",
                "add",
                &namespaces.owner_link,
                "netns",
                &namespaces.owner,
                "type",
                "veth",
                "peer",
                "name",
                &namespaces.consumer_link,
                "netns",
                &namespaces.consumer,
            ],
        )?;
        for (ns, link, address) in [
            (&namespaces.owner, &namespaces.owner_link, OWNER_ADDRESS),
            (
                &namespaces.consumer,
                &namespaces.consumer_link,
                CONSUMER_ADDRESS,
            ),
        ] {
            let cidr = format!("{address}/24");
            ip("ip", &["-n", ns, "addr", "add", &cidr, "dev", link])?;
            ip("ip", &["-n", ns, "link", "set", "lo", "up"])?;
            ip("ip", &["-n", ns, "link", "set", link, "up"])?;
        }
        namespaces.wait_until_running()?;
        Ok(namespaces)
    }

    /// Waits until both ends of the pair report carrier (`LOWER_UP`). UCX
    /// opens tcp only on interfaces that are up *and running* when an engine
    /// starts; a demo started in the few milliseconds before the carrier
    /// comes up sees only `lo` and cannot reach the other namespace.
    fn wait_until_running(&self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        for (ns, link) in [
            (&self.owner, &self.owner_link),
            (&self.consumer, &self.consumer_link),
        ] {
            loop {
                let output = Command::new("ip")
                    .args(["-n", ns, "-o", "link", "show", "dev", link])
                    .stdin(Stdio::null())
                    .output()
                    .context("cannot run `ip`")?;
                if String::from_utf8_lossy(&output.stdout).contains("LOWER_UP") {
                    break;
                }
                if Instant::now() >= deadline {
                    bail!("{link} in {ns} has no carrier after 10 s");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// Shape the owner's outgoing traffic (the GET data) to 200 Mbit/s.
    fn shape(&self) -> Result<()> {
        ip(
            "tc",
            &[
                "-n",
                &self.owner,
                "qdisc",
                "replace",
                "dev",
                &self.owner_link,
                "root",
                "tbf",
                "rate",
                "200mbit",
                "burst",
                "256kb",
                "latency",
                "100ms",
            ],
        )
    }

    /// Take the owner's end of the link down.
    fn cut(&self) -> Result<()> {
        ip(
            "ip",
            &["-n", &self.owner, "link", "set", &self.owner_link, "down"],
        )
    }

    /// Link up, no shaping: the state each scenario starts from.
    fn reset_link(&self) -> Result<()> {
        // Deleting a qdisc that is not there fails; that is fine.
        let _ = ip(
            "tc",
            &[
                "-n",
                &self.owner,
                "qdisc",
                "del",
                "dev",
                &self.owner_link,
                "root",
            ],
        );
        ip(
            "ip",
            &["-n", &self.owner, "link", "set", &self.owner_link, "up"],
        )?;
        self.wait_until_running()
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of the veth pair, and with it
        // the other end.
        for ns in [&self.owner, &self.consumer] {
            if let Err(e) = ip("ip", &["netns", "del", ns]) {
                eprintln!("netns: cleaning up: {e}");
            }
        }
    }
}

/// A line one of the demo processes printed.
enum Event {
    Stdout(String),
    Stderr(String),
}

/// A demo process in a namespace; killed (and reaped) on drop.
pub(crate) struct Demo {
    pub(crate) role: &'static str,
    pub(crate) child: Child,
    events: mpsc::Receiver<Event>,
    pub(crate) stdout: Vec<String>,
    pub(crate) stderr: Vec<String>,
    started: Instant,
}

/// How a demo process ended.
pub(crate) struct Ended {
    pub(crate) success: bool,
    pub(crate) code: Option<i32>,
    /// When it ended.
    pub(crate) at: Instant,
}

impl Demo {
    pub(crate) fn start(
        role: &'static str,
        ns: &str,
        binary: &Path,
        args: &[&str],
    ) -> Result<Demo> {
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(binary)
            .args(args)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context(format!("cannot start the {role}"))?;
        let (sender, events) = mpsc::channel();
        forward(child.stdout.take(), sender.clone(), Event::Stdout);
        forward(child.stderr.take(), sender, Event::Stderr);
        Ok(Demo {
            role,
            child,
            events,
            stdout: Vec::new(),
            stderr: Vec::new(),
            started: Instant::now(),
        })
    }

    /// Takes whatever it printed so far without waiting.
    pub(crate) fn drain(&mut self) {
        while let Ok(event) = self.events.try_recv() {
            self.record(event);
        }
    }

    fn record(&mut self, event: Event) {
        match event {
            Event::Stdout(line) => self.stdout.push(line),
            Event::Stderr(line) => self.stderr.push(line),
        }
    }

    /// Wait until it prints a stdout line starting with `prefix`.
    pub(crate) fn wait_for_line(&mut self, prefix: &str, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        loop {
            if self.stdout.iter().any(|l| l.starts_with(prefix)) {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(event) => self.record(event),
                Err(_) => bail!(
                    "the {} did not print `{prefix}…` within {:.0} s\n{}",
                    self.role,
                    within.as_secs_f64(),
                    self.transcript()
                ),
            }
        }
    }

    /// Wait until it prints a line (stdout or stderr) containing `needle`.
    pub(crate) fn wait_for_containing(&mut self, needle: &str, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let seen = |lines: &[String]| lines.iter().any(|l| l.contains(needle));
            if seen(&self.stdout) || seen(&self.stderr) {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(event) => self.record(event),
                Err(_) => bail!(
                    "the {} did not print `{needle}` within {:.0} s\n{}",
                    self.role,
                    within.as_secs_f64(),
                    self.transcript()
                ),
            }
        }
    }

    /// Wait for it to exit (killing it past [`HARD_LIMIT`]), collecting
    /// what it printed.
    pub(crate) fn wait(&mut self) -> Result<Ended> {
        loop {
            while let Ok(event) = self.events.try_recv() {
                self.record(event);
            }
            if let Some(status) = self.child.try_wait().context("waiting for a demo")? {
                let at = Instant::now();
                // The pipes close when it exits; take the last lines.
                while let Ok(event) = self.events.recv_timeout(Duration::from_secs(2)) {
                    self.record(event);
                }
                return Ok(Ended {
                    success: status.success(),
                    code: status.code(),
                    at,
                });
            }
            if self.started.elapsed() > HARD_LIMIT {
                let _ = self.child.kill();
                bail!(
                    "the {} was still running after {:.0} s; killed it\n{}",
                    self.role,
                    HARD_LIMIT.as_secs_f64(),
                    self.transcript()
                );
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn signal(&self, signal: &str) -> Result<()> {
        run(Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string()))
    }

    /// Its lines on stderr that are neither UCX's own log lines nor its
    /// `tracing` log lines (a lost peer can leave warnings about unmaps the
    /// shutdown had to wait for; the report is the one `rdmareg:` line).
    fn report_lines(&self) -> Vec<&str> {
        self.stderr
            .iter()
            .map(String::as_str)
            .filter(|l| !l.contains(" UCX ") && !is_tracing_line(l))
            .collect()
    }

    pub(crate) fn transcript(&self) -> String {
        let mut text = format!("  {} stdout:\n", self.role);
        for line in &self.stdout {
            text.push_str(&format!("    {line}\n"));
        }
        text.push_str(&format!("  {} stderr:\n", self.role));
        for line in &self.stderr {
            text.push_str(&format!("    {line}\n"));
        }
        text
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = Command::new("kill")
                .args(["-CONT", &self.child.id().to_string()])
                .status();
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn forward(
    stream: Option<impl Read + Send + 'static>,
    sender: mpsc::Sender<Event>,
    wrap: fn(String) -> Event,
) {
    if let Some(stream) = stream {
        thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(|l| l.ok()) {
                if sender.send(wrap(line)).is_err() {
                    return;
                }
            }
        });
    }
}

fn limits() -> [String; 4] {
    [
        "--get-deadline".to_owned(),
        format!("{}ms", GET_DEADLINE.as_millis()),
        "--teardown-timeout".to_owned(),
        format!("{}ms", TEARDOWN.as_millis()),
    ]
}

/// Start an owner offering `count` ranges of `size` and wait until it
/// listens.
fn start_owner(ns: &Namespaces, binary: &Path, size: &str, count: &str) -> Result<Demo> {
    let listen = format!("{OWNER_ADDRESS}:{PORT}");
    let limits = limits();
    let mut args = vec![
        "demo", "--listen", &listen, "--size", size, "--count", count,
    ];
    args.extend(limits.iter().map(String::as_str));
    args.extend(["--accept-timeout", "30s"]);
    let mut owner = Demo::start("owner", &ns.owner, binary, &args)?;
    owner.wait_for_line("owner listening on ", Duration::from_secs(60))?;
    Ok(owner)
}

fn start_consumer(ns: &Namespaces, binary: &Path) -> Result<Demo> {
    let connect = format!("{OWNER_ADDRESS}:{PORT}");
    let limits = limits();
    let mut args = vec!["demo", "--connect", &connect, "--plain"];
    args.extend(limits.iter().map(String::as_str));
    Demo::start("consumer", &ns.consumer, binary, &args)
}

/// Checks on one side, with its transcript in the error.
fn check(demo: &Demo, holds: bool, what: &str) -> Result<()> {
    if !holds {
        bail!("{}: {what}\n{}", demo.role, demo.transcript());
    }
    Ok(())
}

/// A side that lost its peer: non-zero exit, one report line naming the
/// loss, zero registrations left, within the bound after `fault`.
fn check_lost_peer(
    demo: &Demo,
    ended: &Ended,
    fault: Instant,
    lost_line: &str,
    registrations_line: &str,
) -> Result<Duration> {
    let took = ended.at.saturating_duration_since(fault);
    let report = demo.report_lines();
    println!(
        "    {} exited {:?} {:.1} s after the fault: {}",
        demo.role,
        ended.code,
        took.as_secs_f64(),
        report.first().unwrap_or(&"(no report line)")
    );
    check(
        demo,
        !ended.success,
        "exited successfully despite the fault",
    )?;
    check(
        demo,
        report.len() == 1 && report[0].starts_with("rdmareg: ") && report[0].contains(lost_line),
        &format!("expected exactly one stderr line containing `{lost_line}`"),
    )?;
    check(
        demo,
        demo.stdout.iter().any(|l| l == registrations_line),
        &format!("expected `{registrations_line}` on stdout"),
    )?;
    let bound = lost_peer_bound() + LOAD_MARGIN;
    check(
        demo,
        took <= bound,
        &format!(
            "took {:.1} s after the fault, more than the {:.0} s allowed",
            took.as_secs_f64(),
            bound.as_secs_f64()
        ),
    )?;
    Ok(took)
}

const OWNER_CLEAN: &str = "owner shut down: backend holds 0 registrations";
const CONSUMER_CLEAN: &str = "consumer backend registrations left: 0";

fn demo_passes(ns: &Namespaces, binary: &Path) -> Result<()> {
    let mut owner = start_owner(ns, binary, "1M", "8")?;
    let mut consumer = start_consumer(ns, binary)?;
    let consumer_ended = consumer.wait()?;
    let owner_ended = owner.wait()?;
    check(&consumer, consumer_ended.success, "the demo failed")?;
    check(&owner, owner_ended.success, "the owner failed")?;
    check(
        &consumer,
        consumer
            .stdout
            .iter()
            .any(|l| l == "verification passed: 8 ranges, every byte matches"),
        "no verification line",
    )?;
    check(
        &consumer,
        consumer
            .stdout
            .iter()
            .any(|l| l == "shutdown complete: both backends hold zero registrations"),
        "no clean shutdown line",
    )?;
    check(
        &owner,
        owner.stdout.iter().any(|l| l == OWNER_CLEAN),
        "owner did not shut down clean",
    )?;
    Ok(())
}

/// Owner and consumer with the link shaped, the transfer running for
/// [`FAULT_AFTER`]: about 200 MiB at 25 MB/s lasts several seconds.
fn start_transfer(ns: &Namespaces, binary: &Path) -> Result<(Demo, Demo)> {
    ns.shape()?;
    let mut owner = start_owner(ns, binary, "4M", "48")?;
    let consumer = start_consumer(ns, binary)?;
    owner.wait_for_line("offered worker address", Duration::from_secs(30))?;
    thread::sleep(FAULT_AFTER);
    Ok((owner, consumer))
}

/// The consumer's report must show the loss hit mid-transfer.
fn check_mid_transfer(consumer: &Demo) -> Result<()> {
    check(
        consumer,
        consumer
            .report_lines()
            .iter()
            .any(|l| l.contains("GET of range") || l.contains("of a transfer list failed")),
        "the fault did not land mid-transfer (no failed GET or transfer list reported)",
    )
}

fn link_cut(ns: &Namespaces, binary: &Path) -> Result<()> {
    let (mut owner, mut consumer) = start_transfer(ns, binary)?;
    ns.cut()?;
    let fault = Instant::now();
    let consumer_ended = consumer.wait()?;
    let owner_ended = owner.wait()?;
    check_lost_peer(
        &consumer,
        &consumer_ended,
        fault,
        "lost the owner",
        CONSUMER_CLEAN,
    )?;
    check_mid_transfer(&consumer)?;
    check_lost_peer(
        &owner,
        &owner_ended,
        fault,
        "lost the consumer",
        OWNER_CLEAN,
    )?;
    Ok(())
}

fn owner_stopped(ns: &Namespaces, binary: &Path) -> Result<()> {
    let (owner, mut consumer) = start_transfer(ns, binary)?;
    owner.signal("STOP")?;
    let fault = Instant::now();
    let consumer_ended = consumer.wait()?;
    check_lost_peer(
        &consumer,
        &consumer_ended,
        fault,
        "lost the owner",
        CONSUMER_CLEAN,
    )?;
    check_mid_transfer(&consumer)?;
    // The stopped owner is not under test; end it. Resumed, it would
    // shut down only sometimes: its UCX may abort on the reply it was
    // sending to the endpoint the consumer closed meanwhile (the tcp
    // owner-abort limitation in docs/operations.md; measured here: 3 of 3).
    drop(owner);
    Ok(())
}

fn consumer_killed(ns: &Namespaces, binary: &Path) -> Result<()> {
    let (mut owner, mut consumer) = start_transfer(ns, binary)?;
    consumer.signal("KILL")?;
    let fault = Instant::now();
    let _ = consumer.wait()?;
    let owner_ended = owner.wait()?;
    check_lost_peer(
        &owner,
        &owner_ended,
        fault,
        "lost the consumer",
        OWNER_CLEAN,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracing_lines_are_told_apart_from_the_report_line() {
        assert!(is_tracing_line(
            "2026-12-01T06:39:43.697760Z  WARN rdmareg_registry::region::state: unmap not confirmed"
        ));
        assert!(is_tracing_line(
            "2026-12-01T06:38:08.039319Z  INFO rdmareg_registry::shutdown: begins"
        ));
        assert!(!is_tracing_line(
            "rdmareg: lost the consumer 10.77.0.2:33640: no word from it for 5.0 s"
        ));
        assert!(!is_tracing_line("2026 was a year"));
        assert!(!is_tracing_line(""));
    }
}
