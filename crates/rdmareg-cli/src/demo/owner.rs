//! The owner side of the demo: registers an external region and pool
//! buffers filled with a known pattern, offers their descriptors to one
//! consumer, and shuts down only after the consumer says it is done.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context as _, bail};
use rdmareg_registry::{PinnedBuf, RegionGuard};
use tokio::net::TcpListener;

use crate::bootstrap::{self, Message, OfferedRange};
use crate::cli::DemoArgs;
use crate::node::{self, Node};
use crate::owner_process::LISTENING_PREFIX;
use crate::pattern;

/// What the owner registered: half the ranges are slices of one external
/// region, half are pool buffers.
struct Holdings {
    region: RegionGuard,
    /// The external region's memory: the owner's own allocation, freed only
    /// after the region's `deregistered()` resolved.
    memory: ExternalMemory,
    buffers: Vec<PinnedBuf>,
    offered: Vec<OfferedRange>,
}

/// Serve one consumer on `listen`.
pub async fn run(args: &DemoArgs, listen: SocketAddr) -> anyhow::Result<()> {
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let local = listener.local_addr()?;
    let net_devices = args
        .net_devices
        .clone()
        .or_else(|| node::is_loopback(&local.to_string()).then(|| "lo".to_owned()));
    let total = args.size.saturating_mul(u64::from(args.count));
    let node = Node::start(
        args.transport,
        net_devices.as_deref(),
        node::registry_config_for(total),
    )?;
    let holdings = register(&node, args).await?;
    println!("{LISTENING_PREFIX}{local}");
    println!(
        "registered {} ranges of {} B ({} in one external region, {} pool buffers)",
        holdings.offered.len(),
        args.size,
        args.count.div_ceil(2),
        holdings.buffers.len()
    );

    let (mut stream, peer) = listener.accept().await.context("accepting the consumer")?;
    stream.set_nodelay(true)?;
    bootstrap::send(
        &mut stream,
        &Message::Offer {
            worker_address: node.engine.worker_address(),
            ranges: holdings.offered.clone(),
        },
    )
    .await?;
    println!("offered worker address and descriptors to {peer}");
    let verified = match bootstrap::receive(&mut stream).await {
        Ok(Message::Done { verified }) => verified,
        Ok(other) => bail!("unexpected message from the consumer: {other:?}"),
        // The consumer may have died; its GETs are over either way once
        // the connection is gone, because the engine fails them.
        Err(e) => {
            eprintln!("rdmareg: consumer connection lost ({e}); shutting down");
            false
        }
    };

    let Holdings {
        region,
        memory,
        buffers,
        ..
    } = holdings;
    let watch = region.watch();
    match region.unregister(Duration::from_secs(5)).await {
        Ok(_) => {
            watch.deregistered().await;
            memory.free_after_deregistration();
        }
        Err(e) => {
            // Unknown, not unmapped: the memory must outlive the process.
            eprintln!("rdmareg: unregistering the external region failed ({e}); leaking it");
            memory.leak();
        }
    }
    drop(buffers);
    let outcome = node.shutdown().await;
    println!(
        "owner shut down: backend holds {} registrations",
        outcome.live_registrations
    );
    let _ = bootstrap::send(
        &mut stream,
        &Message::OwnerShutDown {
            live_registrations: Some(outcome.live_registrations as u64),
        },
    )
    .await;
    if !outcome.clean {
        bail!("owner shutdown was not clean");
    }
    if !verified {
        bail!("the consumer reported a verification failure");
    }
    Ok(())
}

async fn register(node: &Node, args: &DemoArgs) -> anyhow::Result<Holdings> {
    let size = usize::try_from(args.size).context("size does not fit this machine")?;
    let external_ranges = args.count.div_ceil(2) as usize;
    let pooled_ranges = args.count as usize - external_ranges;
    let mut offered = Vec::with_capacity(args.count as usize);

    let region_len = size
        .checked_mul(external_ranges)
        .context("size × count overflows")?;
    let mut bytes = vec![0u8; region_len].into_boxed_slice();
    for (index, chunk) in bytes.chunks_mut(size).enumerate() {
        pattern::fill(chunk, index as u64);
    }
    let checksums: Vec<u32> = bytes.chunks(size).map(pattern::checksum).collect();
    let memory = ExternalMemory::new(bytes);
    // SAFETY: `memory` is a live heap allocation of `region_len` bytes that
    // this function never references again; it is freed only by
    // `free_after_deregistration` (after `deregistered()` resolved) or
    // leaked, and on an error here it is freed after the registration
    // was refused, which leaves nothing registered.
    let registered = unsafe { node.registry.register_external(memory.ptr, memory.len) }.await;
    let region = match registered {
        Ok(region) => region,
        Err(e) => {
            memory.free_after_deregistration();
            return Err(e).context("registering the external region");
        }
    };
    for (index, crc32) in checksums.into_iter().enumerate() {
        let descriptor = region.descriptor_range((index * size) as u64, size as u64)?;
        offered.push(OfferedRange { descriptor, crc32 });
    }

    let mut buffers = Vec::with_capacity(pooled_ranges);
    for index in 0..pooled_ranges {
        let mut buffer = node
            .registry
            .alloc_pinned(size)
            .await
            .context("allocating a pool buffer")?;
        pattern::fill(&mut buffer, (external_ranges + index) as u64);
        offered.push(OfferedRange {
            descriptor: buffer.describe().await?,
            crc32: pattern::checksum(&buffer),
        });
        buffers.push(buffer);
    }
    Ok(Holdings {
        region,
        memory,
        buffers,
        offered,
    })
}

/// Memory the owner allocates and registers as an external region; held as
/// a raw pointer because no Rust reference may alias registered memory.
struct ExternalMemory {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is a uniquely owned heap allocation; moving the owner
// between threads moves nothing a peer can observe.
unsafe impl Send for ExternalMemory {}

impl ExternalMemory {
    fn new(bytes: Box<[u8]>) -> Self {
        let len = bytes.len();
        let ptr = Box::into_raw(bytes).cast::<u8>();
        ExternalMemory { ptr, len }
    }

    /// Free the memory. Call only when no registration covers it.
    fn free_after_deregistration(self) {
        let slice = std::ptr::slice_from_raw_parts_mut(self.ptr, self.len);
        // SAFETY: `ptr`/`len` came from `Box::into_raw` of a `Box<[u8]>` in
        // `new`, this is the only place it is rebuilt (`self` is consumed),
        // and the caller established that nothing has it registered.
        drop(unsafe { Box::from_raw(slice) });
    }

    /// Give up the memory for good (its release could not be confirmed).
    fn leak(self) {}
}
