//! The scatter run: a transfer list of [`SCATTER_ENTRIES`] reads of
//! [`SCATTER_ENTRY_BYTES`] against one GET of the same bytes, into the same
//! destination.
//!
//! Destination block `i` comes from source block `i × 7919 mod 1000` (7919
//! is prime), so neighbouring entries are never neighbours at the source.
//! The **gapped** layout reads every other block, so nothing can merge; the
//! **contiguous** one tiles one range, which a lane sorting by source
//! address may merge (`docs/benchmarks.md`).

use std::time::Instant;

use anyhow::Context as _;
use rdmareg_core::Descriptor;
use serde::Serialize;

use super::{OWNER, scaled};
use crate::node::Node;
use crate::stats::Samples;

/// Reads in one scatter list.
pub const SCATTER_ENTRIES: u64 = 1000;
/// Bytes per read of the scatter list.
pub const SCATTER_ENTRY_BYTES: u64 = 4096;
/// Bytes one scatter post (and the single GET it is compared with) moves.
pub const SCATTER_BYTES: u64 = SCATTER_ENTRIES * SCATTER_ENTRY_BYTES;
/// Source bytes the scatter runs need (the gapped layout spans twice the
/// bytes it reads).
pub const SCATTER_SOURCE_BYTES: u64 = 2 * SCATTER_BYTES;

/// Where a scatter list's blocks sit in the owner's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// Every other block: no two blocks touch.
    Gapped,
    /// Blocks tile one range.
    Contiguous,
}

impl Layout {
    /// Its name in tables.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Gapped => "gapped",
            Layout::Contiguous => "contiguous",
        }
    }

    /// Source offset of block `block` (`0..SCATTER_ENTRIES`).
    fn offset(self, block: u64) -> u64 {
        match self {
            Layout::Gapped => 2 * block * SCATTER_ENTRY_BYTES,
            Layout::Contiguous => block * SCATTER_ENTRY_BYTES,
        }
    }
}
/// The stride of the source permutation (see the module docs).
const PERMUTATION_STRIDE: u64 = 7919;

/// The scatter list against one GET on one transport.
#[derive(Debug, Clone, Serialize)]
pub struct ScatterRow {
    /// `tcp`, `shm`, …
    pub transport: String,
    /// Where the blocks sit at the source.
    pub layout: Layout,
    /// Reads in the list.
    pub entries: u64,
    /// Bytes per read.
    pub entry_bytes: u64,
    /// Timed posts of each form.
    pub rounds: usize,
    /// Median time of one post of the whole list, µs.
    pub list_p50_us: f64,
    /// Median time of one GET of the same bytes, µs.
    pub single_p50_us: f64,
}

impl ScatterRow {
    /// The list's time over the single GET's (the target is below 1.2).
    pub fn ratio(&self) -> f64 {
        self.list_p50_us / self.single_p50_us.max(f64::MIN_POSITIVE)
    }
}

/// Source block of destination block `index` (a permutation of
/// `0..SCATTER_ENTRIES`).
fn source_block(index: u64) -> u64 {
    index * PERMUTATION_STRIDE % SCATTER_ENTRIES
}

/// Time the scatter list and the single GET, alternating so that both see
/// the same state of a shared machine. `source` must cover at least
/// [`SCATTER_SOURCE_BYTES`].
pub async fn measure(
    node: &Node,
    source: &Descriptor,
    layout: Layout,
    scale: f64,
    transport: &str,
) -> anyhow::Result<ScatterRow> {
    let whole = source
        .slice(0, SCATTER_BYTES)
        .context("the benchmark source is smaller than one scatter list")?;
    let mut list = node.registry.transfer_list(OWNER);
    for index in 0..SCATTER_ENTRIES {
        let block = source.slice(layout.offset(source_block(index)), SCATTER_ENTRY_BYTES)?;
        list.push(&block, 0, usize::try_from(index * SCATTER_ENTRY_BYTES)?)?;
    }
    let mut buffers = vec![
        node.registry
            .alloc_pinned(usize::try_from(SCATTER_BYTES)?)
            .await?,
    ];
    let rounds = scaled(60, 5, 60, scale);
    let mut list_samples = Samples::with_capacity(rounds);
    let mut single_samples = Samples::with_capacity(rounds);
    for round in 0..rounds + rounds.div_ceil(10) {
        let warm_up = round < rounds.div_ceil(10);
        let started = Instant::now();
        for outcome in node.registry.post(&list, &mut buffers).await? {
            outcome?;
        }
        if !warm_up {
            list_samples.push(started.elapsed());
        }
        let started = Instant::now();
        node.registry.get(OWNER, &whole, &mut buffers[0]).await?;
        if !warm_up {
            single_samples.push(started.elapsed());
        }
    }
    Ok(ScatterRow {
        transport: transport.to_owned(),
        layout,
        entries: SCATTER_ENTRIES,
        entry_bytes: SCATTER_ENTRY_BYTES,
        rounds,
        list_p50_us: list_samples.summary().context("no list samples")?.p50_us,
        single_p50_us: single_samples
            .summary()
            .context("no single-GET samples")?
            .p50_us,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_source_order_is_a_permutation_with_no_adjacent_neighbours() {
        let mut seen = vec![false; SCATTER_ENTRIES as usize];
        for index in 0..SCATTER_ENTRIES {
            let block = source_block(index);
            assert!(!seen[block as usize], "block {block} read twice");
            seen[block as usize] = true;
            if index > 0 {
                assert_ne!(source_block(index - 1) + 1, block, "entries {index} merge");
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn gapped_blocks_never_touch_and_both_layouts_fit_the_source() {
        for block in 0..SCATTER_ENTRIES - 1 {
            let end = Layout::Gapped.offset(block) + SCATTER_ENTRY_BYTES;
            assert!(end < Layout::Gapped.offset(block + 1));
            assert_eq!(
                Layout::Contiguous.offset(block) + SCATTER_ENTRY_BYTES,
                Layout::Contiguous.offset(block + 1)
            );
        }
        let last = SCATTER_ENTRIES - 1;
        assert!(Layout::Gapped.offset(last) + SCATTER_ENTRY_BYTES <= SCATTER_SOURCE_BYTES);
    }

    #[test]
    fn the_ratio_is_list_time_over_single_time() {
        let row = ScatterRow {
            transport: "tcp".to_owned(),
            layout: Layout::Gapped,
            entries: SCATTER_ENTRIES,
            entry_bytes: SCATTER_ENTRY_BYTES,
            rounds: 10,
            list_p50_us: 1500.0,
            single_p50_us: 1000.0,
        };
        assert!((row.ratio() - 1.5).abs() < 1e-9);
    }
}
