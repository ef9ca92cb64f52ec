//! The reference decoders: one plain function per block type, written straight from the
//! block layouts, turning one block into its values.
//!
//! These are the definition of correct. The AVX2 kernels and the parallel driver are
//! tested bit-for-bit against them, and they are tested against the values that gguf-py
//! (the reference implementation that ships with llama.cpp) decodes
//! (`tests/vectors.rs`).

mod iquants;
mod kquants;
mod legacy;

pub(crate) use iquants::*;
pub(crate) use kquants::*;
pub(crate) use legacy::*;

/// Lifts a one-block decoder to a kernel over matching slices of blocks and outputs.
pub(crate) fn each<B, const N: usize>(
    decode_one: impl Fn(&B, &mut [f32; N]) + Sync,
) -> impl Fn(&[B], &mut [[f32; N]]) + Sync {
    move |blocks, out| {
        for (block, y) in blocks.iter().zip(out) {
            decode_one(block, y);
        }
    }
}
