//! Property tests over the frame decoder: random bytes, truncated frames, corrupted frames and
//! oversized lengths never panic, fail with a clean error, and never make a [`FrameReader`] hold
//! a buffer larger than its maximum body size. Valid frames round-trip.

use std::io::Cursor;

use offload_core::ChunkKey;
use proptest::prelude::*;
use tier_p2p::frame::{
    decode, decode_data_prefix, decode_header, encode_chunk_prefix, Frame, FrameError, FrameKind,
    FrameReader, Hello, NixlChunk, ReadError, DATA_PREFIX_BYTES, HEADER_BYTES, MAC_BYTES,
    NONCE_BYTES,
};

/// A small maximum, so that random lengths often exceed it.
const BODY_MAX: usize = 4096;

fn key() -> impl Strategy<Value = ChunkKey> {
    (any::<u128>(), any::<u32>()).prop_map(|(hash, group)| ChunkKey::new(hash, group))
}

/// Any valid frame that fits `BODY_MAX`; DATA payloads are owned by the strategy's output.
fn frame() -> impl Strategy<Value = (u8, Vec<ChunkKey>, Vec<bool>, Vec<u8>, u64)> {
    (
        1u8..=12,
        prop::collection::vec(key(), 0..64),
        prop::collection::vec(any::<bool>(), 0..300),
        prop::collection::vec(any::<u8>(), 1..512),
        any::<u64>(),
    )
}

fn build<'a>(
    (kind, keys, flags, bytes, number): &'a (u8, Vec<ChunkKey>, Vec<bool>, Vec<u8>, u64),
) -> Frame<'a> {
    match kind {
        1 => Frame::Hello(Hello {
            secret_required: number % 2 == 0,
            nonce: [bytes[0]; NONCE_BYTES],
            namespace: bytes[..bytes.len().min(200)].to_vec(),
        }),
        2 => Frame::Auth([bytes[0]; MAC_BYTES]),
        3 => Frame::Have(keys.clone()),
        4 => Frame::HaveReply(flags.clone()),
        5 => Frame::Get(keys.clone()),
        6 => Frame::Data {
            key: keys
                .first()
                .copied()
                .unwrap_or(ChunkKey::new(u128::from(*number) << 64, 0)),
            checksum: *number,
            payload: bytes,
        },
        7 => Frame::End {
            sent: *number as u32,
        },
        9 => Frame::NixlGet(keys.clone()),
        10 => Frame::NixlOffer {
            connection: &bytes[..bytes.len() / 3],
            metadata: &bytes[bytes.len() / 2..],
            chunks: keys
                .iter()
                .map(|&key| NixlChunk {
                    key,
                    checksum: *number,
                    addr: number.rotate_left(7),
                    len: *number as u32,
                })
                .collect(),
        },
        11 => Frame::NixlDone,
        12 => Frame::Put {
            key: keys
                .first()
                .copied()
                .unwrap_or(ChunkKey::new(u128::from(*number) << 64, 0)),
            checksum: *number,
            payload: bytes,
        },
        // At most 300 bytes, so that lossy conversion stays under the 1024-byte message limit.
        _ => Frame::Error(String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned()),
    }
}

/// Reads frames from `bytes` until the reader stops; checks the buffer bound after each.
fn read_all(bytes: &[u8], body_max: usize) -> Option<ReadError> {
    let mut reader = FrameReader::new(body_max);
    let mut stream = Cursor::new(bytes);
    loop {
        let result = reader.read_frame(&mut stream).map(|_| ());
        assert!(
            reader.buffer_capacity() <= body_max,
            "buffer of {} bytes over the maximum {body_max}",
            reader.buffer_capacity()
        );
        if let Err(error) = result {
            return Some(error);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        if let Ok(Some((_, used))) = decode(&bytes, BODY_MAX) {
            prop_assert!(used <= bytes.len() && used >= HEADER_BYTES);
        }
        let error = read_all(&bytes, BODY_MAX);
        prop_assert!(error.is_some(), "a finite stream ends in an error");
    }

    #[test]
    fn valid_frames_round_trip_and_every_prefix_is_incomplete(parts in frame()) {
        let frame = build(&parts);
        let mut bytes = Vec::new();
        frame.encode(&mut bytes);
        let decoded = decode(&bytes, BODY_MAX);
        prop_assert_eq!(decoded, Ok(Some((frame.clone(), bytes.len()))));
        for cut in [0, 1, HEADER_BYTES - 1, HEADER_BYTES, bytes.len() / 2, bytes.len() - 1] {
            let cut = cut.min(bytes.len() - 1);
            prop_assert_eq!(decode(&bytes[..cut], BODY_MAX), Ok(None));
            match read_all(&bytes[..cut], BODY_MAX) {
                Some(ReadError::Io(e)) => {
                    prop_assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof)
                }
                other => prop_assert!(false, "truncated frame read as {:?}", other),
            }
        }
        let mut reader = FrameReader::new(BODY_MAX);
        let read = reader.read_frame(&mut Cursor::new(&bytes)).map_err(|e| format!("{e:?}"));
        prop_assert_eq!(read, Ok(frame));
    }

    #[test]
    fn corrupted_frames_never_panic(parts in frame(), at in any::<prop::sample::Index>(), xor in 1u8..) {
        let mut bytes = Vec::new();
        build(&parts).encode(&mut bytes);
        let i = at.index(bytes.len());
        bytes[i] ^= xor;
        let _ = decode(&bytes, BODY_MAX);
        let _ = read_all(&bytes, BODY_MAX);
    }

    #[test]
    fn oversized_lengths_are_refused_before_any_allocation(
        len in (BODY_MAX as u32 + 1)..,
        kind in any::<u8>(),
        tail in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.push(kind);
        bytes.extend_from_slice(&tail);
        let expected = FrameError::Oversized { len: u64::from(len), max: BODY_MAX };
        prop_assert_eq!(decode(&bytes, BODY_MAX), Err(expected.clone()));
        let mut reader = FrameReader::new(BODY_MAX);
        match reader.read_frame(&mut Cursor::new(&bytes)) {
            Err(ReadError::Frame(error)) => prop_assert_eq!(error, expected),
            other => prop_assert!(false, "oversized frame read as {:?}", other.map(|f| f.kind())),
        }
        prop_assert_eq!(reader.buffer_capacity(), 0);
    }

    /// A DATA or PUT prefix (the form the data path writes before a payload sent from where it
    /// lies) decodes to its key and tag, all 128 bits of the hash included; keys that differ in
    /// one bit of the hash (high half or low) or of the group encode differently.
    #[test]
    fn chunk_prefixes_round_trip_every_key(
        hash: u128,
        group: u32,
        checksum: u64,
        payload_len in 0usize..(1 << 30),
        put: bool,
        flip in 0u32..160,
    ) {
        let kind = if put { FrameKind::Put } else { FrameKind::Data };
        let key = ChunkKey::new(hash, group);
        let encoded = |key: ChunkKey| {
            let mut out = Vec::new();
            encode_chunk_prefix(kind, key, checksum, payload_len, &mut out);
            out
        };
        let bytes = encoded(key);
        prop_assert_eq!(bytes.len(), HEADER_BYTES + DATA_PREFIX_BYTES);
        let header = decode_header(bytes[..HEADER_BYTES].try_into().unwrap(), usize::MAX).unwrap();
        prop_assert_eq!(header.kind, kind);
        prop_assert_eq!(header.body_len, DATA_PREFIX_BYTES + payload_len);
        let prefix: [u8; DATA_PREFIX_BYTES] = bytes[HEADER_BYTES..].try_into().unwrap();
        prop_assert_eq!(decode_data_prefix(&prefix), (key, checksum));
        let other = if flip < 128 {
            ChunkKey::new(hash ^ (1u128 << flip), group)
        } else {
            ChunkKey::new(hash, group ^ (1u32 << (flip - 128)))
        };
        let other_bytes = encoded(other);
        prop_assert_ne!(&bytes, &other_bytes);
        let prefix: [u8; DATA_PREFIX_BYTES] = other_bytes[HEADER_BYTES..].try_into().unwrap();
        prop_assert_eq!(decode_data_prefix(&prefix), (other, checksum));
    }

    #[test]
    fn headers_decode_or_fail_cleanly(header in any::<[u8; HEADER_BYTES]>(), max in 0usize..100_000) {
        if let Ok(decoded) = decode_header(header, max) {
            prop_assert!(decoded.body_len <= max);
        }
    }
}
