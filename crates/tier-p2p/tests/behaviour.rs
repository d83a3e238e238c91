//! Behaviour of the peer tier beyond the conformance suite: lookups batched per poll, LRU
//! eviction of published chunks, integrity checks on fetched bytes (a bad checksum or length is
//! never loaded), GETs pipelined within and across jobs (and an answer sent ahead for a job that
//! stopped, or for chunks since evicted here, never read as another request's), idle connections replaced before the peer drops them, and a shutdown that does not
//! wait for a stalled peer's deadline.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use offload_core::tier::{FailedKey, SlotMemory, Tier, TierCompletion, TierFailure, TierLookup};
use offload_core::{ChunkKey, JobId, SlotId};
use tier_p2p::frame::{encode_data_prefix, Frame};
use tier_p2p::{checksum, P2pConfig, P2pTier};

use common::Raw;

const BYTES: u32 = 64 * 1024;
const WAIT: Duration = Duration::from_secs(5);

fn memory(slots: u32) -> Arc<dyn SlotMemory> {
    Arc::new(tier_testkit::VecSlotMemory::new(slots, BYTES as usize))
}

fn instance(
    peers: Vec<SocketAddr>,
    edit: impl FnOnce(&mut P2pConfig),
) -> (P2pTier, Arc<dyn SlotMemory>) {
    let mut config = common::config(peers);
    edit(&mut config);
    let memory = memory(8);
    let tier = P2pTier::new(config, Arc::clone(&memory)).expect("tier starts");
    (tier, memory)
}

#[test]
fn lookups_of_one_step_go_out_as_one_request_per_peer() {
    let (mut a, memory) = instance(Vec::new(), |_| {});
    common::publish(&mut a, &memory, 8, BYTES);
    let (mut b, _) = instance(vec![a.local_addr()], |_| {});
    for i in 0..10 {
        assert_eq!(b.lookup(common::key(i)), TierLookup::Retry);
    }
    let mut out = Vec::new();
    b.poll(&mut out);
    for i in 0..10 {
        let expected = if i < 8 {
            TierLookup::Hit
        } else {
            TierLookup::Miss
        };
        assert_eq!(
            common::settle(&mut b, common::key(i), WAIT),
            expected,
            "key {i}"
        );
    }
    let stats = b.stats();
    assert_eq!(stats.have_requests, 1, "{stats:?}");
    assert_eq!(stats.lookup_keys_asked, 10);
    assert_eq!((stats.lookup_hits, stats.lookup_misses), (8, 2));
}

#[test]
fn published_chunks_are_evicted_least_recently_used_first() {
    let (mut a, memory) = instance(Vec::new(), |c| c.published_bytes_max = 3 * BYTES as usize);
    common::publish(&mut a, &memory, 3, BYTES);
    a.touch(&[common::key(0), common::key(1)]);
    // Chunk 2 is now the least recently used; publishing chunk 3 evicts it.
    tier_testkit::fill_slot(&*memory, SlotId(3), BYTES as usize, common::seed(3));
    a.submit(offload_core::tier::TierJob {
        id: JobId(7),
        request: None,
        op: offload_core::tier::TierOp::Store,
        chunks: vec![offload_core::TierChunk::new(
            common::key(3),
            SlotId(3),
            BYTES,
        )],
    })
    .expect("store accepted");
    assert!(common::wait(&mut a, JobId(7), WAIT).is_success());
    assert!(a.is_published(common::key(0)) && a.is_published(common::key(1)));
    assert!(!a.is_published(common::key(2)));
    assert!(a.is_published(common::key(3)));
    let stats = a.stats();
    assert_eq!((stats.evictions, stats.published_chunks), (1, 3));
    assert_eq!(stats.published_bytes, 3 * u64::from(BYTES));
    let (mut b, _) = instance(vec![a.local_addr()], |_| {});
    assert_eq!(
        common::settle(&mut b, common::key(2), WAIT),
        TierLookup::Miss
    );
    assert_eq!(
        common::settle(&mut b, common::key(3), WAIT),
        TierLookup::Hit
    );
}

/// A peer played by hand: handshakes, then answers each GET with `answer`, until the client
/// closes the connection.
fn fake_peer(
    answer: impl Fn(&mut Raw, &[ChunkKey]) + Send + 'static,
) -> (SocketAddr, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let thread = std::thread::spawn(move || {
        let mut raw = accept_handshaken(&listener);
        loop {
            match raw.recv() {
                Ok(Frame::Have(keys)) => raw.send(&Frame::HaveReply(vec![true; keys.len()])),
                Ok(Frame::Get(keys)) => answer(&mut raw, &keys),
                _ => return,
            }
        }
    });
    (addr, thread)
}

/// Accepts the next client connection (within [`WAIT`], so that a client that never comes fails
/// the test instead of hanging it) and answers its handshake (no secret).
fn accept_handshaken(listener: &TcpListener) -> Raw {
    listener
        .set_nonblocking(true)
        .expect("nonblocking listener");
    let start = Instant::now();
    let stream = loop {
        match listener.accept() {
            Ok((stream, _)) => break stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && start.elapsed() < WAIT => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("no client connection within {WAIT:?}: {e}"),
        }
    };
    stream.set_nonblocking(false).expect("blocking stream");
    let mut raw = Raw::new(stream);
    let Ok(Frame::Hello(hello)) = raw.recv() else {
        panic!("client opens with HELLO");
    };
    raw.send(&Raw::hello(&hello.namespace, false));
    raw
}

/// Sends chunk `index` of the common test data (its bytes and right checksum).
fn send_good(raw: &mut Raw, index: u64) {
    let bytes = tier_testkit::pattern(common::seed(index), BYTES as usize);
    send_chunk(raw, common::key(index), checksum(&bytes), &bytes);
}

/// Answers a GET of chunk `index` (its DATA and END), unless the client has already closed the
/// connection (it may drop a stream whose answer it no longer wants); then waits for the close.
fn answer_unless_closed(mut raw: Raw, index: u64) {
    let bytes = tier_testkit::pattern(common::seed(index), BYTES as usize);
    let mut answer = Vec::new();
    encode_data_prefix(
        common::key(index),
        checksum(&bytes),
        bytes.len(),
        &mut answer,
    );
    answer.extend_from_slice(&bytes);
    Frame::End { sent: 1 }.encode(&mut answer);
    if std::io::Write::write_all(&mut raw.stream, &answer).is_ok() {
        raw.errors_until_closed();
    }
}

/// A fake peer's first connection for two queued one-chunk jobs: waits for `go` (both jobs
/// queued), then the handshake, job 1's GET of chunk `first` and job 2's GET sent ahead of chunk
/// `ahead`; says so on `asked`; waits for `go` again, then answers both (the second unless the
/// client has closed the connection meanwhile).
fn serve_one_then_one_ahead(
    listener: &TcpListener,
    go: &mpsc::Receiver<()>,
    asked: &mpsc::Sender<()>,
    first: u64,
    ahead: u64,
) -> Result<(), String> {
    go.recv_timeout(WAIT).map_err(|e| format!("go: {e}"))?;
    let mut raw = accept_handshaken(listener);
    expect_get(&mut raw, &[first], "job 1")?;
    expect_get(&mut raw, &[ahead], "job 2, ahead")?;
    asked.send(()).map_err(|e| format!("asked: {e}"))?;
    go.recv_timeout(WAIT).map_err(|e| format!("go: {e}"))?;
    send_good(&mut raw, first);
    raw.send(&Frame::End { sent: 1 });
    answer_unless_closed(raw, ahead);
    Ok(())
}

/// Receives the next frame, which must be a GET of chunks `indices`.
fn expect_get(raw: &mut Raw, indices: &[u64], when: &str) -> Result<(), String> {
    let want: Vec<ChunkKey> = indices.iter().map(|&i| common::key(i)).collect();
    match raw.recv() {
        Ok(Frame::Get(keys)) if keys == want => Ok(()),
        other => Err(format!(
            "{when}: expected GET of {indices:?}, got {other:?}"
        )),
    }
}

#[test]
fn the_next_jobs_get_goes_out_while_the_current_answer_streams() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let peer = std::thread::spawn(move || -> Result<(), String> {
        // Both jobs are queued before the client's handshake completes.
        go_rx.recv_timeout(WAIT).map_err(|e| format!("go: {e}"))?;
        let mut raw = accept_handshaken(&listener);
        expect_get(&mut raw, &[0, 1], "first request")?;
        send_good(&mut raw, 0);
        // The client asks for job 2 before the answer to job 1 is complete (Raw reads time out
        // after 5 s).
        expect_get(&mut raw, &[2, 3], "before job 1's answer ended")?;
        send_good(&mut raw, 1);
        raw.send(&Frame::End { sent: 2 });
        send_good(&mut raw, 2);
        send_good(&mut raw, 3);
        raw.send(&Frame::End { sent: 2 });
        raw.errors_until_closed();
        Ok(())
    });
    let (mut b, memory) = instance(vec![addr], |c| c.handshake_deadline = WAIT);
    common::submit_load(&mut b, JobId(1), &[0, 1], 0, BYTES);
    common::submit_load(&mut b, JobId(2), &[2, 3], 2, BYTES);
    go_tx.send(()).expect("peer waits");
    let done = common::wait_all(&mut b, &[JobId(1), JobId(2)], WAIT);
    b.shutdown();
    peer.join().expect("fake peer").expect("requests pipelined");
    assert!(done.iter().all(TierCompletion::is_success), "{done:?}");
    common::expect_loaded(&*memory, &[0, 1, 2, 3], 0, BYTES);
    assert_eq!(b.stats().chunks_fetched, 4);
}

#[test]
fn a_jobs_next_batch_is_asked_for_before_the_current_answer_is_read() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let peer = std::thread::spawn(move || -> Result<(), String> {
        let mut raw = accept_handshaken(&listener);
        expect_get(&mut raw, &[0], "batch 1")?;
        expect_get(&mut raw, &[1], "batch 2, before batch 1's answer")?;
        send_good(&mut raw, 0);
        raw.send(&Frame::End { sent: 1 });
        expect_get(&mut raw, &[2], "batch 3, before batch 2's answer")?;
        for index in [1, 2] {
            send_good(&mut raw, index);
            raw.send(&Frame::End { sent: 1 });
        }
        raw.errors_until_closed();
        Ok(())
    });
    let (mut b, memory) = instance(vec![addr], |c| c.keys_per_request_max = 1);
    common::submit_load(&mut b, JobId(1), &[0, 1, 2], 0, BYTES);
    let done = common::wait(&mut b, JobId(1), WAIT);
    b.shutdown();
    peer.join().expect("fake peer").expect("batches pipelined");
    assert!(done.is_success(), "{done:?}");
    common::expect_loaded(&*memory, &[0, 1, 2], 0, BYTES);
}

#[test]
fn a_job_cancelled_after_its_get_went_ahead_leaves_no_stray_answer() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (asked_tx, asked_rx) = mpsc::channel::<()>();
    let peer = std::thread::spawn(move || -> Result<(), String> {
        // Job 2 is cancelled while its GET is ahead, but its answer was asked for.
        serve_one_then_one_ahead(&listener, &go_rx, &asked_tx, 0, 1)?;
        // What comes next (a lookup, then job 3) must come on a fresh connection: the old one
        // still carried job 2's answer.
        let mut raw = accept_handshaken(&listener);
        match raw.recv() {
            Ok(Frame::Have(keys)) if keys == [common::key(2)] => {
                raw.send(&Frame::HaveReply(vec![true]));
            }
            other => return Err(format!("lookup, new connection: got {other:?}")),
        }
        expect_get(&mut raw, &[2], "job 3, new connection")?;
        send_good(&mut raw, 2);
        raw.send(&Frame::End { sent: 1 });
        raw.errors_until_closed();
        Ok(())
    });
    let (mut b, memory) = instance(vec![addr], |c| c.handshake_deadline = WAIT);
    common::submit_load(&mut b, JobId(1), &[0], 0, BYTES);
    common::submit_load(&mut b, JobId(2), &[1], 1, BYTES);
    go_tx.send(()).expect("peer waits");
    asked_rx.recv_timeout(WAIT).expect("job 2's GET went ahead");
    b.cancel(JobId(2));
    go_tx.send(()).expect("peer waits");
    let done = common::wait_all(&mut b, &[JobId(1), JobId(2)], WAIT);
    assert!(done[0].is_success(), "{done:?}");
    assert_eq!(
        done[1].failed,
        vec![FailedKey::new(common::key(1), TierFailure::Cancelled)],
        "job 2 was cancelled"
    );
    assert_eq!(
        common::settle(&mut b, common::key(2), WAIT),
        TierLookup::Hit
    );
    common::submit_load(&mut b, JobId(3), &[2], 2, BYTES);
    let third = common::wait(&mut b, JobId(3), WAIT);
    b.shutdown();
    peer.join().expect("fake peer").expect("fake peer's script");
    assert!(third.is_success(), "{third:?}");
    common::expect_loaded(&*memory, &[0], 0, BYTES);
    common::expect_loaded(&*memory, &[2], 2, BYTES);
    assert_eq!(b.stats().peer_failures, 0, "{:?}", b.peer_status());
}

#[test]
fn a_get_sent_ahead_for_chunks_since_evicted_here_is_dropped_not_misread() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (asked_tx, asked_rx) = mpsc::channel::<()>();
    let peer = std::thread::spawn(move || -> Result<(), String> {
        // Chunk 1 of job 2 is published at the client, so only chunk 6 is asked for ahead.
        serve_one_then_one_ahead(&listener, &go_rx, &asked_tx, 5, 6)?;
        // Chunk 1 was evicted before job 2's turn: it asks for both, on a fresh connection.
        let mut raw = accept_handshaken(&listener);
        expect_get(&mut raw, &[1, 6], "job 2, new connection")?;
        send_good(&mut raw, 1);
        send_good(&mut raw, 6);
        raw.send(&Frame::End { sent: 2 });
        raw.errors_until_closed();
        Ok(())
    });
    let (mut b, memory) = instance(vec![addr], |c| {
        c.published_bytes_max = 2 * BYTES as usize;
        c.handshake_deadline = WAIT;
    });
    common::publish(&mut b, &memory, 2, BYTES);
    common::submit_load(&mut b, JobId(1), &[5], 4, BYTES);
    common::submit_load(&mut b, JobId(2), &[1, 6], 5, BYTES);
    go_tx.send(()).expect("peer waits");
    asked_rx.recv_timeout(WAIT).expect("job 2's GET went ahead");
    // Publishing chunks 2 and 3 evicts chunks 0 and 1 (least recently used first).
    common::publish(&mut b, &memory, 4, BYTES);
    assert!(!b.is_published(common::key(1)));
    go_tx.send(()).expect("peer waits");
    let done = common::wait_all(&mut b, &[JobId(1), JobId(2)], WAIT);
    b.shutdown();
    peer.join().expect("fake peer").expect("fake peer's script");
    assert!(done.iter().all(TierCompletion::is_success), "{done:?}");
    common::expect_loaded(&*memory, &[5, 1, 6], 4, BYTES);
    let stats = b.stats();
    assert_eq!(
        (stats.chunks_fetched, stats.peer_failures),
        (3, 0),
        "{stats:?}"
    );
}

fn send_chunk(raw: &mut Raw, key: ChunkKey, sum: u64, payload: &[u8]) {
    let mut prefix = Vec::new();
    encode_data_prefix(key, sum, payload.len(), &mut prefix);
    raw.send_bytes(&prefix);
    raw.send_bytes(payload);
}

#[test]
fn bytes_that_do_not_verify_are_never_loaded() {
    let (addr, peer) = fake_peer(|raw, keys| {
        let good = tier_testkit::pattern(common::seed(2), BYTES as usize);
        // Key 0: a checksum that does not match its bytes.
        send_chunk(raw, keys[0], checksum(&good) ^ 1, &good);
        // Key 1: one byte short of the length the job asked for.
        let short = &good[..BYTES as usize - 1];
        send_chunk(raw, keys[1], checksum(short), short);
        // Key 2: right.
        send_chunk(raw, keys[2], checksum(&good), &good);
        raw.send(&Frame::End { sent: 3 });
    });
    let (mut b, memory) = instance(vec![addr], |_| {});
    let chunks = common::submit_load(&mut b, JobId(1), &[0, 1, 2], 0, BYTES);
    let done = common::wait(&mut b, JobId(1), WAIT);
    assert_eq!(
        done.failed,
        vec![
            FailedKey::new(chunks[0].key, TierFailure::Corrupt),
            FailedKey::new(chunks[1].key, TierFailure::Corrupt)
        ]
    );
    common::expect_loaded(&*memory, &[2], 2, BYTES);
    let stats = b.stats();
    assert_eq!(stats.checksum_mismatches, 1, "{stats:?}");
    assert_eq!(stats.chunks_fetched, 1);
    assert_eq!(stats.peer_failures, 0, "bad chunks fail keys, not the peer");
    b.shutdown();
    peer.join().expect("fake peer");
}

/// A GET is answered in request order, each key at most once: a DATA frame for a key the
/// client already passed (out of order, or repeated) is a protocol error of the peer. The chunk
/// already received stays loaded; the one it skipped fails; nothing else is written.
#[test]
fn data_out_of_request_order_or_repeated_fails_the_peer() {
    for repeat in [false, true] {
        let (addr, peer) = fake_peer(move |raw, keys| {
            let index = |key: ChunkKey| (0..3).find(|&i| common::key(i) == key).expect("asked");
            let again = if repeat { keys[1] } else { keys[0] };
            let mut answer = Vec::new();
            for i in [index(keys[1]), index(again)] {
                let bytes = tier_testkit::pattern(common::seed(i), BYTES as usize);
                let key = common::key(i);
                encode_data_prefix(key, checksum(&bytes), bytes.len(), &mut answer);
                answer.extend_from_slice(&bytes);
            }
            Frame::End { sent: 2 }.encode(&mut answer);
            // The client may close the connection at the second DATA frame.
            let _ = std::io::Write::write_all(&mut raw.stream, &answer);
        });
        let (mut b, memory) = instance(vec![addr], |_| {});
        tier_testkit::fill_slot(&*memory, SlotId(0), BYTES as usize, 77);
        let chunks = common::submit_load(&mut b, JobId(1), &[0, 1], 0, BYTES);
        let done = common::wait(&mut b, JobId(1), WAIT);
        let failed: Vec<_> = done.failed_keys().collect();
        assert_eq!(failed, vec![chunks[0].key], "repeat {repeat}");
        common::expect_loaded(&*memory, &[1], 1, BYTES);
        let untouched = tier_testkit::first_mismatch(&*memory, SlotId(0), BYTES as usize, 77);
        assert_eq!(untouched, None, "repeat {repeat}: slot 0 was written");
        let stats = b.stats();
        assert_eq!(stats.peer_failures, 1, "repeat {repeat}: {stats:?}");
        assert_eq!(stats.chunks_fetched, 1, "repeat {repeat}: {stats:?}");
        b.shutdown();
        peer.join().expect("fake peer");
    }
}

#[test]
fn idle_connections_are_replaced_before_the_peer_closes_them() {
    let idle = Duration::from_millis(200);
    let (mut a, memory) = instance(Vec::new(), |c| c.idle_timeout = idle);
    common::publish(&mut a, &memory, 2, BYTES);
    let (mut b, _) = instance(vec![a.local_addr()], |c| c.idle_timeout = idle);
    assert_eq!(
        common::settle(&mut b, common::key(0), WAIT),
        TierLookup::Hit
    );
    // Idle past the server's timeout: it has closed its end by now.
    std::thread::sleep(idle * 2);
    assert_eq!(
        common::settle(&mut b, common::key(1), WAIT),
        TierLookup::Hit
    );
    common::submit_load(&mut b, JobId(1), &[0, 1], 0, BYTES);
    assert!(common::wait(&mut b, JobId(1), WAIT).is_success());
    assert_eq!(b.stats().peer_failures, 0, "{:?}", b.peer_status());
}

#[test]
fn shutdown_does_not_wait_for_a_stalled_peer() {
    let (stalled_tx, stalled_rx) = mpsc::channel();
    let (addr, peer) = fake_peer(move |raw, keys| {
        let mut prefix = Vec::new();
        encode_data_prefix(keys[0], 0, BYTES as usize, &mut prefix);
        raw.send_bytes(&prefix);
        raw.send_bytes(&[0u8; 100]);
        let _ = stalled_tx.send(());
    });
    let (mut b, _) = instance(vec![addr], |c| c.fetch_deadline = Duration::from_secs(30));
    let chunks = common::submit_load(&mut b, JobId(1), &[0], 0, BYTES);
    stalled_rx
        .recv_timeout(WAIT)
        .expect("peer stalls mid-payload");
    let start = Instant::now();
    b.shutdown();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "shutdown waited {:?} for a stalled peer",
        start.elapsed()
    );
    let mut out: Vec<TierCompletion> = Vec::new();
    b.poll(&mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(
        out[0].failed,
        vec![FailedKey::new(chunks[0].key, TierFailure::Cancelled)]
    );
    peer.join().expect("fake peer");
}

#[test]
fn shutdown_skips_queued_pushes_instead_of_waiting_for_each() {
    // Issue 18 item 5: at shutdown the client thread may hold up to 64 queued push batches, each
    // allowed `fetch_deadline` against a peer that does not answer. Queued batches are skipped
    // (pushes are best effort) and counted; only the push under way is waited for.
    let silent: Vec<TcpListener> = (0..3)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    let peers = silent.iter().map(|l| l.local_addr().unwrap()).collect();
    let mut config = common::config(peers);
    config.owners = 1;
    let memory: Arc<dyn SlotMemory> = Arc::new(tier_testkit::VecSlotMemory::new(8, 4096));
    let mut tier = P2pTier::new(config, Arc::clone(&memory)).expect("tier starts");
    for i in 0..4u64 {
        tier_testkit::fill_slot(&*memory, SlotId(i as u32), 4096, common::seed(i));
        let id = JobId(900 + i);
        tier.submit(offload_core::tier::TierJob {
            id,
            request: None,
            op: offload_core::tier::TierOp::Store,
            chunks: vec![offload_core::TierChunk::new(
                common::key(i),
                SlotId(i as u32),
                4096,
            )],
        })
        .expect("publish accepted");
        assert!(common::wait(&mut tier, id, Duration::from_secs(20)).is_success());
    }
    // The first push may be under way on a silent peer (up to fetch_deadline, 5 s) or, on a
    // busy machine, not yet started; the batches queued behind it are skipped either way.
    tier.shutdown();
    let stats = tier.stats();
    assert!(
        (3..=4).contains(&stats.pushes_skipped_at_shutdown),
        "the queued batches (one chunk each) are skipped: {stats:?}"
    );
}

/// Host memory whose slot size can shrink after the tier was made (the tier checked chunk
/// lengths against the size at creation): a job's chunk then no longer fits its slot, which the
/// client must never write past.
struct ShrinkingMemory {
    inner: tier_testkit::VecSlotMemory,
    slot_bytes: std::sync::atomic::AtomicUsize,
}

impl SlotMemory for ShrinkingMemory {
    fn slot_bytes(&self) -> usize {
        self.slot_bytes.load(std::sync::atomic::Ordering::Relaxed)
    }
    fn slot_count(&self) -> u32 {
        self.inner.slot_count()
    }
    fn read_slot(&self, slot: SlotId, offset: usize, dst: &mut [u8]) {
        self.inner.read_slot(slot, offset, dst)
    }
    fn write_slot(&self, slot: SlotId, offset: usize, src: &[u8]) {
        self.inner.write_slot(slot, offset, src)
    }
}

/// Panic messages of this test binary's threads (the client's panic happens on its thread).
static PANICS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

fn record_panics() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let text = info
                .payload()
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| {
                    info.payload()
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                });
            if let Some(text) = text {
                PANICS.lock().unwrap_or_else(|e| e.into_inner()).push(text);
            }
            previous(info);
        }));
    });
}

/// A DATA frame for a chunk that no longer fits its slot (the memory shrank after submit
/// checked it) is a broken invariant: lenient mode counts it and fails the chunk without
/// writing a byte into the slot; strict mode panics naming it.
#[test]
fn data_for_a_chunk_past_its_slot_is_never_written() {
    record_panics();
    let (mut a, memory) = instance(Vec::new(), |_| {});
    common::publish(&mut a, &memory, 1, BYTES);
    for (n, strict) in [(0u64, false), (1, true)] {
        let shrinking = Arc::new(ShrinkingMemory {
            inner: tier_testkit::VecSlotMemory::new(8, BYTES as usize),
            slot_bytes: std::sync::atomic::AtomicUsize::new(BYTES as usize),
        });
        let memory: Arc<dyn SlotMemory> = shrinking.clone();
        let mut b = P2pTier::new(common::config(vec![a.local_addr()]), Arc::clone(&memory))
            .expect("tier starts");
        b.set_strict_invariants(strict);
        tier_testkit::fill_slot(&*memory, SlotId(1), BYTES as usize, 77);
        shrinking
            .slot_bytes
            .store(BYTES as usize / 2, std::sync::atomic::Ordering::Relaxed);
        let id = JobId(10 + n);
        common::submit_load(&mut b, id, &[0], 1, BYTES);
        if strict {
            common::eventually("the client panics", WAIT, || {
                let panics = PANICS.lock().unwrap_or_else(|e| e.into_inner());
                panics
                    .iter()
                    .any(|m| m.contains("invariant broken") && m.contains("p2p client: DATA of"))
            });
        } else {
            let done = common::wait(&mut b, id, WAIT);
            assert_eq!(done.failed_keys().collect::<Vec<_>>(), vec![common::key(0)]);
            assert_eq!(b.stats().invariant_failures, 1, "{:?}", b.stats());
            assert_eq!(b.stats().chunks_fetched, 0, "{:?}", b.stats());
        }
        shrinking
            .slot_bytes
            .store(BYTES as usize, std::sync::atomic::Ordering::Relaxed);
        let slot = tier_testkit::first_mismatch(&*memory, SlotId(1), BYTES as usize, 77);
        assert_eq!(slot, None, "strict {strict}: the slot was written");
    }
}
