//! `cargo xtask ci`: the checks CI runs (fmt, clippy, tests, docs, layering, simulator seeds), in order, each
//! announced with a header and timed, stopping at the first failure, then a summary.

use std::fmt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::features::Selection;
use crate::{layering, Error};

/// What one CI step does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Run `cargo` with these arguments and extra environment variables.
    Cargo {
        /// Arguments after `cargo`.
        args: Vec<String>,
        /// Extra environment variables, `(name, value)`.
        env: Vec<(String, String)>,
    },
    /// Run the layering check ([`layering::check_workspace`]) in-process.
    Layering,
    /// Run a program (a script of the repository) with these arguments, from the root.
    Program {
        /// The program, relative to the workspace root.
        program: String,
        /// Its arguments.
        args: Vec<String>,
    },
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Cargo { args, env } => {
                for (name, value) in env {
                    write!(f, "{name}='{value}' ")?;
                }
                write!(f, "cargo {}", args.join(" "))
            }
            Action::Layering => {
                f.write_str("layering check (cargo metadata + offload-core sources)")
            }
            Action::Program { program, args } => {
                f.write_str(program)?;
                for arg in args {
                    write!(f, " {arg}")?;
                }
                Ok(())
            }
        }
    }
}

/// One named CI step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Short name shown in headers and the summary.
    pub name: &'static str,
    /// What it runs.
    pub action: Action,
}

fn cargo_step(name: &'static str, args: &[&str], extra: &[String]) -> Step {
    let mut args: Vec<String> = args.iter().map(|arg| arg.to_string()).collect();
    args.extend(extra.iter().cloned());
    Step {
        name,
        action: Action::Cargo {
            args,
            env: Vec::new(),
        },
    }
}

/// The CI steps for the workspace at `root`, in order, building the `features` selection
/// ([`crate::features::select`]). `test_args` go after `cargo test --workspace`. `--locked` is passed when a Cargo.lock exists, so that CI fails on a
/// stale lock file instead of rewriting it.
pub fn steps(root: &Path, features: &Selection, test_args: &[String]) -> Vec<Step> {
    let locked: Vec<String> = if root.join("Cargo.lock").is_file() {
        vec!["--locked".to_string()]
    } else {
        Vec::new()
    };
    let mut clippy = cargo_step(
        "clippy",
        &["clippy", "--workspace", "--all-targets"],
        &[features.args.clone(), locked.clone()].concat(),
    );
    if let Action::Cargo { args, .. } = &mut clippy.action {
        args.extend(["--", "-D", "warnings"].map(String::from));
    }
    let mut test_extra = [features.args.clone(), locked.clone()].concat();
    test_extra.extend(test_args.iter().cloned());
    let rustdocflags = match std::env::var("RUSTDOCFLAGS") {
        Ok(flags) if !flags.trim().is_empty() => format!("{flags} -D warnings"),
        _ => "-D warnings".to_string(),
    };
    let mut doc = cargo_step(
        "doc",
        &["doc", "--workspace", "--no-deps"],
        &[features.args.clone(), locked.clone()].concat(),
    );
    if let Action::Cargo { env, .. } = &mut doc.action {
        env.push(("RUSTDOCFLAGS".to_string(), rustdocflags));
    }
    vec![
        cargo_step("fmt", &["fmt", "--all", "--", "--check"], &[]),
        clippy,
        cargo_step("test", &["test", "--workspace"], &test_extra),
        doc,
        Step {
            name: "layering",
            action: Action::Layering,
        },
        crate::sim::ci_step(root),
        python_step(),
    ]
}

/// The Python package: the extension crate's fmt and clippy, then its pytest suite against
/// vLLM's real classes (`crates/kvtier-py/run_tests.sh` sets up its environment).
pub fn python_step() -> Step {
    Step {
        name: "python",
        action: Action::Program {
            program: "crates/kvtier-py/run_tests.sh".to_string(),
            args: Vec::new(),
        },
    }
}

/// How a step ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It passed after this long.
    Passed(Duration),
    /// It failed after this long, for this reason.
    Failed(Duration, String),
    /// It did not run because an earlier step failed.
    Skipped,
}

fn run_action(root: &Path, action: &Action) -> Result<(), String> {
    match action {
        Action::Cargo { args, env } => {
            let status = Command::new(crate::cargo())
                .args(args)
                .envs(env.iter().map(|(name, value)| (name, value)))
                .current_dir(root)
                .status()
                .map_err(|err| format!("cannot start cargo: {err}"))?;
            if status.success() {
                return Ok(());
            }
            Err(match status.code() {
                Some(code) => format!("exit status {code}"),
                None => format!("{status} (killed by a signal)"),
            })
        }
        Action::Program { program, args } => {
            let status = Command::new("bash")
                .arg(root.join(program))
                .args(args)
                .current_dir(root)
                .status()
                .map_err(|err| format!("cannot start {program}: {err}"))?;
            if status.success() {
                Ok(())
            } else {
                Err(format!("{program}: {status}"))
            }
        }
        Action::Layering => {
            let report = layering::check_workspace(root).map_err(|err| err.to_string())?;
            println!("{report}");
            if report.is_ok() {
                Ok(())
            } else {
                Err(format!("{} layering violation(s)", report.violations.len()))
            }
        }
    }
}

fn seconds(duration: Duration) -> String {
    format!("{:.1}s", duration.as_secs_f64())
}

/// Runs `steps` in order in `root`, printing a header and the wall time of each, stopping at the
/// first failure, then printing a summary. Returns the outcome of every step.
pub fn run(root: &Path, steps: &[Step]) -> Vec<Outcome> {
    run_with(steps, |action| run_action(root, action))
}

/// [`run`] with the action runner passed in.
fn run_with(
    steps: &[Step],
    mut run_action: impl FnMut(&Action) -> Result<(), String>,
) -> Vec<Outcome> {
    let started = Instant::now();
    let mut outcomes = Vec::with_capacity(steps.len());
    for (index, step) in steps.iter().enumerate() {
        if outcomes
            .iter()
            .any(|outcome| matches!(outcome, Outcome::Failed(..)))
        {
            outcomes.push(Outcome::Skipped);
            continue;
        }
        println!(
            "\n==> [{}/{}] {}: {}",
            index + 1,
            steps.len(),
            step.name,
            step.action
        );
        let step_started = Instant::now();
        let result = run_action(&step.action);
        let elapsed = step_started.elapsed();
        match result {
            Ok(()) => {
                println!("<== {}: ok in {}", step.name, seconds(elapsed));
                outcomes.push(Outcome::Passed(elapsed));
            }
            Err(reason) => {
                println!(
                    "<== {}: FAILED in {} ({reason})",
                    step.name,
                    seconds(elapsed)
                );
                outcomes.push(Outcome::Failed(elapsed, reason));
            }
        }
    }
    print_summary(steps, &outcomes, started.elapsed());
    outcomes
}

fn print_summary(steps: &[Step], outcomes: &[Outcome], total: Duration) {
    println!("\n==> ci summary");
    let mut failed = None;
    for (step, outcome) in steps.iter().zip(outcomes) {
        let (verdict, time) = match outcome {
            Outcome::Passed(elapsed) => ("ok", seconds(*elapsed)),
            Outcome::Failed(elapsed, _) => {
                failed = Some(step.name);
                ("FAILED", seconds(*elapsed))
            }
            Outcome::Skipped => ("skipped", String::new()),
        };
        println!("    {:<10} {:<8} {:>8}", step.name, verdict, time);
    }
    match failed {
        None => println!("ci: ok, {} steps in {} total", steps.len(), seconds(total)),
        Some(name) => println!("ci: FAILED at `{name}` after {} total", seconds(total)),
    }
}

/// Parses `cargo xtask ci` arguments: nothing, or `--` followed by arguments for `cargo test`.
pub fn parse_args(args: &[String]) -> Result<&[String], Error> {
    match args.split_first() {
        None => Ok(&[]),
        Some((first, rest)) if first == "--" => Ok(rest),
        Some((first, _)) => Err(Error::new(format!(
            "unexpected argument `{first}` to `ci`; pass extra `cargo test` arguments after `--`, \
             e.g. `cargo xtask ci -- --no-fail-fast`"
        ))),
    }
}

/// `cargo xtask ci [-- TEST_ARGS...]`: runs every step; `Ok(true)` when all passed.
pub fn main(args: &[String]) -> Result<bool, Error> {
    let test_args = parse_args(args)?;
    let root = crate::workspace_root();
    let features = crate::features::select(&root)?;
    if !features.left_out.is_empty() {
        println!(
            "ci: FEATURES NOT BUILT: {} ({}); their tests do not run",
            features.left_out.join(", "),
            features.reason
        );
    }
    let outcomes = run(&root, &steps(&root, &features, test_args));
    if !features.left_out.is_empty() {
        println!(
            "ci: FEATURES NOT BUILT: {} ({})",
            features.left_out.join(", "),
            features.reason
        );
    }
    Ok(outcomes
        .iter()
        .all(|outcome| matches!(outcome, Outcome::Passed(_))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|item| item.to_string()).collect()
    }

    #[test]
    fn parse_args_takes_test_args_after_double_dash_only() {
        assert_eq!(parse_args(&[]).unwrap(), &[] as &[String]);
        let args = strings(&["--", "--no-fail-fast", "lifecycle"]);
        assert_eq!(parse_args(&args).unwrap(), &args[1..]);
        let err = parse_args(&strings(&["--fast"])).unwrap_err();
        assert!(err.to_string().contains("`--fast`"), "{err}");
    }

    #[test]
    fn steps_are_in_order_with_expected_commands() {
        let root = crate::workspace_root();
        let all = Selection {
            args: strings(&["--all-features"]),
            left_out: Vec::new(),
            reason: String::new(),
        };
        let steps = steps(&root, &all, &strings(&["--no-fail-fast"]));
        let names: Vec<&str> = steps.iter().map(|step| step.name).collect();
        assert_eq!(
            names,
            ["fmt", "clippy", "test", "doc", "layering", "sim", "python"]
        );
        assert_eq!(steps[0].action.to_string(), "cargo fmt --all -- --check");
        let clippy = steps[1].action.to_string();
        assert!(clippy.starts_with("cargo clippy --workspace --all-targets"));
        assert!(clippy.ends_with("-- -D warnings"), "{clippy}");
        let test = steps[2].action.to_string();
        assert!(test.starts_with("cargo test --workspace"), "{test}");
        assert!(test.ends_with(" --no-fail-fast"), "{test}");
        let doc = steps[3].action.to_string();
        assert!(doc.contains("-D warnings'") && doc.contains("cargo doc --workspace --no-deps"));
        assert_eq!(steps[4].action, Action::Layering);
        assert_eq!(steps[6].action.to_string(), "crates/kvtier-py/run_tests.sh");
    }

    #[test]
    fn run_stops_at_first_failure_and_skips_the_rest() {
        let step = |name| Step {
            name,
            action: Action::Layering,
        };
        let mut calls = 0;
        let outcomes = run_with(&[step("a"), step("b"), step("c")], |_| {
            calls += 1;
            if calls == 2 {
                Err("boom".to_string())
            } else {
                Ok(())
            }
        });
        assert_eq!(calls, 2);
        assert!(matches!(outcomes[0], Outcome::Passed(_)), "{outcomes:?}");
        assert!(matches!(&outcomes[1], Outcome::Failed(_, reason) if reason == "boom"));
        assert_eq!(outcomes[2], Outcome::Skipped);
    }
}
