//! The same behaviour tests run against both I/O engines (`SyncEngine`, `UringEngine`): one body
//! per behaviour, taking `&mut dyn IoEngine`, instantiated per engine by `engine_tests!`.
//!
//! io_uring works on the machines we develop on, so the io_uring variants FAIL when
//! `UringEngine::probe` fails. Only with `KVTIER_NO_URING=1` in the environment do they skip, each
//! printing why.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use tier_fs::io::buf::ALIGN;
use tier_fs::io::sync::{SyncEngine, OPS_IN_FLIGHT_MAX};
use tier_fs::io::uring::UringEngine;
use tier_fs::io::{AlignedBuf, IoCompletion, IoEngine, IoOp, OpKind, SlotSpan};

fn sync_engine() -> Option<Box<dyn IoEngine>> {
    Some(Box::new(SyncEngine::new(4).expect("sync engine starts")))
}

/// A small ring (32 entries, 64 completion entries) so that big batches exercise the engine's
/// pending queue.
fn uring_engine() -> Option<Box<dyn IoEngine>> {
    if let Err(why) = UringEngine::probe() {
        if std::env::var("KVTIER_NO_URING").as_deref() == Ok("1") {
            eprintln!("SKIPPED io_uring test (KVTIER_NO_URING=1): {why}");
            return None;
        }
        panic!("io_uring does not work here (set KVTIER_NO_URING=1 to skip): {why}");
    }
    Some(Box::new(
        UringEngine::new(32).expect("io_uring engine starts"),
    ))
}

macro_rules! engine_tests {
    ($engine:ident: [$($test:ident),* $(,)?], owned: [$($owned:ident),* $(,)?]) => {
        mod $engine {
            $(
                #[test]
                fn $test() {
                    if let Some(mut engine) = super::$engine() {
                        super::$test(engine.as_mut());
                    }
                }
            )*
            $(
                #[test]
                fn $owned() {
                    if let Some(engine) = super::$engine() {
                        super::$owned(engine);
                    }
                }
            )*
        }
    };
}

engine_tests!(sync_engine: [
    write_then_read_back_across_files,
    vectored_ops_move_buffer_then_span,
    read_past_eof_is_short,
    o_direct_misalignment_is_einval,
    bad_fd_is_ebadf_and_returns_buffer,
    many_in_flight_complete_once,
    invalid_batch_is_refused_whole,
    reap_without_work_returns,
], owned: [drop_with_ops_in_flight]);
engine_tests!(uring_engine: [
    write_then_read_back_across_files,
    vectored_ops_move_buffer_then_span,
    read_past_eof_is_short,
    o_direct_misalignment_is_einval,
    bad_fd_is_ebadf_and_returns_buffer,
    many_in_flight_complete_once,
    invalid_batch_is_refused_whole,
    reap_without_work_returns,
], owned: [drop_with_ops_in_flight]);

/// Deterministic test bytes for (`seed`, position).
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

fn write_op(tag: u64, fd: RawFd, offset: u64, data: &[u8]) -> IoOp {
    IoOp {
        tag,
        kind: OpKind::Write,
        fd,
        offset,
        len: data.len(),
        buf: AlignedBuf::from_slice(data),
        span: None,
    }
}

fn read_op(tag: u64, fd: RawFd, offset: u64, len: usize) -> IoOp {
    IoOp {
        tag,
        kind: OpKind::Read,
        fd,
        offset,
        len,
        buf: AlignedBuf::with_capacity(len),
        span: None,
    }
}

fn submit(engine: &mut dyn IoEngine, ops: Vec<IoOp>) {
    if let Err((err, ops)) = engine.submit(ops) {
        panic!(
            "{}: submit of {} ops refused: {err}",
            engine.name(),
            ops.len()
        );
    }
}

/// Reaps until nothing is in flight, with a deadline; completions by tag, each tag at most once.
fn reap_all(engine: &mut dyn IoEngine) -> BTreeMap<u64, IoCompletion> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut by_tag = BTreeMap::new();
    let mut out = Vec::new();
    while engine.in_flight() > 0 {
        assert!(
            Instant::now() < deadline,
            "{}: reap deadline",
            engine.name()
        );
        engine.reap(&mut out, 1).expect("reap");
        for completion in out.drain(..) {
            let tag = completion.tag;
            assert!(
                by_tag.insert(tag, completion).is_none(),
                "{}: tag {tag} completed twice",
                engine.name()
            );
        }
    }
    engine.reap(&mut out, 0).expect("final reap");
    assert!(
        out.is_empty(),
        "{}: completions after in_flight hit 0",
        engine.name()
    );
    by_tag
}

fn create(dir: &Path, name: &str) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.join(name))
        .expect("create test file")
}

/// A directory on the real disk (under the target directory), not a tmpfs `/tmp`.
fn disk_dir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir under target")
}

fn write_then_read_back_across_files(engine: &mut dyn IoEngine) {
    let dir = disk_dir();
    let files: Vec<File> = (0..4)
        .map(|i| create(dir.path(), &format!("f{i}")))
        .collect();
    // 64 writes of varied sizes (aligned and not), laid end to end per file.
    let mut expected: Vec<Vec<u8>> = vec![Vec::new(); files.len()];
    let mut writes = Vec::new();
    let mut extents = Vec::new();
    for tag in 0..64u64 {
        let file = (tag % 4) as usize;
        let len = [4096, 1, 5000, 3 * 4096, 777][tag as usize % 5];
        let data = pattern(tag, len);
        let offset = expected[file].len() as u64;
        expected[file].extend_from_slice(&data);
        writes.push(write_op(tag, files[file].as_raw_fd(), offset, &data));
        extents.push((tag, file, offset, len));
    }
    submit(engine, writes);
    assert_eq!(engine.in_flight(), 64);
    let done = reap_all(engine);
    assert_eq!(done.len(), 64);
    for (tag, completion) in &done {
        let len = extents[*tag as usize].3;
        assert_eq!(
            *completion.result.as_ref().expect("write ok"),
            len,
            "tag {tag}"
        );
        assert_eq!(completion.buf.len(), len, "write keeps its buffer length");
    }
    for (file, data) in files.iter().zip(&expected) {
        let on_disk = std::fs::read(format!("/proc/self/fd/{}", file.as_raw_fd())).expect("read");
        assert!(on_disk == *data, "file content differs");
    }

    let reads = extents
        .iter()
        .map(|&(tag, file, offset, len)| read_op(1000 + tag, files[file].as_raw_fd(), offset, len))
        .collect();
    submit(engine, reads);
    let done = reap_all(engine);
    assert_eq!(done.len(), 64);
    for &(tag, _, _, len) in &extents {
        let completion = &done[&(1000 + tag)];
        assert_eq!(
            *completion.result.as_ref().expect("read ok"),
            len,
            "tag {tag}"
        );
        assert!(
            completion.buf.as_slice() == pattern(tag, len),
            "tag {tag} bytes differ"
        );
    }
}

/// An op with a slot span writes its buffer's first bytes then the span (O_DIRECT, as the tier's
/// zero-copy records do), and a read with a span fills the buffer's part then the span; the span
/// memory is handed back untouched by anything else.
fn vectored_ops_move_buffer_then_span(engine: &mut dyn IoEngine) {
    let dir = disk_dir();
    let path = dir.path().join("vectored");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .expect("create O_DIRECT file");
    let head = pattern(1, ALIGN);
    let body = pattern(2, 3 * ALIGN);
    let mut slot = AlignedBuf::from_slice(&body);
    // SAFETY: `slot` outlives the op (reaped below) and nothing touches it meanwhile.
    let span = unsafe {
        SlotSpan::new(
            std::ptr::NonNull::new(slot.as_mut_ptr()).unwrap(),
            3 * ALIGN,
        )
    };
    let write = IoOp {
        span: Some(span),
        len: 4 * ALIGN,
        ..write_op(1, file.as_raw_fd(), 0, &head)
    };
    submit(engine, vec![write]);
    let done = reap_all(engine);
    assert_eq!(
        *done[&1].result.as_ref().expect("vectored write"),
        4 * ALIGN
    );
    let on_disk = std::fs::read(&path).expect("read back");
    assert_eq!(&on_disk[..ALIGN], &head[..]);
    assert_eq!(&on_disk[ALIGN..], &body[..]);
    // Read it back: the header part into the buffer, the rest into a zeroed span.
    let mut into = AlignedBuf::with_capacity(3 * ALIGN);
    // SAFETY: as above, for `into`.
    let span = unsafe {
        SlotSpan::new(
            std::ptr::NonNull::new(into.as_mut_ptr()).unwrap(),
            3 * ALIGN,
        )
    };
    let read = IoOp {
        span: Some(span),
        len: 4 * ALIGN,
        ..read_op(2, file.as_raw_fd(), 0, ALIGN)
    };
    submit(engine, vec![read]);
    let done = reap_all(engine);
    let completion = &done[&2];
    assert_eq!(
        *completion.result.as_ref().expect("vectored read"),
        4 * ALIGN
    );
    assert_eq!(completion.buf.as_slice(), &head[..]);
    into.set_len(3 * ALIGN);
    assert_eq!(into.as_slice(), &body[..]);
    // A span longer than the op is refused before anything is queued.
    // SAFETY: as above, for `into` (the op is refused, so it never runs).
    let span = unsafe {
        SlotSpan::new(
            std::ptr::NonNull::new(into.as_mut_ptr()).unwrap(),
            3 * ALIGN,
        )
    };
    let bad = IoOp {
        span: Some(span),
        len: ALIGN,
        ..read_op(3, file.as_raw_fd(), 0, ALIGN)
    };
    let refused = engine.submit(vec![bad]).expect_err("refused");
    assert_eq!(refused.0.kind(), std::io::ErrorKind::InvalidInput);
    assert_eq!(engine.in_flight(), 0);
}

fn read_past_eof_is_short(engine: &mut dyn IoEngine) {
    let dir = disk_dir();
    let file = create(dir.path(), "short");
    let data = pattern(9, 10_000);
    std::fs::write(dir.path().join("short"), &data).expect("write");
    let fd = file.as_raw_fd();
    submit(
        engine,
        vec![read_op(1, fd, 8192, 8192), read_op(2, fd, 20_000, 4096)],
    );
    let done = reap_all(engine);
    let straddling = &done[&1];
    assert_eq!(*straddling.result.as_ref().expect("read ok"), 10_000 - 8192);
    assert_eq!(straddling.buf.len(), 10_000 - 8192);
    assert!(straddling.buf.as_slice() == &data[8192..]);
    let beyond = &done[&2];
    assert_eq!(*beyond.result.as_ref().expect("read ok"), 0);
    assert!(beyond.buf.is_empty());
}

fn o_direct_misalignment_is_einval(engine: &mut dyn IoEngine) {
    let dir = disk_dir();
    let path = dir.path().join("direct");
    let file = match OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
    {
        Ok(file) => file,
        Err(err) if err.raw_os_error() == Some(libc::EINVAL) => {
            eprintln!(
                "SKIPPED O_DIRECT test: {} refuses O_DIRECT: {err}",
                path.display()
            );
            return;
        }
        Err(err) => panic!("open O_DIRECT {}: {err}", path.display()),
    };
    let fd = file.as_raw_fd();
    let data = pattern(3, 2 * ALIGN);
    submit(engine, vec![write_op(1, fd, 0, &data)]);
    let aligned = reap_all(engine).remove(&1).expect("completion");
    match &aligned.result {
        Ok(n) => assert_eq!(*n, data.len()),
        Err(err) if err.raw_os_error() == Some(libc::EINVAL) => {
            eprintln!("SKIPPED O_DIRECT test: aligned O_DIRECT write gives EINVAL here: {err}");
            return;
        }
        Err(err) => panic!("aligned O_DIRECT write: {err}"),
    }

    submit(
        engine,
        vec![
            write_op(10, fd, 100, &data[..ALIGN]), // misaligned offset
            write_op(11, fd, 0, &data[..100]),     // misaligned length
            read_op(12, fd, 100, ALIGN),           // misaligned offset
            read_op(13, fd, 0, 100),               // misaligned length
            read_op(14, fd, 0, 2 * ALIGN),         // aligned
        ],
    );
    let done = reap_all(engine);
    for tag in 10..=13 {
        let err = done[&tag]
            .result
            .as_ref()
            .expect_err("misaligned O_DIRECT op must fail");
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL), "tag {tag}: {err}");
    }
    assert_eq!(done[&12].buf.len(), 0, "failed read has no bytes");
    assert_eq!(*done[&14].result.as_ref().expect("aligned read"), 2 * ALIGN);
    assert!(done[&14].buf.as_slice() == data);
}

/// A descriptor number that is not open (high, so a test running in parallel cannot be handed it).
fn closed_fd() -> RawFd {
    let fd = 987_654;
    // SAFETY: F_GETFD only queries the descriptor table.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    assert_eq!(flags, -1, "fd {fd} unexpectedly open");
    fd
}

fn bad_fd_is_ebadf_and_returns_buffer(engine: &mut dyn IoEngine) {
    let fd = closed_fd();
    let data = pattern(5, 3000);
    submit(
        engine,
        vec![write_op(1, fd, 0, &data), read_op(2, fd, 4096, 8192)],
    );
    let done = reap_all(engine);
    for (tag, completion) in &done {
        let err = completion.result.as_ref().expect_err("closed fd must fail");
        assert_eq!(err.raw_os_error(), Some(libc::EBADF), "tag {tag}: {err}");
    }
    assert!(
        done[&1].buf.as_slice() == data,
        "write buffer handed back intact"
    );
    assert_eq!(done[&2].buf.capacity(), 8192, "read buffer handed back");
    assert_eq!(done[&2].buf.len(), 0);
}

fn many_in_flight_complete_once(engine: &mut dyn IoEngine) {
    let dir = disk_dir();
    let file = create(dir.path(), "many");
    let fd = file.as_raw_fd();
    // 256 writes in one submission, then 256 reads in four submissions with partial reaps between.
    let writes = (0..256u64)
        .map(|tag| write_op(tag, fd, tag * 4096, &pattern(tag, 4096)))
        .collect();
    submit(engine, writes);
    assert_eq!(engine.in_flight(), 256);
    let done = reap_all(engine);
    assert_eq!(
        done.keys().copied().collect::<Vec<_>>(),
        (0..256).collect::<Vec<_>>()
    );
    assert!(done.values().all(|c| matches!(c.result, Ok(4096))));

    let mut out = Vec::new();
    for batch in 0..4u64 {
        let reads = (batch * 64..(batch + 1) * 64)
            .map(|i| read_op(10_000 + i, fd, i * 4096, 4096))
            .collect();
        submit(engine, reads);
        engine.reap(&mut out, 10).expect("partial reap");
        assert!(out.len() >= 10 * (batch as usize + 1) || engine.in_flight() == 0);
    }
    let rest = reap_all(engine);
    let mut tags: Vec<u64> = out
        .iter()
        .map(|c| c.tag)
        .chain(rest.keys().copied())
        .collect();
    tags.sort_unstable();
    assert_eq!(
        tags,
        (10_000..10_256).collect::<Vec<_>>(),
        "each read completes once"
    );
    for completion in out.iter().chain(rest.values()) {
        let i = completion.tag - 10_000;
        assert!(
            completion.buf.as_slice() == pattern(i, 4096),
            "read {i} bytes differ"
        );
    }
}

fn invalid_batch_is_refused_whole(engine: &mut dyn IoEngine) {
    let dir = disk_dir();
    let file = create(dir.path(), "invalid");
    let fd = file.as_raw_fd();
    let mut too_long = read_op(2, fd, 0, 4096);
    too_long.len = 4097;
    let ops = vec![read_op(1, fd, 0, 4096), too_long, read_op(3, fd, 0, 4096)];
    let (err, back) = engine.submit(ops).expect_err("len beyond capacity");
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{err}");
    assert!(
        err.to_string().contains("read"),
        "message names the operation: {err}"
    );
    assert_eq!(back.iter().map(|op| op.tag).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(engine.in_flight(), 0);

    let huge: Vec<IoOp> = (0..OPS_IN_FLIGHT_MAX as u64 + 1)
        .map(|tag| read_op(tag, fd, 0, 0))
        .collect();
    let (err, back) = engine.submit(huge).expect_err("over the in-flight limit");
    assert_eq!(err.kind(), std::io::ErrorKind::WouldBlock, "{err}");
    assert_eq!(back.len(), OPS_IN_FLIGHT_MAX + 1);
    assert_eq!(engine.in_flight(), 0);
}

fn reap_without_work_returns(engine: &mut dyn IoEngine) {
    let mut out = Vec::new();
    engine.reap(&mut out, 0).expect("reap 0");
    engine
        .reap(&mut out, 5)
        .expect("reap with nothing in flight does not wait");
    assert!(out.is_empty());
    // Asking for more than is in flight returns once everything is reaped.
    let fd = closed_fd();
    submit(
        engine,
        vec![read_op(1, fd, 0, 4096), read_op(2, fd, 0, 4096)],
    );
    engine.reap(&mut out, 10).expect("reap");
    assert_eq!(out.len(), 2);
    assert_eq!(engine.in_flight(), 0);
}

fn drop_with_ops_in_flight(mut engine: Box<dyn IoEngine>) {
    let dir = disk_dir();
    let len = 32 << 20;
    let data = pattern(11, len);
    std::fs::write(dir.path().join("big"), &data).expect("write big file");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.path().join("big"))
        .expect("open big file");
    let fd = file.as_raw_fd();
    let ops = (0..4u64)
        .map(|tag| read_op(tag, fd, 0, len))
        .chain((4..12u64).map(|tag| {
            let offset = (tag - 4) as usize * 4096;
            write_op(tag, fd, offset as u64, &data[offset..offset + 4096])
        }))
        .collect();
    submit(engine.as_mut(), ops);
    assert_eq!(engine.in_flight(), 12);
    // Dropped with everything in flight: it must wait for (or abandon unstarted) operations
    // before freeing their buffers, and only then may the file be closed.
    drop(engine);
    drop(file);
    let after = std::fs::read(dir.path().join("big")).expect("read back");
    assert!(
        after == data,
        "file intact (the writes rewrote the same bytes)"
    );
}
