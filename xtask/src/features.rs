//! Which Cargo features `cargo xtask ci` builds: all of them where the machine has what they need
//! at build time, else all but those, named loudly. Two features have such a need: tier-p2p's
//! `nixl`, whose nixl-sys build script runs bindgen, which loads libclang, and tier-p2p's `etcd`,
//! whose etcd-client build script compiles etcd's .proto files with `protoc` (`bash .ci/run`
//! installs both, so CI always builds every feature; a fresh machine without them still runs
//! the rest).

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::Error;

/// `(package, feature)` pairs that need libclang at build time.
pub const NEEDS_LIBCLANG: &[(&str, &str)] = &[("tier-p2p", "nixl")];
/// `(package, feature)` pairs that need `protoc` at build time.
pub const NEEDS_PROTOC: &[(&str, &str)] = &[("tier-p2p", "etcd")];

/// Whether `protoc` runs (`$PROTOC`, as prost-build reads it, else `protoc` on the PATH).
pub fn protoc_found() -> bool {
    let protoc = std::env::var_os("PROTOC").unwrap_or_else(|| "protoc".into());
    std::process::Command::new(protoc)
        .arg("--version")
        .output()
        .is_ok_and(|out| out.status.success())
}

/// What `cargo` should be given to select features.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// The arguments: `--all-features`, or `--features` with a list.
    pub args: Vec<String>,
    /// `package/feature` names left out, with the reason (empty when all are built).
    pub left_out: Vec<String>,
    /// Why they were left out.
    pub reason: String,
}

/// Where clang-sys would find libclang: `$LIBCLANG_PATH`, then the usual Debian/LLVM folders.
pub fn find_libclang() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("LIBCLANG_PATH")
        .map(|path| std::env::split_paths(&path).collect())
        .unwrap_or_default();
    for base in ["/usr/lib", "/usr/local/lib", "/usr/lib64"] {
        dirs.push(PathBuf::from(base));
        if let Ok(entries) = std::fs::read_dir(base) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with("llvm-") || name.ends_with("-linux-gnu") {
                    dirs.push(entry.path().join("lib"));
                    dirs.push(entry.path());
                }
            }
        }
    }
    dirs.into_iter().find_map(|dir| libclang_in(&dir))
}

fn libclang_in(dir: &Path) -> Option<PathBuf> {
    let entries = std::fs::read_dir(dir).ok()?;
    entries.flatten().map(|entry| entry.path()).find(|path| {
        path.file_name()
            .and_then(|name| name.to_str())
            .is_some_and(|name| name.starts_with("libclang") && name.contains(".so"))
            && !path
                .file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with("libclang-cpp"))
    })
}

/// Every `package/feature` of the workspace members in `metadata` (`cargo metadata
/// --format-version 1 --no-deps`), except `default`, the `excluded` ones and any feature that
/// enables an excluded one directly (`tier-p2p/nixl` in another package, `nixl` in its own).
pub fn features_except(metadata: &Value, excluded: &[(&str, &str)]) -> Result<Vec<String>, Error> {
    let packages = metadata
        .get("packages")
        .and_then(Value::as_array)
        .ok_or_else(|| Error::new("cargo metadata has no `packages` list"))?;
    let mut selected = Vec::new();
    for package in packages {
        let name = package
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::new("a package in cargo metadata has no `name`"))?;
        let Some(features) = package.get("features").and_then(Value::as_object) else {
            continue;
        };
        for (feature, enables) in features {
            if feature == "default" || excluded.contains(&(name, feature.as_str())) {
                continue;
            }
            let enables_excluded = enables.as_array().into_iter().flatten().any(|item| {
                let item = item.as_str().unwrap_or_default();
                excluded.iter().any(|(pkg, feat)| {
                    item == format!("{pkg}/{feat}")
                        || item == format!("{pkg}?/{feat}")
                        || (name == *pkg && item == *feat)
                })
            });
            if !enables_excluded {
                selected.push(format!("{name}/{feature}"));
            }
        }
    }
    selected.sort();
    Ok(selected)
}

/// The feature selection for this machine: `--all-features` when libclang and `protoc` are
/// found, else every feature but [`NEEDS_LIBCLANG`] and/or [`NEEDS_PROTOC`] (and what enables
/// them).
pub fn select(root: &Path) -> Result<Selection, Error> {
    let mut excluded: Vec<(&str, &str)> = Vec::new();
    let mut reasons = Vec::new();
    if find_libclang().is_none() {
        excluded.extend_from_slice(NEEDS_LIBCLANG);
        reasons.push("libclang not found (bindgen needs it; `bash .ci/run` installs libclang-dev)");
    }
    if !protoc_found() {
        excluded.extend_from_slice(NEEDS_PROTOC);
        reasons.push(
            "protoc not found (etcd-client's build needs it; `bash .ci/run` installs \
             protobuf-compiler)",
        );
    }
    if excluded.is_empty() {
        return Ok(Selection {
            args: vec!["--all-features".to_string()],
            left_out: Vec::new(),
            reason: String::new(),
        });
    }
    let metadata = crate::layering::Workspace::metadata_json(root)?;
    let features = features_except(&metadata, &excluded)?;
    Ok(Selection {
        args: vec!["--features".to_string(), features.join(",")],
        left_out: excluded
            .iter()
            .map(|(pkg, feat)| format!("{pkg}/{feat}"))
            .collect(),
        reason: reasons.join("; "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excluded_features_and_their_enablers_are_left_out() {
        let metadata = serde_json::json!({
            "packages": [
                { "name": "tier-p2p", "features": {
                    "default": [], "nixl": ["dep:nixl-sys"], "fast": [], "all": ["nixl"] } },
                { "name": "connector", "features": {
                    "p2p": ["dep:tier-p2p"], "rdma": ["tier-p2p/nixl"], "rdma2": ["tier-p2p?/nixl"] } },
                { "name": "offload-core" }
            ]
        });
        let features = features_except(&metadata, NEEDS_LIBCLANG).unwrap();
        assert_eq!(features, ["connector/p2p", "tier-p2p/fast"]);
    }

    #[test]
    fn features_needing_protoc_are_left_out_too() {
        let metadata = serde_json::json!({
            "packages": [
                { "name": "tier-p2p", "features": {
                    "nixl": ["dep:nixl-sys"], "etcd": ["dep:etcd-client"], "fast": [] } }
            ]
        });
        let both = [NEEDS_LIBCLANG, NEEDS_PROTOC].concat();
        assert_eq!(
            features_except(&metadata, &both).unwrap(),
            ["tier-p2p/fast"]
        );
        assert_eq!(
            features_except(&metadata, NEEDS_PROTOC).unwrap(),
            ["tier-p2p/fast", "tier-p2p/nixl"]
        );
    }

    #[test]
    fn metadata_without_packages_is_an_error() {
        let err = features_except(&serde_json::json!({}), NEEDS_LIBCLANG).unwrap_err();
        assert!(err.to_string().contains("packages"), "{err}");
    }

    #[test]
    fn the_workspace_selection_names_what_it_leaves_out() {
        let selection = select(&crate::workspace_root()).unwrap();
        if selection.args == ["--all-features"] {
            assert!(selection.left_out.is_empty());
        } else {
            assert_eq!(selection.args[0], "--features");
            for left_out in &selection.left_out {
                assert!(
                    !selection.args[1].contains(left_out.as_str()),
                    "{selection:?}"
                );
            }
            assert!(selection.args[1].contains("connector/"), "{selection:?}");
            let mut expected = Vec::new();
            if find_libclang().is_none() {
                expected.push("tier-p2p/nixl");
            }
            if !protoc_found() {
                expected.push("tier-p2p/etcd");
            }
            assert_eq!(selection.left_out, expected);
        }
    }

    #[test]
    fn ci_builds_every_benchmark_harness() {
        // The `bench` features are off by default; CI's clippy and test steps still build and
        // test the harnesses, with every feature or with every feature a machine can build.
        let metadata = crate::layering::Workspace::metadata_json(&crate::workspace_root()).unwrap();
        let both = [NEEDS_LIBCLANG, NEEDS_PROTOC].concat();
        let selected = features_except(&metadata, &both).unwrap();
        for harness in [
            "offload-core/bench",
            "tier-fs/bench",
            "tier-gpu/bench",
            "tier-p2p/bench",
        ] {
            assert!(
                selected.iter().any(|feature| feature == harness),
                "{harness} is not built by `cargo xtask ci`: {selected:?}"
            );
        }
    }
}
