//! The owner side of the demo: registers an external region and pool
//! buffers filled with a known pattern, offers their descriptors to one
//! consumer, frees each pool buffer as soon as the consumer's notice says
//! it was read, and shuts down only after the consumer says it is done.
//!
//! The external region's ranges are offered under descriptor leases, one
//! per range (one reader, [`LEASE_TTL`]): the owner unregisters the region
//! as soon as every lease was released by the consumer or expired, and
//! says how many ended which way.
//!
//! With `--write` the owner also registers a zeroed read-write buffer and
//! offers as many writable ranges, each with the checksum of the pattern
//! the consumer is to write there; when the consumer's notice names a
//! written range, the owner checks its own bytes against that checksum.

use std::net::SocketAddr;
use std::time::Duration;

use std::collections::HashSet;

use anyhow::{Context as _, bail};
use futures::StreamExt as _;
use futures::channel::oneshot;
use rdmareg_registry::{
    Access, DescribedBuf, LeaseOutcome, LeasedDescriptor, RdmaError, RegionGuard, RegionWatch,
    UnregisterOutcome,
};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::bootstrap::{Message, OfferedRange};
use crate::cli::DemoArgs;
use crate::control::{self, Bounds, Control};
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
    buffers: Vec<DescribedBuf>,
    offered: Vec<OfferedRange>,
    /// One lease per range of the external region; empty on a backend
    /// without leases, whose ranges are offered with plain descriptors.
    leases: Vec<LeasedDescriptor>,
    /// With `--write`: the buffer the consumer writes into.
    writable: Option<Writable>,
}

/// The read-write buffer of `--write` and what the consumer is to write.
struct Writable {
    region: RegionGuard,
    /// Index in the offer of its first range.
    first: usize,
    /// Bytes per range.
    size: usize,
    /// The checksum of each range's pattern.
    checksums: Vec<u32>,
}

/// How long a range's lease lasts: well past any demo's transfer, so a
/// lease ends by expiry only when its reader is gone.
const LEASE_TTL: Duration = Duration::from_secs(60);

/// Serve one consumer on `listen`.
pub async fn run(args: &DemoArgs, listen: SocketAddr) -> anyhow::Result<()> {
    let bounds = Bounds::new(&args.limits);
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let local = listener.local_addr()?;
    let net_devices = args
        .net_devices
        .clone()
        .or_else(|| node::is_loopback(&local.to_string()).then(|| "lo".to_owned()));
    let ranges = if args.write { 2 } else { 1 } * u64::from(args.count);
    let total = args.size.saturating_mul(ranges);
    let node = Node::start(
        args.transport,
        net_devices.as_deref(),
        node::registry_config_for(total),
        bounds,
    )?;
    let holdings = register(&node, args).await?;
    println!("{LISTENING_PREFIX}{local}");
    let writable = holdings.writable.as_ref().map_or(String::new(), |w| {
        format!(", {} writable", w.checksums.len())
    });
    println!(
        "registered {} ranges of {} B ({} in one external region, {} pool buffers{writable})",
        holdings.offered.len(),
        args.size,
        args.count.div_ceil(2),
        holdings.buffers.len()
    );

    let Holdings {
        region,
        memory,
        buffers,
        offered,
        leases,
        writable,
    } = holdings;
    let external_ranges = args.count.div_ceil(2) as usize;
    let written_check = writable.as_ref().map(|writable| WrittenCheck {
        watch: writable.region.watch(),
        first: writable.first,
        size: writable.size,
        checksums: writable.checksums.clone(),
    });
    let (stop_releasing, releasing) =
        release_on_notices(&node, buffers, external_ranges, written_check);
    let served = serve(&node, &listener, &offered, args.accept_timeout).await;
    let _ = stop_releasing.send(());
    let releases = releasing
        .await
        .context("the task releasing ranges on notices")?;
    println!(
        "{} of {} pool buffers freed as their reader's notice arrived; {} of {} ranges of the external region reported read",
        releases.pooled_freed,
        releases.buffers.len(),
        releases.external_read.len(),
        external_ranges
    );
    if let Some(writable) = &writable {
        println!(
            "{} of {} written ranges checked by the owner in its own memory, {} differing",
            releases.written_ok + releases.written_differing,
            writable.checksums.len(),
            releases.written_differing
        );
    }
    if let Some(writable) = writable {
        if let Err(e) = writable.region.unregister_owned(bounds.teardown).await {
            eprintln!("rdmareg: unregistering the writable buffer failed ({e})");
        }
    }
    if !leases.is_empty() {
        let ended = leases_ended(&leases, bounds.teardown).await;
        println!(
            "{} of {} leased ranges of the external region released by their reader, {} by expiry{}",
            ended.released,
            leases.len(),
            ended.expired,
            if ended.unfinished > 0 {
                format!(", {} still leased at shutdown", ended.unfinished)
            } else {
                String::new()
            }
        );
    }
    let buffers = releases.buffers;
    let watch = region.watch();
    // `Some(true)`: released; `Some(false)`: unknown, leak it; `None`: the
    // unmap waits for a UCX reply, decided by the engine's teardown below.
    let mut region_released = match region.unregister(bounds.teardown).await {
        Ok(UnregisterOutcome::UnmapPending {
            readers, transfers, ..
        }) => {
            tracing::info!(
                readers,
                ?transfers,
                "the region's unmap waits for replies still being sent; the engine's teardown ends them"
            );
            None
        }
        Ok(_) => {
            watch.deregistered().await;
            Some(true)
        }
        Err(e) => {
            eprintln!("rdmareg: unregistering the external region failed ({e}); leaking it");
            Some(false)
        }
    };
    drop(buffers);
    let outcome = node.shutdown().await;
    if region_released.is_none() {
        // The teardown unmapped what the worker held: this resolves soon.
        let confirmed = tokio::time::timeout(bounds.teardown, watch.deregistered()).await;
        region_released = Some(confirmed.is_ok());
    }
    let region_released = region_released == Some(true);
    // Freed only once the engine is gone too: a lost consumer may have left
    // emulated-GET replies queued in UCX, which reads the raw address.
    if region_released {
        memory.free_after_deregistration();
    } else {
        // Unknown, not unmapped: the memory must outlive the process.
        memory.leak();
    }
    println!(
        "owner shut down: backend holds {} registrations",
        outcome.live_registrations
    );
    let served = match served {
        Ok(Served {
            control,
            outcome: verified,
        }) => {
            let report = Message::OwnerShutDown {
                live_registrations: Some(outcome.live_registrations as u64),
            };
            if verified.is_ok() {
                // Best effort: the consumer bounds its own wait for it.
                let _ = control.send(report).await;
            }
            control.close(control::SLACK).await;
            verified
        }
        Err(not_served) => Err(not_served),
    };
    if !outcome.clean {
        bail!(
            "owner shutdown was not clean: the backend holds {} registrations",
            outcome.live_registrations
        );
    }
    match served {
        Ok(true) => Ok(()),
        Ok(false) => bail!("the consumer reported a verification failure"),
        Err(e) => Err(e),
    }
}

/// The consumer's session: the control channel, and how it ended —
/// `Ok(verified)` when the consumer said it was done, an error naming what
/// was lost otherwise.
struct Served {
    control: Control,
    outcome: anyhow::Result<bool>,
}

/// Accept one consumer, offer the holdings, and wait until it is done or
/// lost. An error means no consumer was served at all.
async fn serve(
    node: &Node,
    listener: &TcpListener,
    offered: &[OfferedRange],
    accept_timeout: Option<Duration>,
) -> anyhow::Result<Served> {
    let bounds = node.bounds;
    let accepted = match accept_timeout {
        Some(bound) => tokio::time::timeout(bound, listener.accept())
            .await
            .map_err(|_| {
                anyhow::anyhow!("no consumer connected within {:.1} s", bound.as_secs_f64())
            })?,
        None => listener.accept().await,
    };
    let (mut stream, peer) = accepted.context("accepting the consumer")?;
    stream.set_nodelay(true)?;
    let count = offered.len();
    control::send_within(
        &mut stream,
        &Message::Offer {
            worker_address: node.engine.worker_address(),
            ranges: offered.to_vec(),
        },
        bounds.silence(),
    )
    .await
    .map_err(|e| anyhow::anyhow!("lost the consumer {peer} before it took the offer: {e}"))?;
    println!("offered worker address and descriptors to {peer}");
    let mut control = Control::start(stream, bounds);
    // The consumer reports every half second, so silence past the bound
    // means it is gone, and with it the endpoint its GETs used.
    let outcome = match control.receive("done message", None).await {
        Ok(Message::Done { verified, .. }) => Ok(verified),
        Ok(other) => Err(anyhow::anyhow!(
            "unexpected message from the consumer {peer}: {other:?}"
        )),
        Err(lost) => {
            let tally = control.peer_tally();
            Err(anyhow::anyhow!(
                "lost the consumer {peer}: {lost}; it had reported {} of {count} ranges verified",
                tally.verified
            ))
        }
    };
    Ok(Served { control, outcome })
}

/// How the external region's leases ended.
#[derive(Default)]
struct LeasesEnded {
    released: usize,
    expired: usize,
    /// Not ended within the wait (their reader neither released them nor
    /// did they expire yet), or withdrawn by the engine.
    unfinished: usize,
}

/// Waits at most `patience` for every lease to end (releases still on
/// their way after the consumer's "done" arrive meanwhile), and counts how
/// each ended. The region is unregistered right after, whatever is left:
/// its unmap waits for any read still being served.
async fn leases_ended(leases: &[LeasedDescriptor], patience: Duration) -> LeasesEnded {
    let ends = futures::future::join_all(leases.iter().map(|lease| {
        let ended = lease.ended();
        async move { tokio::time::timeout(patience, ended).await.ok() }
    }))
    .await;
    let mut counts = LeasesEnded::default();
    for end in ends {
        match end {
            Some(LeaseOutcome::Released) => counts.released += 1,
            Some(LeaseOutcome::Expired) => counts.expired += 1,
            _ => counts.unfinished += 1,
        }
    }
    counts
}

/// How long notices still on their way after the consumer's "done" may
/// take to arrive.
const NOTICES_IN_FLIGHT: Duration = Duration::from_millis(200);

/// How the owner checks a range the consumer wrote, when its notice
/// arrives.
struct WrittenCheck {
    watch: RegionWatch,
    first: usize,
    size: usize,
    checksums: Vec<u32>,
}

impl WrittenCheck {
    /// `Some(matches)` for a notice naming written range `index` of the
    /// offer; `None` for any other index.
    fn check(&self, index: usize) -> Option<bool> {
        let range = index.checked_sub(self.first)?;
        let want = *self.checksums.get(range)?;
        let mut bytes = vec![0u8; self.size];
        let copied = self
            .watch
            .read(|view| view.copy_to_slice(range * self.size, &mut bytes))?;
        Some(copied.is_ok() && pattern::checksum(&bytes) == want)
    }
}

/// What the consumer's notices released.
struct Releases {
    /// The pool buffers, each `None` once freed.
    buffers: Vec<Option<DescribedBuf>>,
    pooled_freed: usize,
    /// The external region's ranges the consumer reported read (the
    /// region is one registration, released at shutdown).
    external_read: HashSet<usize>,
    /// With `--write`: written ranges whose bytes the owner found as
    /// expected, and those it found otherwise.
    written_ok: usize,
    written_differing: usize,
}

/// Frees each pool buffer as soon as a notice names it (the consumer sends
/// the range's index once its read completed), until `stop` fires or the
/// engine's notices end; hands back what is left.
fn release_on_notices(
    node: &Node,
    buffers: Vec<DescribedBuf>,
    external_ranges: usize,
    written: Option<WrittenCheck>,
) -> (oneshot::Sender<()>, JoinHandle<Releases>) {
    let (stop, mut stopped) = oneshot::channel();
    let notices = node.registry.notices();
    let task = tokio::spawn(async move {
        let mut releases = Releases {
            buffers: buffers.into_iter().map(Some).collect(),
            pooled_freed: 0,
            external_read: HashSet::new(),
            written_ok: 0,
            written_differing: 0,
        };
        let mut written_seen = HashSet::new();
        let Ok(mut notices) = notices else {
            return releases;
        };
        // Once stopped, notices still on their way (they travel apart from
        // the consumer's "done") get a short while to arrive.
        let mut stopping = false;
        loop {
            let notice = if stopping {
                match tokio::time::timeout(NOTICES_IN_FLIGHT, notices.next()).await {
                    Ok(notice) => notice,
                    Err(_) => break,
                }
            } else {
                tokio::select! {
                    _ = &mut stopped => {
                        stopping = true;
                        continue;
                    }
                    notice = notices.next() => notice,
                }
            };
            let Some(notice) = notice else { break };
            let Ok(index) = <[u8; 4]>::try_from(&notice.bytes[..]).map(u32::from_le_bytes) else {
                tracing::warn!(len = notice.bytes.len(), "a notice that names no range");
                continue;
            };
            let index = index as usize;
            // A written range is checked at its first notice (the write's);
            // the later one of its read-back changes nothing.
            if let Some(matches) = written.as_ref().and_then(|w| w.check(index)) {
                if written_seen.insert(index) {
                    if matches {
                        releases.written_ok += 1;
                    } else {
                        releases.written_differing += 1;
                    }
                }
                continue;
            }
            if index < external_ranges {
                releases.external_read.insert(index);
            } else if let Some(slot) = releases.buffers.get_mut(index - external_ranges) {
                if slot.take().is_some() {
                    releases.pooled_freed += 1;
                }
            }
        }
        releases
    });
    (stop, task)
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
    let mut leases = Vec::with_capacity(external_ranges);
    for (index, crc32) in checksums.into_iter().enumerate() {
        let (offset, len) = ((index * size) as u64, size as u64);
        let descriptor = match region.lease(1, LEASE_TTL).await {
            Ok(lease) => {
                let descriptor = lease.descriptor().slice(offset, len)?;
                leases.push(lease);
                descriptor
            }
            Err(RdmaError::Unsupported { .. }) => region.descriptor_range(offset, len)?,
            Err(e) => return Err(e).context("leasing a range of the external region"),
        };
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
        let buffer = buffer.describe().await?;
        offered.push(OfferedRange {
            descriptor: buffer.descriptor(),
            crc32: pattern::checksum(&buffer),
        });
        buffers.push(buffer);
    }
    let writable = if args.write {
        Some(register_writable(node, args, size, &mut offered).await?)
    } else {
        None
    };
    Ok(Holdings {
        region,
        memory,
        buffers,
        offered,
        leases,
        writable,
    })
}

/// `--write`: a zeroed read-write buffer of `count` ranges, offered after
/// the readable ones; range `i` of the offer is to receive the pattern of
/// seed `i`.
async fn register_writable(
    node: &Node,
    args: &DemoArgs,
    size: usize,
    offered: &mut Vec<OfferedRange>,
) -> anyhow::Result<Writable> {
    let count = args.count as usize;
    let len = size.checked_mul(count).context("size × count overflows")?;
    let region = match node
        .registry
        .register_owned_with(vec![0u8; len].into_boxed_slice(), Access::ReadWrite)
        .await
    {
        Ok(region) => region,
        Err(refused) if matches!(refused.error, RdmaError::Unsupported { .. }) => {
            bail!("--write needs a backend that serves remote writes (UCX); this one does not")
        }
        Err(refused) => return Err(refused.error).context("registering the writable buffer"),
    };
    let first = offered.len();
    let mut checksums = Vec::with_capacity(count);
    let mut expected = vec![0u8; size];
    for range in 0..count {
        pattern::fill(&mut expected, (first + range) as u64);
        let crc32 = pattern::checksum(&expected);
        checksums.push(crc32);
        let descriptor = region.descriptor_range((range * size) as u64, size as u64)?;
        offered.push(OfferedRange { descriptor, crc32 });
    }
    Ok(Writable {
        region,
        first,
        size,
        checksums,
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
