//! The checksummed record format of a stored chunk, shared by the tiers that keep chunks as
//! bytes (tier-fs's segment files, tier-obj's objects: a chunk object and a tier-fs record are
//! the same bytes). A record is a [`HEADER_BYTES`] header then a body padded with zeros to a
//! multiple of [`ALIGN`], so that tier-fs can read and write every record with O_DIRECT at an
//! aligned offset. Pure code: no I/O.
//!
//! Header (little-endian): magic `KVTIERFS` (8 bytes), format version (u32), header length
//! (u32), key hash (u128), key group (u32), record kind (u32), body length (u64), xxh3-64 of
//! the body (u64), xxh3-64 of the 56 bytes before it (u64); zeros up to [`HEADER_BYTES`].
//!
//! Version 3 (128-bit keys) replaced version 2 (64-bit keys, every field after the hash 8 bytes
//! earlier). A record of any other version, version 2 included, fails to decode with
//! [`FormatError::BadVersion`] and is never served: a 64-bit key cannot be widened to the
//! 128-bit key the engine now asks for.
//!
//! Record kinds ([`RecordKind`]): a chunk (the body is the payload), a skip record (the body is
//! dead space left by a failed write or a quarantined chunk; readers step over it), and the seal
//! (no body; written once every earlier record of the segment is complete, so a segment without
//! one may have a torn tail).

use crate::key::ChunkKey;

/// Alignment of the header, payload and file length (O_DIRECT's 4 KiB).
pub const ALIGN: usize = 4096;
/// Bytes of the header; the payload starts here.
pub const HEADER_BYTES: usize = ALIGN;
/// The magic at the start of every record.
pub const MAGIC: [u8; 8] = *b"KVTIERFS";
/// The format version written (and the only one read).
pub const FORMAT_VERSION: u32 = 3;
/// Bytes of the header that carry fields (the rest is zero).
const FIELDS_BYTES: usize = 64;

/// What a record holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    /// A chunk: the body is its payload.
    Chunk,
    /// Dead space of `payload_len` bytes after the header (a failed write, a quarantined chunk).
    Skip,
    /// The end of a sealed segment: every record before it is complete.
    Seal,
}

impl RecordKind {
    fn code(self) -> u32 {
        match self {
            RecordKind::Chunk => 0,
            RecordKind::Skip => 1,
            RecordKind::Seal => 2,
        }
    }

    fn from_code(code: u32) -> Option<Self> {
        match code {
            0 => Some(RecordKind::Chunk),
            1 => Some(RecordKind::Skip),
            2 => Some(RecordKind::Seal),
            _ => None,
        }
    }
}

/// The bytes a record with `payload_len` bytes of body occupies on disk (header and padding).
pub fn file_bytes(payload_len: u64) -> u64 {
    HEADER_BYTES as u64 + payload_len.div_ceil(ALIGN as u64) * ALIGN as u64
}

/// The checksum of a payload (xxh3-64).
pub fn payload_checksum(payload: &[u8]) -> u64 {
    xxh3_64(payload)
}

/// xxh3-64 with seed 0 (twox-hash, which picks AVX2 at run time where the CPU has it).
pub fn xxh3_64(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

/// Why a record does not verify.
///
/// Non-exhaustive: later format versions may fail in new ways; every variant means "not served".
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FormatError {
    /// Fewer bytes than the header and payload need.
    Truncated {
        /// Bytes present.
        have: usize,
        /// Bytes needed.
        need: usize,
    },
    /// The magic (or the record kind) is wrong: not a record.
    BadMagic,
    /// A format version this build does not read.
    BadVersion(u32),
    /// The header's own checksum does not match (a torn or corrupted header).
    BadHeaderChecksum,
    /// The header names another key.
    WrongKey(ChunkKey),
    /// The record is not a chunk (a skip record or a seal).
    NotAChunk,
    /// The stored payload length differs from the one asked for (the file itself is valid).
    LengthMismatch {
        /// Stored length.
        stored: u64,
        /// Requested length.
        expected: u64,
    },
    /// The payload's checksum does not match.
    BadChecksum,
}

impl FormatError {
    /// Whether the file is damaged (and should be removed), as opposed to valid but not what the
    /// caller asked for.
    pub fn is_corruption(&self) -> bool {
        !matches!(self, FormatError::LengthMismatch { .. })
    }
}

impl std::fmt::Display for FormatError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FormatError::Truncated { have, need } => {
                write!(f, "truncated: {have} bytes, {need} needed")
            }
            FormatError::BadMagic => write!(f, "bad magic"),
            FormatError::BadVersion(v) => write!(
                f,
                "format version {v}, not {FORMAT_VERSION} (written by another kvtier version: {}); not served",
                if *v < FORMAT_VERSION { "older, 64-bit keys" } else { "newer" }
            ),
            FormatError::BadHeaderChecksum => write!(f, "header checksum mismatch"),
            FormatError::WrongKey(key) => {
                write!(f, "header names key {:#x}/{}", key.hash, key.group)
            }
            FormatError::LengthMismatch { stored, expected } => {
                write!(f, "payload length {stored} stored, {expected} requested")
            }
            FormatError::BadChecksum => write!(f, "payload checksum mismatch"),
            FormatError::NotAChunk => write!(f, "not a chunk record"),
        }
    }
}

/// A record's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What the record holds.
    pub kind: RecordKind,
    /// The chunk's key (zero for other kinds).
    pub key: ChunkKey,
    /// Payload bytes.
    pub payload_len: u64,
    /// xxh3-64 of the payload.
    pub checksum: u64,
}

impl Header {
    /// The header of `payload` stored under `key`.
    pub fn for_payload(key: ChunkKey, payload: &[u8]) -> Self {
        Self {
            kind: RecordKind::Chunk,
            key,
            payload_len: payload.len() as u64,
            checksum: payload_checksum(payload),
        }
    }

    /// The header of a skip record covering `record_bytes` bytes in all (a multiple of
    /// [`ALIGN`], at least [`HEADER_BYTES`]).
    pub fn skip(record_bytes: u64) -> Self {
        Self {
            kind: RecordKind::Skip,
            key: ChunkKey::new(0, 0),
            payload_len: record_bytes.saturating_sub(HEADER_BYTES as u64),
            checksum: 0,
        }
    }

    /// The header of a seal record.
    pub fn seal() -> Self {
        Self {
            kind: RecordKind::Seal,
            key: ChunkKey::new(0, 0),
            payload_len: 0,
            checksum: 0,
        }
    }

    /// Bytes of the whole record (header, body, padding).
    pub fn record_bytes(&self) -> u64 {
        file_bytes(self.payload_len)
    }

    /// Writes the header into the first [`HEADER_BYTES`] bytes of `out` (zeroing the rest of
    /// them).
    ///
    /// Panics if `out` is shorter than [`HEADER_BYTES`] (a caller bug).
    pub fn encode(&self, out: &mut [u8]) {
        let out = &mut out[..HEADER_BYTES];
        out.fill(0);
        out[0..8].copy_from_slice(&MAGIC);
        out[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        out[12..16].copy_from_slice(&(HEADER_BYTES as u32).to_le_bytes());
        out[16..32].copy_from_slice(&self.key.hash.to_le_bytes());
        out[32..36].copy_from_slice(&self.key.group.to_le_bytes());
        out[36..40].copy_from_slice(&self.kind.code().to_le_bytes());
        out[40..48].copy_from_slice(&self.payload_len.to_le_bytes());
        out[48..56].copy_from_slice(&self.checksum.to_le_bytes());
        let own = xxh3_64(&out[0..56]);
        out[56..64].copy_from_slice(&own.to_le_bytes());
    }

    /// Reads a header from the start of `bytes`, checking magic, version and its own checksum.
    pub fn decode(bytes: &[u8]) -> Result<Self, FormatError> {
        if bytes.len() < HEADER_BYTES {
            return Err(FormatError::Truncated {
                have: bytes.len(),
                need: HEADER_BYTES,
            });
        }
        let fields = &bytes[..FIELDS_BYTES];
        if fields[0..8] != MAGIC {
            return Err(FormatError::BadMagic);
        }
        let version = u32_at(fields, 8);
        if version != FORMAT_VERSION {
            return Err(FormatError::BadVersion(version));
        }
        if u64_at(fields, 56) != xxh3_64(&fields[0..56]) {
            return Err(FormatError::BadHeaderChecksum);
        }
        if u32_at(fields, 12) as usize != HEADER_BYTES {
            return Err(FormatError::BadMagic);
        }
        let kind = RecordKind::from_code(u32_at(fields, 36)).ok_or(FormatError::BadMagic)?;
        Ok(Self {
            kind,
            key: ChunkKey::new(u128_at(fields, 16), u32_at(fields, 32)),
            payload_len: u64_at(fields, 40),
            checksum: u64_at(fields, 48),
        })
    }
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut raw = [0u8; 4];
    raw.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(raw)
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(raw)
}

fn u128_at(bytes: &[u8], at: usize) -> u128 {
    let mut raw = [0u8; 16];
    raw.copy_from_slice(&bytes[at..at + 16]);
    u128::from_le_bytes(raw)
}

/// Writes the record image of `key`'s chunk into `out`: the header, then the payload copied by
/// `fill_payload` (which must fill exactly the slice it gets), then zero padding. Returns the file
/// length (the bytes to write) and the header.
///
/// Panics if `out` is shorter than [`file_bytes`]`(payload_len)` (a caller bug).
pub fn encode_into(
    out: &mut [u8],
    key: ChunkKey,
    payload_len: usize,
    fill_payload: impl FnOnce(&mut [u8]),
) -> (usize, Header) {
    let total = file_bytes(payload_len as u64) as usize;
    let payload_end = HEADER_BYTES + payload_len;
    fill_payload(&mut out[HEADER_BYTES..payload_end]);
    out[payload_end..total].fill(0);
    let header = Header::for_payload(key, &out[HEADER_BYTES..payload_end]);
    header.encode(out);
    (total, header)
}

/// Verifies a whole record image read back for `key` with `expected_len` payload bytes and returns
/// the payload.
pub fn verify(file: &[u8], key: ChunkKey, expected_len: u64) -> Result<&[u8], FormatError> {
    let (header, body) = file.split_at(file.len().min(HEADER_BYTES));
    let len = verify_parts(header, body, key, expected_len)?;
    Ok(&body[..len])
}

/// Verifies a record read back in two parts, its header (`header`, [`HEADER_BYTES`]) and the
/// bytes after it (`body`: payload and padding, wherever they were read to, e.g. straight into a
/// host slot), for `key` with `expected_len` payload bytes; returns the payload length (the
/// payload is `body[..len]`). Same checks, in the same order, as [`verify`] of the whole image.
pub fn verify_parts(
    header: &[u8],
    body: &[u8],
    key: ChunkKey,
    expected_len: u64,
) -> Result<usize, FormatError> {
    let have = header.len() + body.len();
    if header.len() < HEADER_BYTES {
        return Err(FormatError::Truncated {
            have,
            need: HEADER_BYTES,
        });
    }
    let header = Header::decode(header)?;
    if header.kind != RecordKind::Chunk {
        return Err(FormatError::NotAChunk);
    }
    if header.key != key {
        return Err(FormatError::WrongKey(header.key));
    }
    let need = file_bytes(header.payload_len);
    if (have as u64) < need {
        return Err(FormatError::Truncated {
            have,
            need: usize::try_from(need).unwrap_or(usize::MAX),
        });
    }
    // Fits: at most `body.len()` (checked just above).
    let len = header.payload_len as usize;
    if payload_checksum(&body[..len]) != header.checksum {
        return Err(FormatError::BadChecksum);
    }
    if header.payload_len != expected_len {
        return Err(FormatError::LengthMismatch {
            stored: header.payload_len,
            expected: expected_len,
        });
    }
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(key: ChunkKey, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![0xEEu8; file_bytes(payload.len() as u64) as usize];
        let (len, header) = encode_into(&mut out, key, payload.len(), |dst| {
            dst.copy_from_slice(payload)
        });
        assert_eq!(len, out.len());
        assert_eq!(header.payload_len, payload.len() as u64);
        out
    }

    #[test]
    fn file_bytes_pads_to_alignment() {
        assert_eq!(file_bytes(0), 4096);
        assert_eq!(file_bytes(1), 8192);
        assert_eq!(file_bytes(4096), 8192);
        assert_eq!(file_bytes(4097), 12288);
    }

    #[test]
    fn round_trip_verifies_and_pads_with_zeros() {
        let key = ChunkKey::new(0xABCD, 3);
        let payload: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        let file = image(key, &payload);
        assert_eq!(verify(&file, key, 5000), Ok(&payload[..]));
        assert!(file[HEADER_BYTES + 5000..].iter().all(|&b| b == 0));
        assert_eq!(Header::decode(&file).map(|h| h.key), Ok(key));
    }

    #[test]
    fn every_damage_is_detected() {
        let key = ChunkKey::new(7, 0);
        let payload = vec![5u8; 10_000];
        let file = image(key, &payload);
        let mut flipped = file.clone();
        flipped[HEADER_BYTES + 1234] ^= 1;
        assert_eq!(verify(&flipped, key, 10_000), Err(FormatError::BadChecksum));
        let mut header = file.clone();
        header[33] ^= 1;
        assert_eq!(
            verify(&header, key, 10_000),
            Err(FormatError::BadHeaderChecksum)
        );
        let mut magic = file.clone();
        magic[0] = b'X';
        assert_eq!(verify(&magic, key, 10_000), Err(FormatError::BadMagic));
        assert!(matches!(
            verify(&file[..8192], key, 10_000),
            Err(FormatError::Truncated { .. })
        ));
        assert!(matches!(
            verify(&file[..100], key, 10_000),
            Err(FormatError::Truncated { .. })
        ));
        assert_eq!(
            verify(&file, ChunkKey::new(7, 1), 10_000),
            Err(FormatError::WrongKey(key))
        );
        let mismatch = verify(&file, key, 9_999);
        assert!(matches!(mismatch, Err(FormatError::LengthMismatch { .. })));
        assert!(!mismatch.unwrap_err().is_corruption());
        assert!(FormatError::BadChecksum.is_corruption());
        let zeros = vec![0u8; file.len()];
        assert_eq!(verify(&zeros, key, 10_000), Err(FormatError::BadMagic));
        let mut skip = file.clone();
        Header::skip(file.len() as u64).encode(&mut skip);
        assert_eq!(verify(&skip, key, 10_000), Err(FormatError::NotAChunk));
        let decoded = Header::decode(&skip).unwrap();
        assert_eq!(decoded.kind, RecordKind::Skip);
        assert_eq!(decoded.record_bytes(), file.len() as u64);
        let mut seal = vec![0u8; HEADER_BYTES];
        Header::seal().encode(&mut seal);
        assert_eq!(Header::decode(&seal).unwrap().kind, RecordKind::Seal);
    }

    #[test]
    fn verify_parts_agrees_with_verify() {
        let key = ChunkKey::new(0x77, 2);
        let payload: Vec<u8> = (0..8192u32).map(|i| (i * 13) as u8).collect();
        let file = image(key, &payload);
        let (header, body) = file.split_at(HEADER_BYTES);
        assert_eq!(verify_parts(header, body, key, 8192), Ok(8192));
        let mut damaged = body.to_vec();
        damaged[100] ^= 1;
        assert_eq!(
            verify_parts(header, &damaged, key, 8192),
            Err(FormatError::BadChecksum)
        );
        assert!(matches!(
            verify_parts(header, &body[..4096], key, 8192),
            Err(FormatError::Truncated { .. })
        ));
        assert!(matches!(
            verify_parts(&header[..100], body, key, 8192),
            Err(FormatError::Truncated { .. })
        ));
        assert_eq!(
            verify_parts(header, body, ChunkKey::new(0x77, 3), 8192),
            Err(FormatError::WrongKey(key))
        );
    }

    #[test]
    fn checksums_equal_the_reference_xxh3() {
        // Records written before the switch to twox-hash must still verify.
        for len in [
            0usize,
            1,
            16,
            17,
            128,
            129,
            240,
            241,
            1000,
            4096,
            100_000,
            1 << 20,
        ] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 131 + len) as u8).collect();
            assert_eq!(
                payload_checksum(&bytes),
                xxhash_rust::xxh3::xxh3_64(&bytes),
                "length {len}"
            );
        }
    }

    #[test]
    fn empty_payload_is_a_header_only_file() {
        let key = ChunkKey::new(1, 1);
        let file = image(key, &[]);
        assert_eq!(file.len(), HEADER_BYTES);
        assert_eq!(verify(&file, key, 0), Ok(&[][..]));
    }
    /// The layout, spelled out field by field (format version 3): tier-fs's files and tier-obj's
    /// objects on disk and in buckets depend on it.
    #[test]
    fn layout_is_tier_fs_format_version_3() {
        let key = ChunkKey::new(0xF0E1_D2C3_B4A5_9687_0123_4567_89AB_CDEF, 7);
        let payload: Vec<u8> = (0..5000u32).map(|i| (i * 31) as u8).collect();
        let file = image(key, &payload);
        assert_eq!(file.len(), 4096 + 8192);
        assert_eq!(&file[0..8], b"KVTIERFS");
        assert_eq!(file[8..12], 3u32.to_le_bytes());
        assert_eq!(file[12..16], 4096u32.to_le_bytes());
        assert_eq!(
            file[16..24],
            0x0123_4567_89AB_CDEFu64.to_le_bytes(),
            "hash, low half"
        );
        assert_eq!(
            file[24..32],
            0xF0E1_D2C3_B4A5_9687u64.to_le_bytes(),
            "hash, high half"
        );
        assert_eq!(file[32..36], 7u32.to_le_bytes());
        assert_eq!(file[36..40], 0u32.to_le_bytes(), "kind: chunk");
        assert_eq!(file[40..48], 5000u64.to_le_bytes());
        let sum = twox_hash::XxHash3_64::oneshot(&payload);
        assert_eq!(file[48..56], sum.to_le_bytes());
        let own = twox_hash::XxHash3_64::oneshot(&file[0..56]);
        assert_eq!(file[56..64], own.to_le_bytes());
        assert!(file[64..4096].iter().all(|&b| b == 0));
        assert_eq!(&file[4096..9096], &payload[..]);
        assert!(file[9096..].iter().all(|&b| b == 0));
        // xxh3-64 (seed 0) of the empty input, its published value: the hash itself is pinned too.
        assert_eq!(xxh3_64(b""), 0x2D06_8005_38D3_94C2);
    }

    /// A record of format version 2 (64-bit keys), as the previous kvtier wrote it, header
    /// checksum and all: refused by its version, whichever key is asked for.
    pub(crate) fn version_2_image(hash: u64, group: u32, payload: &[u8]) -> Vec<u8> {
        let mut file = vec![0u8; file_bytes(payload.len() as u64) as usize];
        file[0..8].copy_from_slice(b"KVTIERFS");
        file[8..12].copy_from_slice(&2u32.to_le_bytes());
        file[12..16].copy_from_slice(&4096u32.to_le_bytes());
        file[16..24].copy_from_slice(&hash.to_le_bytes());
        file[24..28].copy_from_slice(&group.to_le_bytes());
        file[28..32].copy_from_slice(&0u32.to_le_bytes());
        file[32..40].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        file[40..48].copy_from_slice(&xxh3_64(payload).to_le_bytes());
        let own = xxh3_64(&file[0..48]);
        file[48..56].copy_from_slice(&own.to_le_bytes());
        file[HEADER_BYTES..HEADER_BYTES + payload.len()].copy_from_slice(payload);
        file
    }

    #[test]
    fn version_2_records_are_refused_by_version() {
        let payload = vec![9u8; 5000];
        let file = version_2_image(0xABCD, 1, &payload);
        assert_eq!(Header::decode(&file), Err(FormatError::BadVersion(2)));
        for key in [ChunkKey::new(0xABCD, 1), ChunkKey::new(0, 0)] {
            assert_eq!(verify(&file, key, 5000), Err(FormatError::BadVersion(2)));
        }
        let (header, body) = file.split_at(HEADER_BYTES);
        assert_eq!(
            verify_parts(header, body, ChunkKey::new(0xABCD, 1), 5000),
            Err(FormatError::BadVersion(2))
        );
        assert!(FormatError::BadVersion(2).is_corruption());
        let text = FormatError::BadVersion(2).to_string();
        assert!(
            text.contains("format version 2, not 3") && text.contains("64-bit keys"),
            "{text}"
        );
    }

    proptest::proptest! {
        /// Every key (all 128 bits of the hash, any group), kind and length survives a header's
        /// encode and decode, and a whole record verifies under its key and under no key that
        /// differs from it in a single bit.
        #[test]
        fn header_round_trips_every_key(
            hash: u128,
            group: u32,
            payload_len in 0u64..(1 << 40),
            checksum: u64,
            flip in 0u32..160,
            kind_code in 0u32..3,
        ) {
            let key = ChunkKey::new(hash, group);
            let kind = RecordKind::from_code(kind_code).unwrap();
            let header = Header { kind, key, payload_len, checksum };
            let mut out = vec![0xAAu8; HEADER_BYTES];
            header.encode(&mut out);
            proptest::prop_assert_eq!(Header::decode(&out), Ok(header));
            let other = if flip < 128 {
                ChunkKey::new(hash ^ (1u128 << flip), group)
            } else {
                ChunkKey::new(hash, group ^ (1u32 << (flip - 128)))
            };
            let payload = [(hash as u8) ^ 0x5A; 100];
            let file = image(key, &payload);
            proptest::prop_assert_eq!(verify(&file, key, 100), Ok(&payload[..]));
            proptest::prop_assert_eq!(verify(&file, other, 100), Err(FormatError::WrongKey(key)));
        }
    }
}
