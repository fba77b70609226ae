//! GET latency between two engines in one process, per provider and park
//! timeout: `cargo run --release -p rdmareg-ofi --example ofi_get_latency --
//! [tcp|shm] [SIZE] [ITERATIONS] [PARK_MS] [GAP_US]`. Set
//! `RDMAREG_OFI_READ_PATH=one-sided` to measure `fi_read` instead of the
//! default owner-served reads.
//!
//! With a long park timeout it shows whether a parked owner is woken by an
//! incoming read (the completion queue's wait descriptor) or serves it only
//! when its park times out; a gap between GETs longer than the spin window
//! (50 µs) lets both engines park before each GET.

use std::time::{Duration, Instant};

use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, PeerId};
use rdmareg_ofi::{OfiConfig, OfiEngine, Provider, ReadPath};

/// The read path `RDMAREG_OFI_READ_PATH` names, else the provider's default.
fn read_path(provider: &Provider) -> ReadPath {
    match std::env::var("RDMAREG_OFI_READ_PATH").as_deref() {
        Ok("one-sided") => ReadPath::OneSided,
        Ok("owner-served") => ReadPath::OwnerServed,
        _ => provider.default_read_path(),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let provider = match args.first().map(String::as_str) {
        Some("shm") => Provider::Shm,
        _ => Provider::Tcp,
    };
    let size: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(8);
    let iterations: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(2000);
    let park_ms: u64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(1);
    let gap = Duration::from_micros(args.get(4).and_then(|s| s.parse().ok()).unwrap_or(0));
    let mut config = OfiConfig::new(provider.clone())
        .with_park_timeout(Duration::from_millis(park_ms))
        .with_read_path(read_path(&provider));
    if provider == Provider::Tcp {
        config = config.with_domain("lo");
    }
    let owner = OfiEngine::start(config.clone()).expect("owner starts");
    let consumer = OfiEngine::start(config).expect("consumer starts");
    consumer
        .add_peer(PeerId(1), owner.fabric_address())
        .expect("peer added");
    let src = vec![7u8; size];
    let mut dst = vec![0u8; size];
    let (o, c) = (owner.backend(), consumer.backend());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut samples = runtime.block_on(async {
        // SAFETY: `src` and `dst` are this function's Vecs, neither grown
        // nor dropped until both are unmapped below; `dst` is read only
        // after that.
        let s = unsafe { o.map(src.as_ptr() as usize, size) }
            .await
            .expect("map src");
        // SAFETY: as above.
        let d = unsafe { c.map(dst.as_mut_ptr() as usize, size) }
            .await
            .expect("map dst");
        let mut samples = Vec::with_capacity(iterations);
        for _ in 0..iterations {
            if !gap.is_zero() {
                std::thread::sleep(gap);
            }
            let start = Instant::now();
            // SAFETY: nothing touches `dst` until it is unmapped.
            unsafe {
                c.get(BackendGet {
                    peer: PeerId(1),
                    remote_addr: src.as_ptr() as u64,
                    packed_key: s.packed_key.clone(),
                    local_region_id: d.backend_region_id,
                    local_offset: 0,
                    len: size as u64,
                    deadline: None,
                })
            }
            .await
            .expect("get");
            samples.push(start.elapsed());
        }
        c.unmap(d.backend_region_id).await.expect("unmap dst");
        o.unmap(s.backend_region_id).await.expect("unmap src");
        samples
    });
    assert!(dst.iter().all(|&b| b == 7));
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    println!(
        "provider={} path={:?} size={size} park={park_ms}ms gap={gap:?} iterations={iterations}: median {:?}, p90 {:?}, p99 {:?}",
        owner.provider(),
        read_path(&provider),
        at(0.5),
        at(0.9),
        at(0.99)
    );
    consumer.shutdown_blocking();
    owner.shutdown_blocking();
}
