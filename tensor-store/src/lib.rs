//! tensor-store (work in progress).
