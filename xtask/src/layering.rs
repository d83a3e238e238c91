//! The layering check: design.md section 3's dependency rules written as data (an allow-list of
//! workspace edges per crate, and offload-core's allow-list of external crates), checked against
//! `cargo metadata`, plus a scan of offload-core's sources for I/O, clocks, threads, randomness
//! and `unsafe`.

pub mod source_scan;

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::Error;

/// The deterministic core; the bottom layer.
pub const CORE: &str = "offload-core";

/// The tier crates: siblings that implement the `Tier` trait and never depend on each other.
pub const TIER_CRATES: &[&str] = &["tier-gpu", "tier-fs", "tier-p2p", "tier-obj"];

/// Crates at the very top that no other crate may depend on.
pub const TOP_CRATES: &[&str] = &["xtask", "kvtier-tests"];

/// External crates that offload-core may use as normal or build dependencies. Anything that does
/// I/O, reads a clock, starts threads or draws randomness does not belong here.
pub const CORE_EXTERNAL_ALLOWED: &[&str] = &["serde", "thiserror", "twox-hash"];

/// External crates (and crate families: the name itself, or the name followed by `-` or `_`)
/// known to do I/O, read clocks, start threads or draw randomness; named so that the message
/// for them is specific. The allow-list above decides; this list only explains.
pub const CORE_EXTERNAL_KNOWN_FORBIDDEN: &[&str] = &[
    "libc",
    "nix",
    "io-uring",
    "tokio",
    "async-std",
    "mio",
    "cudarc",
    "rand",
    "getrandom",
    "fastrand",
    "crossbeam",
    "rayon",
    "parking_lot",
    "chrono",
    "time",
    "memmap2",
    "socket2",
];

/// What one workspace crate may depend on among workspace crates.
#[derive(Debug, Clone, Copy)]
pub struct CrateRule {
    /// The crate's package name.
    pub name: &'static str,
    /// Workspace crates allowed as normal and build dependencies (and so also as dev-dependencies).
    pub deps: &'static [&'static str],
    /// Workspace crates allowed additionally, as dev-dependencies only.
    pub dev_deps: &'static [&'static str],
    /// The rule in words, quoted when an edge breaks it.
    pub rule: &'static str,
}

impl CrateRule {
    /// Whether the crate may depend on `dep` this way. A crate may always be a dev-dependency of
    /// itself: that is how its tests and examples turn on its own off-by-default features (the
    /// `bench` harnesses), and it adds no edge between crates.
    fn allows(&self, dep: &str, kind: DepKind) -> bool {
        self.deps.contains(&dep)
            || (kind == DepKind::Dev && (self.dev_deps.contains(&dep) || dep == self.name))
    }
}

const TIERS_AND_BELOW: &[&str] = &[
    "offload-core",
    "tier-gpu",
    "tier-fs",
    "tier-p2p",
    "tier-obj",
];

/// The layering table: every workspace crate and the workspace crates it may depend on. A crate
/// missing from this table fails the check until it is added here.
pub const RULES: &[CrateRule] = &[
    CrateRule {
        name: "offload-core",
        deps: &[],
        dev_deps: &[],
        rule: "offload-core depends on no workspace crate",
    },
    CrateRule {
        name: "tier-testkit",
        deps: &["offload-core"],
        dev_deps: &[],
        rule: "tier-testkit depends only on offload-core among workspace crates",
    },
    CrateRule {
        name: "tier-gpu",
        deps: &["offload-core"],
        dev_deps: &["tier-testkit"],
        rule: "tier crates depend only on offload-core (and on tier-testkit as a dev-dependency)",
    },
    CrateRule {
        name: "tier-fs",
        deps: &["offload-core"],
        dev_deps: &["tier-testkit"],
        rule: "tier crates depend only on offload-core (and on tier-testkit as a dev-dependency)",
    },
    CrateRule {
        name: "tier-p2p",
        deps: &["offload-core"],
        dev_deps: &["tier-testkit"],
        rule: "tier crates depend only on offload-core (and on tier-testkit as a dev-dependency)",
    },
    CrateRule {
        name: "tier-obj",
        deps: &["offload-core"],
        dev_deps: &["tier-testkit"],
        rule: "tier crates depend only on offload-core (and on tier-testkit as a dev-dependency)",
    },
    CrateRule {
        name: "connector",
        deps: TIERS_AND_BELOW,
        dev_deps: &["tier-testkit"],
        rule: "connector depends only on offload-core and the tier crates",
    },
    CrateRule {
        name: "engine-sim",
        deps: &["offload-core", "tier-gpu", "tier-fs", "tier-p2p", "connector"],
        dev_deps: &["tier-testkit"],
        rule: "engine-sim (the engine side) depends only on offload-core, the tier crates and connector",
    },
    CrateRule {
        name: "kvtier",
        deps: &[
            "offload-core",
            "tier-gpu",
            "tier-fs",
            "tier-p2p",
            "connector",
            "engine-sim",
        ],
        dev_deps: &["tier-testkit"],
        rule: "the kvtier binary depends on offload-core, the tier crates, connector and engine-sim",
    },
    CrateRule {
        name: "kvtier-sim",
        deps: &["offload-core", "tier-testkit", "connector", "engine-sim"],
        dev_deps: &[],
        rule: "the simulator depends on offload-core, tier-testkit, connector and engine-sim",
    },
    CrateRule {
        name: "kvtier-tests",
        deps: &[
            "offload-core",
            "tier-testkit",
            "tier-gpu",
            "tier-fs",
            "tier-p2p",
            "connector",
            "engine-sim",
            "kvtier",
        ],
        dev_deps: &[],
        rule: "kvtier-tests may depend on every crate except xtask",
    },
    CrateRule {
        name: "xtask",
        deps: &[],
        dev_deps: &[],
        rule: "xtask reads the workspace through cargo and depends on no workspace crate",
    },
];

/// The rule with the given crate name, if the table has one.
pub fn rule_for(name: &str) -> Option<&'static CrateRule> {
    RULES.iter().find(|rule| rule.name == name)
}

/// The kind of a dependency, as `cargo metadata` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DepKind {
    /// `[dependencies]`.
    Normal,
    /// `[build-dependencies]`.
    Build,
    /// `[dev-dependencies]`.
    Dev,
}

impl fmt::Display for DepKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DepKind::Normal => "normal",
            DepKind::Build => "build",
            DepKind::Dev => "dev",
        })
    }
}

/// One declared dependency of a workspace package.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dependency {
    /// The depended-on package's name (not its rename).
    pub name: String,
    /// Normal, build or dev.
    pub kind: DepKind,
    /// Whether it is a path dependency (workspace crates are).
    pub is_path: bool,
}

/// One workspace package with its declared dependencies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Package {
    /// The package name.
    pub name: String,
    /// Path of its Cargo.toml.
    pub manifest_path: PathBuf,
    /// Its declared dependencies, every kind and target.
    pub dependencies: Vec<Dependency>,
}

/// The workspace's packages, as read from `cargo metadata --format-version 1`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workspace {
    /// The workspace root directory.
    pub root: PathBuf,
    /// The workspace member packages.
    pub packages: Vec<Package>,
}

fn field<'a>(value: &'a Value, key: &str, what: &str) -> Result<&'a Value, Error> {
    value
        .get(key)
        .ok_or_else(|| Error::new(format!("cargo metadata: {what} has no `{key}` field")))
}

fn str_field<'a>(value: &'a Value, key: &str, what: &str) -> Result<&'a str, Error> {
    field(value, key, what)?
        .as_str()
        .ok_or_else(|| Error::new(format!("cargo metadata: `{key}` of {what} is not a string")))
}

fn array_field<'a>(value: &'a Value, key: &str, what: &str) -> Result<&'a Vec<Value>, Error> {
    field(value, key, what)?
        .as_array()
        .ok_or_else(|| Error::new(format!("cargo metadata: `{key}` of {what} is not an array")))
}

fn parse_dependency(dep: &Value, package: &str) -> Result<Dependency, Error> {
    let what = format!("a dependency of `{package}`");
    let name = str_field(dep, "name", &what)?.to_string();
    let kind = match dep.get("kind").and_then(Value::as_str) {
        None => DepKind::Normal,
        Some("dev") => DepKind::Dev,
        Some("build") => DepKind::Build,
        Some(other) => {
            return Err(Error::new(format!(
                "cargo metadata: dependency `{name}` of `{package}` has unknown kind `{other}`"
            )))
        }
    };
    let is_path = dep.get("path").is_some_and(|path| !path.is_null());
    Ok(Dependency {
        name,
        kind,
        is_path,
    })
}

fn parse_package(package: &Value) -> Result<Package, Error> {
    let name = str_field(package, "name", "a package")?.to_string();
    let what = format!("package `{name}`");
    let manifest_path = PathBuf::from(str_field(package, "manifest_path", &what)?);
    let dependencies = array_field(package, "dependencies", &what)?
        .iter()
        .map(|dep| parse_dependency(dep, &name))
        .collect::<Result<_, _>>()?;
    Ok(Package {
        name,
        manifest_path,
        dependencies,
    })
}

impl Workspace {
    /// Reads the workspace members out of `cargo metadata --format-version 1` output.
    pub fn from_metadata(metadata: &Value) -> Result<Self, Error> {
        let root = PathBuf::from(str_field(metadata, "workspace_root", "the metadata")?);
        let members: Vec<&str> = array_field(metadata, "workspace_members", "the metadata")?
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let mut packages = Vec::new();
        for package in array_field(metadata, "packages", "the metadata")? {
            let id = str_field(package, "id", "a package")?;
            if members.contains(&id) {
                packages.push(parse_package(package)?);
            }
        }
        Ok(Self { root, packages })
    }

    /// Runs `cargo metadata --format-version 1 --no-deps` in `root` and reads its output.
    pub fn load(root: &Path) -> Result<Self, Error> {
        Self::from_metadata(&Self::metadata_json(root)?)
    }

    /// The output of `cargo metadata --format-version 1 --no-deps` in `root`, parsed.
    pub fn metadata_json(root: &Path) -> Result<Value, Error> {
        let output = Command::new(crate::cargo())
            .args(["metadata", "--format-version", "1", "--no-deps"])
            .current_dir(root)
            .output()
            .map_err(|err| Error::new(format!("cannot run `cargo metadata`: {err}")))?;
        if !output.status.success() {
            return Err(Error::new(format!(
                "`cargo metadata` failed ({}):\n{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            )));
        }
        serde_json::from_slice(&output.stdout)
            .map_err(|err| Error::new(format!("cannot parse `cargo metadata` output: {err}")))
    }

    fn has_member(&self, name: &str) -> bool {
        self.packages.iter().any(|package| package.name == name)
    }

    fn package(&self, name: &str) -> Option<&Package> {
        self.packages.iter().find(|package| package.name == name)
    }
}

/// One broken layering rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// A workspace crate that the layering table does not know.
    UnknownCrate {
        /// The crate's name.
        name: String,
    },
    /// A dependency edge between workspace crates that the table does not allow.
    Edge {
        /// The depending crate.
        from: String,
        /// The depended-on crate.
        to: String,
        /// The kind of dependency.
        kind: DepKind,
        /// The rule broken, in words.
        rule: String,
    },
    /// An external dependency of offload-core that is not on its allow-list.
    CoreExternal {
        /// The external crate.
        dep: String,
        /// The kind of dependency.
        kind: DepKind,
        /// The rule broken, in words.
        rule: String,
    },
    /// A forbidden name in offload-core's sources.
    CoreSource {
        /// The file, relative to the workspace root where possible.
        file: PathBuf,
        /// The 1-based line.
        line: usize,
        /// What was found, e.g. `std::fs` or `unsafe`.
        pattern: String,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::UnknownCrate { name } => write!(
                f,
                "unknown workspace crate `{name}`: add it to the layering table (RULES in \
                 xtask/src/layering.rs) with the workspace crates it may depend on"
            ),
            Violation::Edge {
                from,
                to,
                kind,
                rule,
            } => write!(
                f,
                "forbidden edge {from} -> {to} ({kind} dependency): {rule}"
            ),
            Violation::CoreExternal { dep, kind, rule } => write!(
                f,
                "forbidden dependency {CORE} -> {dep} ({kind} dependency): {rule}"
            ),
            Violation::CoreSource {
                file,
                line,
                pattern,
            } => write!(
                f,
                "{}:{line}: `{pattern}` in {CORE}: the core does no I/O, reads no clock, starts \
                 no threads, draws no randomness and has no unsafe code (design.md section 3)",
                file.display()
            ),
        }
    }
}

fn edge_rule(rule: &CrateRule, to: &str, kind: DepKind) -> String {
    if TOP_CRATES.contains(&to) {
        return "no crate depends on xtask or kvtier-tests".to_string();
    }
    if TIER_CRATES.contains(&rule.name) && TIER_CRATES.contains(&to) {
        return "tier crates never depend on each other (design.md section 3)".to_string();
    }
    if kind != DepKind::Dev && rule.dev_deps.contains(&to) {
        return format!("{to} is allowed only as a dev-dependency of {}", rule.name);
    }
    let mut allowed: Vec<&str> = rule.deps.to_vec();
    allowed.extend(rule.dev_deps.iter().map(|dep| dep.to_owned()));
    let allowed = if allowed.is_empty() {
        "none".to_string()
    } else {
        allowed.join(", ")
    };
    format!("{} (allowed: {allowed})", rule.rule)
}

fn core_external_rule(dep: &str) -> String {
    let allowed = CORE_EXTERNAL_ALLOWED.join(", ");
    let known = CORE_EXTERNAL_KNOWN_FORBIDDEN.iter().any(|family| {
        dep == *family
            || dep
                .strip_prefix(family)
                .is_some_and(|rest| rest.starts_with(['-', '_']))
    });
    if known {
        return format!(
            "`{dep}` does I/O, reads clocks, starts threads or draws randomness; offload-core \
             has none of these (allowed: {allowed})"
        );
    }
    format!(
        "`{dep}` is not on offload-core's allow-list ({allowed}); add it to \
         CORE_EXTERNAL_ALLOWED in xtask/src/layering.rs only if it does no I/O, reads no clock, \
         starts no threads and draws no randomness"
    )
}

/// What the layering check looked at and what it found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Workspace crates checked.
    pub crate_count: usize,
    /// Dependency edges checked (workspace edges, and offload-core's external ones).
    pub edge_count: usize,
    /// offload-core source files scanned.
    pub file_count: usize,
    /// Every broken rule found.
    pub violations: Vec<Violation>,
}

impl Report {
    /// Whether no rule was broken.
    pub fn is_ok(&self) -> bool {
        self.violations.is_empty()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for violation in &self.violations {
            writeln!(f, "layering: {violation}")?;
        }
        let verdict = if self.is_ok() {
            "ok".to_string()
        } else {
            format!("{} violation(s)", self.violations.len())
        };
        write!(
            f,
            "layering: {verdict} ({} crates, {} dependency edges, {} offload-core source files checked)",
            self.crate_count, self.edge_count, self.file_count
        )
    }
}

/// Checks every workspace crate's declared dependencies against [`RULES`] and offload-core's
/// external dependencies against [`CORE_EXTERNAL_ALLOWED`]. Dev-dependencies of offload-core on
/// external crates are not restricted (tests may use proptest and friends).
pub fn check_graph(workspace: &Workspace) -> Report {
    let mut report = Report {
        crate_count: workspace.packages.len(),
        ..Report::default()
    };
    for package in &workspace.packages {
        let Some(rule) = rule_for(&package.name) else {
            report.violations.push(Violation::UnknownCrate {
                name: package.name.clone(),
            });
            continue;
        };
        for dep in &package.dependencies {
            let is_workspace_edge = dep.is_path && workspace.has_member(&dep.name);
            if is_workspace_edge {
                report.edge_count += 1;
                if !rule.allows(&dep.name, dep.kind) {
                    report.violations.push(Violation::Edge {
                        from: package.name.clone(),
                        to: dep.name.clone(),
                        kind: dep.kind,
                        rule: edge_rule(rule, &dep.name, dep.kind),
                    });
                }
                continue;
            }
            if package.name != CORE || dep.kind == DepKind::Dev {
                continue;
            }
            report.edge_count += 1;
            if !CORE_EXTERNAL_ALLOWED.contains(&dep.name.as_str()) {
                report.violations.push(Violation::CoreExternal {
                    dep: dep.name.clone(),
                    kind: dep.kind,
                    rule: core_external_rule(&dep.name),
                });
            }
        }
    }
    report
}

/// Scans offload-core's `src/` (found through its manifest path) with [`source_scan`], adding
/// the files scanned and any forbidden names to `report`.
pub fn check_core_sources(workspace: &Workspace, report: &mut Report) -> Result<(), Error> {
    let core = workspace
        .package(CORE)
        .ok_or_else(|| Error::new(format!("layering: `{CORE}` is not a workspace member")))?;
    let crate_dir = core.manifest_path.parent().unwrap_or(Path::new("."));
    let files = source_scan::rust_files(&crate_dir.join("src"))?;
    for file in &files {
        let text = std::fs::read_to_string(file)
            .map_err(|err| Error::new(format!("cannot read {}: {err}", file.display())))?;
        let shown = file.strip_prefix(&workspace.root).unwrap_or(file);
        for hit in source_scan::scan(&text) {
            report.violations.push(Violation::CoreSource {
                file: shown.to_path_buf(),
                line: hit.line,
                pattern: hit.pattern,
            });
        }
    }
    report.file_count += files.len();
    Ok(())
}

/// The whole layering check on the workspace at `root`: `cargo metadata`, the dependency rules,
/// and the offload-core source scan.
pub fn check_workspace(root: &Path) -> Result<Report, Error> {
    let workspace = Workspace::load(root)?;
    let mut report = check_graph(&workspace);
    check_core_sources(&workspace, &mut report)?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A fake dependency: `(name, kind as cargo metadata spells it, is a path dependency)`.
    type FakeDep<'a> = (&'a str, Option<&'a str>, bool);
    /// A fake workspace crate with its dependencies.
    type FakeCrate<'a> = (&'a str, &'a [FakeDep<'a>]);

    /// Fake `cargo metadata --no-deps` output for `crates`.
    fn metadata(crates: &[FakeCrate<'_>]) -> Value {
        let packages: Vec<Value> = crates
            .iter()
            .map(|(name, deps)| {
                let deps: Vec<Value> = deps
                    .iter()
                    .map(|(dep, kind, is_path)| {
                        json!({
                            "name": dep,
                            "kind": kind,
                            "path": if *is_path { json!(format!("/ws/crates/{dep}")) } else { Value::Null },
                            "source": if *is_path { Value::Null } else { json!("registry+https://github.com/rust-lang/crates.io-index") },
                            "rename": null,
                            "optional": false,
                            "target": null,
                        })
                    })
                    .collect();
                json!({
                    "name": name,
                    "id": format!("path+file:///ws/crates/{name}#0.1.0"),
                    "manifest_path": format!("/ws/crates/{name}/Cargo.toml"),
                    "dependencies": deps,
                })
            })
            .collect();
        let members: Vec<Value> = crates
            .iter()
            .map(|(name, _)| json!(format!("path+file:///ws/crates/{name}#0.1.0")))
            .collect();
        json!({ "packages": packages, "workspace_members": members, "workspace_root": "/ws" })
    }

    fn check(crates: &[FakeCrate<'_>]) -> Report {
        let workspace = Workspace::from_metadata(&metadata(crates)).expect("valid fake metadata");
        check_graph(&workspace)
    }

    const CORE_OK: FakeCrate<'static> = (
        "offload-core",
        &[
            ("serde", None, false),
            ("thiserror", None, false),
            ("proptest", Some("dev"), false),
        ],
    );

    #[test]
    fn the_intended_graph_passes() {
        let report = check(&[
            CORE_OK,
            ("tier-testkit", &[("offload-core", None, true)]),
            (
                "tier-fs",
                &[
                    ("offload-core", None, true),
                    ("tier-testkit", Some("dev"), true),
                    ("libc", None, false),
                ],
            ),
            ("tier-p2p", &[("offload-core", None, true)]),
            (
                "connector",
                &[("offload-core", None, true), ("tier-fs", None, true)],
            ),
            ("engine-sim", &[("connector", None, true)]),
            ("kvtier-tests", &[("engine-sim", None, true)]),
            ("xtask", &[("serde_json", None, false)]),
        ]);
        assert!(report.is_ok(), "{report}");
        assert_eq!(report.crate_count, 8);
        // Workspace edges (8) plus offload-core's two normal external dependencies.
        assert_eq!(report.edge_count, 10);
    }

    #[test]
    fn a_crate_may_dev_depend_on_itself_only() {
        let report = check(&[
            ("offload-core", &[("offload-core", Some("dev"), true)]),
            ("tier-fs", &[("tier-fs", Some("dev"), true)]),
        ]);
        assert!(report.is_ok(), "{report}");
        assert_eq!(report.edge_count, 2);
        for kind in [None, Some("build")] {
            let report = check(&[
                CORE_OK,
                (
                    "tier-fs",
                    &[("offload-core", None, true), ("tier-fs", kind, true)],
                ),
            ]);
            assert_eq!(report.violations.len(), 1, "{report}");
            let message = report.violations[0].to_string();
            assert!(message.contains("tier-fs -> tier-fs"), "{message}");
        }
    }

    #[test]
    fn tier_to_tier_edge_fails_in_every_kind() {
        for kind in [None, Some("build"), Some("dev")] {
            let report = check(&[
                CORE_OK,
                ("tier-fs", &[("tier-p2p", kind, true)]),
                ("tier-p2p", &[("offload-core", None, true)]),
            ]);
            assert_eq!(report.violations.len(), 1, "{report}");
            let message = report.violations[0].to_string();
            assert!(message.contains("tier-fs -> tier-p2p"), "{message}");
            assert!(message.contains("never depend on each other"), "{message}");
        }
    }

    #[test]
    fn core_on_libc_fails() {
        let report = check(&[(
            "offload-core",
            &[("serde", None, false), ("libc", None, false)],
        )]);
        assert_eq!(
            report.violations,
            vec![Violation::CoreExternal {
                dep: "libc".into(),
                kind: DepKind::Normal,
                rule: core_external_rule("libc"),
            }]
        );
        assert!(report.violations[0].to_string().contains("does I/O"));
    }

    #[test]
    fn core_on_unlisted_or_known_family_crate_fails() {
        let report = check(&[(
            "offload-core",
            &[
                ("crossbeam-channel", None, false),
                ("smallvec", Some("build"), false),
                ("rand", Some("dev"), false),
            ],
        )]);
        let messages: Vec<String> = report.violations.iter().map(|v| v.to_string()).collect();
        assert_eq!(messages.len(), 2, "{messages:?}");
        assert!(messages[0].contains("crossbeam-channel") && messages[0].contains("does I/O"));
        assert!(messages[1].contains("smallvec") && messages[1].contains("allow-list"));
    }

    #[test]
    fn core_on_workspace_crate_fails() {
        let report = check(&[
            ("offload-core", &[("tier-testkit", Some("dev"), true)]),
            ("tier-testkit", &[("offload-core", None, true)]),
        ]);
        assert_eq!(report.violations.len(), 1, "{report}");
        assert!(report.violations[0]
            .to_string()
            .contains("offload-core depends on no workspace crate"));
    }

    #[test]
    fn testkit_as_normal_dependency_of_a_tier_fails() {
        let report = check(&[
            CORE_OK,
            ("tier-testkit", &[("offload-core", None, true)]),
            ("tier-gpu", &[("tier-testkit", None, true)]),
        ]);
        assert_eq!(report.violations.len(), 1, "{report}");
        assert!(report.violations[0]
            .to_string()
            .contains("only as a dev-dependency of tier-gpu"));
    }

    #[test]
    fn edges_into_the_top_crates_fail() {
        let report = check(&[
            CORE_OK,
            ("connector", &[("xtask", Some("dev"), true)]),
            ("engine-sim", &[("kvtier-tests", None, true)]),
            ("xtask", &[]),
            ("kvtier-tests", &[]),
        ]);
        assert_eq!(report.violations.len(), 2, "{report}");
        for violation in &report.violations {
            assert!(violation
                .to_string()
                .contains("no crate depends on xtask or kvtier-tests"));
        }
    }

    #[test]
    fn connector_on_engine_sim_fails() {
        let report = check(&[
            CORE_OK,
            ("connector", &[("engine-sim", None, true)]),
            ("engine-sim", &[]),
        ]);
        assert_eq!(report.violations.len(), 1, "{report}");
        let message = report.violations[0].to_string();
        assert!(message.contains("connector -> engine-sim"), "{message}");
        assert!(
            message.contains("allowed: offload-core, tier-gpu"),
            "{message}"
        );
    }

    #[test]
    fn unknown_workspace_crate_fails() {
        let report = check(&[CORE_OK, ("tier-s3", &[("offload-core", None, true)])]);
        assert_eq!(
            report.violations,
            vec![Violation::UnknownCrate {
                name: "tier-s3".into()
            }]
        );
        assert!(report.violations[0]
            .to_string()
            .contains("add it to the layering table"));
    }

    #[test]
    fn registry_crate_named_like_a_member_is_not_a_workspace_edge() {
        // A crates.io package called `connector` is not our `connector`.
        let report = check(&[
            CORE_OK,
            ("tier-fs", &[("connector", None, false)]),
            ("connector", &[]),
        ]);
        assert!(report.is_ok(), "{report}");
    }

    #[test]
    fn every_rule_names_only_known_crates() {
        let names: Vec<&str> = RULES.iter().map(|rule| rule.name).collect();
        for rule in RULES {
            for dep in rule.deps.iter().chain(rule.dev_deps) {
                assert!(names.contains(dep), "{} allows unknown {dep}", rule.name);
                assert!(
                    !TOP_CRATES.contains(dep),
                    "{} allows top crate {dep}",
                    rule.name
                );
            }
        }
    }

    #[test]
    fn malformed_metadata_is_an_error_naming_the_field() {
        let err = Workspace::from_metadata(&json!({ "packages": [] })).unwrap_err();
        assert!(err.to_string().contains("workspace_root"), "{err}");
    }
}
