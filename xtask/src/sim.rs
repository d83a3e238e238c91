//! `cargo xtask sim`: builds the deterministic simulator (`kvtier-sim`, release) and runs it.
//! Arguments go to the simulator (`--seed S`, `--seeds N [--base B]`, `--trace [PATH]`,
//! `--verbose`). `--ci` runs CI's fixed budget of [`CI_SEEDS`] seeds starting at a base derived
//! from the commit ([`commit_base`]), so every commit explores new seeds and a failure replays
//! with the printed `--seed`.

use std::path::Path;
use std::process::Command;

use crate::ci::{Action, Step};
use crate::Error;

/// Seeds CI runs per commit.
pub const CI_SEEDS: u64 = 2000;

/// Base seed when git is absent (or HEAD unreadable).
pub const BASE_WITHOUT_GIT: u64 = 1;

/// FNV-1a of `text`: the seed base of a commit id.
pub fn base_of(text: &str) -> u64 {
    text.trim().bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// The seed base of the commit checked out in `root` (`git rev-parse HEAD`), or
/// [`BASE_WITHOUT_GIT`] when git is not there.
pub fn commit_base(root: &Path) -> u64 {
    let out = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(root)
        .output();
    match out {
        Ok(o) if o.status.success() => base_of(&String::from_utf8_lossy(&o.stdout)),
        _ => BASE_WITHOUT_GIT,
    }
}

fn cargo_args(sim_args: &[String], locked: bool) -> Vec<String> {
    let mut args: Vec<String> = ["run", "--release", "--quiet", "-p", "kvtier-sim"]
        .map(String::from)
        .to_vec();
    if locked {
        args.push("--locked".to_owned());
    }
    args.push("--".to_owned());
    args.extend(sim_args.iter().cloned());
    args
}

/// The CI step: [`CI_SEEDS`] seeds from the commit's base.
pub fn ci_step(root: &Path) -> Step {
    let sim_args = [
        "--seeds".to_owned(),
        CI_SEEDS.to_string(),
        "--base".to_owned(),
        commit_base(root).to_string(),
    ];
    Step {
        name: "sim",
        action: Action::Cargo {
            args: cargo_args(&sim_args, root.join("Cargo.lock").is_file()),
            env: Vec::new(),
        },
    }
}

/// `cargo xtask sim [--ci | SIM_ARGS...]`: `Ok(true)` when every seed ran clean.
pub fn main(args: &[String]) -> Result<bool, Error> {
    let root = crate::workspace_root();
    let cargo = if args.first().map(String::as_str) == Some("--ci") {
        if args.len() > 1 {
            return Err(Error::new("`sim --ci` takes no other arguments"));
        }
        match ci_step(&root).action {
            Action::Cargo { args, .. } => args,
            Action::Layering | Action::Program { .. } => unreachable!("the sim step runs cargo"),
        }
    } else {
        cargo_args(args, false)
    };
    let status = Command::new(crate::cargo())
        .args(&cargo)
        .current_dir(&root)
        .status()
        .map_err(|e| Error::new(format!("cannot start cargo for the simulator: {e}")))?;
    Ok(status.success())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_base_depends_on_the_commit() {
        let a = base_of("0123456789abcdef0123456789abcdef01234567\n");
        assert_eq!(a, base_of("0123456789abcdef0123456789abcdef01234567"));
        assert_ne!(a, base_of("1123456789abcdef0123456789abcdef01234567"));
    }

    #[test]
    fn the_ci_step_runs_the_budget_in_release() {
        let step = ci_step(&crate::workspace_root());
        let text = step.action.to_string();
        assert!(text.starts_with("cargo run --release"), "{text}");
        assert!(
            text.contains(&format!("--seeds {CI_SEEDS} --base ")),
            "{text}"
        );
    }
}
