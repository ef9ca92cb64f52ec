//! dequant (work in progress).

pub mod blocks;
pub mod matmul;
