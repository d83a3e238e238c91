//! Sets `cfg(kvtier_vpclmul)` when the compiler is Rust 1.89 or newer, from which the AVX-512
//! and VPCLMULQDQ intrinsics are stable: `src/polyval.rs` then has a path that multiplies four
//! blocks per instruction. The workspace's rust-version is older, and there the path is left out.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(kvtier_vpclmul)");
    println!("cargo::rerun-if-changed=build.rs");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let Ok(output) = std::process::Command::new(rustc).arg("--version").output() else {
        return;
    };
    let version = String::from_utf8_lossy(&output.stdout);
    // "rustc 1.95.0 (...)"
    let minor = version
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.split('.').nth(1))
        .and_then(|m| m.parse::<u32>().ok());
    if minor.is_some_and(|m| m >= 89) {
        println!("cargo::rustc-cfg=kvtier_vpclmul");
    }
}
