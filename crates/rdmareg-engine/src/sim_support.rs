//! What the seeded simulators share: their random numbers and the seeds
//! a run covers.

/// splitmix64: small, fast, and the same sequence on every platform, so a
/// seed replays exactly anywhere.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in `0..n` (`0` when `n` is 0); the bias of a modulo is
    /// irrelevant here.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// An index into a collection of `len` items.
    pub(crate) fn index(&mut self, len: usize) -> usize {
        self.below(len as u64) as usize
    }

    /// True `percent` times in a hundred.
    pub(crate) fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// splitmix64's finaliser: a well-spread 64-bit function of `z` (the
/// simulators also use it for memory contents).
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The seeds to run: `RDMAREG_SIM_SEEDS` of them from
/// `RDMAREG_SIM_FIRST_SEED` (what `cargo xtask sim` sets); by default the
/// first 10,000 in an optimised build and the first 1,000 in a debug one.
pub(crate) fn seeds() -> std::ops::Range<u64> {
    let var = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let first = var("RDMAREG_SIM_FIRST_SEED").unwrap_or(0);
    let default = if cfg!(debug_assertions) {
        1_000
    } else {
        10_000
    };
    let count = var("RDMAREG_SIM_SEEDS").unwrap_or(default);
    first..first.saturating_add(count)
}
