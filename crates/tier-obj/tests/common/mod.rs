//! Helpers shared by the object tier's tests: configurations and tiers over the in-memory and
//! local-file-system backends.

#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use offload_core::tier::{
    FailedKey, SlotMemory, Tier, TierChunk, TierCompletion, TierFailure, TierJob, TierLookup,
    TierOp,
};
use offload_core::{ChunkKey, JobId, SlotId};
use tier_obj::object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use tier_obj::{NamespaceId, ObjTier, ObjTierConfig};
use tier_testkit::VecSlotMemory;

/// The namespace every test uses.
pub fn namespace() -> NamespaceId {
    NamespaceId {
        model: "test-model".to_owned(),
        dtype: "bfloat16".to_owned(),
        tokens_per_chunk: 256,
        parallel_layout: "tp1".to_owned(),
    }
}

/// A test configuration: short deadlines, and a multipart threshold the suite's 16 KiB slots
/// cross, so that both upload paths run.
pub fn config() -> ObjTierConfig {
    ObjTierConfig {
        request_deadline: Duration::from_secs(10),
        list_deadline: Duration::from_secs(10),
        multipart_threshold_bytes: 12 * 1024,
        part_bytes: 8 * 1024,
        jobs_in_flight_max: 16,
        requests_in_flight_max: 8,
        ..ObjTierConfig::new("kvtier-test", namespace())
    }
}

/// A tier over `store` with `config`.
pub fn tier(
    config: ObjTierConfig,
    store: Arc<dyn ObjectStore>,
    memory: Arc<dyn SlotMemory>,
) -> ObjTier {
    ObjTier::start(config, store, memory).expect("object tier starts")
}

/// A tier that owns the temporary directory its local store lives in (removed after the tier).
pub struct OwnedDirTier {
    pub tier: ObjTier,
    _dir: tempfile::TempDir,
}

impl OwnedDirTier {
    pub fn new(memory: Arc<dyn SlotMemory>) -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let backend = tier_obj::Backend::Local {
            root: dir.path().to_path_buf(),
        };
        let store = backend.open().expect("local store opens");
        Self {
            tier: tier(config(), store, memory),
            _dir: dir,
        }
    }
}

impl Tier for OwnedDirTier {
    fn name(&self) -> &str {
        self.tier.name()
    }
    fn medium(&self) -> offload_core::event::Medium {
        self.tier.medium()
    }
    fn lookup(&mut self, key: offload_core::ChunkKey) -> offload_core::tier::TierLookup {
        self.tier.lookup(key)
    }
    fn touch(&mut self, keys: &[offload_core::ChunkKey]) {
        self.tier.touch(keys)
    }
    fn submit(
        &mut self,
        job: offload_core::tier::TierJob,
    ) -> Result<(), offload_core::tier::SubmitError> {
        self.tier.submit(job)
    }
    fn poll(&mut self, out: &mut Vec<offload_core::tier::TierCompletion>) {
        self.tier.poll(out)
    }
    fn cancel(&mut self, id: offload_core::JobId) {
        self.tier.cancel(id)
    }
    fn drain(&mut self) {
        self.tier.drain()
    }
    fn on_request_finished(&mut self, request: offload_core::RequestId) {
        self.tier.on_request_finished(request)
    }
    fn shutdown(&mut self) {
        self.tier.shutdown()
    }
}

/// A job of `op` on `chunks`, for no request.
pub fn job(id: u64, op: TierOp, chunks: Vec<(ChunkKey, SlotId, u32)>) -> TierJob {
    TierJob {
        id: JobId(id),
        request: None,
        op,
        chunks: chunks
            .into_iter()
            .map(|(key, slot, len)| TierChunk::new(key, slot, len))
            .collect(),
    }
}

/// Polls until `id` completes (`within` at most).
pub fn wait(tier: &mut dyn Tier, id: u64, within: Duration) -> TierCompletion {
    wait_all(tier, &[id], within).remove(0)
}

/// Polls until every job of `ids` completed (`within` at most); their completions in `ids` order.
pub fn wait_all(tier: &mut dyn Tier, ids: &[u64], within: Duration) -> Vec<TierCompletion> {
    let until = Instant::now() + within;
    let mut out = Vec::new();
    loop {
        tier.poll(&mut out);
        if ids.iter().all(|&id| out.iter().any(|c| c.id == JobId(id))) {
            assert_eq!(out.len(), ids.len(), "unexpected completions: {out:?}");
            out.sort_by_key(|c| ids.iter().position(|&id| c.id == JobId(id)));
            return out;
        }
        assert!(
            Instant::now() < until,
            "jobs {ids:?} did not complete within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// One service's round trip against a real server ([`round_trip_and_restart`]): its name for
/// messages, the slot size, and the multipart settings its uploads must cross.
pub struct RoundTrip {
    /// The service, as messages name it ("S3", "Azure").
    pub service: &'static str,
    /// Bytes per slot: the first chunk fills one.
    pub slot: usize,
    /// Records above this go up in parts.
    pub multipart_threshold_bytes: usize,
    /// Bytes per part.
    pub part_bytes: usize,
    /// The fourth chunk's length (over the multipart threshold, under a slot).
    pub big_len: u32,
    /// The first key's hash (the others follow) and the keys' group.
    pub key_base: u128,
    /// The keys' KV group.
    pub group: u32,
}

/// Store four chunks (two of them in parts), restart (a new tier lists what the first stored),
/// load them into other slots and compare bytes; then damage one object on the server: its load
/// fails as corrupt, the object is deleted, and `take_evicted` reports its key once. `open`
/// makes a client of the server.
pub fn round_trip_and_restart(rt: &RoundTrip, open: &dyn Fn() -> Arc<dyn ObjectStore>) {
    let service = rt.service;
    let mem = Arc::new(VecSlotMemory::new(8, rt.slot));
    let config = ObjTierConfig {
        multipart_threshold_bytes: rt.multipart_threshold_bytes,
        part_bytes: rt.part_bytes,
        request_deadline: Duration::from_secs(30),
        ..config()
    };
    let lens = [rt.slot as u32, 100_000, 1, rt.big_len];
    let keys: Vec<ChunkKey> = (0..4u32)
        .map(|i| ChunkKey::new(rt.key_base + u128::from(i), rt.group))
        .collect();
    let seed = |i: usize| (rt.key_base as u64).wrapping_add(i as u64);
    let chunks: Vec<_> = (0..4)
        .map(|i| {
            mem.fill(SlotId(i as u32), lens[i] as usize, seed(i));
            (keys[i], SlotId(i as u32), lens[i])
        })
        .collect();
    {
        let mut tier = self::tier(config.clone(), open(), mem.clone());
        tier.submit(job(1, TierOp::Store, chunks)).expect("submit");
        let done = wait(&mut tier, 1, Duration::from_secs(60));
        assert!(
            done.is_success(),
            "{service} store failed keys {:?}",
            done.failed
        );
        assert_eq!(
            tier.stats().multipart_uploads,
            2,
            "two records over the multipart threshold"
        );
    }
    let store = open();
    let mut tier = self::tier(config, store.clone(), mem.clone());
    assert_eq!(
        tier.stats().keys_listed,
        4,
        "the restart lists every stored chunk"
    );
    for &k in &keys {
        assert_eq!(tier.lookup(k), TierLookup::Hit);
    }
    let loads = (0..4)
        .map(|i| {
            mem.fill(SlotId(4 + i as u32), rt.slot, 0xBAD);
            (keys[i], SlotId(4 + i as u32), lens[i])
        })
        .collect();
    tier.submit(job(2, TierOp::Load, loads)).expect("submit");
    let done = wait(&mut tier, 2, Duration::from_secs(60));
    assert!(
        done.is_success(),
        "{service} load failed keys {:?}",
        done.failed
    );
    for (i, &len) in lens.iter().enumerate() {
        assert_eq!(
            mem.contents(SlotId(4 + i as u32))[..len as usize],
            mem.contents(SlotId(i as u32))[..len as usize],
            "chunk {i} differs after store, restart and load through {service}"
        );
    }
    // A damaged object fails its key, is deleted, and its key is reported once.
    let path = tier.path_of(keys[1]);
    flip_byte(store.as_ref(), &path, 4096 + 99, 0x40);
    tier.submit(job(3, TierOp::Load, vec![(keys[1], SlotId(5), lens[1])]))
        .expect("submit");
    assert_eq!(
        wait(&mut tier, 3, Duration::from_secs(60)).failed,
        vec![FailedKey::new(keys[1], TierFailure::Corrupt)]
    );
    assert_eq!(tier.lookup(keys[1]), TierLookup::Miss);
    let mut evicted = Vec::new();
    assert_eq!(tier.take_evicted(&mut evicted), 0);
    assert_eq!(evicted, vec![keys[1]]);
    assert!(
        block_on(store.get(&path)).is_err(),
        "damaged object deleted"
    );
}

/// The conformance suite over a real server with `base`, each case under its own prefix
/// (`open` makes a client of the server).
pub fn conformance_over(base: &ObjTierConfig, open: &dyn Fn() -> Arc<dyn ObjectStore>) {
    let mut case = 0;
    tier_testkit::conformance::run_all(|memory: Arc<dyn SlotMemory>| {
        case += 1;
        let config = ObjTierConfig {
            prefix: format!("conformance-{case}"),
            ..base.clone()
        };
        Box::new(tier(config, open(), memory))
    });
}

/// Runs `fut` to completion on a fresh current-thread runtime.
pub fn block_on<T>(fut: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("test runtime")
        .block_on(fut)
}

/// Flips bits `mask` of byte `at` of the object at `path` in `store` (damage the tier must
/// catch).
pub fn flip_byte(
    store: &dyn ObjectStore,
    path: &tier_obj::object_store::path::Path,
    at: usize,
    mask: u8,
) {
    block_on(async {
        let mut bytes = store
            .get(path)
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap()
            .to_vec();
        bytes[at] ^= mask;
        store.put(path, PutPayload::from(bytes)).await.unwrap();
    });
}

/// A test server process on loopback (with its data directory, if it has one); killed, and
/// the directory removed, when dropped.
pub struct ServerProcess {
    /// The process.
    pub child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
    _data: Option<tempfile::TempDir>,
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The server binary: `$env` if set (it must be a file), else `name` on `PATH`; or why there
/// is none (`install` says how to get one).
pub fn server_binary(env: &str, name: &str, install: &str) -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os(env) {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!("{env}={} is not a file", path.display()))
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| format!("no {name} on PATH and {env} unset (install: {install})"))
}

/// Starts `binary` on a free port of 127.0.0.1 (`args` gets the port and adds the arguments),
/// its output discarded, and waits at most `within` until it accepts connections.
pub fn start_server(
    binary: &Path,
    args: impl FnOnce(&mut Command, u16),
    data: Option<tempfile::TempDir>,
    within: Duration,
) -> Result<ServerProcess, String> {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free loopback port: {e}"))?
        .port();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut command = Command::new(binary);
    args(&mut command, port);
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
    let mut server = ServerProcess {
        child,
        addr,
        _data: data,
    };
    wait_until_listening(&mut server.child, addr, binary, within)?;
    Ok(server)
}

/// Waits until the server `child` (started from `binary`) accepts connections on `addr`, at most
/// `within`; the error says why not (it exited, or never listened).
fn wait_until_listening(
    child: &mut Child,
    addr: SocketAddr,
    binary: &Path,
    within: Duration,
) -> Result<(), String> {
    let until = Instant::now() + within;
    loop {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("{} exited at start: {status}", binary.display()));
        }
        if Instant::now() > until {
            return Err(format!(
                "{} did not accept connections on {addr} within {within:?}",
                binary.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
