//! The handshake's cryptography: fresh nonces, and the HMAC-SHA256 proof that a side knows the
//! shared secret. The proof binds the role (client or server), the other side's nonce and the
//! namespace, so a proof cannot be reflected back, replayed on another connection, or reused in
//! another namespace.
//!
//! After the proofs, both sides derive a per-connection session key from the secret, both nonces
//! and the namespace ([`session_key`]), and every chunk payload on that connection (DATA, PUT,
//! and the digests of a NIXL_OFFER) carries a keyed BLAKE3 tag under it (`ChunkAuth`) instead
//! of the unkeyed xxh3, so neither a peer without the secret nor anything on the path can serve
//! bytes that verify. The tag keys the payload's POLYVAL digest under a hash key derived from the
//! secret and the namespace (`hash_key`), which a publisher computes once per chunk, not the
//! bytes themselves (protocol 6; protocol 5 keyed an unkeyed BLAKE3 digest, which cost the
//! receiver twice as much CPU per byte). Without a secret (loopback only) the tag is the xxh3
//! checksum.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use offload_core::ChunkKey;

use crate::frame::{FrameKind, MAC_BYTES, NONCE_BYTES};
use crate::polyval::{Polyval, PolyvalKey, BLOCK_BYTES};
use crate::store::PublishedChunk;

/// Which side of a connection computes a proof.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The side that connected.
    Client,
    /// The side that accepted.
    Server,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Client => b"kvtier-p2p v1 client",
            Role::Server => b"kvtier-p2p v1 server",
        }
    }
}

/// A fresh, unpredictable nonce: 32 bytes from the kernel's random source, mixed through SHA-256
/// with per-process random keys, the clock and a counter (so it stays unique if the kernel
/// source cannot be read).
pub fn nonce() -> [u8; NONCE_BYTES] {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = Sha256::new();
    let mut kernel = [0u8; NONCE_BYTES];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut kernel));
    if read.is_ok() {
        hasher.update(kernel);
    }
    let mut mix = RandomState::new().build_hasher();
    mix.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.update(mix.finish().to_le_bytes());
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    hasher.update(now.to_le_bytes());
    hasher.update(std::process::id().to_le_bytes());
    hasher.finalize().into()
}

fn mac(secret: &[u8], role: Role, nonce: &[u8; NONCE_BYTES], namespace: &[u8]) -> Hmac<Sha256> {
    // HMAC accepts keys of any length; the error case cannot happen.
    let mut mac = match Hmac::<Sha256>::new_from_slice(secret) {
        Ok(mac) => mac,
        Err(_) => unreachable_key(),
    };
    mac.update(role.label());
    mac.update(nonce);
    mac.update(namespace);
    mac
}

#[cold]
fn unreachable_key() -> ! {
    panic!("HMAC-SHA256 refused a key; it accepts keys of every length")
}

/// The proof that `role` knows `secret`, answering the other side's `nonce`.
pub fn prove(
    secret: &[u8],
    role: Role,
    nonce: &[u8; NONCE_BYTES],
    namespace: &[u8],
) -> [u8; MAC_BYTES] {
    mac(secret, role, nonce, namespace)
        .finalize()
        .into_bytes()
        .into()
}

/// Whether `proof` is `role`'s proof for our `nonce` (compared in constant time).
pub fn verify(
    secret: &[u8],
    role: Role,
    nonce: &[u8; NONCE_BYTES],
    namespace: &[u8],
    proof: &[u8; MAC_BYTES],
) -> bool {
    mac(secret, role, nonce, namespace)
        .verify_slice(proof)
        .is_ok()
}

/// The session key of one connection: HMAC-SHA256(secret, "kvtier-session" | client nonce |
/// server nonce | namespace). Both sides know both nonces after the handshake; each connection
/// gets its own key, so a tag cannot be replayed on another connection.
pub fn session_key(
    secret: &[u8],
    client_nonce: &[u8; NONCE_BYTES],
    server_nonce: &[u8; NONCE_BYTES],
    namespace: &[u8],
) -> [u8; MAC_BYTES] {
    let mut mac = match Hmac::<Sha256>::new_from_slice(secret) {
        Ok(mac) => mac,
        Err(_) => unreachable_key(),
    };
    mac.update(b"kvtier-session");
    mac.update(client_nonce);
    mac.update(server_nonce);
    mac.update(namespace);
    mac.finalize().into_bytes().into()
}

/// Bytes of a chunk payload's digest, the POLYVAL value that keyed tags bind.
pub(crate) const DIGEST_BYTES: usize = BLOCK_BYTES;

/// The POLYVAL hash key of every connection with `secret` in `namespace`: the first 16 bytes of
/// HMAC-SHA256(secret, "kvtier-p2p chunk hash key" | namespace). It never leaves the process,
/// and nothing computed from it is sent except through the keyed tag.
pub(crate) fn hash_key(secret: &[u8], namespace: &[u8]) -> PolyvalKey {
    let mut mac = match Hmac::<Sha256>::new_from_slice(secret) {
        Ok(mac) => mac,
        Err(_) => unreachable_key(),
    };
    mac.update(b"kvtier-p2p chunk hash key");
    mac.update(namespace);
    let full: [u8; MAC_BYTES] = mac.finalize().into_bytes().into();
    let mut h = [0u8; BLOCK_BYTES];
    h.copy_from_slice(&full[..BLOCK_BYTES]);
    PolyvalKey::new(h)
}

/// A chunk payload's digest under `key`: its POLYVAL. A publisher computes it once per chunk; a
/// keyed tag binds it instead of the bytes, so a server tags a chunk without reading it.
pub(crate) fn digest(key: &PolyvalKey, payload: &[u8]) -> [u8; DIGEST_BYTES] {
    key.hash(payload)
}

/// How a connection protects chunk payloads: the plain xxh3 checksum (no secret, loopback only)
/// or a MAC: keyed BLAKE3 under the session key over the frame kind, the chunk key, the
/// payload's length and its POLYVAL digest under the secret's hash key ([`hash_key`]), cut to
/// the 64 bits of the frame's checksum field. This is hash-then-PRF: POLYVAL is a universal hash
/// (two different payloads of one length collide for at most `blocks / 2^128` of the keys,
/// which stay secret, as do the digests), keyed BLAKE3 the PRF. A forger must guess 64 bits per
/// try, and every wrong try fails that chunk and is counted. The digest is computed once per
/// published chunk, so a server tags each send with one short keyed hash; the receiver hashes
/// the bytes it received as they arrive, then keys the tag over that digest.
#[derive(Clone, Default)]
pub(crate) enum ChunkAuth {
    /// xxh3-64 of the payload.
    #[default]
    Checksum,
    /// Keyed BLAKE3 under this session key, over POLYVAL digests under this hash key.
    Keyed {
        /// The connection's session key ([`session_key`]).
        session: [u8; MAC_BYTES],
        /// The secret's hash key ([`hash_key`]).
        hash_key: PolyvalKey,
    },
}

impl std::fmt::Debug for ChunkAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChunkAuth::Checksum => f.write_str("Checksum"),
            ChunkAuth::Keyed { .. } => f.write_str("Keyed(<redacted>)"),
        }
    }
}

impl ChunkAuth {
    /// Keyed tags under `session`, over digests under `secret`'s hash key in `namespace`.
    pub(crate) fn keyed(session: [u8; MAC_BYTES], secret: &[u8], namespace: &[u8]) -> Self {
        ChunkAuth::Keyed {
            session,
            hash_key: hash_key(secret, namespace),
        }
    }

    /// Whether tags are keyed (a failed one is a MAC failure, not only a checksum mismatch).
    pub(crate) fn is_keyed(&self) -> bool {
        matches!(self, ChunkAuth::Keyed { .. })
    }

    /// The tag of a published chunk, sent as `kind` for `key`: its xxh3 as published, or keyed
    /// over its digest (computed once per chunk: at publish with a secret, else on first use).
    /// Reads no payload byte once the digest is known.
    pub(crate) fn tag_of(&self, kind: FrameKind, key: ChunkKey, chunk: &PublishedChunk) -> u64 {
        match self {
            ChunkAuth::Checksum => chunk.checksum,
            ChunkAuth::Keyed { session, hash_key } => keyed_tag(
                session,
                kind,
                key,
                chunk.bytes.len() as u64,
                &chunk.digest(hash_key),
            ),
        }
    }

    /// The tag of `payload` sent as `kind` for `key` on this connection.
    #[cfg_attr(not(any(test, feature = "nixl")), allow(dead_code))]
    pub(crate) fn tag(&self, kind: FrameKind, key: ChunkKey, payload: &[u8]) -> u64 {
        let mut hasher = self.hasher(kind, key);
        hasher.update(payload);
        hasher.finish()
    }

    /// A streaming hasher for the payload of a `kind` frame for `key`, fed piece by piece.
    pub(crate) fn hasher(&self, kind: FrameKind, key: ChunkKey) -> ChunkHasher {
        match self {
            ChunkAuth::Checksum => ChunkHasher::Checksum(twox_hash::XxHash3_64::default()),
            ChunkAuth::Keyed { session, hash_key } => ChunkHasher::Keyed {
                payload: Polyval::new(hash_key.clone()),
                len: 0,
                session: *session,
                kind,
                key,
            },
        }
    }
}

/// The keyed tag of a payload of `len` bytes with `digest`, sent as `kind` for `key`: the first
/// 8 bytes (little-endian) of keyed BLAKE3 under `session` over `u8 kind | u128 key hash | u32
/// key group | u64 len | digest`.
fn keyed_tag(
    session: &[u8; MAC_BYTES],
    kind: FrameKind,
    key: ChunkKey,
    len: u64,
    digest: &[u8; DIGEST_BYTES],
) -> u64 {
    let mut hasher = blake3::Hasher::new_keyed(session);
    hasher.update(&[kind as u8]);
    hasher.update(&key.hash.to_le_bytes());
    hasher.update(&key.group.to_le_bytes());
    hasher.update(&len.to_le_bytes());
    hasher.update(digest);
    let mut tag = [0u8; 8];
    tag.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
    u64::from_le_bytes(tag)
}

/// The streaming form of [`ChunkAuth::tag`]. One lives on the stack per received chunk; its
/// variants differ in size, and boxing either would cost an allocation per chunk.
#[allow(clippy::large_enum_variant)]
pub(crate) enum ChunkHasher {
    /// xxh3-64.
    Checksum(twox_hash::XxHash3_64),
    /// The payload's POLYVAL, keyed into the tag at the end.
    Keyed {
        /// POLYVAL of the bytes fed so far.
        payload: Polyval,
        /// Bytes fed so far.
        len: u64,
        /// The connection's session key.
        session: [u8; MAC_BYTES],
        /// The frame kind the tag binds.
        kind: FrameKind,
        /// The chunk key the tag binds.
        key: ChunkKey,
    },
}

impl ChunkHasher {
    /// Feeds the next bytes of the payload.
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        match self {
            ChunkHasher::Checksum(hasher) => std::hash::Hasher::write(hasher, bytes),
            ChunkHasher::Keyed { payload, len, .. } => {
                payload.update(bytes);
                *len += bytes.len() as u64;
            }
        }
    }

    /// The tag of all bytes fed.
    pub(crate) fn finish(self) -> u64 {
        match self {
            ChunkHasher::Checksum(hasher) => std::hash::Hasher::finish(&hasher),
            ChunkHasher::Keyed {
                payload,
                len,
                session,
                kind,
                key,
            } => keyed_tag(&session, kind, key, len, &payload.finish()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_tags_bind_session_kind_key_and_bytes() {
        let key = ChunkKey { hash: 7, group: 1 };
        let bytes = vec![3u8; 5000];
        let session = session_key(b"secret-secret-16", &[1; 32], &[2; 32], b"ns");
        assert_ne!(
            session,
            session_key(b"secret-secret-16", &[2; 32], &[1; 32], b"ns")
        );
        let auth = ChunkAuth::keyed(session, b"secret-secret-16", b"ns");
        let tag = auth.tag(FrameKind::Data, key, &bytes);
        let mut streamed = auth.hasher(FrameKind::Data, key);
        for piece in bytes.chunks(999) {
            streamed.update(piece);
        }
        assert_eq!(streamed.finish(), tag);
        assert_ne!(tag, crate::store::checksum(&bytes));
        assert_ne!(tag, auth.tag(FrameKind::Put, key, &bytes));
        assert_ne!(
            tag,
            auth.tag(FrameKind::Data, ChunkKey { hash: 8, group: 1 }, &bytes)
        );
        let mut flipped = bytes.clone();
        flipped[4000] ^= 1;
        assert_ne!(tag, auth.tag(FrameKind::Data, key, &flipped));
        let other = ChunkAuth::keyed(
            session_key(b"secret-secret-17", &[1; 32], &[2; 32], b"ns"),
            b"secret-secret-17",
            b"ns",
        );
        assert_ne!(tag, other.tag(FrameKind::Data, key, &bytes));
        // Another hash key under the same session key (another namespace's) changes the tag.
        let other_hash = ChunkAuth::keyed(session, b"secret-secret-16", b"nt");
        assert_ne!(tag, other_hash.tag(FrameKind::Data, key, &bytes));
        // A payload one zero byte longer (the same zero-padded POLYVAL blocks) does not verify.
        let mut longer = bytes.clone();
        longer.push(0);
        assert_ne!(tag, auth.tag(FrameKind::Data, key, &longer));
        let plain = ChunkAuth::Checksum;
        assert_eq!(
            plain.tag(FrameKind::Data, key, &bytes),
            crate::store::checksum(&bytes)
        );
    }

    /// Protocol 6's tag, computed here from its definition: the hash key by HMAC-SHA256, the
    /// POLYVAL bit by bit (`crate::polyval` is checked against RFC 8452 and that definition),
    /// the keyed hash with the blake3 crate.
    fn tag_by_definition(
        secret: &[u8],
        namespace: &[u8],
        session: &[u8; 32],
        kind: FrameKind,
        key: ChunkKey,
        bytes: &[u8],
    ) -> u64 {
        let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("any key");
        mac.update(b"kvtier-p2p chunk hash key");
        mac.update(namespace);
        let h: [u8; 16] = mac.finalize().into_bytes()[..16]
            .try_into()
            .expect("16 bytes");
        let mut soft = PolyvalKey::new(h);
        soft.force_portable();
        let mut input = vec![kind as u8];
        input.extend_from_slice(&key.hash.to_le_bytes());
        input.extend_from_slice(&key.group.to_le_bytes());
        input.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        input.extend_from_slice(&soft.hash(bytes));
        let tag = blake3::keyed_hash(session, &input);
        u64::from_le_bytes(tag.as_bytes()[..8].try_into().expect("8 bytes"))
    }

    #[test]
    fn keyed_tag_binds_the_payload_digest_and_needs_no_bytes_once_published() {
        let key = ChunkKey {
            hash: 0x0123_4567_89ab_cdef,
            group: 3,
        };
        let bytes: Vec<u8> = (0..300_001u32).map(|i| (i * 13 + i / 7) as u8).collect();
        let (secret, namespace) = (b"secret-secret-16", b"ns");
        let session = session_key(secret, &[4; 32], &[5; 32], namespace);
        let auth = ChunkAuth::keyed(session, secret, namespace);
        let expected = tag_by_definition(secret, namespace, &session, FrameKind::Data, key, &bytes);
        // What the receiver computes over the bytes it received, in pieces.
        let mut streamed = auth.hasher(FrameKind::Data, key);
        for piece in bytes.chunks(64 * 1024) {
            streamed.update(piece);
        }
        assert_eq!(streamed.finish(), expected);
        assert_eq!(auth.tag(FrameKind::Data, key, &bytes), expected);
        // What the sender tags a published chunk with: from its digest, not its bytes. A chunk
        // whose bytes changed after it was published keeps the tag of what was published, so
        // the receiver's hash of the changed bytes fails it.
        let chunk = PublishedChunk::new(bytes.clone().into_boxed_slice(), 0);
        let hash_key = hash_key(secret, namespace);
        assert_eq!(chunk.digest(&hash_key), hash_key.hash(&bytes));
        assert_eq!(auth.tag_of(FrameKind::Data, key, &chunk), expected);
        let mut changed = bytes.clone();
        changed[123_456] ^= 0x10;
        assert_ne!(auth.tag(FrameKind::Data, key, &changed), expected);
        // Unkeyed, a published chunk's tag is its stored xxh3.
        let plain = PublishedChunk::new(bytes.into_boxed_slice(), 77);
        assert_eq!(ChunkAuth::Checksum.tag_of(FrameKind::Data, key, &plain), 77);
    }

    #[test]
    fn nonces_differ() {
        assert_ne!(nonce(), nonce());
    }

    #[test]
    fn proofs_bind_secret_role_nonce_and_namespace() {
        let n = [5; NONCE_BYTES];
        let proof = prove(b"secret-secret-16", Role::Client, &n, b"ns");
        assert!(verify(b"secret-secret-16", Role::Client, &n, b"ns", &proof));
        assert!(!verify(
            b"other-secret-016",
            Role::Client,
            &n,
            b"ns",
            &proof
        ));
        assert!(!verify(
            b"secret-secret-16",
            Role::Server,
            &n,
            b"ns",
            &proof
        ));
        assert!(!verify(
            b"secret-secret-16",
            Role::Client,
            &[6; NONCE_BYTES],
            b"ns",
            &proof
        ));
        assert!(!verify(
            b"secret-secret-16",
            Role::Client,
            &n,
            b"nt",
            &proof
        ));
    }
}
