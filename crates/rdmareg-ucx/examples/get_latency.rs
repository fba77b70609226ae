//! GET latency and bandwidth through `UcxBackend`, side by side with
//! `ucx_perftest -t ucp_get` from the same UCX on the same transport.
//!
//! ```text
//! cargo run --release -p rdmareg-ucx --example get_latency -- [tcp|same-host] [--no-perftest] [--no-huge-pages] [--spin-us=N]
//! ```
//!
//! Two engines in one process (owner and consumer) on the loopback
//! interface. Latency: 8 B GETs, one outstanding, 20 000 iterations after a
//! warm-up, reported as median / p99 / mean — once with a caller that
//! busy-polls its future (the engine's own cost) and once with a tokio
//! current-thread runtime (adds the caller's wake-up). Bandwidth: 64 KiB,
//! 1 MiB and 16 MiB GETs with a window of outstanding requests.
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
use futures::stream::FuturesUnordered;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, BackendRegion, PeerId};
use rdmareg_ucx::{Transport, UcxBackend, UcxConfig, UcxEngine};

const OWNER: PeerId = PeerId(1);
const LATENCY_ITERS: usize = 20_000;
const WARMUP_ITERS: usize = 2_000;
const BANDWIDTH_SIZES: [(usize, usize); 3] = [(64 << 10, 16), (1 << 20, 8), (16 << 20, 4)];

/// Polls `future` in a loop on this thread until it is ready: a caller that
/// never sleeps, so no wake-up cost is measured.
fn spin_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return output;
        }
        std::hint::spin_loop();
    }
}

/// An anonymous mapping, optionally backed by transparent huge pages
/// (`MADV_HUGEPAGE`), as ucx_perftest's buffers are (UCX allocates them with
/// its `thp` method). `process_vm_readv` over 4 KiB pages is several times
/// slower than over huge pages, so the comparison is only fair with them.
struct Buffer {
    ptr: *mut u8,
    len: usize,
}

impl Buffer {
    fn new(len: usize, huge_pages: bool, fill: u8) -> Buffer {
        // SAFETY: an anonymous private mapping; no pointer arguments.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "mmap of {len} bytes");
        if huge_pages {
            // SAFETY: advice on the mapping just created; failure is harmless.
            unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) };
        }
        // SAFETY: the mapping is `len` writable bytes that nothing else uses.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), fill, len) };
        Buffer {
            ptr: ptr.cast(),
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
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
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

fn setup(transport: Transport, dest_len: usize, huge_pages: bool, spin: Option<Duration>) -> Setup {
    let mut config = UcxConfig::default()
        .with_transport(transport)
        .with_net_devices("lo");
    if let Some(spin) = spin {
        config = config.with_spin_window(spin);
    }
    let owner = UcxEngine::start(config.clone()).expect("owner engine");
    let consumer = UcxEngine::start(config).expect("consumer engine");
    consumer.add_peer(OWNER, owner.worker_address()).unwrap();
    let owner_backend = owner.backend();
    let backend = consumer.backend();
    let source = Buffer::new(16 << 20, huge_pages, 7);
    let dest = Buffer::new(dest_len, huge_pages, 0);
    let source_region = spin_on(owner_backend.map(source.addr(), source.len)).expect("map source");
    let dest_region = spin_on(backend.map(dest.addr(), dest.len)).expect("map dest");
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
        assert_eq!(self.consumer.live_registrations(), 0);
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

fn latency_spinning(s: &Setup) -> Latency {
    let request = s.request(8, 0);
    for _ in 0..WARMUP_ITERS {
        spin_on(s.backend.get(request.clone())).unwrap();
    }
    let samples = (0..LATENCY_ITERS)
        .map(|_| {
            let started = Instant::now();
            spin_on(s.backend.get(request.clone())).unwrap();
            started.elapsed()
        })
        .collect();
    summarize(samples)
}

fn latency_tokio(s: &Setup) -> Latency {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let request = s.request(8, 0);
    runtime.block_on(async {
        for _ in 0..WARMUP_ITERS {
            s.backend.get(request.clone()).await.unwrap();
        }
        let mut samples = Vec::with_capacity(LATENCY_ITERS);
        for _ in 0..LATENCY_ITERS {
            let started = Instant::now();
            s.backend.get(request.clone()).await.unwrap();
            samples.push(started.elapsed());
        }
        summarize(samples)
    })
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
                in_flight.push(s.backend.get(s.request(size, slot(issued))));
                issued += 1;
            }
            while let Some(answer) = in_flight.next().await {
                answer.unwrap();
                if issued < iters {
                    in_flight.push(s.backend.get(s.request(size, slot(issued))));
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
    let max_dest = BANDWIDTH_SIZES.iter().map(|(s, w)| s * w).max().unwrap();
    let s = setup(transport, max_dest, huge_pages, spin);

    println!(
        "transport: {transport_name}, huge pages: {huge_pages}, engine spin window: {spin:?} (None = default)"
    );
    let spin = latency_spinning(&s);
    let tokio = latency_tokio(&s);
    println!(
        "8 B GET, caller spinning : median {:6.2} us  p99 {:6.2} us  mean {:6.2} us",
        spin.median_us, spin.p99_us, spin.mean_us
    );
    println!(
        "8 B GET, tokio caller    : median {:6.2} us  p99 {:6.2} us  mean {:6.2} us",
        tokio.median_us, tokio.p99_us, tokio.mean_us
    );
    let perf_latency = run_perftest
        .then(|| perftest(&env, 8, LATENCY_ITERS, 1))
        .flatten();
    if let Some((p50, _)) = perf_latency {
        println!(
            "8 B ucx_perftest (-O 1)  : median {p50:6.2} us   -> rdmareg spinning median - perftest = {:+.2} us",
            spin.median_us - p50
        );
    }
    for (size, window) in BANDWIDTH_SIZES {
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
