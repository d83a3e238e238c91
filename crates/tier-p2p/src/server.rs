//! The server: an accept thread and one handler thread per connection (at most
//! `connections_max`), serving HAVE, GET and NIXL_GET from the published-chunk store after a
//! handshake, and storing the chunks that publishers PUT (this instance owns their keys). Chunks offered for a NIXL READ stay lent to the connection (alive and registered)
//! until its next request or its end.
//! A malformed or oversized frame, a refused handshake or an idle connection closes that
//! connection with a log line; the server itself keeps running.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use offload_core::ChunkKey;

use crate::auth::ChunkAuth;
use crate::config::P2pConfig;
use crate::conn::Conn;
use crate::error::{P2pError, P2pErrorKind};
use crate::frame::{
    decode_data_prefix, Frame, FrameError, FrameKind, NixlChunk, DATA_PREFIX_BYTES,
    FRAME_BODY_BYTES_MIN, KEY_BYTES,
};
use crate::handshake;
use crate::shared::{lock, log, spawn, Shared};
use crate::stats::add;
use crate::store::{checksum, PublishedChunk};

/// How long a refusal of a busy server may take to write.
const BUSY_WRITE_TIMEOUT: Duration = Duration::from_millis(100);
/// Pause after a failed `accept` (out of file descriptors, ...), so it does not spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(10);

/// Open connections and their handler threads.
#[derive(Default)]
struct Table {
    next_id: u64,
    streams: HashMap<u64, TcpStream>,
    handles: Vec<JoinHandle<()>>,
}

/// A running server; [`Server::stop`] (or drop) closes every connection and joins every thread.
pub(crate) struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
    table: Arc<Mutex<Table>>,
}

impl Server {
    /// Binds `shared.config.listen` and starts accepting.
    pub(crate) fn start(shared: Arc<Shared>) -> Result<Self, P2pError> {
        let listen = shared.config.listen;
        let listener = TcpListener::bind(listen)
            .map_err(|e| P2pError::io("bind", listen, e, Duration::ZERO))?;
        let addr = listener
            .local_addr()
            .map_err(|e| P2pError::io("local address of", listen, e, Duration::ZERO))?;
        let stop = Arc::new(AtomicBool::new(false));
        let table = Arc::new(Mutex::new(Table::default()));
        let accept = {
            let (stop, table) = (Arc::clone(&stop), Arc::clone(&table));
            spawn(format!("p2p-accept-{}", addr.port()), move || {
                accept_loop(&listener, &shared, &stop, &table);
            })?
        };
        Ok(Self {
            addr,
            stop,
            accept: Some(accept),
            table,
        })
    }

    /// The address it listens on.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, closes every connection and joins every thread. Idempotent.
    pub(crate) fn stop(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept thread with a connection of our own.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        match TcpStream::connect_timeout(&wake, Duration::from_secs(1)) {
            Ok(_) => {
                if accept.join().is_err() {
                    log(format_args!("server {}: accept thread panicked", self.addr));
                }
            }
            Err(error) => log(format_args!(
                "server {}: could not wake the accept thread ({error}); leaving it detached",
                self.addr
            )),
        }
        let handles = {
            let mut table = lock(&self.table);
            for stream in table.streams.values() {
                // Already closed is fine.
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
            std::mem::take(&mut table.handles)
        };
        for handle in handles {
            if handle.join().is_err() {
                log(format_args!(
                    "server {}: a handler thread panicked",
                    self.addr
                ));
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(
    listener: &TcpListener,
    shared: &Arc<Shared>,
    stop: &Arc<AtomicBool>,
    table: &Arc<Mutex<Table>>,
) {
    for incoming in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let stream = match incoming {
            Ok(stream) => stream,
            Err(error) => {
                log(format_args!(
                    "accept on {:?}: {error}",
                    listener.local_addr()
                ));
                std::thread::sleep(ACCEPT_ERROR_PAUSE);
                continue;
            }
        };
        let peer = match stream.peer_addr() {
            Ok(peer) => peer,
            // The peer is already gone.
            Err(_) => continue,
        };
        admit(stream, peer, shared, table);
    }
}

/// Starts a handler for `stream`, or refuses it if `connections_max` are open.
fn admit(stream: TcpStream, peer: SocketAddr, shared: &Arc<Shared>, table: &Arc<Mutex<Table>>) {
    let mut guard = lock(table);
    reap(&mut guard.handles);
    if guard.streams.len() >= shared.config.connections_max {
        drop(guard);
        add(&shared.counters.connections_refused_busy, 1);
        log(format_args!(
            "refusing connection from {peer}: {} connections open (`connections_max`)",
            shared.config.connections_max
        ));
        refuse_busy(stream, peer);
        return;
    }
    let Ok(clone) = stream.try_clone() else {
        log(format_args!(
            "refusing connection from {peer}: cannot clone its socket"
        ));
        return;
    };
    let id = guard.next_id;
    guard.next_id += 1;
    guard.streams.insert(id, clone);
    let handler = {
        let (shared, table) = (Arc::clone(shared), Arc::clone(table));
        spawn(format!("p2p-serve-{}", peer.port()), move || {
            handle(&shared, stream, peer);
            lock(&table).streams.remove(&id);
        })
    };
    match handler {
        Ok(handle) => guard.handles.push(handle),
        Err(error) => {
            log(format_args!("refusing connection from {peer}: {error}"));
            guard.streams.remove(&id);
        }
    }
}

/// Joins handler threads that have finished.
fn reap(handles: &mut Vec<JoinHandle<()>>) {
    let (done, running): (Vec<_>, Vec<_>) = handles.drain(..).partition(|h| h.is_finished());
    *handles = running;
    for handle in done {
        // A panicked handler already printed its message; its connection is gone.
        let _ = handle.join();
    }
}

fn refuse_busy(stream: TcpStream, peer: SocketAddr) {
    let Ok(mut conn) = Conn::new(stream, peer, FRAME_BODY_BYTES_MIN) else {
        return;
    };
    conn.set_timeout(BUSY_WRITE_TIMEOUT);
    // Best effort: the peer learns why, or sees the connection close.
    let _ = conn.send(&Frame::Error("server busy".to_owned()), "send busy");
    conn.shutdown();
}

/// Serves one connection to its end, logging why it ended if that was not a clean close.
fn handle(shared: &Shared, stream: TcpStream, peer: SocketAddr) {
    let Err(error) = serve(shared, stream, peer) else {
        return;
    };
    match &error {
        P2pError::Closed { .. } => {}
        P2pError::Refused { .. } => {
            add(&shared.counters.handshakes_refused, 1);
            log(format_args!("server: {error}"));
        }
        P2pError::Frame { .. } => {
            add(&shared.counters.frames_rejected, 1);
            log(format_args!("server: closing connection: {error}"));
        }
        _ if error.kind() == P2pErrorKind::Transient => {
            log(format_args!("server: closing connection: {error}"));
        }
        _ => log(format_args!("server: connection ended: {error}")),
    }
}

/// The largest frame body a server accepts, but for PUT: a HELLO, or a request of
/// `keys_per_request_max` keys. A PUT (after the handshake only) may carry a chunk of up to
/// `frame_body_bytes_max`; its payload is read straight into the chunk's own buffer.
fn request_body_max(config: &P2pConfig) -> usize {
    let request = config.keys_per_request_max.saturating_mul(KEY_BYTES) + 4;
    request.max(FRAME_BODY_BYTES_MIN)
}

fn serve(shared: &Shared, stream: TcpStream, peer: SocketAddr) -> Result<(), P2pError> {
    let config = &shared.config;
    let request_max = request_body_max(config);
    let mut conn = Conn::new(stream, peer, request_max)?;
    handshake::server(&mut conn, &shared.identity, config.handshake_deadline)?;
    conn.set_body_max(config.frame_body_bytes_max.max(request_max));
    // Chunks offered by the last NIXL_OFFER: the client READs them until its next request.
    let mut lent: Vec<Arc<PublishedChunk>> = Vec::new();
    loop {
        conn.set_timeout(config.idle_timeout);
        let header = match conn.recv_header("receive request") {
            Ok(header) => header,
            Err(error) => return Err(tell(&mut conn, error)),
        };
        if header.kind == FrameKind::Put {
            lent.clear();
            let stored = receive_put(shared, &mut conn, header.body_len)?;
            let sent = u32::from(stored);
            conn.send(&Frame::End { sent }, "send PUT answer")?;
            continue;
        }
        if header.body_len > request_max {
            let error = P2pError::Frame {
                op: "receive request",
                peer,
                source: FrameError::Oversized {
                    len: header.body_len as u64,
                    max: request_max,
                },
            };
            return Err(tell(&mut conn, error));
        }
        let request = match conn.recv_body(header, "receive request") {
            Ok(Frame::Have(keys)) => Request::Have(keys),
            Ok(Frame::Get(keys)) => Request::Get(keys),
            Ok(Frame::NixlGet(keys)) => Request::NixlGet(keys),
            Ok(Frame::NixlDone) => Request::NixlDone,
            Ok(other) => Request::Other(other.kind()),
            Err(error) => return Err(tell(&mut conn, error)),
        };
        // Every request means the client finished with the last offer.
        lent.clear();
        match request {
            Request::Have(keys) => {
                check_count(&mut conn, keys.len(), config.keys_per_request_max)?;
                let held: Vec<bool> = {
                    let store = lock(&shared.store);
                    keys.iter().map(|&key| store.contains(key)).collect()
                };
                conn.send(&Frame::HaveReply(held), "send HAVE reply")?;
            }
            Request::Get(keys) => {
                check_count(&mut conn, keys.len(), config.keys_per_request_max)?;
                send_chunks(shared, &mut conn, &keys)?;
            }
            Request::NixlGet(keys) => {
                check_count(&mut conn, keys.len(), config.keys_per_request_max)?;
                let offer = offer(shared, &conn.chunk_auth().clone(), &keys, &mut lent);
                let frame = Frame::NixlOffer {
                    connection: &offer.connection,
                    metadata: &offer.metadata,
                    chunks: offer.chunks,
                };
                conn.send(&frame, "send NIXL_OFFER")?;
            }
            Request::NixlDone => {}
            Request::Other(found) => {
                let error = P2pError::Frame {
                    op: "receive request",
                    peer,
                    source: FrameError::Unexpected {
                        expected: "HAVE, GET, NIXL_GET, NIXL_DONE or PUT",
                        found,
                    },
                };
                return Err(tell(&mut conn, error));
            }
        }
    }
}

/// A request detached from the connection's buffer.
enum Request {
    Have(Vec<ChunkKey>),
    Get(Vec<ChunkKey>),
    NixlGet(Vec<ChunkKey>),
    NixlDone,
    Other(FrameKind),
}

/// Tells the peer why its frame ends the connection (best effort), and returns the error.
fn tell(conn: &mut Conn, error: P2pError) -> P2pError {
    if let P2pError::Frame { source, .. } = &error {
        let _ = conn.send(&Frame::Error(source.to_string()), "send error");
    }
    error
}

fn check_count(conn: &mut Conn, count: usize, max: usize) -> Result<(), P2pError> {
    if count <= max {
        return Ok(());
    }
    let error = P2pError::Frame {
        op: "receive request",
        peer: conn.peer(),
        source: FrameError::Malformed {
            kind: FrameKind::Get,
            reason: format!("{count} keys, more than `keys_per_request_max` {max}"),
        },
    };
    Err(tell(conn, error))
}

/// The parts of a NIXL_OFFER; all empty: no NIXL data plane here.
#[derive(Default)]
struct Offer {
    connection: Vec<u8>,
    metadata: Vec<u8>,
    chunks: Vec<NixlChunk>,
}

/// What to offer for a NIXL_GET of `keys`: the agent's connection metadata, the NIXL metadata
/// of the held chunks (registered on first offer), and the chunks, which go into `lent`.
/// Without a NIXL data plane the offer is empty, which tells the client to use GET.
#[cfg(feature = "nixl")]
fn offer(
    shared: &Shared,
    auth: &ChunkAuth,
    keys: &[ChunkKey],
    lent: &mut Vec<Arc<PublishedChunk>>,
) -> Offer {
    let Some(plane) = shared.nixl.get() else {
        return Offer::default();
    };
    let mut chunks = Vec::new();
    let mut spans = Vec::new();
    for &key in keys {
        let Some(chunk) = lock(&shared.store).get(key) else {
            continue;
        };
        let (addr, len) = (chunk.bytes.as_ptr() as usize, chunk.bytes.len());
        let registered = chunk.registration.get_or_init(|| {
            // The bytes live (at this address) as long as the chunk, which drops the
            // registration before them.
            plane
                .register(addr, len)
                .map_err(|reason| log(format_args!("cannot offer {key:?}: {reason}")))
                .ok()
        });
        if registered.is_none() {
            continue;
        }
        spans.push((addr, len));
        chunks.push(NixlChunk {
            key,
            checksum: auth.tag_of(FrameKind::NixlOffer, key, &chunk),
            addr: addr as u64,
            len: len as u32,
        });
        lent.push(chunk);
    }
    // Connection metadata is what `partial_metadata` gives for no spans.
    let parts = plane
        .partial_metadata(&[])
        .and_then(|connection| Ok((connection, plane.partial_metadata(&spans)?)));
    match parts {
        Ok((connection, metadata)) => {
            add(&shared.counters.chunks_offered_nixl, chunks.len() as u64);
            Offer {
                connection,
                metadata,
                chunks,
            }
        }
        Err(reason) => {
            log(format_args!(
                "NIXL offer refused, client will use GET: {reason}"
            ));
            lent.clear();
            Offer::default()
        }
    }
}

/// Without the `nixl` feature there is no NIXL data plane: an empty offer.
#[cfg(not(feature = "nixl"))]
fn offer(
    _shared: &Shared,
    _auth: &ChunkAuth,
    _keys: &[ChunkKey],
    _lent: &mut Vec<Arc<PublishedChunk>>,
) -> Offer {
    Offer::default()
}

/// Receives a PUT body of `body_len` bytes (its header read): verifies the payload against its
/// checksum and publishes it here. Whether it was stored (a mismatch or a chunk larger than
/// `published_bytes_max` is not).
fn receive_put(shared: &Shared, conn: &mut Conn, body_len: usize) -> Result<bool, P2pError> {
    if body_len <= DATA_PREFIX_BYTES {
        let error = P2pError::Frame {
            op: "receive PUT",
            peer: conn.peer(),
            source: FrameError::Malformed {
                kind: FrameKind::Put,
                reason: format!("body of {body_len} bytes"),
            },
        };
        return Err(tell(conn, error));
    }
    let mut prefix = [0u8; DATA_PREFIX_BYTES];
    conn.read_exact(&mut prefix, "receive PUT")?;
    let (key, tag) = decode_data_prefix(&prefix);
    let mut bytes = vec![0u8; body_len - DATA_PREFIX_BYTES].into_boxed_slice();
    conn.read_exact(&mut bytes, "receive PUT payload")?;
    let sum = checksum(&bytes);
    let chunk = PublishedChunk::new(bytes, sum);
    let auth = conn.chunk_auth();
    // Keyed: hashes the bytes once for the digest, which the chunk keeps for its sends.
    if auth.tag_of(FrameKind::Put, key, &chunk) != tag {
        shared.counters.tag_failed(auth.is_keyed());
        log(format_args!(
            "peer {} pushed {key:?} with a checksum or MAC mismatch; not stored",
            conn.peer()
        ));
        return Ok(false);
    }
    let inserted = lock(&shared.store).insert(key, chunk);
    match inserted {
        Ok(evicted) => {
            add(&shared.counters.evictions, evicted as u64);
            add(&shared.counters.chunks_received, 1);
            Ok(true)
        }
        Err(_) => Ok(false),
    }
}

/// Answers a GET: one DATA frame per held key, in request order, then END.
fn send_chunks(shared: &Shared, conn: &mut Conn, keys: &[ChunkKey]) -> Result<(), P2pError> {
    let mut sent = 0u32;
    for &key in keys {
        let Some(chunk) = lock(&shared.store).get(key) else {
            continue;
        };
        let tag = conn.chunk_auth().tag_of(FrameKind::Data, key, &chunk);
        conn.send_data(key, tag, &chunk.bytes, "send DATA")?;
        sent += 1;
        add(&shared.counters.chunks_served, 1);
        add(&shared.counters.bytes_served, chunk.bytes.len() as u64);
    }
    conn.send(&Frame::End { sent }, "send END")
}
