//! dequant (work in progress).

pub mod matmul;
