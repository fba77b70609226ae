//! Does the owner's provider still read a region after `fi_close` of it
//! returned, while a consumer's large read of it is in flight?
//! `cargo run --release -p rdmareg-ofi --example close_mid_read -- [tcp|shm] [MIB] [DELAY_MS]`
//! (`RDMAREG_OFI_READ_PATH=one-sided` for `fi_read` instead of the default
//! owner-served reads).
//!
//! The owner unmaps the source a moment after the consumer's GET started,
//! then overwrites it with a new byte. Destination bytes with the new byte
//! were read after the unmap answered `Ok` — on freed memory, in a real
//! owner, a use-after-free.

use std::time::{Duration, Instant};

use rdmareg_backend::RdmaBackend;
use rdmareg_core::{BackendGet, PeerId};
use rdmareg_ofi::{OfiConfig, OfiEngine, Provider, ReadPath};

/// Zeroes the destination again after the warm-up read.
fn dst_fill(ptr: usize, size: usize) {
    // SAFETY: the destination is this process's buffer, with no read in
    // flight into it and no Rust borrow of it.
    unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, size) };
}

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
    let mib: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(64);
    let delay = Duration::from_millis(args.get(2).and_then(|s| s.parse().ok()).unwrap_or(5));
    let size = mib << 20;
    let mut config = OfiConfig::new(provider.clone()).with_read_path(read_path(&provider));
    if provider == Provider::Tcp {
        config = config.with_domain("lo");
    }
    let owner = OfiEngine::start(config.clone()).expect("owner starts");
    let consumer = OfiEngine::start(config).expect("consumer starts");
    consumer
        .add_peer(PeerId(1), owner.fabric_address())
        .expect("peer added");
    let src = vec![0x11u8; size];
    let src_ptr = src.as_ptr() as usize;
    let mut dst = vec![0u8; size];
    let dst_ptr = dst.as_mut_ptr() as usize;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let (o, c) = (owner.backend(), consumer.backend());
    let (unmap_took, get_answer) = runtime.block_on(async {
        // SAFETY: `src` and `dst` are this function's Vecs, neither grown
        // nor dropped until the engines shut down; they are touched only
        // between GETs (`dst`) or once unregistered (`src`).
        let s = unsafe { o.map(src_ptr, size) }.await.expect("map src");
        // SAFETY: as above.
        let d = unsafe { c.map(dst_ptr, size) }.await.expect("map dst");
        let request = BackendGet {
            peer: PeerId(1),
            remote_addr: src_ptr as u64,
            packed_key: s.packed_key.clone(),
            local_region_id: d.backend_region_id,
            local_offset: 0,
            len: size as u64,
            deadline: Some(Duration::from_secs(30)),
        };
        // Warm up: the first read opens the connection.
        // SAFETY: `dst` is read only after this GET answered.
        unsafe {
            c.get(BackendGet {
                len: 8,
                ..request.clone()
            })
        }
        .await
        .expect("warm-up read");
        dst_fill(dst_ptr, size);
        // SAFETY: `dst` is read only after this GET and the unmap of its
        // region answered.
        let get = unsafe { c.get(request) };
        let (answer, took) = futures::join!(get, async {
            tokio::time::sleep(delay).await;
            let start = Instant::now();
            o.unmap(s.backend_region_id).await.expect("unmap src");
            let took = start.elapsed();
            // SAFETY: the region is unregistered; this process owns `src`
            // and nothing in Rust borrows it while it is rewritten.
            unsafe { std::ptr::write_bytes(src_ptr as *mut u8, 0x33, size) };
            took
        });
        c.unmap(d.backend_region_id).await.expect("unmap dst");
        (took, answer)
    });
    let late = dst.iter().filter(|&&b| b == 0x33).count();
    let early = dst.iter().filter(|&&b| b == 0x11).count();
    println!(
        "provider={} path={:?} {mib} MiB, unmap {delay:?} after the GET: unmap took {unmap_took:?}, GET answered {get_answer:?}; \
         {early} bytes from before the unmap, {late} bytes written after it returned",
        owner.provider(),
        read_path(&provider)
    );
    drop(src);
    consumer.shutdown_blocking();
    owner.shutdown_blocking();
}
