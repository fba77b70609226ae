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
//! etcd runs in its namespace; each owner runs `rdmareg serve` publishing two
//! ranges with a short lease; the consumer runs `rdmareg fetch --for` over
//! all six names on UCX tcp across the bridge. Once every owner has been read
//! and verified, `owner-a` is SIGKILLed and `owner-b`'s link is taken down.
//! Checked from the consumer's stamped lines:
//!
//! - `owner-a` is reported gone within the TTL (plus etcd's expiry slack);
//! - a GET to `owner-b` fails within the GET deadline of the cut, and
//!   `owner-b` is reported gone within the TTL (it cannot reach etcd either);
//! - `owner-c` keeps serving: its GETs keep verifying and none fails;
//! - `owner-c`, stopped with SIGTERM at the end, withdraws and shuts down
//!   with zero registrations.
//!
//! Needs root, iproute2 and etcd (installed when missing).

use std::path::Path;
use std::process::Stdio;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::native::Need;
use crate::netns::{Demo, build, ensure_root, ip};
use crate::util::{Context, Result, bail, target_dir};

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

/// `cargo xtask cluster [--release]`.
pub fn run_task(args: &[String]) -> Result<()> {
    let release = match args {
        [] => false,
        [flag] if flag == "--release" => true,
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

fn scenario(cluster: &Cluster, binary: &Path, data: &Path) -> Result<()> {
    let etcd_host = cluster.host(ETCD_HOST);
    let url = format!("http://{}:2379", etcd_host.address);
    let data_arg = format!("--data-dir={}", data.join("member").display());
    let listen = format!("--listen-client-urls={url}");
    let advertise = format!("--advertise-client-urls={url}");
    let mut etcd = Demo::start(
        "etcd",
        &etcd_host.ns,
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
    println!("    etcd serving at {url}");

    let ttl = format!("{}s", TTL.as_secs());
    let deadline = format!("{}ms", GET_DEADLINE.as_millis());
    let mut owners = Vec::new();
    for (name, host) in OWNERS {
        let host = cluster.host(host);
        let mut owner = Demo::start(
            "owner",
            &host.ns,
            binary,
            &[
                "serve",
                "--etcd",
                &url,
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
        println!("    {name} serving from {}", host.address);
        owners.push(owner);
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
    // 3. owner-c keeps serving: more verified GETs after the faults, none failed.
    let tallies: Vec<(f64, u64, u64)> = lines
        .iter()
        .filter(|l| l.contains("tally `owner-c`"))
        .filter_map(|l| {
            let (v, f) = tally_of(l)?;
            Some((stamp_of(l)?, v, f))
        })
        .collect();
    let before = tallies.iter().rev().find(|(t, ..)| *t < killed_at);
    let last = tallies.last();
    match (before, last) {
        (Some((_, v0, _)), Some((_, v1, 0))) if v1 > v0 => {
            println!(
                "    owner-c kept serving: {v0} verified GETs before the faults, {v1} at the end, none failed"
            );
        }
        _ => fail(format!(
            "owner-c did not keep serving cleanly (tallies {tallies:?})"
        ))?,
    }
    if !ended.success {
        fail("the consumer exited unsuccessfully".into())?;
    }
    // 4. owner-c stops clean and withdraws.
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
