//! Number formats shared by host and device.

/// bf16 bits → f32 (exact: bf16 is the top half of an f32).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Low bf16 of a packed pair → f32.
#[inline(always)]
pub fn bf16x2_lo(pair: u32) -> f32 {
    f32::from_bits(pair << 16)
}

/// High bf16 of a packed pair → f32.
#[inline(always)]
pub fn bf16x2_hi(pair: u32) -> f32 {
    f32::from_bits(pair & 0xffff_0000)
}

/// f32 → bf16 bits, round to nearest even; NaN stays a (quiet) NaN. The device uses the
/// `cvt.rn.bf16.f32` instruction instead; this is the same function for host code and tests.
#[inline]
pub fn f32_to_bf16_rne(value: f32) -> u16 {
    let bits = value.to_bits();
    if value.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let rounding_bias = 0x7fff + ((bits >> 16) & 1);
    ((bits + rounding_bias) >> 16) as u16
}

/// A counter-based random number in [-1, 1): splitmix64 of `seed` and `index`, top 24 bits.
/// Host and device compute identical values, so tests can generate data on either side.
#[inline(always)]
pub fn random_uniform(seed: u64, index: u64) -> f32 {
    let mut z = seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(0x6a09_e667_f3bc_c909);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    ((z >> 40) as f32) * (2.0 / (1u64 << 24) as f32) - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_and_ties_to_even() {
        for bits in [0u16, 0x3f80, 0xbf80, 0x7f7f, 0x0001, 0x8000] {
            assert_eq!(f32_to_bf16_rne(bf16_to_f32(bits)), bits);
        }
        // 1 + 2^-8 is exactly half-way between 1 and 1 + 2^-7: ties go to the even mantissa (1).
        assert_eq!(f32_to_bf16_rne(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3·2^-8 is half-way between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
        assert_eq!(f32_to_bf16_rne(1.0 + 3.0 / 256.0), 0x3f82);
        assert!(bf16_to_f32(f32_to_bf16_rne(f32::NAN)).is_nan());
        assert_eq!(f32_to_bf16_rne(f32::INFINITY), 0x7f80);
    }

    #[test]
    fn random_uniform_is_in_range_and_spread() {
        let values: Vec<f32> = (0..10_000).map(|i| random_uniform(7, i)).collect();
        assert!(values.iter().all(|v| (-1.0..1.0).contains(v)));
        let mean = values.iter().sum::<f32>() / values.len() as f32;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert_ne!(random_uniform(7, 0), random_uniform(8, 0));
    }

    #[test]
    fn packed_halves() {
        let pair = (0x4000u32 << 16) | 0x3f80;
        assert_eq!(bf16x2_lo(pair), 1.0);
        assert_eq!(bf16x2_hi(pair), 2.0);
    }
}
