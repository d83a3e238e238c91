//! How a posted NIXL transfer is waited for and, when its job stops, ended: the ordering that
//! keeps a NIC from writing a host slot after the slot went back to the host pool. Pure logic
//! over a [`Posted`] transfer, so that it is tested with a fake that stays active; `nixl.rs`
//! runs it over a real NIXL request.
//!
//! A request that is dropped is released in NIXL, and NIXL refuses to release an active one
//! (`NIXL_ERR_REPOST_ACTIVE`): the transfer goes on in UCX, writing into the slot, while the
//! handle that could still see it is gone. So a transfer whose job stopped (cancel, shutdown,
//! deadline) is polled until NIXL says it is over (done or failed), and only then dropped; its
//! slots may be reused after that. If it is still active after a grace period, it is handed back
//! to the caller as [`Waited::Stuck`], to be kept (never dropped while active) with its slots
//! quarantined: never handed out again until NIXL ends it.

#![cfg_attr(not(feature = "nixl"), allow(dead_code))]

use std::time::{Duration, Instant};

/// Status polls that only yield the core, before each poll sleeps [`BACKOFF`].
const SPINS: u32 = 256;
/// The pause between status polls of a transfer that is taking long.
const BACKOFF: Duration = Duration::from_micros(50);

/// NIXL's word on a posted transfer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum TransferState {
    /// Still moving bytes (NIXL_IN_PROG): the local memory may still be written.
    Active,
    /// Completed successfully.
    Done,
    /// Ended with an error; NIXL no longer touches the memory.
    Failed(String),
}

/// A posted transfer. Dropping it releases it in NIXL, which is allowed only once
/// [`Posted::state`] said it is no longer [`TransferState::Active`].
pub(crate) trait Posted {
    /// Asks NIXL where the transfer stands.
    fn state(&mut self) -> TransferState;
}

/// How waiting for a posted transfer ended.
#[derive(Debug)]
pub(crate) enum Waited<T> {
    /// Completed successfully.
    Done,
    /// NIXL failed the transfer (it touches the memory no more).
    Failed(String),
    /// The job stopped (cancel, shutdown or deadline) and NIXL then ended the transfer: the
    /// transfer was released and its memory may be reused.
    Stopped,
    /// The job stopped, but NIXL still said active when the grace period ran out. The transfer
    /// comes back unreleased: the caller keeps it and its memory (never reused) until
    /// [`Posted::state`] says it is over.
    Stuck(T),
}

/// Waits for `transfer` until it ends, `stop()` says its job stopped, or `deadline` passes;
/// a stopped transfer is ended by [`settle`] within `grace`.
pub(crate) fn wait<T: Posted>(
    mut transfer: T,
    deadline: Instant,
    stop: &dyn Fn() -> bool,
    grace: Duration,
) -> Waited<T> {
    let mut polls = 0u32;
    loop {
        match transfer.state() {
            TransferState::Done => return Waited::Done,
            TransferState::Failed(reason) => return Waited::Failed(reason),
            TransferState::Active => {}
        }
        if stop() || Instant::now() >= deadline {
            return settle(transfer, grace);
        }
        pause(&mut polls);
    }
}

/// Ends a transfer whose job stopped: polls it until NIXL says it is over, then releases it
/// ([`Waited::Stopped`]); still active after `grace`: [`Waited::Stuck`], unreleased.
pub(crate) fn settle<T: Posted>(mut transfer: T, grace: Duration) -> Waited<T> {
    let until = Instant::now() + grace;
    let mut polls = 0u32;
    loop {
        if transfer.state() != TransferState::Active {
            // Over: releasing it now succeeds, and nothing writes the memory any more.
            drop(transfer);
            return Waited::Stopped;
        }
        if Instant::now() >= until {
            return Waited::Stuck(transfer);
        }
        pause(&mut polls);
    }
}

/// Spins briefly between polls (completions on a fast link come within microseconds), then
/// backs off so that a long transfer does not hold a core the transport may need.
fn pause(polls: &mut u32) {
    *polls = polls.saturating_add(1);
    if *polls < SPINS {
        std::thread::yield_now();
    } else {
        std::thread::sleep(BACKOFF);
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;

    use super::*;

    /// What the fake's owner can see after the fake is gone.
    #[derive(Debug, Default)]
    struct Seen {
        polls: Cell<u32>,
        /// Dropped (released) while it still said active: the bug this module prevents.
        released_while_active: Cell<bool>,
        released: Cell<bool>,
    }

    /// A transfer that says active for `active_polls` polls, then `end`.
    #[derive(Debug)]
    struct Fake {
        active_polls: Option<u32>,
        end: TransferState,
        seen: Rc<Seen>,
    }

    impl Fake {
        /// Active for `active_polls` polls (`None`: forever), then `end`.
        fn new(active_polls: Option<u32>, end: TransferState) -> (Self, Rc<Seen>) {
            let seen = Rc::new(Seen::default());
            let fake = Self {
                active_polls,
                end,
                seen: Rc::clone(&seen),
            };
            (fake, seen)
        }

        fn active(&self) -> bool {
            self.active_polls.is_none_or(|n| self.seen.polls.get() < n)
        }
    }

    impl Posted for Fake {
        fn state(&mut self) -> TransferState {
            let active = self.active();
            self.seen.polls.set(self.seen.polls.get() + 1);
            if active {
                TransferState::Active
            } else {
                self.end.clone()
            }
        }
    }

    impl Drop for Fake {
        fn drop(&mut self) {
            self.seen.released.set(true);
            if self.active() {
                self.seen.released_while_active.set(true);
            }
        }
    }

    const LONG: Duration = Duration::from_secs(600);

    fn later() -> Instant {
        Instant::now() + LONG
    }

    #[test]
    fn a_cancelled_transfer_is_released_only_after_nixl_ends_it() {
        // Active for 40 polls, the job cancelled from the start: the wait must keep polling
        // until the transfer is over before it releases it.
        let (fake, seen) = Fake::new(Some(40), TransferState::Done);
        let outcome = wait(fake, later(), &|| true, LONG);
        assert!(matches!(outcome, Waited::Stopped), "{outcome:?}");
        assert!(
            !seen.released_while_active.get(),
            "released while NIXL still said active (after {} polls)",
            seen.polls.get()
        );
        assert!(seen.released.get());
        assert_eq!(seen.polls.get(), 41);
    }

    #[test]
    fn a_transfer_past_its_deadline_is_released_only_after_nixl_ends_it() {
        // The deadline has passed; NIXL ends the transfer with an error 10 polls later.
        let (fake, seen) = Fake::new(Some(10), TransferState::Failed("remote gone".into()));
        let outcome = wait(fake, Instant::now(), &|| false, LONG);
        assert!(matches!(outcome, Waited::Stopped), "{outcome:?}");
        assert!(!seen.released_while_active.get());
        assert!(seen.released.get());
    }

    #[test]
    fn a_transfer_that_never_ends_comes_back_unreleased_after_the_grace() {
        let (fake, seen) = Fake::new(None, TransferState::Done);
        let outcome = wait(fake, later(), &|| true, Duration::from_millis(1));
        let Waited::Stuck(stuck) = outcome else {
            panic!("expected Stuck, got {outcome:?}");
        };
        assert!(!seen.released.get(), "a stuck transfer was released");
        // The caller keeps it; it is released only when it ends (here the test lets it go).
        std::mem::forget(stuck);
    }

    #[test]
    fn a_transfer_that_ends_is_reported_without_waiting_for_stop() {
        let (fake, _) = Fake::new(Some(3), TransferState::Done);
        assert!(matches!(wait(fake, later(), &|| false, LONG), Waited::Done));
        let (fake, _) = Fake::new(Some(0), TransferState::Failed("refused".into()));
        let outcome = wait(fake, later(), &|| false, LONG);
        assert!(
            matches!(outcome, Waited::Failed(ref r) if r == "refused"),
            "{outcome:?}"
        );
    }
}
