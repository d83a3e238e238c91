//! A progress line on stderr, redrawn in place; silent with `--json` or when stderr is not a
//! terminal, so pipes and tests see clean output.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Shortest time between two redraws.
const REDRAW_EVERY: Duration = Duration::from_millis(100);

/// The progress line of one command.
#[derive(Debug)]
pub struct Progress {
    enabled: bool,
    drawn: bool,
    last: Option<Instant>,
}

impl Progress {
    /// A progress line, shown only if `wanted` and stderr is a terminal.
    pub fn new(wanted: bool) -> Self {
        Self {
            enabled: wanted && std::io::stderr().is_terminal(),
            drawn: false,
            last: None,
        }
    }

    /// Redraws the line with `message` (at most every 100 ms).
    pub fn set(&mut self, message: &str) {
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        if self.last.is_some_and(|t| now - t < REDRAW_EVERY) {
            return;
        }
        self.last = Some(now);
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[2K{message}");
        let _ = err.flush();
        self.drawn = true;
    }

    /// A bar of `done` out of `total` with a label, e.g. `[#####.....] 50/100 requests`.
    pub fn bar(&mut self, label: &str, done: u64, total: u64) {
        if !self.enabled {
            return;
        }
        const WIDTH: u64 = 30;
        let filled = (done.min(total) * WIDTH)
            .checked_div(total)
            .unwrap_or(WIDTH);
        let bar: String = (0..WIDTH)
            .map(|i| if i < filled { '#' } else { '.' })
            .collect();
        self.set(&format!("[{bar}] {done}/{total} {label}"));
    }

    /// Clears the line.
    pub fn finish(&mut self) {
        if self.drawn {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K");
            let _ = err.flush();
            self.drawn = false;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disabled_progress_draws_nothing() {
        let mut p = Progress::new(false);
        p.set("x");
        p.bar("requests", 1, 2);
        assert!(!p.drawn && !p.enabled);
    }
}
