//! Drawing exponential countdowns without floating point.
//!
//! A 32-bit random number `r` stands for `u = r / 2^32`. Writing
//! `r = 2^(31 - z) * m` with `m` in `[1, 2)` gives
//! `-ln(u) = (z + 1) ln 2 - ln(m)`, i.e. `z * ln 2 + (-ln(m / 2))`: a
//! multiple of `ln 2` plus `-ln` of a number in `[0.5, 1)`. The second part
//! comes from a table of [`QUANTILE_COUNT`] values indexed by the bits after
//! the leading one; entry [`LN2_INDEX`] holds `ln 2`. All entries are scaled
//! by the mean sampling interval, so the sum is the next countdown in bytes.

/// Bits of the mantissa used to index the table.
pub const QUANTILE_BITS: u32 = 10;
pub const QUANTILE_COUNT: u32 = 1 << QUANTILE_BITS;
/// Index of the `ln 2 * interval` entry.
pub const LN2_INDEX: u32 = QUANTILE_COUNT;
/// Length of the table map.
pub const TABLE_LEN: u32 = QUANTILE_COUNT + 1;

/// Splits a random number into (leading zeros, table index).
#[inline(always)]
pub fn split_random(random: u32) -> (u32, u32) {
    // r = 0 would have 32 leading zeros and no mantissa; 1 is as rare.
    let mut x = random | 1;
    let mut zeros = 0;
    if x & 0xffff_0000 == 0 {
        zeros += 16;
        x <<= 16;
    }
    if x & 0xff00_0000 == 0 {
        zeros += 8;
        x <<= 8;
    }
    if x & 0xf000_0000 == 0 {
        zeros += 4;
        x <<= 4;
    }
    if x & 0xc000_0000 == 0 {
        zeros += 2;
        x <<= 2;
    }
    if x & 0x8000_0000 == 0 {
        zeros += 1;
        x <<= 1;
    }
    let index = (x >> (31 - QUANTILE_BITS)) & (QUANTILE_COUNT - 1);
    (zeros, index)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_random_finds_leading_zeros_and_mantissa() {
        assert_eq!(split_random(0x8000_0000), (0, 0));
        assert_eq!(split_random(0xffff_ffff), (0, QUANTILE_COUNT - 1));
        assert_eq!(split_random(0x4000_0000), (1, 0));
        assert_eq!(split_random(0x0000_0001), (31, 0));
        assert_eq!(split_random(0), (31, 0));
        // 0b0110_0000... : one leading zero, mantissa 1.1 -> index half way.
        assert_eq!(split_random(0x6000_0000), (1, QUANTILE_COUNT / 2));
    }
}
