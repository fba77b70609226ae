//! Command-line arguments.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Register memory for RDMA and move it with GETs over UCX or libfabric.
#[derive(Debug, Parser)]
#[command(name = "rdmareg", version, about)]
pub struct Cli {
    /// More log output on stderr (-v info, -vv debug). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run an owner and a consumer process, GET and verify registered memory
    /// (over UCX, or libfabric with `--backend ofi`).
    Demo(DemoArgs),
    /// Benchmark GETs (UCX and libfabric lanes) and the pool against
    /// ucx_perftest and map+unmap.
    Bench(BenchArgs),
    /// Own registered memory and publish it by name in etcd, until stopped.
    Serve(ServeArgs),
    /// Resolve names in etcd, GET what they describe and verify it.
    Fetch(FetchArgs),
    /// The owner side of `rdmareg bench` (started by it).
    #[command(hide = true)]
    BenchOwner(BenchOwnerArgs),
}

/// The transport lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    /// UCX over tcp: every read served by the owner's engine.
    Tcp,
    /// Same host: tcp for control; reads one-sided with cma
    /// (process_vm_readv) between processes of the same user, through the
    /// owner otherwise.
    Shm,
    /// Same host with the direct-read lane closed: every read is served and
    /// checked by the owner's engine (bulk bytes still move with cma).
    ShmServed,
    /// libfabric's `tcp;ofi_rxm` provider: every read served by the owner's
    /// engine over tagged messages.
    OfiTcp,
    /// libfabric's `shm` provider (same host): every read served by the
    /// owner's engine over tagged messages.
    OfiShm,
}

impl TransportArg {
    /// The name used in reports (and on the command line).
    pub fn name(self) -> &'static str {
        match self {
            TransportArg::Tcp => "tcp",
            TransportArg::Shm => "shm",
            TransportArg::ShmServed => "shm-served",
            TransportArg::OfiTcp => "ofi-tcp",
            TransportArg::OfiShm => "ofi-shm",
        }
    }

    /// Whether this lane runs over libfabric (else over UCX).
    pub fn is_ofi(self) -> bool {
        matches!(self, TransportArg::OfiTcp | TransportArg::OfiShm)
    }
}

/// The backend the demo runs over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// UCX (`rdmareg-ucx`); `--transport` picks the lane.
    Ucx,
    /// libfabric (`rdmareg-ofi`); `--provider` picks the provider.
    Ofi,
}

/// A libfabric provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProviderArg {
    /// `tcp;ofi_rxm`.
    Tcp,
    /// `shm` (same host).
    Shm,
}

/// `rdmareg demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// The backend: UCX, or libfabric (`ofi`).
    #[arg(long, value_enum, default_value_t = BackendArg::Ucx)]
    pub backend: BackendArg,
    /// Transport lane (UCX's, or `ofi-tcp` / `ofi-shm`).
    #[arg(long, value_enum, default_value_t = TransportArg::Tcp)]
    pub transport: TransportArg,
    /// libfabric provider, with `--backend ofi` (default: tcp).
    #[arg(long, value_enum)]
    pub provider: Option<ProviderArg>,
    /// Bytes per GET (suffixes K, M, G accepted: 64K, 1M).
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    pub size: u64,
    /// Number of ranges the owner offers and the consumer GETs.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub count: u32,
    /// Run only the owner: listen for one consumer on this address.
    #[arg(long, conflicts_with = "connect")]
    pub listen: Option<SocketAddr>,
    /// Run only the consumer: connect to an owner at this address (host:port).
    #[arg(long)]
    pub connect: Option<String>,
    /// UCX network devices (UCX_NET_DEVICES); defaults to `lo` for loopback
    /// addresses and to UCX's choice otherwise.
    #[arg(long)]
    pub net_devices: Option<String>,
    /// Never draw a progress bar, even on a terminal.
    #[arg(long)]
    pub plain: bool,
    /// Also push: the owner offers as many writable ranges, the consumer
    /// writes a pattern into each (PUT), and both sides verify it (the
    /// owner in its memory, the consumer by reading it back).
    #[arg(long)]
    pub write: bool,
    /// Run limits: GET deadline and teardown bound.
    #[command(flatten)]
    pub limits: LimitArgs,
    /// As the owner (`--listen`): give up if no consumer connects within
    /// this long (e.g. 30s). Default: wait for one indefinitely.
    #[arg(long, value_parser = parse_duration, requires = "listen")]
    pub accept_timeout: Option<Duration>,
    /// Serve this process's registry metrics at http://ADDR/metrics
    /// (Prometheus text format) while it runs; without --listen/--connect,
    /// the consumer's.
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
}

impl DemoArgs {
    /// The lane `--backend`, `--transport` and `--provider` name together.
    ///
    /// # Errors
    /// `--provider` without `--backend ofi`.
    pub fn lane(&self) -> Result<TransportArg, String> {
        match (self.backend, self.provider) {
            (BackendArg::Ofi, None | Some(ProviderArg::Tcp)) => Ok(TransportArg::OfiTcp),
            (BackendArg::Ofi, Some(ProviderArg::Shm)) => Ok(TransportArg::OfiShm),
            (BackendArg::Ucx, None) => Ok(self.transport),
            (BackendArg::Ucx, Some(_)) => {
                Err("--provider names a libfabric provider: add --backend ofi".into())
            }
        }
    }
}

/// The two figures every wait of a run derives from (see
/// `docs/operations.md`, "When the other side is lost").
#[derive(Debug, Clone, Copy, Args)]
pub struct LimitArgs {
    /// Longest one GET may take before it is given up (e.g. 500ms, 10s, 1m).
    /// Raise it for large --size over slow links.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub get_deadline: Duration,
    /// Longest each shutdown step (draining transfers, deregistering, the
    /// UCX engine's teardown) may take before it gives up on a peer.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub teardown_timeout: Duration,
}

/// `rdmareg bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Lanes to sweep: UCX transports and libfabric providers (`ofi-tcp`,
    /// `ofi-shm`), side by side in one run.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [TransportArg::Tcp, TransportArg::Shm, TransportArg::ShmServed, TransportArg::OfiTcp, TransportArg::OfiShm])]
    pub transport: Vec<TransportArg>,
    /// Message sizes to sweep (suffixes K, M, G accepted).
    #[arg(long, value_delimiter = ',', value_parser = parse_size,
          default_value = "8,64,512,4K,32K,64K,256K,1M,4M,16M,64M")]
    pub sizes: Vec<u64>,
    /// Outstanding GETs in the bandwidth runs (ucx_perftest -O).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub window: u32,
    /// Scale iteration counts (1.0 = defaults; smaller is quicker and noisier).
    #[arg(long, default_value_t = 1.0)]
    pub scale: f64,
    /// Directory for results.csv, results.json and results.svg.
    #[arg(long, default_value = "target/bench")]
    pub out: PathBuf,
    /// The ucx_perftest binary (default: the one of the UCX rdmareg was built with).
    #[arg(long)]
    pub perftest: Option<PathBuf>,
    /// Skip the ucx_perftest baseline (no ratios).
    #[arg(long)]
    pub no_perftest: bool,
    /// Other transfer libraries to measure in the same run, over the same
    /// UCX lane and sizes (`nixl`: NIXL's READ, provisioned by
    /// `cargo xtask nixl`). Each gets its own column and ratio.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub peers: Vec<PeerArg>,
    /// The Python interpreter that has NIXL (default: the one
    /// `cargo xtask nixl` recorded in target/nixl-python).
    #[arg(long)]
    pub nixl_python: Option<PathBuf>,
    /// Pool sizes for the alloc+free against map+unmap comparison.
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "4K,1M,64M")]
    pub pool_sizes: Vec<u64>,
    /// First TCP port to use for ucx_perftest runs.
    #[arg(long, default_value_t = 13370)]
    pub perftest_port: u16,
    /// How long a lone GET or list polls before its task sleeps, µs (the
    /// registry's `get_busy_poll`; default: the registry's default, 0 turns
    /// polling off).
    #[arg(long)]
    pub get_busy_poll_us: Option<u64>,
    /// Run limits: GET deadline and teardown bound.
    #[command(flatten)]
    pub limits: LimitArgs,
    /// Serve the measuring registry's metrics at http://ADDR/metrics
    /// (Prometheus text format) while the benchmark runs; each transport's
    /// registry replaces the previous one.
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
}

/// A transfer library `rdmareg bench --peers` measures beside rdmareg.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PeerArg {
    /// NIXL's READ through its UCX backend (the `nixl-cu12` wheel).
    Nixl,
}

/// `rdmareg bench-owner`.
#[derive(Debug, Clone, Args)]
pub struct BenchOwnerArgs {
    /// Transport lane.
    #[arg(long, value_enum)]
    pub transport: TransportArg,
    /// Bytes to register and offer.
    #[arg(long, value_parser = parse_size)]
    pub size: u64,
    /// Address to listen on.
    #[arg(long)]
    pub listen: SocketAddr,
    /// Run limits: GET deadline and teardown bound.
    #[command(flatten)]
    pub limits: LimitArgs,
}

/// Where etcd is and how the cluster's keys are laid out.
#[derive(Debug, Clone, Args)]
pub struct EtcdArgs {
    /// etcd endpoint, e.g. http://127.0.0.1:2379 (repeat or comma-separate
    /// for several members of one cluster).
    #[arg(long, required = true, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Key prefix of the cluster in etcd.
    #[arg(long, default_value = "/rdmareg/default")]
    pub prefix: String,
    /// Lease TTL: how long a dead owner stays visible at most (whole seconds).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub ttl: Duration,
}

/// `rdmareg serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Where etcd is.
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// This node's name; its descriptors are published as NAME.0, NAME.1, …
    #[arg(long)]
    pub name: String,
    /// Transport lane.
    #[arg(long, value_enum, default_value_t = TransportArg::Tcp)]
    pub transport: TransportArg,
    /// Bytes per published range (suffixes K, M, G accepted).
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    pub size: u64,
    /// Number of ranges to register and publish.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub count: u32,
    /// UCX network devices (UCX_NET_DEVICES), e.g. `lo` or `eth0`.
    #[arg(long)]
    pub net_devices: Option<String>,
    /// Stop after this long (default: run until SIGINT or SIGTERM).
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Run limits: GET deadline and teardown bound.
    #[command(flatten)]
    pub limits: LimitArgs,
    /// Serve this process's registry metrics at http://ADDR/metrics
    /// (Prometheus text format) while it runs.
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
}

/// `rdmareg fetch`.
#[derive(Debug, Clone, Args)]
pub struct FetchArgs {
    /// Where etcd is.
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Descriptor names to fetch (as published by `serve`: NODE.INDEX).
    #[arg(required = true)]
    pub names: Vec<String>,
    /// Transport lane.
    #[arg(long, value_enum, default_value_t = TransportArg::Tcp)]
    pub transport: TransportArg,
    /// UCX network devices (UCX_NET_DEVICES), e.g. `lo` or `eth0`.
    #[arg(long)]
    pub net_devices: Option<String>,
    /// How long to wait for every name to be published before giving up.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub wait: Duration,
    /// Keep fetching every name in rounds for this long, following owners
    /// that come and go (default: one round).
    #[arg(long = "for", value_parser = parse_duration)]
    pub keep_fetching: Option<Duration>,
    /// Pause between rounds.
    #[arg(long, default_value = "200ms", value_parser = parse_duration)]
    pub interval: Duration,
    /// Run limits: GET deadline and teardown bound.
    #[command(flatten)]
    pub limits: LimitArgs,
    /// Serve this process's registry metrics at http://ADDR/metrics
    /// (Prometheus text format) while it runs.
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
}

/// Parse `4096`, `4K`, `1M`, `2G` (binary multiples). Zero is refused.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (digits, multiplier) = match text.char_indices().last() {
        Some((i, 'k' | 'K')) => (&text[..i], 1u64 << 10),
        Some((i, 'm' | 'M')) => (&text[..i], 1u64 << 20),
        Some((i, 'g' | 'G')) => (&text[..i], 1u64 << 30),
        _ => (text, 1),
    };
    let value: u64 = digits
        .parse()
        .map_err(|_| format!("`{text}` is not a size (examples: 4096, 64K, 1M)"))?;
    let bytes = value
        .checked_mul(multiplier)
        .ok_or_else(|| format!("`{text}` is too large"))?;
    if bytes == 0 {
        return Err("size must be at least one byte".into());
    }
    Ok(bytes)
}

/// Why a duration argument was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// Not a number followed by an optional unit.
    #[error("`{0}` is not a duration (examples: 500ms, 2s, 1m; a bare number is seconds)")]
    Malformed(String),
    /// Zero: every bound must leave some time.
    #[error("a duration must be positive")]
    Zero,
    /// More than a day: surely a typo.
    #[error("`{0}` is longer than a day")]
    TooLong(String),
}

/// Parse `500ms`, `2s`, `1.5s`, `1m` or a bare number of seconds. Zero and
/// anything over a day are refused.
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let text = text.trim();
    let malformed = || DurationError::Malformed(text.to_owned());
    let (number, unit_seconds) = if let Some(n) = text.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60.0)
    } else {
        (text, 1.0)
    };
    if number.is_empty() || !number.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return Err(malformed());
    }
    let value: f64 = number.parse().map_err(|_| malformed())?;
    let seconds = value * unit_seconds;
    if seconds > 86_400.0 {
        return Err(DurationError::TooLong(text.to_owned()));
    }
    let duration = Duration::from_secs_f64(seconds);
    if duration.is_zero() {
        return Err(DurationError::Zero);
    }
    Ok(duration)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_accept_binary_suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("1m"), Ok(1 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
    }

    #[test]
    fn bad_sizes_are_refused_with_a_reason() {
        assert!(parse_size("0").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
    }

    #[test]
    fn durations_accept_milliseconds_seconds_minutes_and_bare_seconds() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
    }

    #[test]
    fn bad_durations_are_typed_errors() {
        assert_eq!(parse_duration("0s"), Err(DurationError::Zero));
        assert_eq!(parse_duration("0.0"), Err(DurationError::Zero));
        for bad in ["", "s", "-1s", "2h", "1e3s", "nan", "1.2.3s"] {
            assert!(
                matches!(parse_duration(bad), Err(DurationError::Malformed(_))),
                "{bad:?}"
            );
        }
        assert!(matches!(
            parse_duration("100000s"),
            Err(DurationError::TooLong(_))
        ));
    }

    fn bench_args(extra: &[&str]) -> Result<BenchArgs, clap::Error> {
        let argv = ["rdmareg", "bench"].iter().chain(extra);
        match Cli::try_parse_from(argv)?.command {
            Command::Bench(args) => Ok(args),
            other => panic!("not a bench command: {other:?}"),
        }
    }

    #[test]
    fn bench_measures_no_peers_unless_asked() {
        let args = bench_args(&[]).unwrap();
        assert!(args.peers.is_empty());
        assert_eq!(args.nixl_python, None);
    }

    #[test]
    fn bench_peers_name_nixl_and_its_interpreter() {
        let args =
            bench_args(&["--peers", "nixl", "--nixl-python", "/opt/nixl/bin/python"]).unwrap();
        assert_eq!(args.peers, [PeerArg::Nixl]);
        assert_eq!(
            args.nixl_python,
            Some(PathBuf::from("/opt/nixl/bin/python"))
        );
    }

    #[test]
    fn bench_refuses_a_peer_it_does_not_know() {
        let err = bench_args(&["--peers", "mooncake"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::InvalidValue);
    }

    #[test]
    fn demo_limits_default_to_a_ten_second_deadline_and_five_second_teardown() {
        let Cli {
            command: Command::Demo(args),
            ..
        } = Cli::try_parse_from(["rdmareg", "demo"]).unwrap()
        else {
            panic!("not a demo command");
        };
        assert_eq!(args.limits.get_deadline, Duration::from_secs(10));
        assert_eq!(args.limits.teardown_timeout, Duration::from_secs(5));
        assert_eq!(args.accept_timeout, None);
    }

    #[test]
    fn demo_and_bench_take_a_metrics_address() {
        let Cli {
            command: Command::Demo(demo),
            ..
        } = Cli::try_parse_from(["rdmareg", "demo", "--metrics-addr", "127.0.0.1:9464"]).unwrap()
        else {
            panic!("not a demo command");
        };
        assert_eq!(demo.metrics_addr, Some("127.0.0.1:9464".parse().unwrap()));
        let Cli {
            command: Command::Bench(bench),
            ..
        } = Cli::try_parse_from(["rdmareg", "bench", "--metrics-addr", "0.0.0.0:9100"]).unwrap()
        else {
            panic!("not a bench command");
        };
        assert_eq!(bench.metrics_addr, Some("0.0.0.0:9100".parse().unwrap()));
        assert!(Cli::try_parse_from(["rdmareg", "demo", "--metrics-addr", "nowhere"]).is_err());
    }

    fn demo_args(extra: &[&str]) -> Result<DemoArgs, clap::Error> {
        let argv = ["rdmareg", "demo"].iter().chain(extra);
        match Cli::try_parse_from(argv)?.command {
            Command::Demo(args) => Ok(args),
            other => panic!("not a demo command: {other:?}"),
        }
    }

    #[test]
    fn demo_backend_ofi_takes_its_provider_and_defaults_to_tcp() {
        let lane = |extra: &[&str]| demo_args(extra).unwrap().lane();
        assert_eq!(lane(&["--backend", "ofi"]), Ok(TransportArg::OfiTcp));
        assert_eq!(
            lane(&["--backend", "ofi", "--provider", "tcp"]),
            Ok(TransportArg::OfiTcp)
        );
        assert_eq!(
            lane(&["--backend", "ofi", "--provider", "shm"]),
            Ok(TransportArg::OfiShm)
        );
        assert_eq!(lane(&["--transport", "shm"]), Ok(TransportArg::Shm));
        assert_eq!(lane(&["--transport", "ofi-shm"]), Ok(TransportArg::OfiShm));
        assert!(lane(&["--provider", "shm"]).is_err());
        assert!(demo_args(&["--backend", "ofi", "--provider", "verbs"]).is_err());
    }

    #[test]
    fn bench_sweeps_the_ucx_and_libfabric_lanes_by_default() {
        let args = bench_args(&[]).unwrap();
        let names: Vec<&str> = args.transport.iter().map(|t| t.name()).collect();
        assert_eq!(names, ["tcp", "shm", "shm-served", "ofi-tcp", "ofi-shm"]);
        let args = bench_args(&["--transport", "ofi-tcp,tcp"]).unwrap();
        assert_eq!(args.transport, [TransportArg::OfiTcp, TransportArg::Tcp]);
    }

    #[test]
    fn listen_and_connect_are_mutually_exclusive() {
        let parsed = Cli::try_parse_from([
            "rdmareg",
            "demo",
            "--listen",
            "127.0.0.1:1",
            "--connect",
            "x:1",
        ]);
        assert!(parsed.is_err());
    }

    #[test]
    fn serve_and_fetch_need_an_etcd_endpoint() {
        assert!(Cli::try_parse_from(["rdmareg", "serve", "--name", "a"]).is_err());
        assert!(Cli::try_parse_from(["rdmareg", "fetch", "a.0"]).is_err());
        let Cli {
            command: Command::Fetch(args),
            ..
        } = Cli::try_parse_from(["rdmareg", "fetch", "--etcd", "h:1,h:2", "a.0", "b.1"]).unwrap()
        else {
            panic!("not a fetch command");
        };
        assert_eq!(args.etcd.etcd, ["h:1", "h:2"]);
        assert_eq!(args.names, ["a.0", "b.1"]);
        assert_eq!(args.metrics_addr, None);
    }

    #[test]
    fn serve_and_fetch_take_a_metrics_address() {
        let serve = ["rdmareg", "serve", "--etcd", "h:1", "--name", "a"];
        let Cli {
            command: Command::Serve(args),
            ..
        } = Cli::try_parse_from(serve.iter().chain(&["--metrics-addr", "127.0.0.1:9464"])).unwrap()
        else {
            panic!("not a serve command");
        };
        assert_eq!(args.metrics_addr, Some("127.0.0.1:9464".parse().unwrap()));
        let Cli {
            command: Command::Fetch(args),
            ..
        } = Cli::try_parse_from([
            "rdmareg",
            "fetch",
            "--etcd",
            "h:1",
            "--metrics-addr",
            "[::1]:9100",
            "a.0",
        ])
        .unwrap()
        else {
            panic!("not a fetch command");
        };
        assert_eq!(args.metrics_addr, Some("[::1]:9100".parse().unwrap()));
    }

    #[test]
    fn demo_defaults_are_tcp_one_mebibyte_sixteen_ranges() {
        let Cli {
            command: Command::Demo(args),
            ..
        } = Cli::try_parse_from(["rdmareg", "demo"]).unwrap()
        else {
            panic!("not a demo command");
        };
        assert_eq!(
            (args.transport, args.size, args.count),
            (TransportArg::Tcp, 1 << 20, 16)
        );
    }
}
