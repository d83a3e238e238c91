//! One framed TCP connection with deadlines: every read and write is bounded by the deadline of
//! the operation in progress, and every socket error comes out as a [`P2pError`] naming the peer
//! and the operation.

use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use offload_core::ChunkKey;

use crate::auth::ChunkAuth;
use crate::error::P2pError;
use crate::frame::{encode_chunk_prefix, Frame, FrameHeader, FrameKind, FrameReader, ReadError};

/// How far past its deadline a read or write may block, in exchange for fewer `setsockopt`
/// calls while bytes flow.
const TIMEOUT_SLACK: Duration = Duration::from_millis(10);

/// Bytes of the read buffer in front of the socket (large payloads bypass it). Small, because
/// the payload bytes that a header read pulls into it are copied once more on their way out.
const READ_BUFFER_BYTES: usize = 4 * 1024;

/// A socket whose reads and writes fail with `TimedOut` once the deadline has passed.
#[derive(Debug)]
struct Timed {
    stream: TcpStream,
    deadline: Instant,
    read_timeout: Option<Duration>,
    write_timeout: Option<Duration>,
}

impl Timed {
    fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            deadline: Instant::now(),
            read_timeout: None,
            write_timeout: None,
        }
    }

    fn set_deadline(&mut self, deadline: Instant) {
        self.deadline = deadline;
        self.read_timeout = None;
        self.write_timeout = None;
    }

    /// The timeout to give the socket now, if the one it has is not good enough: at most the
    /// time left (plus a little slack), never less than it.
    fn refresh(current: Option<Duration>, deadline: Instant) -> io::Result<Option<Duration>> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        match current {
            Some(set) if set >= left && set <= left + TIMEOUT_SLACK => Ok(None),
            _ => Ok(Some(left)),
        }
    }
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(timeout) = Self::refresh(self.read_timeout, self.deadline)? {
            self.stream.set_read_timeout(Some(timeout))?;
            self.read_timeout = Some(timeout);
        }
        self.stream.read(buf)
    }
}

impl Write for Timed {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if let Some(timeout) = Self::refresh(self.write_timeout, self.deadline)? {
            self.stream.set_write_timeout(Some(timeout))?;
            self.write_timeout = Some(timeout);
        }
        self.stream.write(buf)
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        if let Some(timeout) = Self::refresh(self.write_timeout, self.deadline)? {
            self.stream.set_write_timeout(Some(timeout))?;
            self.write_timeout = Some(timeout);
        }
        self.stream.write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Writes all of `bufs` with as few `writev` calls as the socket allows.
fn write_all_vectored(writer: &mut Timed, mut bufs: &mut [io::IoSlice<'_>]) -> io::Result<()> {
    while !bufs.is_empty() {
        match writer.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => io::IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A framed connection to one peer.
#[derive(Debug)]
pub(crate) struct Conn {
    peer: SocketAddr,
    reader: BufReader<Timed>,
    writer: Timed,
    frames: FrameReader,
    out: Vec<u8>,
    /// The span of the current deadline, for error messages.
    span: Duration,
    /// How chunk payloads are tagged on this connection (set by the handshake).
    chunk_auth: ChunkAuth,
}

impl Conn {
    /// Connects to `peer` within `timeout`.
    pub(crate) fn connect(
        peer: SocketAddr,
        timeout: Duration,
        body_max: usize,
    ) -> Result<Self, P2pError> {
        let stream = TcpStream::connect_timeout(&peer, timeout)
            .map_err(|e| P2pError::io("connect", peer, e, timeout))?;
        Self::new(stream, peer, body_max)
    }

    /// Wraps an accepted or connected stream.
    pub(crate) fn new(
        stream: TcpStream,
        peer: SocketAddr,
        body_max: usize,
    ) -> Result<Self, P2pError> {
        let zero = Duration::ZERO;
        stream
            .set_nodelay(true)
            .map_err(|e| P2pError::io("set TCP_NODELAY", peer, e, zero))?;
        let clone = stream
            .try_clone()
            .map_err(|e| P2pError::io("clone socket", peer, e, zero))?;
        Ok(Self {
            peer,
            reader: BufReader::with_capacity(READ_BUFFER_BYTES, Timed::new(clone)),
            writer: Timed::new(stream),
            frames: FrameReader::new(body_max),
            out: Vec::new(),
            chunk_auth: ChunkAuth::Checksum,
            span: zero,
        })
    }

    /// Accepts frame bodies of up to `body_max` bytes from now on (the reader's buffer is
    /// empty between frames, so nothing is lost).
    pub(crate) fn set_body_max(&mut self, body_max: usize) {
        self.frames = FrameReader::new(body_max);
    }

    /// The remote address.
    pub(crate) fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Every read and write from now on must finish by `deadline`.
    pub(crate) fn set_deadline(&mut self, deadline: Instant) {
        self.span = deadline.saturating_duration_since(Instant::now());
        self.reader.get_mut().set_deadline(deadline);
        self.writer.set_deadline(deadline);
    }

    /// Every read and write from now on must finish within `timeout`.
    pub(crate) fn set_timeout(&mut self, timeout: Duration) {
        self.set_deadline(Instant::now() + timeout);
    }

    fn io_error(&self, op: &'static str, error: io::Error) -> P2pError {
        P2pError::io(op, self.peer, error, self.span)
    }

    fn read_error(&self, op: &'static str, error: ReadError) -> P2pError {
        match error {
            ReadError::Io(e) => self.io_error(op, e),
            ReadError::Frame(source) => P2pError::Frame {
                op,
                peer: self.peer,
                source,
            },
        }
    }

    /// Sends one frame.
    pub(crate) fn send(&mut self, frame: &Frame<'_>, op: &'static str) -> Result<(), P2pError> {
        self.out.clear();
        frame.encode(&mut self.out);
        let result = self.writer.write_all(&self.out);
        result.map_err(|e| self.io_error(op, e))
    }

    /// How chunk payloads are tagged on this connection.
    pub(crate) fn chunk_auth(&self) -> &ChunkAuth {
        &self.chunk_auth
    }

    /// Sets how chunk payloads are tagged (the handshake does, once the secret is proven).
    pub(crate) fn set_chunk_auth(&mut self, auth: ChunkAuth) {
        self.chunk_auth = auth;
    }

    /// Sends one DATA frame, its payload straight from `payload`.
    pub(crate) fn send_data(
        &mut self,
        key: ChunkKey,
        checksum: u64,
        payload: &[u8],
        op: &'static str,
    ) -> Result<(), P2pError> {
        self.send_chunk(FrameKind::Data, key, checksum, payload, op)
    }

    /// Sends one DATA or PUT frame (`kind`), its payload straight from `payload`.
    pub(crate) fn send_chunk(
        &mut self,
        kind: FrameKind,
        key: ChunkKey,
        checksum: u64,
        payload: &[u8],
        op: &'static str,
    ) -> Result<(), P2pError> {
        self.out.clear();
        encode_chunk_prefix(kind, key, checksum, payload.len(), &mut self.out);
        // One `writev` for header and payload: no lone small segment ahead of each chunk.
        let mut bufs = [io::IoSlice::new(&self.out), io::IoSlice::new(payload)];
        let result = write_all_vectored(&mut self.writer, &mut bufs);
        result.map_err(|e| self.io_error(op, e))
    }

    /// Receives one whole frame.
    pub(crate) fn recv(&mut self, op: &'static str) -> Result<Frame<'_>, P2pError> {
        let header = self
            .frames
            .read_header(&mut self.reader)
            .map_err(|e| self.read_error(op, e))?;
        self.recv_body(header, op)
    }

    /// Receives and checks the next frame header only.
    pub(crate) fn recv_header(&mut self, op: &'static str) -> Result<FrameHeader, P2pError> {
        let result = self.frames.read_header(&mut self.reader);
        result.map_err(|e| self.read_error(op, e))
    }

    /// Receives the body of a frame whose header was just received.
    pub(crate) fn recv_body(
        &mut self,
        header: FrameHeader,
        op: &'static str,
    ) -> Result<Frame<'_>, P2pError> {
        let peer = self.peer;
        let span = self.span;
        self.frames
            .read_body(&mut self.reader, header)
            .map_err(|e| match e {
                ReadError::Io(e) => P2pError::io(op, peer, e, span),
                ReadError::Frame(source) => P2pError::Frame { op, peer, source },
            })
    }

    /// Fills `buf` with the next bytes of the stream (a DATA payload).
    pub(crate) fn read_exact(&mut self, buf: &mut [u8], op: &'static str) -> Result<(), P2pError> {
        let result = self.reader.read_exact(buf);
        result.map_err(|e| self.io_error(op, e))
    }

    /// Another handle to the socket, with which another thread can shut it down.
    pub(crate) fn socket(&self) -> io::Result<TcpStream> {
        self.writer.stream.try_clone()
    }

    /// Closes both directions; a thread blocked reading it wakes up.
    pub(crate) fn shutdown(&self) {
        // Already closed by the peer is fine.
        let _ = self.writer.stream.shutdown(Shutdown::Both);
    }
}
