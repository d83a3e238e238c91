//! Engine simulator: placeholder.
