//! The exponential as ggml's vectorised CPU code computes it.
//!
//! llama.cpp evaluates `exp` in its softmax and SiLU with a polynomial over eight lanes
//! rather than the C library's `expf`; the two differ in the last bit now and then, which
//! is enough to move an activation across an 8-bit quantization boundary later on. This
//! is the same sequence of operations, one lane at a time, with fused multiply-adds where
//! ggml uses them, so it gives the same bits.

/// `e^x` by ggml's vectorised approximation (within about 1.5 ulp of the exact value),
/// lane for lane: `x = n·ln2 + b` with `n` an integer, `e^b` by a polynomial, and the
/// exponent built from `n` in the bits; arguments beyond ±126 · ln 2 are scaled in two
/// steps, and beyond ±192 · ln 2 they saturate to 0 or infinity.
#[inline(always)]
pub fn expf(x: f32) -> f32 {
    let c = |bits: u32| f32::from_bits(bits);
    let r = c(0x4b40_0000); // 1.5 · 2^23: adding it rounds to an integer
    let z = x.mul_add(c(0x3fb8_aa3b), r); // x / ln 2 + r
    let n = z - r;
    // b = x − n·ln 2, with ln 2 split in a high and a low part.
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    let e = z.to_bits() << 23;
    let k = f32::from_bits(e.wrapping_add(1.0f32.to_bits()));
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)))
        .mul_add(u, c(0x3f7f_fff6) * b);
    if n.abs() <= 126.0 {
        return j.mul_add(k, k);
    }
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
    let s2 = f32::from_bits(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expf_is_within_two_ulp_of_the_exact_value() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let exact = f64::from(x).exp();
            let got = f64::from(expf(x));
            let ulp = f64::from(f32::EPSILON) * exact;
            assert!(
                (got - exact).abs() <= 2.0 * ulp,
                "exp({x}) = {got}, exact {exact}"
            );
            x += 0.0137;
        }
        assert_eq!(expf(0.0), 1.0);
        assert_eq!(expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(expf(-200.0), 0.0);
        assert_eq!(expf(200.0), f32::INFINITY);
    }
}
