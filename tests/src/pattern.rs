//! Byte patterns whose every position is distinguishable, so a GET that
//! lands a byte early, late, or from the wrong region is caught.
//!
//! Each 8-byte word of the pattern with seed `s` is a hash of `(s, word
//! index)`: unlike a short repeating ramp, a shift by any distance changes
//! the bytes, and two seeds give unrelated contents. Hashing per word rather
//! than per byte keeps multi-megabyte fills cheap in unoptimised test builds.

/// The 8 pattern bytes of word `word` (positions `8 * word ..`).
fn word(seed: u8, word: usize) -> [u8; 8] {
    let mut x = (word as u64) ^ (u64::from(seed) << 56) ^ 0x5851_F42D_4C95_7F2D;
    x = (x ^ (x >> 33)).wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x = (x ^ (x >> 33)).wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    (x ^ (x >> 33)).to_le_bytes()
}

/// Byte `index` of the pattern with `seed`.
pub fn byte(seed: u8, index: usize) -> u8 {
    word(seed, index / 8)[index % 8]
}

/// Write positions `start..start + buf.len()` of the pattern with `seed`
/// over `buf`.
pub fn fill_from(buf: &mut [u8], seed: u8, start: usize) {
    let mut position = start;
    let mut rest = buf;
    // Leading bytes up to a word boundary, then whole words, then the tail.
    while !rest.is_empty() {
        let offset = position % 8;
        let take = (8 - offset).min(rest.len());
        let bytes = word(seed, position / 8);
        let (head, tail) = rest.split_at_mut(take);
        head.copy_from_slice(&bytes[offset..offset + take]);
        rest = tail;
        position += take;
    }
}

/// Write the pattern with `seed`, from position 0, over `buf`.
pub fn fill(buf: &mut [u8], seed: u8) {
    fill_from(buf, seed, 0);
}

/// A boxed buffer of `len` bytes holding the pattern with `seed`.
pub fn patterned(len: usize, seed: u8) -> Box<[u8]> {
    let mut buf = vec![0u8; len].into_boxed_slice();
    fill(&mut buf, seed);
    buf
}

/// Positions `start..start + len` of the pattern with `seed`.
pub fn expected(seed: u8, start: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    fill_from(&mut out, seed, start);
    out
}

/// Assert `actual == expected`, reporting the first differing position
/// instead of printing megabytes.
#[track_caller]
pub fn assert_same_bytes(what: &str, actual: &[u8], expected: &[u8]) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths differ");
    // Slice equality is a memcmp even in unoptimised builds; the byte walk
    // only runs to report a difference.
    if actual == expected {
        return;
    }
    if let Some(at) = actual.iter().zip(expected).position(|(a, e)| a != e) {
        panic!(
            "{what}: first difference at byte {at} of {}: got {:#04x}, expected {:#04x}",
            actual.len(),
            actual[at],
            expected[at]
        );
    }
}

/// Assert every byte of `actual` is `value`.
#[track_caller]
pub fn assert_all(what: &str, actual: &[u8], value: u8) {
    let block = [value; 4096];
    if actual
        .chunks(block.len())
        .all(|chunk| chunk == &block[..chunk.len()])
    {
        return;
    }
    if let Some(at) = actual.iter().position(|&b| b != value) {
        panic!(
            "{what}: byte {at} of {} is {:#04x}, expected {value:#04x}",
            actual.len(),
            actual[at]
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shifted_patterns_differ_from_the_original() {
        let base = expected(3, 0, 4096);
        for shift in [1, 2, 8, 251, 256, 4095] {
            assert_ne!(expected(3, shift, 4096), base, "shift {shift}");
        }
    }

    #[test]
    fn different_seeds_give_different_contents() {
        assert_ne!(expected(1, 0, 64), expected(2, 0, 64));
    }

    #[test]
    fn filling_from_an_offset_agrees_with_byte_by_byte() {
        for start in [0, 1, 7, 8, 9, 4093] {
            let bytes: Vec<u8> = (start..start + 37).map(|i| byte(5, i)).collect();
            assert_eq!(expected(5, start, 37), bytes, "start {start}");
        }
    }
}
