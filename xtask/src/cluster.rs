//! `cargo xtask cluster`: discovery across hosts, simulated by network
//! namespaces on one bridge.
//!
//! Six namespaces (named after this process's id, so parallel runs do not
//! collide): a switch holding a bridge, and five hosts each joined to it by a
//! veth pair — etcd (10.78.0.1), three owners `owner-a`/`owner-b`/`owner-c`
//! (10.78.0.2–4) and a consumer (10.78.0.5). Nothing else is attached, so
//! the traffic stays among them; a guard deletes every namespace it made,
//! also when a step fails.
//!
//! etcd runs in its namespace, aged to a few hundred revisions; each owner
//! runs `rdmareg serve` publishing two ranges with a short lease; the
//! consumer runs `rdmareg fetch --for` over all six names on UCX tcp across
//! the bridge. Once every owner has been read and verified, `owner-a` is
//! SIGKILLed and `owner-b`'s link is taken down. Once both are reported
//! gone, etcd is SIGKILLed and started again on an empty data directory (a
//! lost disk: its revisions count from 1 again), and `owner-a` is started
//! again. Checked from the consumer's stamped lines:
//!
//! - `owner-a` is reported gone within the TTL (plus etcd's expiry slack);
//! - a GET to `owner-b` fails within the GET deadline of the cut, and
//!   `owner-b` is reported gone within the TTL (it cannot reach etcd either);
//! - `owner-c` keeps serving: its GETs keep verifying, none fails until the
//!   consumer reads the wiped store, and they verify again after it
//!   (`owner-c` outlives the wipe and republishes into the new store; until
//!   it has, it is absent there, so a consumer that reads the new store
//!   first drops it for that moment);
//! - the consumer notices that etcd lost its data and reads and verifies
//!   both ranges of the restarted `owner-a`, whose entries are at lower
//!   revisions than the old store's;
//! - the consumer exits 1, saying how many of its reads failed (those to
//!   `owner-a` and `owner-b` after the faults);
//! - `owner-c`, stopped with SIGTERM at the end, withdraws and shuts down
//!   with zero registrations.
//!
//! Needs root, iproute2 and etcd (installed when missing).

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::native::Need;
use crate::netns::{Demo, build, ensure_root, ip};
use crate::util::{Context, Error, Result, bail, run, target_dir};

const SUBNET: &str = "10.78.0";
const ETCD_HOST: u8 = 1;
const OWNERS: [(&str, u8); 3] = [("owner-a", 2), ("owner-b", 3), ("owner-c", 4)];
const CONSUMER_HOST: u8 = 5;
const TTL: Duration = Duration::from_secs(3);
const GET_DEADLINE: Duration = Duration::from_secs(2);
/// etcd checks lease expiry every 500 ms and revokes through its log; the
/// rest is a loaded two-core machine.
const EXPIRY_SLACK: Duration = Duration::from_secs(1);
/// Extra time on a loaded two-core machine for a GET failure to be printed.
const LOAD_MARGIN: Duration = Duration::from_secs(2);
/// How long the consumer fetches in rounds.
const FETCH_FOR: Duration = Duration::from_secs(30);
/// Writes to etcd before anything is published, so that the store the
/// consumer first sees is far ahead of the wiped one.
const AGE_REVISIONS: u32 = 300;
/// The key those writes go to (outside every cluster prefix), base64 for
/// etcd's JSON gateway: `/aging`.
const AGE_KEY: &str = "L2FnaW5n";

/// `cargo xtask cluster [--release]`.
///
/// `cargo xtask cluster --age-etcd URL COUNT` is the scenario's own helper:
/// it writes COUNT times to etcd's JSON gateway at URL, from inside a host's
/// namespace (the scenario runs it there with `ip netns exec`).
pub fn run_task(args: &[String]) -> Result<()> {
    let release = match args {
        [] => false,
        [flag] if flag == "--release" => true,
        [flag, url, count] if flag == "--age-etcd" => {
            let count = count
                .parse()
                .map_err(|_| Error::msg(format!("not a count: {count}")))?;
            return age_etcd(url, count);
        }
        _ => bail!("usage: cargo xtask cluster [--release]"),
    };
    ensure_root()?;
    crate::native::ensure(&[crate::native::BUILD, &[Need::Etcd, Need::Iproute2]].concat())?;
    let binary = build(release)?;
    let cluster = Cluster::create()?;
    let data = DataDir::create()?;
    println!(
        "cluster: switch {}, etcd {SUBNET}.{ETCD_HOST}, owners {SUBNET}.2-4, consumer {SUBNET}.{CONSUMER_HOST}",
        cluster.switch
    );
    scenario(&cluster, &binary, &data.0)?;
    println!("\ncluster: passed");
    Ok(())
}

/// A data directory for etcd, removed on drop.
struct DataDir(std::path::PathBuf);

impl DataDir {
    fn create() -> Result<DataDir> {
        let path = target_dir().join(format!("cluster-etcd-{}", std::process::id()));
        std::fs::create_dir_all(&path).context(format!("creating {}", path.display()))?;
        Ok(DataDir(path))
    }
}

impl Drop for DataDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One host: its namespace, its interface, its address.
struct Host {
    ns: String,
    link: String,
    address: String,
}

/// The switch namespace and the hosts on it; every namespace made is deleted
/// on drop.
struct Cluster {
    switch: String,
    hosts: Vec<Host>,
    created: Vec<String>,
}

impl Cluster {
    fn create() -> Result<Cluster> {
        let id = std::process::id();
        let mut cluster = Cluster {
            switch: format!("rdmareg-{id}-switch"),
            hosts: Vec::new(),
            created: Vec::new(),
        };
        ip("ip", &["netns", "add", &cluster.switch])?;
        cluster.created.push(cluster.switch.clone());
        let switch = cluster.switch.clone();
        ip(
            "ip",
            &["-n", &switch, "link", "add", "br0", "type", "bridge"],
        )?;
        ip("ip", &["-n", &switch, "link", "set", "br0", "up"])?;
        let mut names: Vec<(&str, u8)> = vec![("etcd", ETCD_HOST)];
        names.extend(OWNERS);
        names.push(("consumer", CONSUMER_HOST));
        for (role, host) in names {
            let ns = format!("rdmareg-{id}-{role}");
            ip("ip", &["netns", "add", &ns])?;
            cluster.created.push(ns.clone());
            // Interface names have at most 15 bytes.
            let link = format!("rc{id}h{host}");
            let port = format!("rc{id}s{host}");
            ip(
                "ip",
                &[
                    "link", "add", &link, "netns", &ns, "type", "veth", "peer", "name", &port,
                    "netns", &switch,
                ],
            )?;
            ip(
                "ip",
                &["-n", &switch, "link", "set", &port, "master", "br0"],
            )?;
            ip("ip", &["-n", &switch, "link", "set", &port, "up"])?;
            let address = format!("{SUBNET}.{host}");
            ip(
                "ip",
                &[
                    "-n",
                    &ns,
                    "addr",
                    "add",
                    &format!("{address}/24"),
                    "dev",
                    &link,
                ],
            )?;
            ip("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
            ip("ip", &["-n", &ns, "link", "set", &link, "up"])?;
            cluster.hosts.push(Host { ns, link, address });
        }
        for host in &cluster.hosts {
            wait_until_running(host)?;
        }
        Ok(cluster)
    }

    fn host(&self, host: u8) -> &Host {
        &self.hosts[self
            .hosts
            .iter()
            .position(|h| h.address == format!("{SUBNET}.{host}"))
            .unwrap_or(0)]
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for ns in self.created.iter().rev() {
            if let Err(e) = ip("ip", &["netns", "del", ns]) {
                eprintln!("cluster: cleaning up: {e}");
            }
        }
    }
}

/// Waits for carrier: UCX only opens tcp on interfaces that are running.
fn wait_until_running(host: &Host) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let output = std::process::Command::new("ip")
            .args(["-n", &host.ns, "-o", "link", "show", "dev", &host.link])
            .stdin(Stdio::null())
            .output()
            .context("cannot run `ip`")?;
        if String::from_utf8_lossy(&output.stdout).contains("LOWER_UP") {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("{} in {} has no carrier after 10 s", host.link, host.ns);
        }
        thread::sleep(Duration::from_millis(20));
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// The `[t=SECONDS]` stamp of a line printed by `rdmareg serve`/`fetch`.
fn stamp_of(line: &str) -> Option<f64> {
    line.strip_prefix("[t=")?.split(']').next()?.parse().ok()
}

/// `verified N, failed M` of a tally line.
fn tally_of(line: &str) -> Option<(u64, u64)> {
    let rest = line.split("verified ").nth(1)?;
    let (verified, failed) = rest.split_once(", failed ")?;
    Some((verified.trim().parse().ok()?, failed.trim().parse().ok()?))
}

/// `POST`s `count` puts of one key to etcd's JSON gateway at `url`
/// (`http://HOST:PORT`), one connection each: every put is a new revision.
fn age_etcd(url: &str, count: u32) -> Result<()> {
    let address = url.strip_prefix("http://").unwrap_or(url);
    let body = format!("{{\"key\":\"{AGE_KEY}\",\"value\":\"MQ==\"}}");
    let request = format!(
        "POST /v3/kv/put HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    for i in 0..count {
        let mut stream =
            TcpStream::connect(address).context(format!("connecting to etcd at {address}"))?;
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .context("setting a read timeout")?;
        stream
            .write_all(request.as_bytes())
            .context("writing to etcd")?;
        let mut answer = String::new();
        stream
            .read_to_string(&mut answer)
            .context("reading etcd's answer")?;
        if !answer.starts_with("HTTP/1.1 200") {
            bail!("put {i} of {count} to etcd failed: {answer}");
        }
    }
    Ok(())
}

/// etcd in its namespace, on `data` (created if empty), serving clients.
fn start_etcd(host: &Host, url: &str, data: &Path) -> Result<Demo> {
    let data_arg = format!("--data-dir={}", data.join("member").display());
    let listen = format!("--listen-client-urls={url}");
    let advertise = format!("--advertise-client-urls={url}");
    let mut etcd = Demo::start(
        "etcd",
        &host.ns,
        Path::new("etcd"),
        &[
            &data_arg,
            &listen,
            &advertise,
            "--listen-peer-urls=http://127.0.0.1:2380",
            "--initial-advertise-peer-urls=http://127.0.0.1:2380",
            "--initial-cluster=default=http://127.0.0.1:2380",
        ],
    )?;
    etcd.wait_for_containing("ready to serve client requests", Duration::from_secs(30))?;
    Ok(etcd)
}

/// `rdmareg serve` for owner `name` on `host`, once it is serving.
fn start_owner(binary: &Path, host: &Host, url: &str, name: &str) -> Result<Demo> {
    let ttl = format!("{}s", TTL.as_secs());
    let deadline = format!("{}ms", GET_DEADLINE.as_millis());
    let mut owner = Demo::start(
        "owner",
        &host.ns,
        binary,
        &[
            "serve",
            "--etcd",
            url,
            "--name",
            name,
            "--count",
            "2",
            "--size",
            "256K",
            "--ttl",
            &ttl,
            "--net-devices",
            &host.link,
            "--get-deadline",
            &deadline,
            "--duration",
            "120s",
        ],
    )?;
    owner.wait_for_containing("serving", Duration::from_secs(60))?;
    Ok(owner)
}

/// Waits until `demo` prints a stamped stdout line containing `needle`
/// stamped at or after `after`; its stamp.
fn wait_for_after(demo: &mut Demo, needle: &str, after: f64, within: Duration) -> Result<f64> {
    let deadline = Instant::now() + within;
    loop {
        demo.drain();
        let found = demo.stdout.iter().find_map(|l| {
            let t = stamp_of(l)?;
            (t >= after && l.contains(needle)).then_some(t)
        });
        if let Some(t) = found {
            return Ok(t);
        }
        if Instant::now() >= deadline {
            bail!(
                "the {} did not print `{needle}` within {:.0} s\n{}",
                demo.role,
                within.as_secs_f64(),
                demo.transcript()
            );
        }
        thread::sleep(Duration::from_millis(50));
    }
}

fn scenario(cluster: &Cluster, binary: &Path, data: &Path) -> Result<()> {
    let etcd_host = cluster.host(ETCD_HOST);
    let url = format!("http://{}:2379", etcd_host.address);
    let mut etcd = start_etcd(etcd_host, &url, data)?;
    let aging = Instant::now();
    let xtask = std::env::current_exe().context("finding this program")?;
    run(Command::new("ip")
        .args(["netns", "exec", &cluster.host(CONSUMER_HOST).ns])
        .arg(&xtask)
        .args(["cluster", "--age-etcd", &url, &AGE_REVISIONS.to_string()]))?;
    println!(
        "    etcd serving at {url}, aged by {AGE_REVISIONS} revisions in {:.1} s",
        aging.elapsed().as_secs_f64()
    );

    let ttl = format!("{}s", TTL.as_secs());
    let deadline = format!("{}ms", GET_DEADLINE.as_millis());
    let mut owners = Vec::new();
    for (name, host) in OWNERS {
        let host = cluster.host(host);
        owners.push(start_owner(binary, host, &url, name)?);
        println!("    {name} serving from {}", host.address);
    }
    let consumer_host = cluster.host(CONSUMER_HOST);
    let names: Vec<String> = OWNERS
        .iter()
        .flat_map(|(name, _)| [format!("{name}.0"), format!("{name}.1")])
        .collect();
    let fetch_for = format!("{}s", FETCH_FOR.as_secs());
    let mut args = vec![
        "fetch",
        "--etcd",
        &url,
        "--ttl",
        &ttl,
        "--net-devices",
        &consumer_host.link,
        "--get-deadline",
        &deadline,
        "--for",
        &fetch_for,
        "--interval",
        "100ms",
    ];
    args.extend(names.iter().map(String::as_str));
    let mut consumer = Demo::start("consumer", &consumer_host.ns, binary, &args)?;
    for (name, _) in OWNERS {
        consumer
            .wait_for_containing(&format!("from `{name}`: verified"), Duration::from_secs(60))?;
    }
    // Let a tally or two pass with everyone serving.
    thread::sleep(Duration::from_millis(2500));
    consumer.drain();

    owners[0].signal("KILL")?;
    let killed_at = now();
    let owner_b = cluster.host(OWNERS[1].1);
    ip(
        "ip",
        &["-n", &owner_b.ns, "link", "set", &owner_b.link, "down"],
    )?;
    let cut_at = now();
    println!("    SIGKILLed owner-a, took owner-b's link down");

    // Once both are gone: etcd loses its data, owner-a comes back.
    let gone_within = TTL + EXPIRY_SLACK + LOAD_MARGIN + LOAD_MARGIN;
    wait_for_after(
        &mut consumer,
        "owner `owner-a` gone",
        killed_at,
        gone_within,
    )?;
    wait_for_after(&mut consumer, "owner `owner-b` gone", cut_at, gone_within)?;
    etcd.signal("KILL")?;
    etcd.wait()?;
    let wiped_at = now();
    let member = data.join("member");
    std::fs::remove_dir_all(&member).context(format!("removing {}", member.display()))?;
    etcd = start_etcd(etcd_host, &url, data)?;
    let etcd_back_at = now();
    println!(
        "    SIGKILLed etcd, started it on an empty data directory ({:.2} s)",
        etcd_back_at - wiped_at
    );
    owners[0] = start_owner(binary, cluster.host(OWNERS[0].1), &url, OWNERS[0].0)?;
    let restarted_at = now();
    println!("    owner-a serving again");
    let mut verified_at = Vec::new();
    for index in 0..2 {
        verified_at.push(wait_for_after(
            &mut consumer,
            &format!("GET `owner-a.{index}` from `owner-a`: verified"),
            restarted_at,
            Duration::from_secs(15),
        )?);
    }

    let ended = consumer.wait()?;
    let transcript = consumer.transcript();
    let fail = |what: String| -> Result<()> { bail!("{what}\n{transcript}") };
    let lines = &consumer.stdout;
    let find = |needle: &str, after: f64| {
        lines.iter().find_map(|l| {
            let t = stamp_of(l)?;
            (t >= after && l.contains(needle)).then_some(t)
        })
    };

    // 1. owner-a vanishes within the TTL.
    let bound = (TTL + EXPIRY_SLACK).as_secs_f64();
    match find("owner `owner-a` gone", killed_at) {
        Some(t) if t - killed_at <= bound => {
            println!(
                "    owner-a reported gone {:.2} s after SIGKILL (TTL {} s)",
                t - killed_at,
                TTL.as_secs()
            );
        }
        Some(t) => fail(format!(
            "owner-a reported gone {:.2} s after the kill (bound {bound} s)",
            t - killed_at
        ))?,
        None => fail("owner-a was never reported gone".into())?,
    }
    // 2. owner-b's GETs fail within their deadline, and it vanishes too.
    let get_bound = (GET_DEADLINE + LOAD_MARGIN).as_secs_f64();
    match find("from `owner-b` failed", cut_at) {
        Some(t) if t - cut_at <= get_bound => {
            println!(
                "    owner-b's first GET failure {:.2} s after the cut (deadline {} s)",
                t - cut_at,
                GET_DEADLINE.as_secs()
            );
        }
        Some(t) => fail(format!(
            "owner-b's GETs failed only {:.2} s after the cut (bound {get_bound} s)",
            t - cut_at
        ))?,
        None => fail("no GET to owner-b failed after the cut".into())?,
    }
    match find("owner `owner-b` gone", cut_at) {
        Some(t) if t - cut_at <= bound => {
            println!(
                "    owner-b reported gone {:.2} s after the cut",
                t - cut_at
            );
        }
        Some(t) => fail(format!(
            "owner-b reported gone {:.2} s after the cut (bound {bound} s)",
            t - cut_at
        ))?,
        None => fail("owner-b was never reported gone".into())?,
    }
    // 3. The consumer follows etcd across the wipe.
    let Some(noticed_at) = find("etcd lost its data", wiped_at) else {
        return fail("the consumer never reported that etcd lost its data".into());
    };
    println!(
        "    consumer noticed that etcd lost its data {:.2} s after etcd was back",
        noticed_at - etcd_back_at
    );
    // 4. owner-c keeps serving: no GET to it fails until the consumer reads
    // the new store, and it verifies more after that than before the
    // faults. (Whether its reads fail for a moment after the wipe depends
    // on whether the consumer reads the new store before owner-c has
    // republished there: then owner-c is absent from it for that moment.)
    let failed_before_wipe = lines.iter().any(|l| {
        l.contains("GET `owner-c.") && l.contains(" failed") && stamp_of(l) < Some(noticed_at)
    });
    let tallies: Vec<(f64, u64, u64)> = lines
        .iter()
        .filter(|l| l.contains("tally `owner-c`"))
        .filter_map(|l| {
            let (v, f) = tally_of(l)?;
            Some((stamp_of(l)?, v, f))
        })
        .collect();
    let before = tallies.iter().rev().find(|(t, ..)| *t < killed_at);
    let at_wipe = tallies.iter().rev().find(|(t, ..)| *t < noticed_at);
    let last = tallies.last();
    match (before, at_wipe, last) {
        (Some((_, v0, _)), Some((_, v1, _)), Some((_, v2, f2)))
            if !failed_before_wipe && v2 > v1 && v1 >= v0 =>
        {
            println!(
                "    owner-c kept serving: {v0} verified GETs before the faults, {v1} before the \
                 wipe with none failed, {v2} at the end ({f2} failed after the wipe)"
            );
        }
        _ => fail(format!(
            "owner-c did not keep serving cleanly (failed before the wipe: \
             {failed_before_wipe}, tallies {tallies:?})"
        ))?,
    }
    // 5. The restarted owner-a is read.
    let last_verified = verified_at.iter().copied().fold(f64::MIN, f64::max);
    println!(
        "    restarted owner-a: both ranges verified {:.2} s after it was serving",
        last_verified - restarted_at
    );
    // 6. Reads failed (owner-a's and owner-b's after the faults): the run
    // fails and says how many.
    let report = consumer
        .stderr
        .iter()
        .find(|l| l.starts_with("rdmareg:"))
        .cloned()
        .unwrap_or_default();
    if ended.code != Some(1) || !report.contains(" reads failed") {
        fail(format!(
            "the consumer should exit 1 naming its failed reads (exit {:?}, `{report}`)",
            ended.code
        ))?;
    }
    println!("    consumer exited 1: `{report}`");
    // 7. owner-c stops clean and withdraws.
    owners[2].signal("TERM")?;
    let c_ended = owners[2].wait()?;
    let clean = owners[2]
        .stdout
        .iter()
        .any(|l| l.contains("backend holds 0 registrations"));
    let withdrew = owners[2]
        .stdout
        .iter()
        .any(|l| l.contains("withdrew `owner-c`"));
    if !(c_ended.success && clean && withdrew) {
        bail!(
            "owner-c did not withdraw and shut down clean\n{}",
            owners[2].transcript()
        );
    }
    println!("    owner-c withdrew and shut down with 0 registrations");
    drop(owners);
    drop(etcd);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_and_tallies_are_read_from_the_consumers_lines() {
        let line = "[t=1764612345.678] tally `owner-c`: verified 12, failed 0";
        assert_eq!(stamp_of(line), Some(1_764_612_345.678));
        assert_eq!(tally_of(line), Some((12, 0)));
        assert_eq!(stamp_of("no stamp"), None);
    }
}
