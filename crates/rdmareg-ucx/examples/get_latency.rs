//! GET latency and bandwidth through `UcxBackend`, beside `ucx_perftest`.
//!
//! `ucx_perftest -t ucp_get` runs from the same UCX on the same transport.
//!
//! ```text
//! cargo run --release -p rdmareg-ucx --example get_latency -- [tcp|same-host] [--no-perftest] [--no-huge-pages] [--spin-us=N] [--window=N] [--small-only] [--iters=N] [--batch=N] [--batch-entry-bytes=N] [--owner-cpus=LIST] [--consumer-cpus=LIST] [--ucx-setting=KEY=VALUE]...
//! ```
//!
//! `--small-only` measures the 8 B latency alone (no 1 MiB latency, no
//! bandwidth runs), and `--iters=N` sets its iteration count: quick enough
//! to repeat in alternating A/B rounds, or under `perf`.
//!
//! `--batch=N` also times one `get_batch` of N 8 B reads (each into its
//! own destination slot) against the lone 8 B read, with the caller
//! polling: what a transfer list of small reads costs the engine.
//! `--batch-entry-bytes=N` makes them N-byte reads, and then also times one
//! read of all the batch's bytes (`--batch=1000 --batch-entry-bytes=4096`
//! is the bench's scatter run without the registry; every entry reads the
//! same source bytes).
//!
//! `--owner-cpus` and `--consumer-cpus` pin each engine's progress thread
//! (`UcxConfig::with_progress_cpus`, a comma-separated list of CPU numbers);
//! run the whole example under `taskset` to place the caller too.
//!
//! `--ucx-setting` applies a UCX setting to both engines on top of their
//! own (`UcxConfig::with_ucx_setting`), for example
//! `--ucx-setting=TCP_PUT_ENABLE=y` to compare with tcp PUT back on.
//!
//! Two engines in one process (owner and consumer) on the loopback
//! interface. Latency: 8 B and 1 MiB GETs, one outstanding, up to 20 000
//! iterations after a warm-up, reported as median / p99 / mean — once with
//! a caller that polls its future without ever sleeping (the engine's own
//! cost) and once with a tokio current-thread runtime (adds the caller's
//! wake-up). Bandwidth: 64 KiB, 1 MiB and
//! 16 MiB GETs with a window of outstanding requests (`--window` overrides
//! it for every size), once into the same destination bytes as ucx_perftest
//! does and once into a slot per outstanding GET.
//!
//! Unless `--no-perftest` is given, `ucx_perftest` (server and client, two
//! processes) is run for the same sizes and the ratios are printed.

use std::future::Future;
use std::pin::pin;
use std::process::Stdio;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, BackendRegion, PeerId, RdmaError};
use rdmareg_ucx::{Transport, UcxBackend, UcxConfig, UcxEngine};

const OWNER: PeerId = PeerId(1);
/// Sizes whose single-outstanding latency is measured.
const LATENCY_SIZES: [usize; 2] = [8, 1 << 20];
const BANDWIDTH_SIZES: [(usize, usize); 3] = [(64 << 10, 16), (1 << 20, 8), (16 << 20, 4)];

/// Polls `future` in a loop on this thread until it is ready: a caller that
/// never sleeps, so no wake-up cost is measured. It yields between polls,
/// so a progress thread that shares its CPU still gets to run.
fn spin_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return output;
        }
        std::thread::yield_now();
    }
}

/// An anonymous mapping, optionally backed by transparent huge pages
/// (`MADV_HUGEPAGE`), as ucx_perftest's buffers are (UCX allocates them with
/// its `thp` method). `process_vm_readv` over 4 KiB pages is several times
/// slower than over huge pages, so the comparison is only fair with them.
struct Buffer {
    /// The whole mapping (what `munmap` gets).
    mapping: *mut libc::c_void,
    mapping_len: usize,
    /// The usable bytes: `len` bytes from the first huge-page boundary.
    ptr: *mut u8,
    len: usize,
}

/// Transparent huge pages cover only 2 MiB-aligned 2 MiB ranges, so buffers
/// start on such a boundary (as UCX's `thp` allocations do); otherwise the
/// head of every buffer would sit on small pages.
const HUGE_PAGE: usize = 2 << 20;

impl Buffer {
    fn new(len: usize, huge_pages: bool, fill: u8) -> Buffer {
        let mapping_len = len + HUGE_PAGE;
        // SAFETY: an anonymous private mapping; no pointer arguments.
        let mapping = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapping_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(mapping, libc::MAP_FAILED, "mmap of {mapping_len} bytes");
        let ptr = (mapping as usize).next_multiple_of(HUGE_PAGE) as *mut u8;
        if huge_pages {
            // SAFETY: advice on the mapping just created; failure is harmless.
            unsafe { libc::madvise(mapping, mapping_len, libc::MADV_HUGEPAGE) };
        }
        // SAFETY: `[ptr, ptr + len)` lies inside the mapping (at most
        // HUGE_PAGE - 1 bytes of padding precede it) and nothing else uses it.
        unsafe { std::ptr::write_bytes(ptr, fill, len) };
        Buffer {
            mapping,
            mapping_len,
            ptr,
            len,
        }
    }

    fn addr(&self) -> usize {
        self.ptr as usize
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping made in `new`, once, after its
        // registration is gone (the engines were shut down first).
        unsafe { libc::munmap(self.mapping, self.mapping_len) };
    }
}

struct Setup {
    owner: UcxEngine,
    consumer: UcxEngine,
    backend: Arc<UcxBackend>,
    source: Buffer,
    source_region: BackendRegion,
    dest: Buffer,
    dest_region: BackendRegion,
}

/// Where each engine's progress thread may run (`None`: anywhere).
#[derive(Default)]
struct Placement {
    owner: Option<Vec<usize>>,
    consumer: Option<Vec<usize>>,
}

fn setup(
    transport: Transport,
    dest_len: usize,
    huge_pages: bool,
    spin: Option<Duration>,
    settings: &[(String, String)],
    placement: &Placement,
) -> Setup {
    let mut config = UcxConfig::default()
        .with_transport(transport)
        .with_net_devices("lo");
    for (key, value) in settings {
        config = config.with_ucx_setting(key, value);
    }
    if let Some(spin) = spin {
        config = config.with_spin_window(spin);
    }
    let pinned = |cpus: &Option<Vec<usize>>| match cpus {
        Some(cpus) => config.clone().with_progress_cpus(cpus.iter().copied()),
        None => config.clone(),
    };
    let owner = UcxEngine::start(pinned(&placement.owner)).expect("owner engine");
    let consumer = UcxEngine::start(pinned(&placement.consumer)).expect("consumer engine");
    consumer.add_peer(OWNER, owner.worker_address()).unwrap();
    let owner_backend = owner.backend();
    let backend = consumer.backend();
    let source = Buffer::new(16 << 20, huge_pages, 7);
    let dest = Buffer::new(dest_len, huge_pages, 0);
    // SAFETY: both ranges are mappings this function made, reached only
    // through raw pointers and unmapped in `teardown` after the engines shut
    // down (which ends every registration).
    let source_region =
        spin_on(unsafe { owner_backend.map(source.addr(), source.len) }).expect("map source");
    // SAFETY: as above.
    let dest_region = spin_on(unsafe { backend.map(dest.addr(), dest.len) }).expect("map dest");
    Setup {
        owner,
        consumer,
        backend,
        source,
        source_region,
        dest,
        dest_region,
    }
}

impl Setup {
    /// A GET into the destination mapping.
    fn get(&self, request: BackendGet) -> BoxFuture<'_, Result<(), RdmaError>> {
        // SAFETY: the destination is the mapping `setup` registered; the
        // benchmark never reads it, so concurrent GETs into it (even into
        // the same bytes) write memory no reference aliases, and it is
        // unmapped only after the engines shut down.
        unsafe { self.backend.get(request) }
    }

    fn request(&self, len: usize, dest_offset: usize) -> BackendGet {
        BackendGet {
            peer: OWNER,
            remote_addr: self.source.addr() as u64,
            packed_key: self.source_region.packed_key.clone(),
            local_region_id: self.dest_region.backend_region_id,
            local_offset: dest_offset as u64,
            len: len as u64,
            deadline: None,
        }
    }

    fn teardown(self) {
        self.consumer.shutdown_blocking();
        self.owner.shutdown_blocking();
        assert_eq!(self.consumer.live_registrations(), Some(0));
        drop(self.dest);
        drop(self.source);
    }
}

struct Latency {
    median_us: f64,
    p99_us: f64,
    mean_us: f64,
}

fn summarize(mut samples: Vec<Duration>) -> Latency {
    samples.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let mean = samples.iter().map(|d| us(*d)).sum::<f64>() / samples.len() as f64;
    Latency {
        median_us: us(samples[samples.len() / 2]),
        p99_us: us(samples[samples.len() * 99 / 100]),
        mean_us: mean,
    }
}

/// Latency iterations for `size`: 20 000 for small GETs, fewer for large
/// ones (4 GiB moved at most), never under 1 000.
fn latency_iters(size: usize) -> usize {
    ((4usize << 30) / size).clamp(1_000, 20_000)
}

fn latency_spinning(s: &Setup, size: usize, iters: usize) -> Latency {
    let request = s.request(size, 0);
    for _ in 0..iters / 10 {
        spin_on(s.get(request.clone())).unwrap();
    }
    let samples = (0..iters)
        .map(|_| {
            let started = Instant::now();
            spin_on(s.get(request.clone())).unwrap();
            started.elapsed()
        })
        .collect();
    summarize(samples)
}

fn latency_tokio(s: &Setup, size: usize, iters: usize) -> Latency {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let request = s.request(size, 0);
    runtime.block_on(async {
        for _ in 0..iters / 10 {
            s.get(request.clone()).await.unwrap();
        }
        let mut samples = Vec::with_capacity(iters);
        for _ in 0..iters {
            let started = Instant::now();
            s.get(request.clone()).await.unwrap();
            samples.push(started.elapsed());
        }
        summarize(samples)
    })
}

/// Latency of one `get_batch` of `entries` reads of `size` bytes, each into
/// its own destination slot, with a caller that polls without sleeping.
fn latency_batch_spinning(s: &Setup, size: usize, entries: usize, iters: usize) -> Latency {
    let requests: Vec<BackendGet> = (0..entries).map(|n| s.request(size, n * size)).collect();
    let post = || {
        // SAFETY: as in `Setup::get`: every destination is in the mapping
        // `setup` registered, which nothing reads and which outlives the
        // engines.
        let batch = unsafe { s.backend.get_batch(requests.clone()) };
        for answer in spin_on(batch) {
            answer.unwrap();
        }
    };
    for _ in 0..iters / 10 {
        post();
    }
    let samples = (0..iters)
        .map(|_| {
            let started = Instant::now();
            post();
            started.elapsed()
        })
        .collect();
    summarize(samples)
}

/// MB/s (10^6 bytes per second, as ucx_perftest reports) with `window`
/// GETs of `size` bytes outstanding. Like ucx_perftest, every GET lands in
/// the same destination bytes unless `distinct` gives each in-flight GET
/// its own slot (which also measures the cache misses of a larger footprint).
fn bandwidth(s: &Setup, size: usize, window: usize, distinct: bool) -> f64 {
    let slot = |n: usize| if distinct { (n % window) * size } else { 0 };
    let total_iters = ((1usize << 30) / size).clamp(64, 20_000);
    let run = |iters: usize| {
        spin_on(async {
            let mut in_flight = FuturesUnordered::new();
            let mut issued = 0;
            let started = Instant::now();
            while issued < iters.min(window) {
                in_flight.push(s.get(s.request(size, slot(issued))));
                issued += 1;
            }
            while let Some(answer) = in_flight.next().await {
                answer.unwrap();
                if issued < iters {
                    in_flight.push(s.get(s.request(size, slot(issued))));
                    issued += 1;
                }
            }
            started.elapsed()
        })
    };
    run(total_iters / 10 + 1);
    let took = run(total_iters);
    (total_iters * size) as f64 / took.as_secs_f64() / 1e6
}

/// Runs `ucx_perftest -t ucp_get` (server + client) and returns the client's
/// final (median latency µs, bandwidth MB/s).
fn perftest(
    env: &[(&str, &str)],
    size: usize,
    iters: usize,
    outstanding: usize,
) -> Option<(f64, f64)> {
    let port = 13337 + (size.trailing_zeros() as u16);
    let mut server = ucx_sys::install::tool_command("ucx_perftest");
    server
        .args(["-t", "ucp_get", "-p", &port.to_string()])
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut server = server.spawn().ok()?;
    std::thread::sleep(Duration::from_millis(500));
    let mut client = ucx_sys::install::tool_command("ucx_perftest");
    client
        .args(["localhost", "-t", "ucp_get", "-p", &port.to_string()])
        .args(["-s", &size.to_string(), "-n", &iters.to_string()])
        .args(["-O", &outstanding.to_string(), "-f"])
        .envs(env.iter().copied());
    let output = client.output().ok();
    let _ = server.wait();
    let text = String::from_utf8_lossy(&output?.stdout).into_owned();
    // With `-f` the result is one line of eight numbers.
    let fields: Vec<f64> = text
        .lines()
        .map(|l| {
            l.split_whitespace()
                .filter_map(|f| f.parse().ok())
                .collect::<Vec<f64>>()
        })
        .rfind(|fields| fields.len() == 8)?;
    // iterations, p50 latency, avg latency, overall latency, avg MB/s,
    // overall MB/s, avg msg/s, overall msg/s
    Some((*fields.get(1)?, *fields.get(5)?))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let transport_name = args
        .iter()
        .find(|a| !a.starts_with('-'))
        .map(String::as_str)
        .unwrap_or("same-host");
    let run_perftest = !args.iter().any(|a| a == "--no-perftest");
    let huge_pages = !args.iter().any(|a| a == "--no-huge-pages");
    let spin = args
        .iter()
        .find_map(|a| a.strip_prefix("--spin-us="))
        .map(|us| Duration::from_micros(us.parse().expect("--spin-us=<microseconds>")));
    let window_override: Option<usize> = args
        .iter()
        .find_map(|a| a.strip_prefix("--window="))
        .map(|n| n.parse().expect("--window=<outstanding GETs>"));
    let small_only = args.iter().any(|a| a == "--small-only");
    let iters_override: Option<usize> = args
        .iter()
        .find_map(|a| a.strip_prefix("--iters="))
        .map(|n| n.parse().expect("--iters=<latency iterations>"));
    let batch: Option<usize> = args
        .iter()
        .find_map(|a| a.strip_prefix("--batch="))
        .map(|n| n.parse().expect("--batch=<reads per batch>"));
    let batch_entry_bytes: usize = args
        .iter()
        .find_map(|a| a.strip_prefix("--batch-entry-bytes="))
        .map_or(LATENCY_SIZES[0], |n| {
            n.parse().expect("--batch-entry-bytes=<bytes per read>")
        });
    let cpus = |flag: &str| {
        args.iter().find_map(|a| a.strip_prefix(flag)).map(|list| {
            list.split(',')
                .map(|cpu| {
                    cpu.parse()
                        .expect("a CPU list: numbers separated by commas")
                })
                .collect::<Vec<usize>>()
        })
    };
    let placement = Placement {
        owner: cpus("--owner-cpus="),
        consumer: cpus("--consumer-cpus="),
    };
    let settings: Vec<(String, String)> = args
        .iter()
        .filter_map(|a| a.strip_prefix("--ucx-setting="))
        .map(|kv| {
            let (key, value) = kv.split_once('=').expect("--ucx-setting=KEY=VALUE");
            (key.to_owned(), value.to_owned())
        })
        .collect();
    let bandwidth_runs: Vec<(usize, usize)> = BANDWIDTH_SIZES
        .iter()
        .map(|&(size, window)| (size, window_override.unwrap_or(window).max(1)))
        .collect();
    let (transport, env): (Transport, Vec<(&str, &str)>) = match transport_name {
        "tcp" => (
            Transport::Tcp,
            vec![("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")],
        ),
        "same-host" => (
            Transport::SameHost,
            vec![
                ("UCX_TLS", "tcp,cma"),
                ("UCX_CMA_MEMORY_INVALIDATE", "y"),
                ("UCX_NET_DEVICES", "lo"),
            ],
        ),
        other => panic!("unknown transport {other:?}: use tcp or same-host"),
    };
    let max_dest = bandwidth_runs.iter().map(|(s, w)| s * w).max().unwrap();
    let s = setup(transport, max_dest, huge_pages, spin, &settings, &placement);

    println!(
        "transport: {transport_name}, huge pages: {huge_pages}, engine spin window: {spin:?} (None = default), extra UCX settings: {settings:?}, progress CPUs: owner {:?}, consumer {:?}",
        placement.owner, placement.consumer
    );
    let latency_sizes: &[usize] = if small_only {
        &LATENCY_SIZES[..1]
    } else {
        &LATENCY_SIZES
    };
    for &size in latency_sizes {
        let iters = iters_override
            .unwrap_or_else(|| latency_iters(size))
            .max(10);
        let spin = latency_spinning(&s, size, iters);
        let tokio = latency_tokio(&s, size, iters);
        println!(
            "{size:>8} B GET, caller spinning : median {:7.2} us  p99 {:7.2} us  mean {:7.2} us",
            spin.median_us, spin.p99_us, spin.mean_us
        );
        println!(
            "{size:>8} B GET, tokio caller    : median {:7.2} us  p99 {:7.2} us  mean {:7.2} us",
            tokio.median_us, tokio.p99_us, tokio.mean_us
        );
        let perf_latency = run_perftest
            .then(|| perftest(&env, size, iters, 1))
            .flatten();
        if let Some((p50, _)) = perf_latency {
            println!(
                "{size:>8} B ucx_perftest (-O 1)  : median {p50:7.2} us   -> rdmareg spinning median - perftest = {:+.2} us",
                spin.median_us - p50
            );
        }
    }
    if let Some(entries) = batch.filter(|&n| n > 0) {
        let size = batch_entry_bytes;
        assert!(
            entries * size <= max_dest,
            "--batch={entries} of {size} B needs more than the {max_dest} B destination"
        );
        let iters = iters_override
            .unwrap_or_else(|| latency_iters(entries * size))
            .max(10);
        let lone = latency_spinning(&s, size, iters);
        let listed = latency_batch_spinning(&s, size, entries, iters);
        println!(
            "{size:>8} B x {entries} batch, caller spinning: median {:7.2} us  p99 {:7.2} us  mean {:7.2} us  (a lone read in the same run: median {:7.2} us)",
            listed.median_us, listed.p99_us, listed.mean_us, lone.median_us
        );
        if entries > 1 && size > LATENCY_SIZES[0] {
            let whole = latency_spinning(&s, entries * size, iters);
            println!(
                "{:>8} B, one read of the batch's bytes: median {:7.2} us  -> batch / one read = {:.2}",
                entries * size,
                whole.median_us,
                listed.median_us / whole.median_us
            );
        }
    }
    let bandwidth_runs = if small_only {
        Vec::new()
    } else {
        bandwidth_runs
    };
    for (size, window) in bandwidth_runs {
        let ours = bandwidth(&s, size, window, false);
        let distinct = bandwidth(&s, size, window, true);
        let theirs = run_perftest
            .then(|| {
                perftest(
                    &env,
                    size,
                    ((1usize << 30) / size).clamp(64, 20_000),
                    window,
                )
            })
            .flatten();
        match theirs {
            Some((_, perf_bw)) => println!(
                "{:>8} B GET, window {window:2}: {ours:9.1} MB/s (distinct slots {distinct:9.1})   ucx_perftest (-O {window}) {perf_bw:9.1} MB/s   ratio {:.3}",
                size,
                ours / perf_bw
            ),
            None => println!(
                "{:>8} B GET, window {window:2}: {ours:9.1} MB/s (distinct slots {distinct:9.1})",
                size
            ),
        }
    }
    s.teardown();
}
