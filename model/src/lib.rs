//! model (work in progress).
