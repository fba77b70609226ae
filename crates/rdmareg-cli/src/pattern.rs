//! The known byte pattern the demo and bench fill memory with, so the
//! consumer can tell that what it read is what the owner wrote (and not,
//! say, zeroes from an untouched buffer or a neighbouring range).

/// Fill `buffer` with a pattern that depends on `seed` and on each byte's
/// position, so two ranges with different seeds never match and a shifted
/// read does not either.
pub fn fill(buffer: &mut [u8], seed: u64) {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in buffer.chunks_mut(8) {
        // xorshift64: cheap, full-period, and position-dependent.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let bytes = state.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

/// CRC32 of `bytes`.
pub fn checksum(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn different_seeds_give_different_bytes() {
        let mut a = vec![0u8; 4096];
        let mut b = vec![0u8; 4096];
        fill(&mut a, 1);
        fill(&mut b, 2);
        assert_ne!(checksum(&a), checksum(&b));
    }

    #[test]
    fn the_pattern_is_reproducible_and_not_all_zero() {
        let mut a = vec![0u8; 1001];
        let mut b = vec![0u8; 1001];
        fill(&mut a, 7);
        fill(&mut b, 7);
        assert_eq!(a, b);
        assert!(a.iter().any(|&x| x != 0));
    }
}
