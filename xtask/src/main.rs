//! `cargo xtask`: kvtier's developer tasks (`ci`, `layering`, `gpu`, `sim`, `help`). A thin front end
//! over the `xtask` library; add a task by adding a row to `TASKS`.

use std::process::ExitCode;

use xtask::{ci, gpu, layering, sim, Error};

/// One subcommand: its name, usage line, one-line description and entry point. The entry point
/// gets the arguments after the subcommand's name and returns whether the task passed.
struct Task {
    name: &'static str,
    usage: &'static str,
    about: &'static str,
    run: fn(&[String]) -> Result<bool, Error>,
}

const TASKS: &[Task] = &[
    Task {
        name: "ci",
        usage: "cargo xtask ci [-- CARGO_TEST_ARGS...]",
        about: "fmt check, clippy -D warnings, tests, docs -D warnings, layering check; \
                stops at the first failure",
        run: ci::main,
    },
    Task {
        name: "layering",
        usage: "cargo xtask layering",
        about: "only the layering check (design.md section 3 dependency rules and \
                offload-core source scan)",
        run: run_layering,
    },
    Task {
        name: "gpu",
        usage: "cargo xtask gpu",
        about: "tier-gpu's CUDA checks: build, the CUDA test (--nocapture), the gpu_bandwidth \
                example; 5-minute budget, each step timed and killed past its limit",
        run: gpu::main,
    },
    Task {
        name: "sim",
        usage: "cargo xtask sim [--ci | --seed S | --seeds N [--base B]] [--trace [PATH]]",
        about: "the deterministic simulator (release build): one seed replays exactly; \
                --ci runs CI's budget of seeds derived from the commit",
        run: sim::main,
    },
    Task {
        name: "help",
        usage: "cargo xtask help",
        about: "this message",
        run: run_help,
    },
];

fn no_args(task: &str, args: &[String]) -> Result<(), Error> {
    match args.first() {
        None => Ok(()),
        Some(arg) => Err(Error::new(format!(
            "`{task}` takes no arguments, got `{arg}`"
        ))),
    }
}

fn run_layering(args: &[String]) -> Result<bool, Error> {
    no_args("layering", args)?;
    let report = layering::check_workspace(&xtask::workspace_root())?;
    println!("{report}");
    Ok(report.is_ok())
}

fn help_text() -> String {
    let mut text = String::from("kvtier developer tasks\n\nUsage:\n");
    for task in TASKS {
        text.push_str(&format!("    {:<42} {}\n", task.usage, task.about));
    }
    text
}

fn run_help(args: &[String]) -> Result<bool, Error> {
    no_args("help", args)?;
    print!("{}", help_text());
    Ok(true)
}

fn find_task(name: &str) -> Result<&'static Task, Error> {
    let name = match name {
        "-h" | "--help" => "help",
        other => other,
    };
    TASKS.iter().find(|task| task.name == name).ok_or_else(|| {
        let known: Vec<&str> = TASKS.iter().map(|task| task.name).collect();
        Error::new(format!(
            "unknown subcommand `{name}`; known subcommands: {} (see `cargo xtask help`)",
            known.join(", ")
        ))
    })
}

fn parse_args() -> Result<Vec<String>, Error> {
    std::env::args_os()
        .skip(1)
        .map(|arg| {
            arg.into_string()
                .map_err(|arg| Error::new(format!("argument {arg:?} is not UTF-8")))
        })
        .collect()
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(err) => {
            eprintln!("error: {err}");
            return ExitCode::from(2);
        }
    };
    let Some((name, rest)) = args.split_first() else {
        print!("{}", help_text());
        return ExitCode::SUCCESS;
    };
    let task = match find_task(name) {
        Ok(task) => task,
        Err(err) => {
            eprintln!("error: {err}");
            return ExitCode::from(2);
        }
    };
    match (task.run)(rest) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_subcommand_is_named_in_the_error() {
        let err = find_task("lint").err().expect("`lint` is not a task");
        let message = err.to_string();
        assert!(message.contains("unknown subcommand `lint`"), "{message}");
        assert!(
            message.contains("ci, layering, gpu, sim, help"),
            "{message}"
        );
    }

    #[test]
    fn help_flags_and_names_find_their_tasks() {
        assert_eq!(find_task("--help").map(|task| task.name), Ok("help"));
        assert_eq!(find_task("-h").map(|task| task.name), Ok("help"));
        assert_eq!(find_task("ci").map(|task| task.name), Ok("ci"));
        assert_eq!(find_task("layering").map(|task| task.name), Ok("layering"));
    }

    #[test]
    fn help_lists_every_task() {
        let text = help_text();
        for task in TASKS {
            assert!(text.contains(task.usage), "{text}");
        }
    }

    #[test]
    fn tasks_without_arguments_reject_extra_ones() {
        let err = run_layering(&["--verbose".to_string()]).unwrap_err();
        assert!(err.to_string().contains("`layering` takes no arguments"));
    }
}
