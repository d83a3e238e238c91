//! The NIXL data plane (Cargo feature `nixl`): a GET's bytes move by a NIXL READ (RDMA or
//! another UCX transport) instead of the TCP stream; the TCP connection still carries the
//! request, the offer and the checksums.
//!
//! The crate links nixl-sys with its `stub-api` feature: the build needs no NIXL install (only a
//! C++ compiler and libclang for bindgen), and `libnixl_capi.so` is opened at run time. It is
//! found through `LD_LIBRARY_PATH`, or through the folder named by [`LIB_DIR_ENV`], which
//! [`available`] opens by full path before anything else asks for it. Every NIXL call is made
//! only after [`available`] said yes: a call into the stub without the library aborts the process.
//!
//! Flow of one batch: the fetching side sends NIXL_GET with the keys; the serving side registers
//! each held chunk of its published store with its agent (once per chunk, undone when the chunk
//! is freed), answers NIXL_OFFER with partial metadata for those chunks and where they lie, and
//! keeps them alive until NIXL_DONE. The fetching side loads the metadata, READs the chunks
//! straight into its host slots (registered once each), waits for completion within the job's
//! deadline, sends NIXL_DONE, and verifies every chunk's checksum before it counts.

use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::settle::{wait, Posted, TransferState, Waited};
use crate::shared::log;
use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, RegDescList,
    RegistrationHandle, ThreadSync, XferDescList, XferOp, XferRequest, XferStatus,
};

/// Environment variable naming a folder that holds `libnixl_capi.so` (for example the
/// `.nixl_cu12.mesonpy.libs` folder of the unpacked `nixl-cu12` wheel).
pub const LIB_DIR_ENV: &str = "KVTIER_NIXL_LIB_DIR";

/// The NIXL backend plugin the data plane uses.
const BACKEND: &str = "UCX";
/// How long a READ whose job stopped is polled for its end before it is handed back as stuck
/// (its slots then quarantined). UCX ends a cancelled or failing transfer well within this.
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(2);

/// Whether the NIXL library can be used in this process; the error says why not. The first call
/// opens the library (from [`LIB_DIR_ENV`] if set, else by name); the answer is kept.
pub fn available() -> Result<(), String> {
    static ANSWER: OnceLock<Result<(), String>> = OnceLock::new();
    ANSWER.get_or_init(probe).clone()
}

fn probe() -> Result<(), String> {
    if let Some(dir) = std::env::var_os(LIB_DIR_ENV) {
        let path = std::path::Path::new(&dir).join("libnixl_capi.so");
        let Some(c_path) = path.to_str().and_then(|p| CString::new(p).ok()) else {
            return Err(format!(
                "{LIB_DIR_ENV} path {} is not a C string",
                path.display()
            ));
        };
        // SAFETY: `c_path` is a valid NUL-terminated string. The handle is kept open for the
        // life of the process on purpose: the stub's own `dlopen("libnixl_capi.so")` then finds
        // this already-loaded library by its soname.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if handle.is_null() {
            return Err(format!("cannot open {}: {}", path.display(), dl_error()));
        }
    }
    // `is_stub` is the one stub call that never aborts: it only reports whether the library
    // was found.
    if nixl_sys::is_stub() {
        return Err(format!(
            "libnixl_capi.so not found (set {LIB_DIR_ENV} to its folder, or LD_LIBRARY_PATH)"
        ));
    }
    Ok(())
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call on
    // this thread; it is copied at once.
    unsafe {
        let message = libc::dlerror();
        if message.is_null() {
            "unknown dlopen error".to_owned()
        } else {
            std::ffi::CStr::from_ptr(message)
                .to_string_lossy()
                .into_owned()
        }
    }
}

/// A span of host memory given to NIXL (registration or transfer descriptor).
#[derive(Debug)]
struct Region {
    addr: usize,
    len: usize,
}

impl MemoryRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Region {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

/// One READ of a batch: a local slot span and the remote span it is filled from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReadPair {
    /// The local destination (a registered host slot).
    pub(crate) local: usize,
    /// The remote source (a registered published chunk of the peer).
    pub(crate) remote: u64,
    /// Bytes.
    pub(crate) len: usize,
}

/// How a READ ended without success.
#[derive(Debug)]
pub(crate) enum ReadEnd {
    /// NIXL refused or failed the transfer.
    Failed(String),
    /// The deadline passed or the job was cancelled, and NIXL then ended the READ; the request
    /// was released, so the local memory may be reused.
    Stopped,
    /// The deadline passed or the job was cancelled, and NIXL still said the READ was active
    /// after [`STOP_GRACE`]: the local memory must stay out of use while it is kept.
    Stuck(StuckRead),
}

/// An instance's data plane, made on first use: no agent (and no UCX threads) for an instance
/// that never serves or fetches over NIXL.
pub(crate) struct LazyPlane {
    enabled: bool,
    plane: OnceLock<Option<Plane>>,
}

impl LazyPlane {
    /// A plane to make on first use if `enabled` (the config's `nixl`).
    pub(crate) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            plane: OnceLock::new(),
        }
    }

    /// The plane, made now if this is the first use; `None` if disabled or NIXL is unusable
    /// (said once per process in the log).
    pub(crate) fn get(&self) -> Option<&Plane> {
        if !self.enabled {
            return None;
        }
        let plane = self.plane.get_or_init(|| match Plane::new() {
            Ok(plane) => Some(plane),
            Err(reason) => {
                static SAID: AtomicBool = AtomicBool::new(false);
                if !SAID.swap(true, Ordering::Relaxed) {
                    log(format_args!("NIXL data plane off, using TCP: {reason}"));
                }
                None
            }
        });
        plane.as_ref()
    }
}

/// One instance's NIXL agent with its UCX backend.
pub(crate) struct Plane {
    agent: Agent,
    _backend: Backend,
}

impl std::fmt::Debug for Plane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plane")
            .field("agent", &self.agent.name())
            .finish_non_exhaustive()
    }
}

impl Plane {
    /// An agent with a UCX backend, or why there is none. Checks [`available`] first.
    pub(crate) fn new() -> Result<Self, String> {
        available()?;
        static SEQUENCE: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "kvtier-p2p-{}-{}",
            std::process::id(),
            SEQUENCE.fetch_add(1, Ordering::Relaxed)
        );
        let config = AgentConfig {
            thread_sync: ThreadSync::Strict,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(&name, &config)
            .map_err(|e| format!("create NIXL agent {name}: {e:?}"))?;
        let (_, params) = agent
            .get_plugin_params(BACKEND)
            .map_err(|e| format!("NIXL plugin {BACKEND} parameters: {e:?}"))?;
        let backend = agent
            .create_backend(BACKEND, &params)
            .map_err(|e| format!("create NIXL backend {BACKEND}: {e:?}"))?;
        Ok(Self {
            agent,
            _backend: backend,
        })
    }

    /// Registers `len` bytes at `addr` with the agent; dropping the handle deregisters them.
    ///
    /// The caller keeps the memory alive (and at the same address) until the handle is dropped.
    pub(crate) fn register(&self, addr: usize, len: usize) -> Result<RegistrationHandle, String> {
        self.agent
            .register_memory(&Region { addr, len }, None)
            .map_err(|e| format!("register {len} bytes with NIXL: {e:?}"))
    }

    /// Metadata a peer needs to READ these registered spans (connection info included).
    pub(crate) fn partial_metadata(&self, spans: &[(usize, usize)]) -> Result<Vec<u8>, String> {
        let mut list = RegDescList::new(MemType::Dram).map_err(|e| format!("{e:?}"))?;
        for &(addr, len) in spans {
            list.add_desc(addr, len, 0);
        }
        self.agent
            .get_local_partial_md(&list, None)
            .map_err(|e| format!("NIXL partial metadata: {e:?}"))
    }

    /// Loads a peer's metadata; returns the peer agent's name.
    pub(crate) fn load_metadata(&self, metadata: &[u8]) -> Result<String, String> {
        self.agent
            .load_remote_md(metadata)
            .map_err(|e| format!("load NIXL metadata of {} bytes: {e:?}", metadata.len()))
    }

    /// Forgets a peer agent's metadata (the peer went away).
    pub(crate) fn forget(&self, remote: &str) {
        // A peer we never loaded is fine.
        let _ = self.agent.invalidate_remote_md(remote);
    }

    /// READs every pair from `remote` into local memory and waits for completion, polling
    /// `stop` and the deadline. A stopped READ is released only once NIXL says it is over
    /// ([`settle`](crate::settle::settle)): then `Stopped`; still active after
    /// [`STOP_GRACE`]: `Stuck`, with the unreleased request, whose local memory the caller must
    /// never reuse until [`Plane::ended`] says it is over.
    pub(crate) fn read(
        &self,
        remote: &str,
        pairs: &[ReadPair],
        deadline: Instant,
        stop: &dyn Fn() -> bool,
    ) -> Result<(), ReadEnd> {
        let failed = |what: &str, e: nixl_sys::NixlError| ReadEnd::Failed(format!("{what}: {e:?}"));
        let mut local = XferDescList::new(MemType::Dram).map_err(|e| failed("local list", e))?;
        let mut far = XferDescList::new(MemType::Dram).map_err(|e| failed("remote list", e))?;
        for pair in pairs {
            local.add_desc(pair.local, pair.len, 0);
            far.add_desc(pair.remote as usize, pair.len, 0);
        }
        let request = self
            .agent
            .create_xfer_req(XferOp::Read, &local, &far, remote, None)
            .map_err(|e| failed("create NIXL READ", e))?;
        let in_progress = self
            .agent
            .post_xfer_req(&request, None)
            .map_err(|e| failed("post NIXL READ", e))?;
        if !in_progress {
            return Ok(());
        }
        let posted = PostedRead {
            agent: &self.agent,
            request: Some(request),
        };
        match wait(posted, deadline, stop, STOP_GRACE) {
            Waited::Done => Ok(()),
            Waited::Failed(reason) => Err(ReadEnd::Failed(format!("NIXL READ: {reason}"))),
            Waited::Stopped => Err(ReadEnd::Stopped),
            Waited::Stuck(mut posted) => match posted.request.take() {
                Some(request) => Err(ReadEnd::Stuck(StuckRead { request })),
                None => Err(ReadEnd::Stopped),
            },
        }
    }

    /// Whether a stuck READ is over now (then dropping it releases it).
    pub(crate) fn ended(&self, stuck: &StuckRead) -> bool {
        status(&self.agent, &stuck.request) != TransferState::Active
    }
}

/// NIXL's word on `request`; an error status means NIXL ended it.
fn status(agent: &Agent, request: &XferRequest) -> TransferState {
    match agent.get_xfer_status(request) {
        Ok(XferStatus::InProgress) => TransferState::Active,
        Ok(XferStatus::Success) => TransferState::Done,
        Err(e) => TransferState::Failed(format!("status: {e:?}")),
    }
}

/// A posted READ under [`wait`]; dropping it releases the request.
struct PostedRead<'a> {
    agent: &'a Agent,
    /// Always `Some` until a stuck READ is handed out.
    request: Option<XferRequest>,
}

impl Posted for PostedRead<'_> {
    fn state(&mut self) -> TransferState {
        match &self.request {
            Some(request) => status(self.agent, request),
            None => TransferState::Failed("no request".to_owned()),
        }
    }
}

/// A READ whose job stopped and that NIXL still called active after [`STOP_GRACE`]. It must
/// not be dropped (released) before [`Plane::ended`] says it is over, and the local memory it
/// writes must stay out of use until then; [`StuckRead::abandon`] leaks it instead.
pub(crate) struct StuckRead {
    request: XferRequest,
}

impl std::fmt::Debug for StuckRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StuckRead")
    }
}

impl StuckRead {
    /// Leaks the request: it is never released, so NIXL never frees what it may still use.
    pub(crate) fn abandon(self) {
        std::mem::forget(self.request);
    }
}
