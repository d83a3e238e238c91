//! xtask: placeholder.
fn main() {}
