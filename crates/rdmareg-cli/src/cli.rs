//! Command-line arguments.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Register memory for RDMA and move it with one-sided GETs over UCX.
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
    /// Run an owner and a consumer process, GET and verify registered memory.
    Demo(DemoArgs),
    /// Benchmark GETs and the pool against ucx_perftest and map+unmap.
    Bench(BenchArgs),
    /// The owner side of `rdmareg bench` (started by it).
    #[command(hide = true)]
    BenchOwner(BenchOwnerArgs),
}

/// The transport lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    /// UCX over tcp: GETs emulated over active messages.
    Tcp,
    /// Same host: tcp for control plus cma (process_vm_readv) for data.
    Shm,
}

impl TransportArg {
    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            TransportArg::Tcp => "tcp",
            TransportArg::Shm => "shm",
        }
    }
}

/// `rdmareg demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Transport lane.
    #[arg(long, value_enum, default_value_t = TransportArg::Tcp)]
    pub transport: TransportArg,
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
}

/// `rdmareg bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Transports to sweep.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [TransportArg::Tcp, TransportArg::Shm])]
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
    /// Pool sizes for the alloc+free against map+unmap comparison.
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "4K,1M,64M")]
    pub pool_sizes: Vec<u64>,
    /// First TCP port to use for ucx_perftest runs.
    #[arg(long, default_value_t = 13370)]
    pub perftest_port: u16,
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
