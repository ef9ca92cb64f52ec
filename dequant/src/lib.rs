//! dequant (work in progress).
