//! Page arithmetic for registrations.
//!
//! Registration pins whole pages, so budgets are charged on the
//! page-enclosing range; every function returns `None` rather than wrap.

/// A page-aligned range `[start, start + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRange {
    /// First byte of the first page.
    pub start: u64,
    /// Length in bytes; a multiple of the page size.
    pub len: u64,
}

impl PageRange {
    /// One past the last byte; cannot overflow for a range built by
    /// [`page_enclosing_range`].
    pub fn end(&self) -> u64 {
        self.start + self.len
    }

    /// The smallest range covering this one and `[start, start + len)` (a
    /// backend's untrusted report of what it pinned), saturating at the top
    /// of the address space: the budget never counts less than the OS pins.
    pub fn cover(&self, start: u64, len: u64) -> PageRange {
        let first = self.start.min(start);
        let end = self.end().max(start.saturating_add(len));
        PageRange {
            start: first,
            len: end - first,
        }
    }
}

/// Round `value` up to a multiple of `align` (a power of two), or `None` on
/// overflow or a bad alignment.
pub fn round_up(value: u64, align: u64) -> Option<u64> {
    if !align.is_power_of_two() {
        return None;
    }
    let mask = align - 1;
    value.checked_add(mask).map(|v| v & !mask)
}

/// The smallest page-aligned range covering `[addr, addr + len)`; `None`
/// for a zero length, a page size not a power of two, or overflow.
pub fn page_enclosing_range(addr: u64, len: u64, page_size: u64) -> Option<PageRange> {
    if len == 0 || !page_size.is_power_of_two() {
        return None;
    }
    let end = addr.checked_add(len)?;
    let start = addr & !(page_size - 1);
    let end = round_up(end, page_size)?;
    Some(PageRange {
        start,
        len: end - start,
    })
}

/// Length of the page-enclosing range of `[addr, addr + len)`; see
/// [`page_enclosing_range`].
pub fn page_enclosing_len(addr: u64, len: u64, page_size: u64) -> Option<u64> {
    page_enclosing_range(addr, len, page_size).map(|r| r.len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn aligned_range_is_its_own_enclosure() {
        assert_eq!(
            page_enclosing_range(8192, 4096, 4096),
            Some(PageRange {
                start: 8192,
                len: 4096
            })
        );
    }

    #[test]
    fn one_byte_straddling_a_boundary_charges_two_pages() {
        assert_eq!(page_enclosing_len(4095, 2, 4096), Some(8192));
    }

    #[test]
    fn cover_of_an_unrounded_report_is_the_page_enclosing_range() {
        let enclosing = page_enclosing_range(4096 + 4095, 1, 4096).unwrap();
        assert_eq!(enclosing.cover(4096 + 4095, 1), enclosing);
        assert_eq!(
            enclosing.cover(0, 3 * 4096),
            PageRange {
                start: 0,
                len: 3 * 4096
            }
        );
    }

    #[test]
    fn zero_length_has_no_enclosure() {
        assert_eq!(page_enclosing_len(4096, 0, 4096), None);
    }

    #[test]
    fn overflow_returns_none_instead_of_wrapping() {
        assert_eq!(page_enclosing_len(u64::MAX - 10, 11, 4096), None);
        assert_eq!(page_enclosing_len(u64::MAX - 10, 5, 4096), None);
        assert_eq!(round_up(u64::MAX, 4096), None);
    }

    #[test]
    fn non_power_of_two_page_size_is_refused() {
        assert_eq!(page_enclosing_len(0, 10, 3000), None);
        assert_eq!(round_up(10, 0), None);
    }

    proptest! {
        #[test]
        fn enclosure_covers_the_range_and_is_page_aligned(
            addr in 0u64..(1 << 48), len in 1u64..(1 << 32), shift in 12u32..22
        ) {
            let page = 1u64 << shift;
            let r = page_enclosing_range(addr, len, page).unwrap();
            prop_assert_eq!(r.start % page, 0);
            prop_assert_eq!(r.len % page, 0);
            prop_assert!(r.start <= addr);
            prop_assert!(r.end() >= addr + len);
            prop_assert!(r.end() - (addr + len) < page);
            prop_assert!(addr - r.start < page);
        }
    }
}
