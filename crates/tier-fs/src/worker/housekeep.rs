//! The writer's housekeeper: two threads that take the file system's slow calls off the
//! writer's thread. A seal's 4 KiB write waits at the disk behind the writer's own writes in
//! flight, and a fresh segment's `fallocate` reads allocation bitmaps and joins the journal:
//! each took 20-60 ms on the development disk, during which a writer that made the call itself
//! neither reaped nor submitted (docs/perf.md).
//!
//! - `kvtier-fs-seal` writes the seals (trim, seal, sync). The writer brings the index to the
//!   sealed state when it hands a segment over ([`account_seal`]), so eviction and the byte
//!   count are as with an inline seal; a segment evicted before its seal is written is sealed
//!   as an unlinked file, and the index ignores updates of segments it no longer has.
//! - `kvtier-fs-alloc` creates and allocates the writer's next segment while the writer fills
//!   the open one: an unnamed file (`O_TMPFILE`), named by the writer when it takes it, so no
//!   reader, probe or start-up scan sees it before, and the kernel frees it if the process
//!   dies. Its bytes are reserved against the capacity from the request until the writer takes
//!   it, so the files on disk stay within the limit.

use super::*;
use std::thread::JoinHandle;

/// Most segments waiting for their seal; beyond it the writer seals inline.
const SEALS_QUEUED_MAX: usize = 64;

/// A segment for the housekeeper to create and allocate ahead of need.
pub(super) struct Prepare {
    /// The directory of the writer's segments.
    pub(super) dir: PathBuf,
    pub(super) direct: bool,
    /// Bytes to allocate (the whole segment, sized for records like the open one's first).
    pub(super) bytes: u64,
}

/// An unnamed segment file (`O_TMPFILE`), allocated up to `allocated` (0 where `fallocate`
/// failed). The writer names it when it takes it.
pub(super) struct Prepared {
    pub(super) file: File,
    pub(super) direct: bool,
    pub(super) allocated: u64,
    /// `fallocate` said the file system cannot allocate at all.
    pub(super) unsupported: bool,
}

/// What the preparing thread answers: the file, or why there is none.
enum Answer {
    Ready(Prepared),
    /// Not created; `unnamed` false: the file system has no unnamed files (ask no more).
    Failed {
        unnamed: bool,
    },
}

/// The two housekeeping threads of a writer, and the one prepared segment it may hold.
pub(super) struct Housekeeper {
    shared: Arc<Shared>,
    seals: Option<Sender<OpenSegment>>,
    prepares: Option<Sender<Prepare>>,
    prepared: Receiver<Answer>,
    /// Capacity reserved for the segment being prepared (0: none asked for).
    reserved: u64,
    /// Unnamed files work here (until a creation says otherwise).
    unnamed: bool,
    threads: Vec<JoinHandle<()>>,
}

impl Housekeeper {
    /// Starts the threads (`None` if the system refuses a thread: the writer then does the work
    /// itself, as it would without a housekeeper).
    pub(super) fn start(shared: &Arc<Shared>, durable: bool) -> Option<Self> {
        let (seal_tx, seal_rx) = crossbeam_channel::bounded::<OpenSegment>(SEALS_QUEUED_MAX);
        let (prepare_tx, prepare_rx) = crossbeam_channel::bounded::<Prepare>(1);
        let (prepared_tx, prepared_rx) = crossbeam_channel::bounded::<Answer>(1);
        let sealer = {
            let shared = Arc::clone(shared);
            std::thread::Builder::new()
                .name("kvtier-fs-seal".into())
                .spawn(move || {
                    for seg in seal_rx {
                        // A panic leaves it unsealed (and evictable, as it already is); the next
                        // start verifies and seals it.
                        let _ = catch_unwind(AssertUnwindSafe(|| {
                            write_seal_of(&shared, durable, &seg);
                        }));
                    }
                })
                .ok()?
        };
        let preparer = std::thread::Builder::new()
            .name("kvtier-fs-alloc".into())
            .spawn(move || {
                for task in prepare_rx {
                    let answer = catch_unwind(AssertUnwindSafe(|| prepare(task)))
                        .unwrap_or(Answer::Failed { unnamed: true });
                    if prepared_tx.send(answer).is_err() {
                        return;
                    }
                }
            });
        let Ok(preparer) = preparer else {
            drop(seal_tx);
            let _ = sealer.join();
            return None;
        };
        Some(Self {
            shared: Arc::clone(shared),
            seals: Some(seal_tx),
            // A synced directory entry is the writer's to make (`open_segment`).
            prepares: (!durable).then_some(prepare_tx),
            prepared: prepared_rx,
            reserved: 0,
            unnamed: true,
            threads: vec![sealer, preparer],
        })
    }

    /// Queues `seg`'s seal; gives it back if the queue is full (the caller seals it).
    pub(super) fn seal(&self, seg: OpenSegment) -> Result<(), OpenSegment> {
        match &self.seals {
            Some(tx) => tx.try_send(seg).map_err(|e| e.into_inner()),
            None => Err(seg),
        }
    }

    /// Whether a segment may be asked for now: none is on its way, and the file system has
    /// unnamed files.
    pub(super) fn can_prepare(&self) -> bool {
        self.reserved == 0 && self.unnamed && self.prepares.is_some()
    }

    /// Asks for the next segment, for which the caller reserved `reserved` bytes of capacity
    /// (given back when the segment is taken or dropped).
    pub(super) fn request(&mut self, task: Prepare, reserved: u64) {
        let sent = self
            .prepares
            .as_ref()
            .is_some_and(|tx| tx.try_send(task).is_ok());
        if sent {
            self.reserved = reserved;
        } else {
            self.shared.index().release(reserved);
        }
    }

    /// The prepared segment, waiting for it if it is on its way (`None`: none was asked for, or
    /// preparing it failed, and the caller creates one itself). Its reservation is given back:
    /// the taker counts the file's allocated bytes as its segment's.
    pub(super) fn take(&mut self) -> Option<Prepared> {
        if self.reserved == 0 {
            return None;
        }
        let answer = self.prepared.recv().ok();
        self.shared
            .index()
            .release(std::mem::take(&mut self.reserved));
        match answer? {
            Answer::Ready(prepared) => Some(prepared),
            Answer::Failed { unnamed } => {
                self.unnamed &= unnamed;
                None
            }
        }
    }

    /// No more segments are asked for (the writer could not name one).
    pub(super) fn stop_preparing(&mut self) {
        self.unnamed = false;
    }
}

impl Drop for Housekeeper {
    /// Finishes the queued seals; a prepared segment the writer did not take is an unnamed file,
    /// gone with its descriptor.
    fn drop(&mut self) {
        self.seals = None;
        self.prepares = None;
        drop(self.take());
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Creates an unnamed segment file in the writer's directory and allocates it.
fn prepare(task: Prepare) -> Answer {
    let file = match crate::direct::create_unnamed(&task.dir, task.direct) {
        Ok(file) => file,
        Err(e) => {
            let unsupported = matches!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL | libc::ENOENT)
            );
            return Answer::Failed {
                unnamed: !unsupported,
            };
        }
    };
    let (allocated, unsupported) = match crate::direct::allocate(&file, 0, task.bytes) {
        Ok(()) => (task.bytes, false),
        Err(e) => (0, crate::direct::is_unsupported(&e)),
    };
    Answer::Ready(Prepared {
        file,
        direct: task.direct,
        allocated,
        unsupported,
    })
}

/// Brings the index to the state after `seg`'s seal, before the seal is written: its seal
/// reservation is given back, its bytes are its records and the seal (an allocated tail is
/// trimmed by the seal), and it is evictable. Eviction then takes segments oldest first and
/// counts their bytes as the writer seals them, whether a seal's write is done or still queued
/// (a segment evicted meanwhile is sealed as an unlinked file; the index ignores later updates
/// of a segment it no longer has). A segment without records is removed here (and its file
/// deleted); returns whether a seal is to be written.
pub(super) fn account_seal(shared: &Shared, seg: &OpenSegment) -> bool {
    let mut index = shared.index();
    index.release(SEAL_BYTES);
    if seg.cursor == 0 {
        index.remove_segment(seg.id);
        drop(index);
        let _ = std::fs::remove_file(&*seg.path);
        return false;
    }
    index.set_segment_bytes(seg.id, seg.cursor + SEAL_BYTES);
    index.set_state(seg.id, SegmentState::Sealed);
    true
}

/// Writes `seg`'s seal: trims an allocated tail past the records, writes the seal after them,
/// syncs it with `Durability::Fsync`. Where that fails, the index gets the file's real size
/// (the segment stays unsealed on disk; the next start's scan recovers it).
pub(super) fn write_seal_of(shared: &Shared, durable: bool, seg: &OpenSegment) {
    let trimmed = if seg.allocated > seg.cursor + SEAL_BYTES {
        seg.file.set_len(seg.cursor)
    } else {
        Ok(())
    };
    let sealed = trimmed
        .and_then(|()| write_seal(&seg.file, seg.cursor))
        .and_then(|()| {
            if durable {
                seg.file.sync_data()
            } else {
                Ok(())
            }
        });
    if sealed.is_err() {
        if let Ok(meta) = seg.file.metadata() {
            shared.index().set_segment_bytes(seg.id, meta.len());
        }
    }
    add(&shared.stats.segments_sealed, 1);
}
