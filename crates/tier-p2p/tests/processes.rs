//! Two instances in separate processes on loopback. This test binary re-executes itself
//! (`current_exe`) with `KVTIER_P2P_CHILD` naming a child role:
//!
//! * `serve`: a real [`P2pTier`] that publishes chunks, prints `PORT <n>`, and serves until its
//!   standard input closes;
//! * `stall`: a peer played by hand that handshakes, says it holds every key, then on GET sends
//!   half a DATA payload, prints `MIDFETCH`, and stalls until its standard input closes (or the
//!   parent kills it).
//!
//! It has its own `main` (no libtest harness) so that a child runs only its role. It prints
//! libtest-style lines and exits non-zero when a test fails. A filter argument selects tests by
//! substring.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use offload_core::tier::{FailedKey, SlotMemory, Tier, TierFailure, TierLookup};
use offload_core::JobId;
use tier_p2p::frame::{encode_data_prefix, Frame};
use tier_p2p::P2pTier;
use tier_testkit::VecSlotMemory;

use common::Raw;

const ROLE: &str = "KVTIER_P2P_CHILD";
const CHUNKS: &str = "KVTIER_P2P_CHUNKS";
const CHUNK_BYTES: &str = "KVTIER_P2P_CHUNK_BYTES";
const PORT: &str = "KVTIER_P2P_PORT";

/// How long a child may take to start and print its port.
const START_DEADLINE: Duration = Duration::from_secs(20);

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Blocks until standard input closes (the parent dropped it or died).
fn wait_for_stdin_eof() {
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
}

fn announce(line: &str) {
    let mut out = std::io::stdout();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Role `serve`: publish `CHUNKS` chunks of `CHUNK_BYTES`, serve until stdin closes.
fn child_serve() -> i32 {
    let count = env_number(CHUNKS, 8);
    let bytes = env_number(CHUNK_BYTES, 1 << 20) as u32;
    let port = env_number(PORT, 0) as u16;
    let memory: Arc<dyn SlotMemory> = Arc::new(VecSlotMemory::new(count as u32, bytes as usize));
    let mut config = common::config(Vec::new());
    config.listen = SocketAddr::from(([127, 0, 0, 1], port));
    let mut tier = match P2pTier::new(config, Arc::clone(&memory)) {
        Ok(tier) => tier,
        Err(error) => {
            eprintln!("child serve: {error}");
            return 2;
        }
    };
    common::publish(&mut tier, &memory, count, bytes);
    announce(&format!("PORT {}", tier.local_addr().port()));
    wait_for_stdin_eof();
    tier.shutdown();
    0
}

/// Role `stall`: handshake, claim every key, send half of the first GET's first chunk, stall.
fn child_stall() -> i32 {
    let bytes = env_number(CHUNK_BYTES, 4 << 20) as usize;
    let listener = match TcpListener::bind("127.0.0.1:0") {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!("child stall: bind: {error}");
            return 2;
        }
    };
    let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
    announce(&format!("PORT {port}"));
    let Ok((stream, _)) = listener.accept() else {
        return 2;
    };
    let mut raw = Raw::new(stream);
    raw.stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let Ok(Frame::Hello(hello)) = raw.recv() else {
        return 3;
    };
    raw.send(&Raw::hello(&hello.namespace, false));
    loop {
        match raw.recv() {
            Ok(Frame::Have(keys)) => raw.send(&Frame::HaveReply(vec![true; keys.len()])),
            Ok(Frame::Get(keys)) => {
                let Some(&key) = keys.first() else {
                    return 4;
                };
                let mut prefix = Vec::new();
                encode_data_prefix(key, 0, bytes, &mut prefix);
                raw.send_bytes(&prefix);
                raw.send_bytes(&vec![0xAB; bytes / 2]);
                announce("MIDFETCH");
                wait_for_stdin_eof();
                return 0;
            }
            _ => return 5,
        }
    }
}

/// A child process of this binary in `role`, with its stdout lines on a channel.
struct ChildProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl ChildProcess {
    fn spawn(role: &str, env: &[(&str, String)]) -> Self {
        let exe = std::env::current_exe().expect("current_exe");
        let mut command = Command::new(exe);
        command
            .env(ROLE, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (name, value) in env {
            command.env(name, value);
        }
        let mut child = command.spawn().expect("spawn child");
        let stdout = child.stdout.take().expect("child stdout");
        let stdin = child.stdin.take();
        let (sender, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if sender.send(line).is_err() {
                    return;
                }
            }
        });
        Self {
            child,
            stdin,
            lines,
        }
    }

    /// Waits for the line starting with `prefix`; returns the rest.
    fn expect_line(&self, prefix: &str, deadline: Duration) -> String {
        let start = Instant::now();
        loop {
            let left = deadline.saturating_sub(start.elapsed());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return rest.trim().to_owned();
                    }
                }
                Err(error) => panic!("child never printed {prefix:?} within {deadline:?}: {error}"),
            }
        }
    }

    fn addr(&self) -> SocketAddr {
        let port: u16 = self
            .expect_line("PORT ", START_DEADLINE)
            .parse()
            .expect("port number");
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// Closes its stdin and waits for a clean exit.
    fn finish(mut self) {
        drop(self.stdin.take());
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                assert!(status.success(), "child exited with {status}");
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "child did not exit after stdin closed"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGKILL, then reap.
    fn kill(mut self) {
        self.child.kill().expect("kill child");
        let _ = self.child.wait();
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        // A failing test must not leave its child behind.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn memory(slots: u32, bytes: usize) -> Arc<dyn SlotMemory> {
    Arc::new(VecSlotMemory::new(slots, bytes))
}

/// B loads the prefix that A, another process, published: lookups answer `Retry` first, then
/// `Hit`; an absent key is a `Miss`; the loaded bytes are identical.
fn two_processes_share_a_prefix() {
    const COUNT: u64 = 8;
    const BYTES: u32 = 1 << 20;
    let a = ChildProcess::spawn(
        "serve",
        &[
            (CHUNKS, COUNT.to_string()),
            (CHUNK_BYTES, BYTES.to_string()),
        ],
    );
    let peer = a.addr();
    let memory = memory(COUNT as u32, BYTES as usize);
    let mut b = P2pTier::new(common::config(vec![peer]), Arc::clone(&memory)).expect("B starts");
    assert_eq!(
        b.lookup(common::key(0)),
        TierLookup::Retry,
        "first lookup asks the peer"
    );
    let indices: Vec<u64> = (0..COUNT).collect();
    for &i in &indices {
        let answer = common::settle(&mut b, common::key(i), Duration::from_secs(5));
        assert_eq!(answer, TierLookup::Hit, "chunk {i} published by A");
    }
    assert_eq!(
        common::settle(&mut b, common::key(100), Duration::from_secs(5)),
        TierLookup::Miss
    );
    common::submit_load(&mut b, JobId(1), &indices, 0, BYTES);
    let done = common::wait(&mut b, JobId(1), Duration::from_secs(10));
    assert!(done.is_success(), "load failed keys {:?}", done.failed);
    common::expect_loaded(&*memory, &indices, 0, BYTES);
    let stats = b.stats();
    assert_eq!(stats.chunks_fetched, COUNT);
    assert_eq!(stats.bytes_fetched, COUNT * u64::from(BYTES));
    assert_eq!(stats.checksum_mismatches, 0);
    b.shutdown();
    a.finish();
}

/// A peer that stalls in the middle of a DATA payload fails the load at its fetch deadline,
/// is marked down, and later lookups answer `Miss` within their deadline.
fn stalled_peer_fails_the_load_at_its_deadline() {
    const BYTES: u32 = 4 << 20;
    let fake = ChildProcess::spawn("stall", &[(CHUNK_BYTES, BYTES.to_string())]);
    let peer = fake.addr();
    let memory = memory(2, BYTES as usize);
    let mut config = common::config(vec![peer]);
    config.fetch_deadline = Duration::from_secs(1);
    config.handshake_deadline = Duration::from_millis(300);
    let mut b = P2pTier::new(config, memory).expect("B starts");
    assert_eq!(
        common::settle(&mut b, common::key(0), Duration::from_secs(5)),
        TierLookup::Hit
    );
    let start = Instant::now();
    common::submit_load(&mut b, JobId(1), &[0], 0, BYTES);
    fake.expect_line("MIDFETCH", Duration::from_secs(5));
    let done = common::wait(&mut b, JobId(1), Duration::from_secs(5));
    let elapsed = start.elapsed();
    let timed_out = FailedKey::new(common::key(0), TierFailure::Timeout);
    assert_eq!(done.failed, vec![timed_out]);
    assert!(
        elapsed >= Duration::from_millis(900) && elapsed < Duration::from_millis(2500),
        "the stalled load failed after {elapsed:?}, expected about its 1 s deadline"
    );
    let status = &b.peer_status()[0];
    assert!(status.consecutive_failures >= 1, "{status:?}");
    let error = status.last_error.clone().unwrap_or_default();
    assert!(error.contains("no progress"), "last error: {error}");
    assert_eq!(
        common::settle(&mut b, common::key(1), Duration::from_secs(5)),
        TierLookup::Miss,
        "a stalled peer cannot answer"
    );
    assert!(b.stats().peer_failures >= 1);
    b.shutdown();
    fake.finish();
}

/// A peer killed in the middle of a fetch fails the load at once (long before its deadline),
/// lookups then miss, and when the peer restarts on the same port it is reconnected and serves.
fn killed_peer_fails_fast_and_a_restart_is_reconnected() {
    const BYTES: u32 = 4 << 20;
    let fake = ChildProcess::spawn("stall", &[(CHUNK_BYTES, BYTES.to_string())]);
    let peer = fake.addr();
    let memory = memory(2, BYTES as usize);
    let mut config = common::config(vec![peer]);
    config.fetch_deadline = Duration::from_secs(20);
    let mut b = P2pTier::new(config, Arc::clone(&memory)).expect("B starts");
    common::submit_load(&mut b, JobId(1), &[0], 0, BYTES);
    fake.expect_line("MIDFETCH", Duration::from_secs(5));
    let killed = Instant::now();
    fake.kill();
    let done = common::wait(&mut b, JobId(1), Duration::from_secs(5));
    assert_eq!(done.failed_keys().collect::<Vec<_>>(), vec![common::key(0)]);
    assert!(
        killed.elapsed() < Duration::from_secs(2),
        "a dead peer took {:?} to fail the load",
        killed.elapsed()
    );
    assert_eq!(
        common::settle(&mut b, common::key(0), Duration::from_secs(5)),
        TierLookup::Miss,
        "the dead peer holds nothing"
    );
    let restarted = ChildProcess::spawn(
        "serve",
        &[
            (CHUNKS, "2".to_owned()),
            (CHUNK_BYTES, BYTES.to_string()),
            (PORT, peer.port().to_string()),
        ],
    );
    assert_eq!(restarted.addr(), peer, "restarted on the same port");
    common::eventually(
        "lookup hits the restarted peer",
        Duration::from_secs(10),
        || common::settle(&mut b, common::key(0), Duration::from_secs(5)) == TierLookup::Hit,
    );
    common::submit_load(&mut b, JobId(2), &[0, 1], 0, BYTES);
    let done = common::wait(&mut b, JobId(2), Duration::from_secs(10));
    assert!(
        done.is_success(),
        "load from the restarted peer: {:?}",
        done.failed
    );
    common::expect_loaded(&*memory, &[0, 1], 0, BYTES);
    let status = &b.peer_status()[0];
    assert!(
        status.connected && status.consecutive_failures == 0,
        "{status:?}"
    );
    b.shutdown();
    restarted.finish();
}

const TESTS: &[(&str, fn())] = &[
    ("two_processes_share_a_prefix", two_processes_share_a_prefix),
    (
        "stalled_peer_fails_the_load_at_its_deadline",
        stalled_peer_fails_the_load_at_its_deadline,
    ),
    (
        "killed_peer_fails_fast_and_a_restart_is_reconnected",
        killed_peer_fails_fast_and_a_restart_is_reconnected,
    ),
];

/// The test-name filter among libtest-style arguments, if any.
fn filter() -> Option<String> {
    const WITH_VALUE: &[&str] = &[
        "--test-threads",
        "--skip",
        "--format",
        "--color",
        "--logfile",
        "-Z",
    ];
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if WITH_VALUE.contains(&arg.as_str()) {
            args.next();
        } else if !arg.starts_with('-') {
            return Some(arg);
        }
    }
    None
}

fn main() {
    if let Ok(role) = std::env::var(ROLE) {
        let code = match role.as_str() {
            "serve" => child_serve(),
            "stall" => child_stall(),
            other => {
                eprintln!("unknown child role {other:?}");
                64
            }
        };
        std::process::exit(code);
    }
    if std::env::args().any(|a| a == "--list") {
        for (name, _) in TESTS {
            println!("{name}: test");
        }
        return;
    }
    let filter = filter();
    let selected: Vec<_> = TESTS
        .iter()
        .filter(|(name, _)| filter.as_ref().is_none_or(|f| name.contains(f.as_str())))
        .collect();
    println!("\nrunning {} tests", selected.len());
    let mut failed = Vec::new();
    for (name, test) in &selected {
        let start = Instant::now();
        let result = std::panic::catch_unwind(test);
        let verdict = if result.is_ok() { "ok" } else { "FAILED" };
        println!("test {name} ... {verdict} ({:.2?})", start.elapsed());
        if result.is_err() {
            failed.push(*name);
        }
    }
    let passed = selected.len() - failed.len();
    let status = if failed.is_empty() { "ok" } else { "FAILED" };
    println!(
        "\ntest result: {status}. {passed} passed; {} failed; 0 ignored; 0 measured; {} filtered out\n",
        failed.len(),
        TESTS.len() - selected.len()
    );
    if !failed.is_empty() {
        println!("failures: {failed:?}");
        std::process::exit(101);
    }
}
