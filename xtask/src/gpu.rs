//! `cargo xtask gpu`: the GPU checks of tier-gpu's CUDA path in one command with a hard time
//! budget (5 minutes): build, the CUDA test (one sentinel test that says "CUDA tests NOT RUN"
//! without a GPU), then the `gpu_bandwidth` example. Each step is timed and killed, with its whole
//! process group, when it runs past its share of the budget. Output is streamed and scanned for
//! the "NOT RUN" markers, so the summary says loudly when no GPU was used.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::Error;

/// The whole check's budget.
pub const TOTAL_BUDGET: Duration = Duration::from_secs(300);

/// Lines that mean a step ran without a GPU.
const NOT_RUN_MARKERS: [&str; 2] = ["CUDA tests NOT RUN", "gpu_bandwidth: NOT RUN"];

/// One step: a cargo command with its own time limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Short name for headers and the summary.
    pub name: &'static str,
    /// Arguments after `cargo`.
    pub args: Vec<String>,
    /// The most this step may take (further capped by what is left of [`TOTAL_BUDGET`]).
    pub budget: Duration,
    /// Whether later steps need this one (a failed build skips the rest).
    pub required: bool,
}

/// `cargo HEAD -p tier-gpu --features cuda TAIL` as a step.
fn step(name: &'static str, head: &[&str], tail: &[&str], secs: u64, required: bool) -> Step {
    const PACKAGE: [&str; 4] = ["-p", "tier-gpu", "--features", "cuda"];
    Step {
        name,
        args: head
            .iter()
            .chain(&PACKAGE)
            .chain(tail)
            .map(|a| a.to_string())
            .collect(),
        budget: Duration::from_secs(secs),
        required,
    }
}

/// The steps, in order: build first (`cargo test --no-run` also builds the examples, so the timed
/// runs do not compile), then the test with `--nocapture`, then the bandwidth example.
pub fn steps() -> Vec<Step> {
    let example = ["--example", "gpu_bandwidth"];
    let nocapture = ["--", "--nocapture"];
    vec![
        step("build", &["test", "--release"], &["--no-run"], 120, true),
        step("test", &["test", "--release"], &nocapture, 60, false),
        step("bandwidth", &["run", "--release"], &example, 120, false),
    ]
}

/// How a step ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Exit status 0 after this long; `not_run` holds the "NOT RUN" lines it printed.
    Passed {
        /// Wall time.
        elapsed: Duration,
        /// Lines saying a GPU check did not run.
        not_run: Vec<String>,
    },
    /// Failed (non-zero exit, signal, could not start, or timed out) after this long.
    Failed(Duration, String),
    /// Not run: an earlier required step failed, or no budget was left.
    Skipped(String),
}

/// The time limit of the next step: its budget, capped by what is left of the total.
pub fn limit(budget: Duration, started: Instant, total: Duration) -> Duration {
    budget.min(total.saturating_sub(started.elapsed()))
}

/// The "NOT RUN" marker lines in `text`.
pub fn not_run_lines(text: &str) -> Vec<String> {
    text.lines()
        .filter(|line| NOT_RUN_MARKERS.iter().any(|m| line.contains(m)))
        .map(|line| line.trim().to_string())
        .collect()
}

/// Copies `from` to `to` line by line, keeping the marker lines.
fn forward(from: impl Read, mut to: impl Write) -> Vec<String> {
    let mut seen = Vec::new();
    for line in BufReader::new(from).lines() {
        let Ok(line) = line else { break };
        let _ = writeln!(to, "{line}");
        seen.extend(not_run_lines(&line));
    }
    seen
}

/// Runs `program args` in `dir` in its own process group, streaming its output; kills the group
/// after `limit`. Returns the "NOT RUN" lines on success.
pub fn run_with_limit(
    program: &str,
    args: &[String],
    dir: &Path,
    limit: Duration,
) -> Result<Vec<String>, String> {
    let mut command = Command::new(program);
    command
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        // Own group, so a timeout kills cargo and the test or example it started.
        command.process_group(0);
    }
    let mut child = command
        .spawn()
        .map_err(|err| format!("cannot start {program}: {err}"))?;
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let out = std::thread::spawn(move || stdout.map(|s| forward(s, std::io::stdout())));
    let err = std::thread::spawn(move || stderr.map(|s| forward(s, std::io::stderr())));
    let started = Instant::now();
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) if started.elapsed() >= limit => {
                timed_out = true;
                kill_group(&mut child);
                break child.wait();
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(err) => break Err(err),
        }
    };
    let mut not_run = Vec::new();
    for handle in [out, err] {
        if let Ok(Some(lines)) = handle.join() {
            not_run.extend(lines);
        }
    }
    let status = status.map_err(|err| format!("waiting for {program}: {err}"))?;
    if timed_out {
        return Err(format!(
            "timed out after {} (killed)",
            seconds(started.elapsed())
        ));
    }
    if status.success() {
        return Ok(not_run);
    }
    Err(match status.code() {
        Some(code) => format!("exit status {code}"),
        None => format!("{status} (killed by a signal)"),
    })
}

/// Kills the child's process group (unix) or the child.
fn kill_group(child: &mut std::process::Child) {
    #[cfg(unix)]
    {
        let group = format!("-{}", child.id());
        let killed = Command::new("kill")
            .args(["-KILL", "--", &group])
            .status()
            .is_ok_and(|s| s.success());
        if killed {
            return;
        }
    }
    let _ = child.kill();
}

fn seconds(duration: Duration) -> String {
    format!("{:.1}s", duration.as_secs_f64())
}

/// Runs `steps` with `cargo` in `root` within `total`; prints headers, wall times and a summary.
pub fn run(root: &Path, steps: &[Step], total: Duration) -> Vec<Outcome> {
    let cargo = crate::cargo();
    let cargo = cargo.to_string_lossy();
    let started = Instant::now();
    let mut outcomes: Vec<Outcome> = Vec::with_capacity(steps.len());
    for (index, step) in steps.iter().enumerate() {
        let blocked = steps
            .iter()
            .zip(&outcomes)
            .find(|(s, o)| s.required && !matches!(o, Outcome::Passed { .. }));
        if let Some((s, _)) = blocked {
            outcomes.push(Outcome::Skipped(format!("`{}` did not pass", s.name)));
            continue;
        }
        let limit = limit(step.budget, started, total);
        if limit.is_zero() {
            outcomes.push(Outcome::Skipped("no time left in the budget".into()));
            continue;
        }
        println!(
            "\n==> [{}/{}] {}: cargo {} (limit {})",
            index + 1,
            steps.len(),
            step.name,
            step.args.join(" "),
            seconds(limit)
        );
        let step_started = Instant::now();
        let result = run_with_limit(&cargo, &step.args, root, limit);
        let elapsed = step_started.elapsed();
        let outcome = match result {
            Ok(not_run) => {
                println!("<== {}: ok in {}", step.name, seconds(elapsed));
                Outcome::Passed { elapsed, not_run }
            }
            Err(reason) => {
                println!(
                    "<== {}: FAILED in {} ({reason})",
                    step.name,
                    seconds(elapsed)
                );
                Outcome::Failed(elapsed, reason)
            }
        };
        outcomes.push(outcome);
    }
    print_summary(steps, &outcomes, started.elapsed());
    outcomes
}

fn print_summary(steps: &[Step], outcomes: &[Outcome], total: Duration) {
    println!("\n==> gpu summary");
    let mut not_run = Vec::new();
    for (step, outcome) in steps.iter().zip(outcomes) {
        let (verdict, time) = match outcome {
            Outcome::Passed {
                elapsed,
                not_run: lines,
            } => {
                not_run.extend(lines.iter().cloned());
                ("ok", seconds(*elapsed))
            }
            Outcome::Failed(elapsed, reason) => {
                ("FAILED", format!("{} ({reason})", seconds(*elapsed)))
            }
            Outcome::Skipped(why) => ("skipped", why.clone()),
        };
        println!("    {:<14} {:<8} {}", step.name, verdict, time);
    }
    let passed = outcomes.iter().all(|o| matches!(o, Outcome::Passed { .. }));
    println!(
        "gpu: {} in {} total",
        if passed { "ok" } else { "FAILED" },
        seconds(total)
    );
    if !not_run.is_empty() {
        println!("gpu: WARNING: no GPU was used; the GPU checks did NOT run:");
        for line in not_run {
            println!("    {line}");
        }
    }
}

/// `cargo xtask gpu`: `Ok(true)` when every step passed (also when they reported NOT RUN).
pub fn main(args: &[String]) -> Result<bool, Error> {
    if let Some(arg) = args.first() {
        return Err(Error::new(format!("`gpu` takes no arguments, got `{arg}`")));
    }
    let root = crate::workspace_root();
    let outcomes = run(&root, &steps(), TOTAL_BUDGET);
    Ok(outcomes.iter().all(|o| matches!(o, Outcome::Passed { .. })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_build_first_then_test_then_bandwidth_within_the_total_budget() {
        let steps = steps();
        let names: Vec<&str> = steps.iter().map(|s| s.name).collect();
        assert_eq!(names, ["build", "test", "bandwidth"]);
        let line = |i: usize| steps[i].args.join(" ");
        assert_eq!(
            line(0),
            "test --release -p tier-gpu --features cuda --no-run"
        );
        assert_eq!(
            line(1),
            "test --release -p tier-gpu --features cuda -- --nocapture"
        );
        assert_eq!(
            line(2),
            "run --release -p tier-gpu --features cuda --example gpu_bandwidth"
        );
        assert!(steps[0].required && !steps[1].required && !steps[2].required);
        let sum: Duration = steps.iter().map(|s| s.budget).sum();
        assert!(sum <= TOTAL_BUDGET, "{sum:?}");
    }

    #[test]
    fn a_step_limit_is_capped_by_what_is_left_of_the_total() {
        let started = Instant::now();
        let total = Duration::from_secs(300);
        assert_eq!(
            limit(Duration::from_secs(60), started, total),
            Duration::from_secs(60)
        );
        let long_ago = started - Duration::from_secs(280);
        assert!(limit(Duration::from_secs(60), long_ago, total) <= Duration::from_secs(20));
        let too_late = started - Duration::from_secs(400);
        assert!(limit(Duration::from_secs(60), too_late, total).is_zero());
    }

    #[test]
    fn not_run_markers_are_found_in_test_and_example_output() {
        let text = "running 1 test\n\nCUDA tests NOT RUN: no libcuda\nok\n\
                    gpu_bandwidth: NOT RUN: no libcuda\n";
        assert_eq!(
            not_run_lines(text),
            vec![
                "CUDA tests NOT RUN: no libcuda".to_string(),
                "gpu_bandwidth: NOT RUN: no libcuda".to_string()
            ]
        );
        assert!(not_run_lines("CUDA tests RAN: all GPU checks passed").is_empty());
    }

    #[cfg(unix)]
    #[test]
    fn a_command_past_its_limit_is_killed_with_its_children() {
        let dir = std::env::temp_dir();
        let args = ["-c", "sleep 30 & sleep 30; wait"].map(String::from);
        let started = Instant::now();
        let err = run_with_limit("sh", &args, &dir, Duration::from_millis(300)).unwrap_err();
        assert!(err.contains("timed out"), "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the group was killed"
        );
        let ok = run_with_limit(
            "sh",
            &[
                "-c".to_string(),
                "echo 'CUDA tests NOT RUN: none' >&2".to_string(),
            ],
            &dir,
            Duration::from_secs(10),
        );
        assert_eq!(ok, Ok(vec!["CUDA tests NOT RUN: none".to_string()]));
        let failed = run_with_limit(
            "sh",
            &["-c".into(), "exit 3".into()],
            &dir,
            Duration::from_secs(10),
        );
        assert_eq!(failed, Err("exit status 3".to_string()));
    }
}
