//! Segment files: walking their records (the start-up scan and shared-directory probes), checking
//! and cutting a torn tail, and the small writes that mark records (skip records over dead space,
//! the seal at the end).
//!
//! A segment is appended by one worker of one tier instance: records are placed one after another
//! at aligned offsets; a record counts (enters the index) only once its write completed (and was
//! flushed with `Durability::Fsync`). When the worker is done with a segment (full, failed, or at
//! shutdown) and every write into it has completed, it appends the seal. So a sealed segment's
//! records are all complete, and only an unsealed one (its writer was killed) may end in a torn
//! record: the scan verifies the checksums of an unsealed segment's records, cuts it after the last
//! good one, and seals it.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use offload_core::ChunkKey;

use crate::format::{verify, FormatError, Header, RecordKind, ALIGN, HEADER_BYTES};
use crate::io::AlignedBuf;

/// A chunk record found by a walk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Found {
    pub(crate) key: ChunkKey,
    pub(crate) offset: u64,
    pub(crate) bytes: u64,
}

/// What a walk over a segment found.
#[derive(Debug, Default)]
pub(crate) struct Walk {
    /// Chunk records, in file order.
    pub(crate) chunks: Vec<Found>,
    /// End of the last good record (the seal included).
    pub(crate) end: u64,
    /// Whether the walk ended at the seal.
    pub(crate) sealed: bool,
    /// Chunk records whose header was good but whose body did not verify (only with `verify`).
    pub(crate) torn: u64,
    /// The format version of a record header that stopped the walk by its version alone (its
    /// magic and length were right): a record written by another kvtier version.
    pub(crate) other_version: Option<u32>,
}

/// Walks the records of `file` (`len` bytes) from `from`, reading headers (and, with `verify`,
/// whole chunk records, checking their checksums), until the seal, the end, or the first record
/// that does not decode or verify.
pub(crate) fn walk(file: &File, from: u64, len: u64, verify_bodies: bool) -> io::Result<Walk> {
    let mut walk = Walk {
        end: from,
        ..Walk::default()
    };
    let mut head = vec![0u8; HEADER_BYTES];
    let mut offset = from;
    while offset + HEADER_BYTES as u64 <= len {
        if file.read_at(&mut head, offset)? < HEADER_BYTES {
            break;
        }
        let header = match Header::decode(&head) {
            Ok(header) => header,
            Err(FormatError::BadVersion(version)) => {
                walk.other_version = Some(version);
                break;
            }
            Err(_) => break,
        };
        let bytes = header.record_bytes();
        if header.kind == RecordKind::Seal {
            walk.sealed = true;
            walk.end = offset + bytes;
            break;
        }
        if offset + bytes > len {
            break;
        }
        if header.kind == RecordKind::Chunk {
            if verify_bodies && !record_verifies(file, offset, &header)? {
                walk.torn += 1;
                break;
            }
            walk.chunks.push(Found {
                key: header.key,
                offset,
                bytes,
            });
        }
        offset += bytes;
        walk.end = offset;
    }
    Ok(walk)
}

fn record_verifies(file: &File, offset: u64, header: &Header) -> io::Result<bool> {
    let Ok(bytes) = usize::try_from(header.record_bytes()) else {
        return Ok(false);
    };
    let mut image = vec![0u8; bytes];
    if file.read_at(&mut image, offset)? < bytes {
        return Ok(false);
    }
    Ok(verify(&image, header.key, header.payload_len).is_ok())
}

/// Writes one 4 KiB header at `offset` of `file` (opened with or without O_DIRECT).
fn write_header(file: &File, offset: u64, header: &Header) -> io::Result<()> {
    let mut buf = AlignedBuf::try_with_capacity(ALIGN)?;
    header.encode(buf.as_full_mut_slice());
    buf.set_len(ALIGN);
    let n = file.write_at(buf.as_slice(), offset)?;
    if n != ALIGN {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            format!("short write of a record header: {n} of {ALIGN} bytes at offset {offset}"),
        ));
    }
    Ok(())
}

/// Marks `record_bytes` bytes at `offset` as dead space (a skip record).
pub(crate) fn write_skip(file: &File, offset: u64, record_bytes: u64) -> io::Result<()> {
    write_header(file, offset, &Header::skip(record_bytes))
}

/// Appends the seal at `offset` (the end of the segment's records).
pub(crate) fn write_seal(file: &File, offset: u64) -> io::Result<()> {
    write_header(file, offset, &Header::seal())
}

/// Opens a segment for the small writes above and for cutting (buffered).
pub(crate) fn open_for_repair(path: &Path) -> io::Result<File> {
    OpenOptions::new().read(true).write(true).open(path)
}

/// Recovers an unsealed segment of a dead writer: verifies its records, cuts the file after the
/// last good one, and seals it. Returns the walk (its `end` includes the new seal).
pub(crate) fn recover(path: &Path) -> io::Result<Walk> {
    let file = open_for_repair(path)?;
    let len = file.metadata()?.len();
    let mut walk = walk(&file, 0, len, true)?;
    if walk.sealed {
        return Ok(walk);
    }
    // Records past the first bad one are dropped too (the walk cannot step over a bad header).
    file.set_len(walk.end)?;
    if !walk.chunks.is_empty() {
        write_seal(&file, walk.end)?;
        walk.end += HEADER_BYTES as u64;
        walk.sealed = true;
    }
    Ok(walk)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{encode_into, file_bytes};

    fn record(key: ChunkKey, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; file_bytes(len as u64) as usize];
        encode_into(&mut out, key, len, |dst| dst.fill(key.hash as u8));
        out
    }

    #[test]
    fn walk_steps_over_skips_stops_at_the_seal_and_recovery_cuts_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.seg");
        let a = record(ChunkKey::new(1, 0), 5000);
        let b = record(ChunkKey::new(2, 0), 100);
        let c = record(ChunkKey::new(3, 0), 9000);
        let mut image = a.clone();
        image.extend_from_slice(&b);
        image.extend_from_slice(&c);
        std::fs::write(&path, &image).unwrap();
        let file = open_for_repair(&path).unwrap();
        // Mark b dead.
        write_skip(&file, a.len() as u64, b.len() as u64).unwrap();
        let len = image.len() as u64;
        let found = walk(&file, 0, len, true).unwrap();
        assert_eq!(found.chunks.len(), 2);
        assert_eq!(found.chunks[1].key, ChunkKey::new(3, 0));
        assert_eq!(found.end, len);
        assert!(!found.sealed);
        // Tear c's body: a header walk still sees it, a verifying walk does not.
        file.write_at(&[0xFF; 16], a.len() as u64 + b.len() as u64 + 5000)
            .unwrap();
        assert_eq!(walk(&file, 0, len, false).unwrap().chunks.len(), 2);
        let torn = walk(&file, 0, len, true).unwrap();
        assert_eq!(torn.chunks.len(), 1);
        assert_eq!(torn.torn, 1);
        drop(file);
        let recovered = recover(&path).unwrap();
        assert!(recovered.sealed);
        let cut = (a.len() + b.len()) as u64;
        assert_eq!(recovered.end, cut + HEADER_BYTES as u64);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), recovered.end);
        let file = File::open(&path).unwrap();
        let again = walk(&file, 0, recovered.end, false).unwrap();
        assert!(again.sealed);
        assert_eq!(again.chunks.len(), 1);
        // A walk from the middle starts there.
        let tail = walk(&file, a.len() as u64, recovered.end, false).unwrap();
        assert!(tail.chunks.is_empty() && tail.sealed);
    }

    #[test]
    fn recovery_cuts_a_preallocated_tail_of_zeros() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.seg");
        let a = record(ChunkKey::new(1, 0), 8192);
        let b = record(ChunkKey::new(2, 0), 4096);
        let mut image = a.clone();
        image.extend_from_slice(&b);
        std::fs::write(&path, &image).unwrap();
        // A writer killed after allocating its next batch: the file goes on in zeros.
        let file = open_for_repair(&path).unwrap();
        let good = image.len() as u64;
        crate::direct::allocate(&file, good, 3 * 4096 + 1_048_576).unwrap();
        assert!(file.metadata().unwrap().len() > good);
        drop(file);
        let recovered = recover(&path).unwrap();
        assert_eq!(recovered.chunks.len(), 2);
        assert_eq!(recovered.torn, 0);
        assert!(recovered.sealed);
        assert_eq!(recovered.end, good + HEADER_BYTES as u64);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), recovered.end);
    }
}
