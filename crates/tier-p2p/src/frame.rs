//! The wire protocol: versioned, length-prefixed binary frames, and their encoder and decoder.
//!
//! Every frame is `u32 body length (little-endian) | u8 kind | body`. The body length never
//! exceeds the receiver's `frame_body_bytes_max`; a larger length is refused from the header
//! alone, before any body byte is read or any memory is reserved for it. All integers are
//! little-endian. A chunk key is `u128 hash | u32 group` (20 bytes).
//!
//! | kind | body |
//! |------|------|
//! | HELLO (1) | `"KVP2" | u16 version | u8 flags (bit 0: shared secret configured) | 32-byte nonce | u16 n | n namespace bytes` (n = 0 with a secret: the proofs bind the namespace) |
//! | AUTH (2) | 32-byte HMAC-SHA256 (see [`crate::auth`]) |
//! | HAVE (3) | `u32 count | count keys` |
//! | HAVE_REPLY (4) | `u32 count | ceil(count / 8) bytes of bitmap (bit i of byte i / 8: key i is held)` |
//! | GET (5) | `u32 count | count keys` |
//! | DATA (6) | `key | u64 tag | payload` (the payload's length is the body's, less 28; the tag: see below) |
//! | END (7) | `u32 number of DATA frames sent for the GET` |
//! | ERROR (8) | UTF-8 message, at most 1024 bytes |
//! | NIXL_GET (9) | `u32 count | count keys` |
//! | NIXL_OFFER (10) | `u32 c | c bytes of NIXL connection metadata | u32 n | n bytes of NIXL metadata of the chunks | u32 count | count × (key | u64 tag | u64 address | u32 length)` |
//! | NIXL_DONE (11) | empty |
//! | PUT (12) | `key | u64 tag | payload`, as DATA |
//!
//! A chunk's tag (DATA, PUT, each chunk of NIXL_OFFER) is the xxh3-64 of its bytes when the
//! connection has no shared secret (loopback only); with one, it is the first 8 bytes
//! (little-endian) of keyed BLAKE3 under the connection's session key over `u8 frame kind | u128
//! key hash | u32 key group | u64 byte count | 16-byte POLYVAL of the bytes` (RFC 8452, the
//! bytes zero-padded to whole blocks, under the hash key that `auth::hash_key` derives from the
//! secret and the namespace; see `auth::ChunkAuth`). The digest itself is not sent: the receiver
//! hashes the bytes it received and keys the tag over that; the sender keeps each chunk's
//! digest, so it tags a send without hashing the bytes.
//!
//! A GET is answered by one DATA frame per requested key that the server holds, in request
//! order, then END; keys without a DATA frame are not held. A NIXL_GET is answered by one NIXL_OFFER:
//! the server agent's connection metadata (empty when the server has no NIXL data plane, which
//! tells the client to use GET), its metadata for the offered chunks, and where each held key lies in the server's
//! registered memory; the server keeps those chunks alive and registered until the client's
//! NIXL_DONE (or its next request, or the connection's end), while the client READs them. A PUT
//! (a publisher pushing a chunk to one of its key's owners) is answered by END: 1 if the server
//! verified and stored the chunk, 0 if not. The decoder never panics, and a
//! [`FrameReader`] never holds a buffer larger than its maximum body size.

use std::io::{self, Read};

use offload_core::ChunkKey;
use thiserror::Error;

/// The protocol version this crate speaks; a peer with another version is refused. Version 2
/// added NIXL_GET, NIXL_OFFER and NIXL_DONE; version 3 added PUT; version 4 tags chunks with
/// the session key when a secret is set, and HELLO carries no namespace then; version 5 has
/// 128-bit key hashes (every key 20 bytes, DATA and PUT prefixes 28) and keys the chunk tag over
/// the payload's BLAKE3 digest instead of the payload (the sender keeps the digest); version 6
/// keys it over the payload's length and POLYVAL digest under a hash key derived from the
/// secret (half the receiver's CPU per byte of BLAKE3's). A peer of another version is refused
/// by name of both versions (of version 4 or earlier: its 64-bit keys cannot name our chunks; of
/// version 5: its keyed tags cannot verify here).
pub const PROTOCOL_VERSION: u16 = 6;
/// The first bytes of every HELLO body.
pub const MAGIC: [u8; 4] = *b"KVP2";
/// Bytes of a frame header: body length (4) and kind (1).
pub const HEADER_BYTES: usize = 5;
/// Bytes of a handshake nonce.
pub const NONCE_BYTES: usize = 32;
/// Bytes of an HMAC-SHA256 tag.
pub const MAC_BYTES: usize = 32;
/// Bytes of an encoded chunk key.
pub const KEY_BYTES: usize = 20;
/// Bytes of a DATA body before the payload: key and checksum.
pub const DATA_PREFIX_BYTES: usize = KEY_BYTES + 8;
/// Most bytes of a namespace identity in HELLO.
pub const NAMESPACE_BYTES_MAX: usize = 1024;
/// Most bytes of an ERROR message (longer messages are cut on a character boundary).
pub const ERROR_MESSAGE_BYTES_MAX: usize = 1024;
/// The smallest maximum body size a receiver may configure: it must hold a full HELLO.
pub const FRAME_BODY_BYTES_MIN: usize = 4 + 2 + 1 + NONCE_BYTES + 2 + NAMESPACE_BYTES_MAX;

const FLAG_SECRET: u8 = 1;

/// The kind byte of a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// Handshake greeting.
    Hello = 1,
    /// Handshake proof of the shared secret.
    Auth = 2,
    /// Which of these keys do you hold?
    Have = 3,
    /// Bitmap answer to HAVE.
    HaveReply = 4,
    /// Send me these keys.
    Get = 5,
    /// One chunk.
    Data = 6,
    /// End of a GET's answer.
    End = 7,
    /// A refusal or failure, with a message; the sender closes the connection after it.
    Error = 8,
    /// Describe these keys for a NIXL READ, and keep them until NIXL_DONE.
    NixlGet = 9,
    /// Answer to NIXL_GET: metadata and the held keys' registered addresses.
    NixlOffer = 10,
    /// The client finished reading the offered chunks.
    NixlDone = 11,
    /// Keep this chunk (a push to one of its key's owners).
    Put = 12,
}

impl FrameKind {
    /// The kind for a byte, if it is one.
    pub fn from_byte(byte: u8) -> Option<Self> {
        Some(match byte {
            1 => FrameKind::Hello,
            2 => FrameKind::Auth,
            3 => FrameKind::Have,
            4 => FrameKind::HaveReply,
            5 => FrameKind::Get,
            6 => FrameKind::Data,
            7 => FrameKind::End,
            8 => FrameKind::Error,
            9 => FrameKind::NixlGet,
            10 => FrameKind::NixlOffer,
            11 => FrameKind::NixlDone,
            12 => FrameKind::Put,
            _ => return None,
        })
    }
}

/// Why bytes do not decode as a frame.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum FrameError {
    /// The header announces a body larger than the receiver accepts.
    #[error("frame body of {len} bytes exceeds the maximum of {max}")]
    Oversized {
        /// The announced body length.
        len: u64,
        /// The receiver's maximum.
        max: usize,
    },
    /// The kind byte is not a known frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// The body does not have the layout its kind requires.
    #[error("malformed {kind:?} frame: {reason}")]
    Malformed {
        /// The frame's kind.
        kind: FrameKind,
        /// What is wrong.
        reason: String,
    },
    /// A HELLO of another protocol version.
    #[error("protocol version {found}, expected {expected}")]
    Version {
        /// The peer's version.
        found: u16,
        /// Ours.
        expected: u16,
    },
    /// A well-formed frame that the protocol does not allow at this point.
    #[error("unexpected {found:?} frame, expected {expected}")]
    Unexpected {
        /// What the protocol allows here.
        expected: &'static str,
        /// What arrived.
        found: FrameKind,
    },
}

/// A decoded HELLO.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Whether the sender has a shared secret configured (and so expects AUTH).
    pub secret_required: bool,
    /// The sender's challenge.
    pub nonce: [u8; NONCE_BYTES],
    /// The sender's namespace identity (model, layout, hash seed).
    pub namespace: Vec<u8>,
}

/// One chunk offered for a NIXL READ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NixlChunk {
    /// The chunk's key.
    pub key: ChunkKey,
    /// The chunk's tag: xxh3-64 of its bytes, or keyed BLAKE3 with a secret (see the module doc).
    pub checksum: u64,
    /// The chunk's address in the server's registered memory.
    pub addr: u64,
    /// The chunk's length in bytes.
    pub len: u32,
}

/// Bytes of one encoded [`NixlChunk`].
pub const NIXL_CHUNK_BYTES: usize = KEY_BYTES + 8 + 8 + 4;

/// One decoded frame. DATA borrows its payload from the decoder's buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    /// Handshake greeting (of [`PROTOCOL_VERSION`]).
    Hello(Hello),
    /// Handshake proof.
    Auth([u8; MAC_BYTES]),
    /// Which of these keys do you hold?
    Have(Vec<ChunkKey>),
    /// One flag per HAVE key, in order.
    HaveReply(Vec<bool>),
    /// Send me these keys.
    Get(Vec<ChunkKey>),
    /// One chunk.
    Data {
        /// The chunk's key.
        key: ChunkKey,
        /// The payload's tag: xxh3-64, or keyed BLAKE3 with a secret (see the module doc).
        checksum: u64,
        /// The chunk's bytes.
        payload: &'a [u8],
    },
    /// End of a GET's answer: how many DATA frames preceded it.
    End {
        /// DATA frames sent.
        sent: u32,
    },
    /// A refusal or failure.
    Error(String),
    /// Describe these keys for a NIXL READ.
    NixlGet(Vec<ChunkKey>),
    /// Answer to NIXL_GET.
    NixlOffer {
        /// The server agent's connection metadata (empty: no NIXL data plane there).
        connection: &'a [u8],
        /// The server's NIXL metadata of the offered chunks.
        metadata: &'a [u8],
        /// The held keys, in request order.
        chunks: Vec<NixlChunk>,
    },
    /// The client finished reading the offered chunks.
    NixlDone,
    /// Keep this chunk.
    Put {
        /// The chunk's key.
        key: ChunkKey,
        /// The payload's tag: xxh3-64, or keyed BLAKE3 with a secret (see the module doc).
        checksum: u64,
        /// The chunk's bytes.
        payload: &'a [u8],
    },
}

impl Frame<'_> {
    /// The frame's kind.
    pub fn kind(&self) -> FrameKind {
        match self {
            Frame::Hello(_) => FrameKind::Hello,
            Frame::Auth(_) => FrameKind::Auth,
            Frame::Have(_) => FrameKind::Have,
            Frame::HaveReply(_) => FrameKind::HaveReply,
            Frame::Get(_) => FrameKind::Get,
            Frame::Data { .. } => FrameKind::Data,
            Frame::End { .. } => FrameKind::End,
            Frame::Error(_) => FrameKind::Error,
            Frame::NixlGet(_) => FrameKind::NixlGet,
            Frame::NixlOffer { .. } => FrameKind::NixlOffer,
            Frame::NixlDone => FrameKind::NixlDone,
            Frame::Put { .. } => FrameKind::Put,
        }
    }

    /// Appends the encoded frame (header and body) to `out`.
    ///
    /// Lengths beyond the protocol's limits (a namespace over [`NAMESPACE_BYTES_MAX`], an error
    /// message over [`ERROR_MESSAGE_BYTES_MAX`]) are cut to the limit.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&[0; HEADER_BYTES]);
        out[start + 4] = self.kind() as u8;
        match self {
            Frame::Hello(hello) => encode_hello(hello, out),
            Frame::Auth(mac) => out.extend_from_slice(mac),
            Frame::Have(keys) | Frame::Get(keys) | Frame::NixlGet(keys) => encode_keys(keys, out),
            Frame::HaveReply(flags) => encode_flags(flags, out),
            Frame::Data {
                key,
                checksum,
                payload,
            }
            | Frame::Put {
                key,
                checksum,
                payload,
            } => {
                encode_key(*key, out);
                out.extend_from_slice(&checksum.to_le_bytes());
                out.extend_from_slice(payload);
            }
            Frame::End { sent } => out.extend_from_slice(&sent.to_le_bytes()),
            Frame::Error(message) => out.extend_from_slice(cut(message).as_bytes()),
            Frame::NixlOffer {
                connection,
                metadata,
                chunks,
            } => encode_offer(connection, metadata, chunks, out),
            Frame::NixlDone => {}
        }
        let body_len = out.len() - start - HEADER_BYTES;
        let len = u32::try_from(body_len).unwrap_or(u32::MAX);
        out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    }
}

/// Appends the header and prefix of a DATA frame whose payload (of `payload_len` bytes) the
/// caller writes next, so that the payload is sent straight from where it lies.
pub fn encode_data_prefix(key: ChunkKey, checksum: u64, payload_len: usize, out: &mut Vec<u8>) {
    encode_chunk_prefix(FrameKind::Data, key, checksum, payload_len, out);
}

/// As [`encode_data_prefix`], for a frame of `kind` (DATA or PUT).
pub fn encode_chunk_prefix(
    kind: FrameKind,
    key: ChunkKey,
    checksum: u64,
    payload_len: usize,
    out: &mut Vec<u8>,
) {
    let body_len = u32::try_from(DATA_PREFIX_BYTES + payload_len).unwrap_or(u32::MAX);
    out.extend_from_slice(&body_len.to_le_bytes());
    out.push(kind as u8);
    encode_key(key, out);
    out.extend_from_slice(&checksum.to_le_bytes());
}

/// The key and checksum of a DATA or PUT body's first bytes.
pub fn decode_data_prefix(prefix: &[u8; DATA_PREFIX_BYTES]) -> (ChunkKey, u64) {
    let mut hash = [0u8; 16];
    let mut group = [0u8; 4];
    let mut sum = [0u8; 8];
    hash.copy_from_slice(&prefix[0..16]);
    group.copy_from_slice(&prefix[16..20]);
    sum.copy_from_slice(&prefix[20..28]);
    (
        ChunkKey::new(u128::from_le_bytes(hash), u32::from_le_bytes(group)),
        u64::from_le_bytes(sum),
    )
}

fn cut(message: &str) -> &str {
    if message.len() <= ERROR_MESSAGE_BYTES_MAX {
        return message;
    }
    let mut end = ERROR_MESSAGE_BYTES_MAX;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message[..end]
}

fn encode_hello(hello: &Hello, out: &mut Vec<u8>) {
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.push(if hello.secret_required {
        FLAG_SECRET
    } else {
        0
    });
    out.extend_from_slice(&hello.nonce);
    let namespace = &hello.namespace[..hello.namespace.len().min(NAMESPACE_BYTES_MAX)];
    // At most NAMESPACE_BYTES_MAX, which fits a u16.
    out.extend_from_slice(&(namespace.len() as u16).to_le_bytes());
    out.extend_from_slice(namespace);
}

fn encode_blob(blob: &[u8], out: &mut Vec<u8>) {
    let len = u32::try_from(blob.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&blob[..len as usize]);
}

fn encode_offer(connection: &[u8], metadata: &[u8], chunks: &[NixlChunk], out: &mut Vec<u8>) {
    encode_blob(connection, out);
    encode_blob(metadata, out);
    let count = u32::try_from(chunks.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&count.to_le_bytes());
    for chunk in chunks.iter().take(count as usize) {
        encode_key(chunk.key, out);
        out.extend_from_slice(&chunk.checksum.to_le_bytes());
        out.extend_from_slice(&chunk.addr.to_le_bytes());
        out.extend_from_slice(&chunk.len.to_le_bytes());
    }
}

fn encode_key(key: ChunkKey, out: &mut Vec<u8>) {
    out.extend_from_slice(&key.hash.to_le_bytes());
    out.extend_from_slice(&key.group.to_le_bytes());
}

fn encode_keys(keys: &[ChunkKey], out: &mut Vec<u8>) {
    let count = u32::try_from(keys.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&count.to_le_bytes());
    for &key in keys.iter().take(count as usize) {
        encode_key(key, out);
    }
}

fn encode_flags(flags: &[bool], out: &mut Vec<u8>) {
    let count = u32::try_from(flags.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&count.to_le_bytes());
    for byte in flags.chunks(8) {
        let bits = byte
            .iter()
            .enumerate()
            .fold(0u8, |acc, (i, &held)| acc | (u8::from(held) << i));
        out.push(bits);
    }
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// The frame's kind.
    pub kind: FrameKind,
    /// The body's length in bytes (at most the receiver's maximum).
    pub body_len: usize,
}

/// Decodes a header, refusing a body longer than `body_max` or an unknown kind.
pub fn decode_header(
    bytes: [u8; HEADER_BYTES],
    body_max: usize,
) -> Result<FrameHeader, FrameError> {
    let len = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    let body_len = usize::try_from(len).unwrap_or(usize::MAX);
    if body_len > body_max {
        return Err(FrameError::Oversized {
            len: u64::from(len),
            max: body_max,
        });
    }
    let kind = FrameKind::from_byte(bytes[4]).ok_or(FrameError::UnknownKind(bytes[4]))?;
    Ok(FrameHeader { kind, body_len })
}

/// Decodes one frame from the front of `buf`: `Ok(None)` if `buf` holds only part of it, else the
/// frame and the number of bytes it took.
pub fn decode(buf: &[u8], body_max: usize) -> Result<Option<(Frame<'_>, usize)>, FrameError> {
    let Some(header_bytes) = buf.first_chunk::<HEADER_BYTES>() else {
        return Ok(None);
    };
    let header = decode_header(*header_bytes, body_max)?;
    let Some(body) = buf[HEADER_BYTES..].get(..header.body_len) else {
        return Ok(None);
    };
    let frame = decode_body(header.kind, body)?;
    Ok(Some((frame, HEADER_BYTES + header.body_len)))
}

/// Decodes the body of a frame of `kind`.
pub fn decode_body(kind: FrameKind, body: &[u8]) -> Result<Frame<'_>, FrameError> {
    let mut cursor = Cursor { kind, body, at: 0 };
    let frame = match kind {
        FrameKind::Hello => Frame::Hello(decode_hello(&mut cursor)?),
        FrameKind::Auth => Frame::Auth(cursor.array()?),
        FrameKind::Have => Frame::Have(decode_keys(&mut cursor)?),
        FrameKind::Get => Frame::Get(decode_keys(&mut cursor)?),
        FrameKind::NixlGet => Frame::NixlGet(decode_keys(&mut cursor)?),
        FrameKind::NixlOffer => decode_offer(&mut cursor)?,
        FrameKind::NixlDone => Frame::NixlDone,
        FrameKind::HaveReply => Frame::HaveReply(decode_flags(&mut cursor)?),
        FrameKind::Data | FrameKind::Put => {
            let key = cursor.key()?;
            let checksum = u64::from_le_bytes(cursor.array()?);
            let payload = cursor.rest();
            if payload.is_empty() {
                return Err(cursor.malformed("empty payload".to_owned()));
            }
            if kind == FrameKind::Put {
                Frame::Put {
                    key,
                    checksum,
                    payload,
                }
            } else {
                Frame::Data {
                    key,
                    checksum,
                    payload,
                }
            }
        }
        FrameKind::End => Frame::End {
            sent: u32::from_le_bytes(cursor.array()?),
        },
        FrameKind::Error => {
            let bytes = cursor.rest();
            if bytes.len() > ERROR_MESSAGE_BYTES_MAX {
                return Err(cursor.malformed(format!("message of {} bytes", bytes.len())));
            }
            Frame::Error(String::from_utf8_lossy(bytes).into_owned())
        }
    };
    cursor.finish()?;
    Ok(frame)
}

fn decode_hello(cursor: &mut Cursor<'_>) -> Result<Hello, FrameError> {
    let magic: [u8; 4] = cursor.array()?;
    if magic != MAGIC {
        return Err(cursor.malformed(format!("magic {magic:02x?}, expected \"KVP2\"")));
    }
    let version = u16::from_le_bytes(cursor.array()?);
    if version != PROTOCOL_VERSION {
        return Err(FrameError::Version {
            found: version,
            expected: PROTOCOL_VERSION,
        });
    }
    let [flags] = cursor.array()?;
    if flags & !FLAG_SECRET != 0 {
        return Err(cursor.malformed(format!("unknown flags {flags:#04x}")));
    }
    let nonce = cursor.array()?;
    let len = usize::from(u16::from_le_bytes(cursor.array()?));
    if len > NAMESPACE_BYTES_MAX {
        return Err(cursor.malformed(format!("namespace of {len} bytes")));
    }
    let namespace = cursor.take(len)?.to_vec();
    Ok(Hello {
        secret_required: flags & FLAG_SECRET != 0,
        nonce,
        namespace,
    })
}

fn decode_offer<'a>(cursor: &mut Cursor<'a>) -> Result<Frame<'a>, FrameError> {
    let len = u32::from_le_bytes(cursor.array()?) as usize;
    let connection = cursor.take(len)?;
    let len = u32::from_le_bytes(cursor.array()?) as usize;
    let metadata = cursor.take(len)?;
    let count = u32::from_le_bytes(cursor.array()?) as usize;
    if count.checked_mul(NIXL_CHUNK_BYTES) != Some(cursor.remaining()) {
        return Err(cursor.malformed(format!(
            "{count} offered chunks but {} bytes of them",
            cursor.remaining()
        )));
    }
    // The count is bounded by the body length, itself bounded by the frame maximum.
    let mut chunks = Vec::with_capacity(count);
    for _ in 0..count {
        chunks.push(NixlChunk {
            key: cursor.key()?,
            checksum: u64::from_le_bytes(cursor.array()?),
            addr: u64::from_le_bytes(cursor.array()?),
            len: u32::from_le_bytes(cursor.array()?),
        });
    }
    Ok(Frame::NixlOffer {
        connection,
        metadata,
        chunks,
    })
}

fn decode_keys(cursor: &mut Cursor<'_>) -> Result<Vec<ChunkKey>, FrameError> {
    let count = u32::from_le_bytes(cursor.array()?) as usize;
    let expected = count.checked_mul(KEY_BYTES);
    if expected != Some(cursor.remaining()) {
        return Err(cursor.malformed(format!(
            "{count} keys but {} bytes of keys",
            cursor.remaining()
        )));
    }
    // The count is bounded by the body length, itself bounded by the frame maximum.
    let mut keys = Vec::with_capacity(count);
    for _ in 0..count {
        keys.push(cursor.key()?);
    }
    Ok(keys)
}

fn decode_flags(cursor: &mut Cursor<'_>) -> Result<Vec<bool>, FrameError> {
    let count = u32::from_le_bytes(cursor.array()?) as usize;
    let bytes = count.div_ceil(8);
    if bytes != cursor.remaining() {
        return Err(cursor.malformed(format!(
            "{count} flags but {} bitmap bytes",
            cursor.remaining()
        )));
    }
    let bitmap = cursor.take(bytes)?;
    Ok((0..count)
        .map(|i| bitmap[i / 8] & (1 << (i % 8)) != 0)
        .collect())
}

/// Reads a body front to back, turning every short read into a [`FrameError::Malformed`].
struct Cursor<'a> {
    kind: FrameKind,
    body: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn malformed(&self, reason: String) -> FrameError {
        FrameError::Malformed {
            kind: self.kind,
            reason,
        }
    }

    fn remaining(&self) -> usize {
        self.body.len() - self.at
    }

    fn take(&mut self, len: usize) -> Result<&'a [u8], FrameError> {
        let Some(bytes) = self.body.get(self.at..self.at.saturating_add(len)) else {
            return Err(self.malformed(format!(
                "body of {} bytes ends before byte {}",
                self.body.len(),
                self.at.saturating_add(len)
            )));
        };
        self.at += len;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], FrameError> {
        let bytes = self.take(N)?;
        let mut out = [0; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn key(&mut self) -> Result<ChunkKey, FrameError> {
        let hash = u128::from_le_bytes(self.array()?);
        let group = u32::from_le_bytes(self.array()?);
        Ok(ChunkKey::new(hash, group))
    }

    fn rest(&mut self) -> &'a [u8] {
        let rest = &self.body[self.at..];
        self.at = self.body.len();
        rest
    }

    fn finish(&self) -> Result<(), FrameError> {
        if self.remaining() != 0 {
            return Err(self.malformed(format!("{} trailing bytes", self.remaining())));
        }
        Ok(())
    }
}

/// Why [`FrameReader`] could not read a frame.
#[derive(Debug)]
pub enum ReadError {
    /// The stream failed, ended, or timed out.
    Io(io::Error),
    /// The bytes do not decode.
    Frame(FrameError),
}

/// Reads frames from a byte stream into one reused body buffer, never larger than its maximum.
#[derive(Debug)]
pub struct FrameReader {
    body: Vec<u8>,
    body_max: usize,
}

impl FrameReader {
    /// A reader that refuses bodies over `body_max` bytes.
    pub fn new(body_max: usize) -> Self {
        Self {
            body: Vec::new(),
            body_max,
        }
    }

    /// The largest body it accepts.
    pub fn body_max(&self) -> usize {
        self.body_max
    }

    /// The capacity of its body buffer (never over [`FrameReader::body_max`]).
    pub fn buffer_capacity(&self) -> usize {
        self.body.capacity()
    }

    /// Reads and checks one header.
    pub fn read_header<R: Read>(&mut self, stream: &mut R) -> Result<FrameHeader, ReadError> {
        let mut bytes = [0; HEADER_BYTES];
        stream.read_exact(&mut bytes).map_err(ReadError::Io)?;
        decode_header(bytes, self.body_max).map_err(ReadError::Frame)
    }

    /// Reads the body of a frame whose header was just read, and decodes it.
    pub fn read_body<R: Read>(
        &mut self,
        stream: &mut R,
        header: FrameHeader,
    ) -> Result<Frame<'_>, ReadError> {
        let len = header.body_len.min(self.body_max);
        self.body.clear();
        if len > self.body.capacity() {
            // Exact, so that the buffer never grows past the largest accepted body.
            self.body.reserve_exact(len);
        }
        self.body.resize(len, 0);
        stream.read_exact(&mut self.body).map_err(ReadError::Io)?;
        decode_body(header.kind, &self.body).map_err(ReadError::Frame)
    }

    /// Reads one whole frame.
    pub fn read_frame<R: Read>(&mut self, stream: &mut R) -> Result<Frame<'_>, ReadError> {
        let header = self.read_header(stream)?;
        self.read_body(stream, header)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(frame: &Frame<'_>) {
        let mut bytes = Vec::new();
        frame.encode(&mut bytes);
        let (decoded, used) = match decode(&bytes, 1 << 20) {
            Ok(Some(done)) => done,
            other => panic!("{frame:?} did not decode: {other:?}"),
        };
        assert_eq!(used, bytes.len());
        assert_eq!(&decoded, frame);
        for cut in 0..bytes.len() {
            assert_eq!(
                decode(&bytes[..cut], 1 << 20),
                Ok(None),
                "prefix of {cut} bytes"
            );
        }
    }

    #[test]
    fn every_kind_round_trips() {
        let keys = vec![ChunkKey::new(1, 0), ChunkKey::new(u128::MAX, 7)];
        round_trip(&Frame::Hello(Hello {
            secret_required: true,
            nonce: [9; NONCE_BYTES],
            namespace: b"model".to_vec(),
        }));
        round_trip(&Frame::Auth([3; MAC_BYTES]));
        round_trip(&Frame::Have(keys.clone()));
        round_trip(&Frame::Get(keys));
        round_trip(&Frame::Get(Vec::new()));
        round_trip(&Frame::HaveReply(vec![
            true, false, true, true, false, false, false, false, true,
        ]));
        round_trip(&Frame::Data {
            key: ChunkKey::new(5, 1),
            checksum: 77,
            payload: b"bytes",
        });
        round_trip(&Frame::End { sent: 3 });
        round_trip(&Frame::Error("no".to_owned()));
        round_trip(&Frame::NixlGet(vec![ChunkKey::new(8, 2)]));
        round_trip(&Frame::NixlDone);
        round_trip(&Frame::NixlOffer {
            connection: b"",
            metadata: b"",
            chunks: Vec::new(),
        });
        round_trip(&Frame::NixlOffer {
            connection: b"agent connection",
            metadata: b"agent metadata",
            chunks: vec![
                NixlChunk {
                    key: ChunkKey::new(1, 0),
                    checksum: 5,
                    addr: 0x7f00_0000_1000,
                    len: 1 << 20,
                },
                NixlChunk {
                    key: ChunkKey::new(u128::MAX, 9),
                    checksum: u64::MAX,
                    addr: u64::MAX,
                    len: u32::MAX,
                },
            ],
        });
    }

    #[test]
    fn offer_with_wrong_chunk_bytes_is_malformed() {
        let mut bytes = Vec::new();
        Frame::NixlOffer {
            connection: b"c",
            metadata: b"md",
            chunks: vec![NixlChunk {
                key: ChunkKey::new(1, 0),
                checksum: 5,
                addr: 6,
                len: 7,
            }],
        }
        .encode(&mut bytes);
        // Say 2 chunks where one is encoded.
        let count_at = HEADER_BYTES + 4 + 1 + 4 + 2;
        bytes[count_at..count_at + 4].copy_from_slice(&2u32.to_le_bytes());
        assert!(matches!(
            decode(&bytes, 1 << 20),
            Err(FrameError::Malformed {
                kind: FrameKind::NixlOffer,
                ..
            })
        ));
    }

    #[test]
    fn data_prefix_matches_full_encoding() {
        let key = ChunkKey::new(42, 3);
        let mut full = Vec::new();
        Frame::Data {
            key,
            checksum: 11,
            payload: b"payload",
        }
        .encode(&mut full);
        let mut split = Vec::new();
        encode_data_prefix(key, 11, 7, &mut split);
        split.extend_from_slice(b"payload");
        assert_eq!(full, split);
    }

    #[test]
    fn oversized_and_unknown_headers_are_refused() {
        let mut header = [0u8; HEADER_BYTES];
        header[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        header[4] = FrameKind::Get as u8;
        assert!(matches!(
            decode_header(header, 1024),
            Err(FrameError::Oversized { .. })
        ));
        header[..4].copy_from_slice(&4u32.to_le_bytes());
        header[4] = 99;
        assert_eq!(
            decode_header(header, 1024),
            Err(FrameError::UnknownKind(99))
        );
    }

    #[test]
    fn hello_of_another_version_is_a_version_error() {
        let mut bytes = Vec::new();
        Frame::Hello(Hello {
            secret_required: false,
            nonce: [0; NONCE_BYTES],
            namespace: Vec::new(),
        })
        .encode(&mut bytes);
        bytes[HEADER_BYTES + 4..HEADER_BYTES + 6].copy_from_slice(&7u16.to_le_bytes());
        assert_eq!(
            decode(&bytes, 4096),
            Err(FrameError::Version {
                found: 7,
                expected: PROTOCOL_VERSION
            })
        );
    }

    #[test]
    fn key_count_must_match_body() {
        let mut bytes = Vec::new();
        Frame::Have(vec![ChunkKey::new(1, 1)]).encode(&mut bytes);
        bytes[HEADER_BYTES..HEADER_BYTES + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode(&bytes, 4096),
            Err(FrameError::Malformed { .. })
        ));
    }
}
