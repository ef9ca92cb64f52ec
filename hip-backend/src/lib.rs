//! hip-backend (work in progress).
