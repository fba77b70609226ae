//! `rdmareg serve` and `rdmareg fetch` end to end, over a real etcd and UCX
//! tcp on loopback.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdmareg_discovery::test_support::{EtcdServer, free_port};

const TTL_SECS: u64 = 2;

fn rdmareg() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rdmareg"));
    command.env_remove("RUST_LOG");
    command
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A child's stdout, read line by line on a thread of its own so a test can
/// wait for one line while the child keeps running.
struct Lines {
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Lines {
    fn of(child: &mut Child) -> Lines {
        let stdout = child.stdout.take().expect("the child's stdout is piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Lines {
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits for a line containing `needle`; panics with what was seen.
    fn wait_line(&mut self, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(e) => panic!(
                    "no `{needle}` line within {within:?} ({e}); seen:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// Every line, once the child has closed its stdout.
    fn rest(mut self) -> String {
        self.seen.extend(self.lines.iter());
        self.seen.join("\n")
    }
}

/// An owner process and its stdout lines.
struct Owner {
    child: Child,
    lines: std::cell::RefCell<Lines>,
}

impl Owner {
    fn start(etcd: &EtcdServer, name: &str, count: u32) -> Owner {
        let mut child = rdmareg()
            .args([
                "serve",
                "--etcd",
                &etcd.url(),
                "--name",
                name,
                "--net-devices",
                "lo",
            ])
            .args(["--count", &count.to_string(), "--size", "64K"])
            .args(["--ttl", &format!("{TTL_SECS}s"), "--duration", "60s"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("rdmareg serve starts");
        let lines = std::cell::RefCell::new(Lines::of(&mut child));
        let owner = Owner { child, lines };
        owner.wait_line("serving", Duration::from_secs(30));
        owner
    }

    fn wait_line(&self, needle: &str, within: Duration) -> String {
        self.lines.borrow_mut().wait_line(needle, within)
    }

    fn signal(&self, signal: i32) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: `kill` with the pid of a child this test spawned and has
        // not reaped yet; it touches no memory of this process.
        let rc = unsafe { libc::kill(pid, signal) };
        assert_eq!(rc, 0, "signalling the owner");
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn fetch(etcd: &EtcdServer, args: &[&str]) -> Command {
    let mut command = rdmareg();
    command
        .args(["fetch", "--etcd", &etcd.url(), "--net-devices", "lo"])
        .args(["--ttl", &format!("{TTL_SECS}s"), "--get-deadline", "5s"])
        .args(args);
    command
}

/// The `[t=SECONDS]` stamp at the start of an event line.
fn stamp_of(line: &str) -> f64 {
    let inner = line
        .strip_prefix("[t=")
        .and_then(|rest| rest.split(']').next())
        .unwrap_or_else(|| panic!("no stamp in `{line}`"));
    inner.parse().unwrap()
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[test]
fn fetch_resolves_gets_and_verifies_every_range_an_owner_serves() {
    let etcd = EtcdServer::start().unwrap();
    let owner = Owner::start(&etcd, "owner-a", 3);
    let output = fetch(&etcd, &["owner-a.0", "owner-a.1", "owner-a.2"])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&output);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    for index in 0..3 {
        assert!(
            stdout.contains(&format!("GET `owner-a.{index}` from `owner-a`: verified")),
            "{stdout}"
        );
    }
    assert!(
        stdout.contains("consumer backend registrations left: 0"),
        "{stdout}"
    );

    // A stopped owner withdraws its names before it deregisters them.
    owner.signal(libc::SIGTERM);
    owner.wait_line("withdrew `owner-a`", Duration::from_secs(15));
    owner.wait_line("backend holds 0 registrations", Duration::from_secs(15));
    let output = fetch(&etcd, &["--wait", "500ms", "owner-a.0"])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&output);
    assert!(!output.status.success(), "{stdout}");
    assert!(
        stderr.contains("no descriptor is published under `owner-a.0`"),
        "{stderr}"
    );
}

#[test]
fn a_killed_owner_is_dropped_within_the_ttl_and_its_gets_then_fail_at_once() {
    let etcd = EtcdServer::start().unwrap();
    let owner = Owner::start(&etcd, "owner-k", 1);
    let mut consumer = fetch(&etcd, &["owner-k.0", "--for", "12s", "--interval", "100ms"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Kill the owner only once the consumer has verified a read from it: on
    // a loaded machine the consumer's start and first endpoint can take
    // seconds, and a kill before that tests nothing this test names.
    let mut lines = Lines::of(&mut consumer);
    lines.wait_line(
        "GET `owner-k.0` from `owner-k`: verified",
        Duration::from_secs(8),
    );
    let killed_at = now();
    owner.signal(libc::SIGKILL);
    let status = consumer.wait().unwrap();
    let stdout = lines.rest();
    // Reads failed after the kill, so the run as a whole fails although it
    // verified before (the count is checked in
    // `fetch_with_failed_reads_exits_non_zero_and_counts_them`).
    assert_eq!(status.code(), Some(1), "{stdout}");
    let gone = stdout
        .lines()
        .find(|l| l.contains("owner `owner-k` gone"))
        .unwrap_or_else(|| panic!("the consumer never saw the owner go:\n{stdout}"));
    let after = stamp_of(gone) - killed_at;
    assert!(
        after <= (TTL_SECS + 2) as f64,
        "seen {after:.2} s after the kill:\n{stdout}"
    );
    // After the owner was dropped, its GETs fail at once with a typed error.
    let dropped = stdout
        .lines()
        .skip_while(|l| !l.contains("gone"))
        .find(|l| l.contains("failed: no rdma backend configured"))
        .unwrap_or_else(|| panic!("no GET failed after the drop:\n{stdout}"));
    let ms: u64 = dropped
        .rsplit("(after ")
        .next()
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no time to failure in `{dropped}`"));
    assert!(ms < 100, "{dropped}");
}

/// An owner killed during `fetch --for`: the reads before verified, the
/// reads after failed. The run exits 1 and its one error line says how many
/// of its reads failed, the same number the per-name summary shows.
#[test]
fn fetch_with_failed_reads_exits_non_zero_and_counts_them() {
    let etcd = EtcdServer::start().unwrap();
    let owner = Owner::start(&etcd, "owner-f", 1);
    let mut consumer = fetch(&etcd, &["owner-f.0", "--for", "4s", "--interval", "100ms"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = consumer.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap());
    let mut lines = Lines::of(&mut consumer);
    lines.wait_line(
        "GET `owner-f.0` from `owner-f`: verified",
        Duration::from_secs(8),
    );
    owner.signal(libc::SIGKILL);
    let status = consumer.wait().unwrap();
    let stdout = lines.rest();
    let stderr = stderr.join().unwrap();
    assert_eq!(status.code(), Some(1), "{stdout}\n{stderr}");
    // `  owner-f.0   owner owner-f   verified     N  mismatched   0  failed     M`
    let summary = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("owner-f.0 "))
        .unwrap_or_else(|| panic!("no summary line:\n{stdout}"));
    let count = |label: &str| -> u64 {
        summary
            .split(label)
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no `{label}` count in `{summary}`"))
    };
    let (verified, failed) = (count("verified"), count("failed"));
    assert!(verified > 0 && failed > 0, "{summary}");
    let expected = format!("rdmareg: {failed} of {} reads failed", verified + failed);
    // UCX may log the lost connection on stderr too; the error is one line.
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("rdmareg:"))
        .collect();
    assert_eq!(errors, [expected.as_str()], "{stdout}\n{stderr}");
}

/// The run: etcd that has been in use (revision ~300) is killed
/// and started again on an empty data directory while `fetch --for` runs,
/// and the owner restarts with it. The new store's entries are at lower
/// revisions than what the consumer saw; it must notice that etcd lost its
/// data, take the restarted owner's new descriptor and verify reads from
/// it, instead of keeping the dead process's descriptor (every read then
/// failed with `RegionNotFound`).
#[test]
fn fetch_follows_an_owner_restarted_on_a_wiped_etcd() {
    let mut etcd = EtcdServer::start().unwrap();
    etcd.age(300).unwrap();
    let owner = Owner::start(&etcd, "owner-w", 1);
    let mut consumer = fetch(&etcd, &["owner-w.0", "--for", "15s", "--interval", "100ms"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = Lines::of(&mut consumer);
    lines.wait_line(
        "GET `owner-w.0` from `owner-w`: verified",
        Duration::from_secs(8),
    );
    owner.signal(libc::SIGKILL);
    drop(owner);
    etcd.wipe().unwrap();
    let _restarted = Owner::start(&etcd, "owner-w", 1);
    lines.wait_line("etcd lost its data", Duration::from_secs(10));
    lines.wait_line("owner `owner-w` is back", Duration::from_secs(10));
    // Printed on a change only: the first success after the failures.
    lines.wait_line(
        "GET `owner-w.0` from `owner-w`: verified",
        Duration::from_secs(10),
    );
    let status = consumer.wait().unwrap();
    let stdout = lines.rest();
    // The reads between the kill and the restart failed.
    assert_eq!(status.code(), Some(1), "{stdout}");
    assert!(
        !stdout
            .lines()
            .skip_while(|l| !l.contains("is back"))
            .any(|l| l.contains("failed: rdma region not found")),
        "{stdout}"
    );
}

#[test]
fn fetch_against_an_unreachable_etcd_is_one_clear_error() {
    let port = free_port().unwrap();
    let output = rdmareg()
        .args([
            "fetch",
            "--etcd",
            &format!("http://127.0.0.1:{port}"),
            "x.0",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&output);
    assert_eq!(output.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stderr.contains("etcd unreachable"), "{stderr}");
    assert_eq!(
        stderr.lines().filter(|l| l.starts_with("rdmareg:")).count(),
        1,
        "{stderr}"
    );
}

/// `serve`, the process that stays up, exports its registry's metrics like
/// `demo` does: the page counts the pool bytes its two ranges hold.
#[test]
fn serve_exports_its_registry_metrics() {
    use std::io::{Read, Write};
    let etcd = EtcdServer::start().unwrap();
    let mut child = rdmareg()
        .args(["serve", "--etcd", &etcd.url(), "--name", "metered"])
        .args(["--net-devices", "lo", "--count", "2", "--size", "64K"])
        .args(["--duration", "30s", "--metrics-addr", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("rdmareg serve starts");
    let stderr = child.stderr.take().expect("piped");
    let mut lines = BufReader::new(stderr).lines().map_while(Result::ok);
    let address = lines
        .find_map(|line| {
            line.strip_prefix("metrics at http://")
                .and_then(|rest| rest.strip_suffix("/metrics"))
                .map(str::to_owned)
        })
        .expect("serve says where its metrics are");
    let deadline = Instant::now() + Duration::from_secs(30);
    let page = loop {
        let mut stream = std::net::TcpStream::connect(&address).expect("metrics port connects");
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .expect("request sent");
        let mut page = String::new();
        stream.read_to_string(&mut page).expect("page read");
        // The ranges are allocated once the node has started.
        if page.contains("rdmareg_pool_bytes_in_use 131072") || Instant::now() > deadline {
            break page;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    assert!(page.contains("rdmareg_pool_bytes_in_use 131072"), "{page}");
}
