//! Helpers shared by the tier-p2p integration tests: configurations on 127.0.0.1, waits that poll
//! with a deadline, and store/lookup/load steps that fail with a clear message.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use offload_core::tier::{
    SlotMemory, Tier, TierChunk, TierCompletion, TierJob, TierLookup, TierOp,
};
use offload_core::{ChunkKey, JobId, SlotId};
use tier_p2p::{Namespace, NamespaceId, P2pConfig, P2pTier};

/// The namespace every test instance shares unless it tests a mismatch.
pub fn namespace() -> Namespace {
    Namespace::new(&namespace_id("test-model", "bfloat16"), 4096, 0x5EED)
}

/// The KV layout of the test instances, for `model` with `dtype`.
pub fn namespace_id(model: &str, dtype: &str) -> NamespaceId {
    NamespaceId {
        model: model.into(),
        dtype: dtype.into(),
        tokens_per_chunk: 64,
        parallel_layout: "tp1".into(),
    }
}

/// A loopback configuration on a free port with short deadlines, talking to `peers`.
pub fn config(peers: Vec<SocketAddr>) -> P2pConfig {
    let mut config = P2pConfig::new(namespace());
    config.peers = peers.into_iter().map(Into::into).collect();
    config.lookup_deadline = Duration::from_secs(2);
    config.lookup_cache_ttl = Duration::ZERO;
    config.fetch_deadline = Duration::from_secs(5);
    config.backoff_initial = Duration::from_millis(20);
    config.backoff_max = Duration::from_millis(200);
    config
}

/// The key of test chunk `index`.
pub fn key(index: u64) -> ChunkKey {
    ChunkKey::new(
        0xF00D_0000_0000_0001 << 64 | u128::from(0xC0FF_EE00_0000 + index),
        (index % 2) as u32,
    )
}

/// The seed of test chunk `index`'s bytes.
pub fn seed(index: u64) -> u64 {
    0xDA7A_0000 + index
}

/// Polls `tier` until `id` completes, or panics after `deadline`.
pub fn wait(tier: &mut dyn Tier, id: JobId, deadline: Duration) -> TierCompletion {
    let start = Instant::now();
    let mut out = Vec::new();
    loop {
        tier.poll(&mut out);
        if let Some(done) = out.iter().find(|c| c.id == id) {
            return done.clone();
        }
        assert!(
            start.elapsed() < deadline,
            "job {} did not complete within {deadline:?}",
            id.0
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Polls `tier` until every job of `ids` completes (their completions in `ids` order), or panics
/// after `deadline`.
pub fn wait_all(tier: &mut dyn Tier, ids: &[JobId], deadline: Duration) -> Vec<TierCompletion> {
    let start = Instant::now();
    let mut out = Vec::new();
    loop {
        tier.poll(&mut out);
        let done: Vec<TierCompletion> = ids
            .iter()
            .filter_map(|id| out.iter().find(|c| c.id == *id).cloned())
            .collect();
        if done.len() == ids.len() {
            return done;
        }
        assert!(
            start.elapsed() < deadline,
            "jobs {ids:?} did not all complete within {deadline:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Looks `key` up until the answer is not `Retry` (polling in between), or panics after
/// `deadline`.
pub fn settle(tier: &mut dyn Tier, key: ChunkKey, deadline: Duration) -> TierLookup {
    let start = Instant::now();
    let mut out = Vec::new();
    loop {
        let answer = tier.lookup(key);
        if answer != TierLookup::Retry {
            return answer;
        }
        assert!(
            start.elapsed() < deadline,
            "lookup of {key:?} still Retry after {deadline:?}"
        );
        tier.poll(&mut out);
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Fills slots `0..count` with chunks `0..count` of `len` bytes and publishes them in one job.
pub fn publish(tier: &mut P2pTier, memory: &Arc<dyn SlotMemory>, count: u64, len: u32) {
    let chunks = (0..count)
        .map(|i| {
            let slot = SlotId(i as u32);
            tier_testkit::fill_slot(&**memory, slot, len as usize, seed(i));
            TierChunk::new(key(i), slot, len)
        })
        .collect();
    let id = JobId(1_000_000);
    tier.submit(TierJob {
        id,
        request: None,
        op: TierOp::Store,
        chunks,
    })
    .expect("publish accepted");
    let done = wait(tier, id, Duration::from_secs(10));
    assert!(done.is_success(), "publish failed keys {:?}", done.failed);
}

/// Submits a load of chunks `indices` into slots `first_slot..`, each of `len` bytes.
pub fn submit_load(
    tier: &mut dyn Tier,
    id: JobId,
    indices: &[u64],
    first_slot: u32,
    len: u32,
) -> Vec<TierChunk> {
    let chunks: Vec<_> = indices
        .iter()
        .enumerate()
        .map(|(n, &i)| TierChunk::new(key(i), SlotId(first_slot + n as u32), len))
        .collect();
    tier.submit(TierJob {
        id,
        request: None,
        op: TierOp::Load,
        chunks: chunks.clone(),
    })
    .expect("load accepted");
    chunks
}

/// Panics unless every slot of `chunks` (loaded chunk indices `indices`) holds its bytes.
pub fn expect_loaded(memory: &dyn SlotMemory, indices: &[u64], first_slot: u32, len: u32) {
    for (n, &i) in indices.iter().enumerate() {
        let slot = SlotId(first_slot + n as u32);
        if let Some(at) = tier_testkit::first_mismatch(memory, slot, len as usize, seed(i)) {
            panic!("chunk {i} in slot {} differs at byte {at}", slot.0);
        }
    }
}

/// Polls `check` until it is true, or panics with `what` after `deadline`.
pub fn eventually(what: &str, deadline: Duration, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(
            start.elapsed() < deadline,
            "{what}: not within {deadline:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A raw protocol connection for playing a misbehaving peer by hand.
pub struct Raw {
    /// The socket.
    pub stream: std::net::TcpStream,
    reader: tier_p2p::frame::FrameReader,
}

impl Raw {
    /// Wraps a connected or accepted socket (reads and writes time out after 5 s).
    pub fn new(stream: std::net::TcpStream) -> Self {
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("read timeout");
        stream
            .set_write_timeout(Some(Duration::from_secs(5)))
            .expect("write timeout");
        Self {
            stream,
            reader: tier_p2p::frame::FrameReader::new(64 << 20),
        }
    }

    /// Connects to `addr`.
    pub fn connect(addr: SocketAddr) -> Self {
        Self::new(std::net::TcpStream::connect(addr).expect("connect"))
    }

    /// Sends a frame.
    pub fn send(&mut self, frame: &tier_p2p::frame::Frame<'_>) {
        let mut bytes = Vec::new();
        frame.encode(&mut bytes);
        self.send_bytes(&bytes);
    }

    /// Sends raw bytes.
    pub fn send_bytes(&mut self, bytes: &[u8]) {
        use std::io::Write;
        self.stream.write_all(bytes).expect("write");
    }

    /// Receives a frame, with its payload (if DATA) dropped.
    pub fn recv(&mut self) -> Result<tier_p2p::frame::Frame<'static>, tier_p2p::frame::ReadError> {
        use tier_p2p::frame::Frame;
        Ok(match self.reader.read_frame(&mut self.stream)? {
            Frame::Data { key, checksum, .. } => Frame::Data {
                key,
                checksum,
                payload: &[],
            },
            Frame::Hello(h) => Frame::Hello(h),
            Frame::Auth(a) => Frame::Auth(a),
            Frame::Have(k) => Frame::Have(k),
            Frame::HaveReply(f) => Frame::HaveReply(f),
            Frame::Get(k) => Frame::Get(k),
            Frame::End { sent } => Frame::End { sent },
            Frame::Error(m) => Frame::Error(m),
            Frame::NixlGet(k) => Frame::NixlGet(k),
            Frame::NixlOffer { chunks, .. } => Frame::NixlOffer {
                connection: &[],
                metadata: &[],
                chunks,
            },
            Frame::NixlDone => Frame::NixlDone,
            Frame::Put { key, checksum, .. } => Frame::Put {
                key,
                checksum,
                payload: &[],
            },
        })
    }

    /// A HELLO in `namespace`.
    pub fn hello(namespace: &[u8], secret_required: bool) -> tier_p2p::frame::Frame<'static> {
        tier_p2p::frame::Frame::Hello(tier_p2p::frame::Hello {
            secret_required,
            nonce: tier_p2p::auth::nonce(),
            namespace: namespace.to_vec(),
        })
    }

    /// Receives frames until the peer closes; returns the ERROR messages seen.
    pub fn errors_until_closed(&mut self) -> Vec<String> {
        let mut errors = Vec::new();
        loop {
            match self.recv() {
                Ok(tier_p2p::frame::Frame::Error(message)) => errors.push(message),
                Ok(_) => {}
                Err(tier_p2p::frame::ReadError::Io(e))
                    if e.kind() == std::io::ErrorKind::UnexpectedEof
                        || e.kind() == std::io::ErrorKind::ConnectionReset =>
                {
                    return errors
                }
                Err(other) => panic!("expected the peer to close, got {other:?}"),
            }
        }
    }
}
