//! Which Cargo features `cargo xtask ci` builds: all of them where the machine has what they need
//! at build time, else all but those, named loudly. Today one feature has such a need: tier-p2p's
//! `nixl`, whose nixl-sys build script runs bindgen, which loads libclang (`bash .ci/run` installs
//! it, so CI always builds every feature; a fresh machine without it still runs the rest).

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::Error;

/// `(package, feature)` pairs that need libclang at build time.
pub const NEEDS_LIBCLANG: &[(&str, &str)] = &[("tier-p2p", "nixl")];

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

/// The feature selection for this machine: `--all-features` when libclang is found, else every
/// feature but [`NEEDS_LIBCLANG`] (and what enables them).
pub fn select(root: &Path) -> Result<Selection, Error> {
    if find_libclang().is_some() {
        return Ok(Selection {
            args: vec!["--all-features".to_string()],
            left_out: Vec::new(),
            reason: String::new(),
        });
    }
    let metadata = crate::layering::Workspace::metadata_json(root)?;
    let features = features_except(&metadata, NEEDS_LIBCLANG)?;
    Ok(Selection {
        args: vec!["--features".to_string(), features.join(",")],
        left_out: NEEDS_LIBCLANG
            .iter()
            .map(|(pkg, feat)| format!("{pkg}/{feat}"))
            .collect(),
        reason: "libclang not found (bindgen needs it; `bash .ci/run` installs libclang-dev)"
            .to_string(),
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
            assert!(
                !selection.args[1].contains("tier-p2p/nixl"),
                "{selection:?}"
            );
            assert!(selection.args[1].contains("connector/"), "{selection:?}");
            assert_eq!(selection.left_out, ["tier-p2p/nixl"]);
        }
    }
}
