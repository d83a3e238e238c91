//! [`AlignedBuf`]: an owned, zeroed heap buffer aligned to 4096 bytes, the unit of memory that
//! I/O operations own while the kernel (or a worker thread) reads or writes it.
//!
//! Buffers of [`HUGE_MIN`] bytes or more are their own anonymous mappings, aligned to and sized in
//! 2 MiB, and asked for transparent huge pages (`MADV_HUGEPAGE`) before their first touch. A
//! direct read or write of a megabyte from 4 KiB pages hands the disk 256 or more separate
//! segments, more than a virtio disk takes in one request (`max_segments` 254 on the development
//! machine), so the kernel splits it; from huge pages it is one or two segments. Pinning the
//! pages of each request also costs per page: `strace` showed `io_uring_enter` stalling 10-40 ms
//! faulting in a fresh 8 MiB buffer's 4 KiB pages. With huge pages both the tier's loads and the
//! raw `O_DIRECT` ceiling of `kvtier bench fs` ran faster (`docs/perf.md`, disk tier). Where the
//! kernel has no huge page to give (or THP is off), the buffer is ordinary pages.

use std::alloc::{self, Layout};
use std::fmt;
use std::io;
use std::ptr::NonNull;
use std::slice;

/// Alignment and capacity granularity of an [`AlignedBuf`], in bytes (enough for O_DIRECT on
/// disks with 512-byte or 4 KiB logical blocks).
pub const ALIGN: usize = 4096;

/// Capacity from which an [`AlignedBuf`] is a huge-page mapping (module doc), in bytes.
pub const HUGE_MIN: usize = 1 << 20;

/// Alignment and capacity granularity of a huge-page [`AlignedBuf`]: the x86-64 and arm64
/// (4 KiB base pages) transparent huge page size.
pub const HUGE_ALIGN: usize = 2 << 20;

/// An owned heap buffer whose start is aligned to [`ALIGN`] and whose capacity is a multiple of it.
///
/// The whole capacity is zeroed at allocation, so every byte is always initialized: `set_len`
/// is safe and never exposes uninitialized memory. `len` is the number of meaningful bytes (for a
/// read, the bytes read); it never exceeds the capacity.
pub struct AlignedBuf {
    /// Start of the allocation; dangling (but aligned) when the capacity is 0.
    ptr: NonNull<u8>,
    /// Bytes allocated, a multiple of [`ALIGN`] (of [`HUGE_ALIGN`] from [`HUGE_MIN`] on, then
    /// the size of the buffer's own mapping).
    capacity: usize,
    /// Meaningful bytes, `len <= capacity`.
    len: usize,
}

// SAFETY: AlignedBuf uniquely owns its allocation (no aliasing handles exist), like a Vec<u8>,
// so moving it to another thread is sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only allow reading the bytes (`as_slice`, `as_ptr`); all mutation
// goes through `&mut self`, like Vec<u8>.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates a zeroed buffer of at least `bytes` bytes (rounded up to a multiple of [`ALIGN`],
    /// or of [`HUGE_ALIGN`] from [`HUGE_MIN`] bytes on), with length 0.
    ///
    /// # Panics
    ///
    /// If the rounded capacity overflows `isize`, or the allocation fails (like `Vec`).
    /// [`AlignedBuf::try_with_capacity`] reports these as errors instead.
    pub fn with_capacity(bytes: usize) -> AlignedBuf {
        match Self::try_with_capacity(bytes) {
            Ok(buf) => buf,
            Err(err) => panic!("AlignedBuf::with_capacity({bytes}): {err}"),
        }
    }

    /// Like [`AlignedBuf::with_capacity`], but returns an `OutOfMemory` error when the capacity
    /// overflows or the allocator refuses.
    pub fn try_with_capacity(bytes: usize) -> io::Result<AlignedBuf> {
        let capacity = bytes
            .checked_next_multiple_of(ALIGN)
            .ok_or_else(|| capacity_error(bytes))?;
        if capacity == 0 {
            return Ok(AlignedBuf {
                ptr: dangling_aligned(),
                capacity: 0,
                len: 0,
            });
        }
        if capacity >= HUGE_MIN {
            return Self::try_huge(bytes);
        }
        let layout = Layout::from_size_align(capacity, ALIGN).map_err(|_| capacity_error(bytes))?;
        // SAFETY: the layout has a non-zero size (checked above) and a valid power-of-two align.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("AlignedBuf: allocation of {capacity} bytes failed"),
            )
        })?;
        Ok(AlignedBuf {
            ptr,
            capacity,
            len: 0,
        })
    }

    /// A mapping of `bytes` rounded up to [`HUGE_ALIGN`], starting on a [`HUGE_ALIGN`] boundary,
    /// advised for huge pages before anything touches it (fresh anonymous pages read as zero).
    fn try_huge(bytes: usize) -> io::Result<AlignedBuf> {
        let capacity = bytes
            .checked_next_multiple_of(HUGE_ALIGN)
            .filter(|&c| c <= isize::MAX as usize - HUGE_ALIGN)
            .ok_or_else(|| capacity_error(bytes))?;
        let mapped = capacity + HUGE_ALIGN;
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            let err = io::Error::last_os_error();
            return Err(io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("AlignedBuf: mapping of {mapped} bytes failed: {err}"),
            ));
        }
        let start = raw as usize;
        let aligned = start.next_multiple_of(HUGE_ALIGN);
        let (head, tail) = (aligned - start, start + mapped - (aligned + capacity));
        // SAFETY: the head and tail lie inside the mapping just made and outside the part kept;
        // munmap of page-aligned ranges of it cannot fail but for an invalid range.
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((aligned + capacity) as *mut libc::c_void, tail);
            }
            // Advice only: without huge pages (THP off, none free) the pages are ordinary ones.
            libc::madvise(aligned as *mut libc::c_void, capacity, libc::MADV_HUGEPAGE);
        }
        let ptr = NonNull::new(aligned as *mut u8).ok_or_else(|| capacity_error(bytes))?;
        Ok(AlignedBuf {
            ptr,
            capacity,
            len: 0,
        })
    }

    /// Allocates a buffer holding a copy of `data` (length `data.len()`, capacity rounded up).
    pub fn from_slice(data: &[u8]) -> AlignedBuf {
        let mut buf = AlignedBuf::with_capacity(data.len());
        buf.as_full_mut_slice()[..data.len()].copy_from_slice(data);
        buf.len = data.len();
        buf
    }

    /// Meaningful bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether `len()` is 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes allocated (a multiple of [`ALIGN`]; of [`HUGE_ALIGN`] from [`HUGE_MIN`] on).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sets the number of meaningful bytes. The bytes between the old and the new length keep
    /// whatever they held (zero, or earlier contents); they are always initialized.
    ///
    /// # Panics
    ///
    /// If `len > capacity()` (a caller's bug, like indexing out of bounds).
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.capacity,
            "AlignedBuf::set_len({len}) beyond capacity {}",
            self.capacity
        );
        self.len = len;
    }

    /// Sets the length to 0 (contents are kept, not zeroed).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// The first `len()` bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for `capacity` initialized bytes (zeroed at allocation, or dangling
        // and aligned with len 0), len <= capacity, and &self forbids concurrent mutation.
        unsafe { slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The first `len()` bytes, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; &mut self makes this the only reference.
        unsafe { slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The whole capacity (all bytes are initialized).
    pub fn as_full_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for `capacity` initialized bytes; &self forbids mutation.
        unsafe { slice::from_raw_parts(self.ptr.as_ptr(), self.capacity) }
    }

    /// The whole capacity, mutable (for filling before a write; then `set_len`).
    pub fn as_full_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for `capacity` initialized bytes; &mut self makes this unique.
        unsafe { slice::from_raw_parts_mut(self.ptr.as_ptr(), self.capacity) }
    }

    /// Start of the buffer (aligned to [`ALIGN`]), valid for `capacity()` bytes.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Start of the buffer (aligned to [`ALIGN`]), valid for writes of `capacity()` bytes.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.capacity == 0 {
            return;
        }
        if self.capacity >= HUGE_MIN {
            // SAFETY: a capacity from HUGE_MIN on means `try_huge` mapped exactly
            // [ptr, ptr + capacity); it is unmapped once.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.capacity) };
            return;
        }
        // SAFETY: a non-zero capacity below HUGE_MIN means ptr came from alloc_zeroed with
        // exactly this layout (which was valid then, so from_size_align_unchecked is sound), and
        // it is freed once.
        unsafe {
            let layout = Layout::from_size_align_unchecked(self.capacity, ALIGN);
            alloc::dealloc(self.ptr.as_ptr(), layout);
        }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

/// A non-null pointer aligned to [`ALIGN`] for zero-capacity buffers (never dereferenced for
/// more than 0 bytes, never freed).
fn dangling_aligned() -> NonNull<u8> {
    NonNull::new(std::ptr::without_provenance_mut(ALIGN)).unwrap_or(NonNull::dangling())
}

fn capacity_error(bytes: usize) -> io::Error {
    io::Error::new(
        io::ErrorKind::OutOfMemory,
        format!("AlignedBuf: capacity {bytes} overflows when rounded up to {ALIGN}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_rounds_up_to_align_and_start_is_aligned() {
        for (asked, expected) in [
            (1, ALIGN),
            (ALIGN, ALIGN),
            (ALIGN + 1, 2 * ALIGN),
            (3 * ALIGN - 7, 3 * ALIGN),
        ] {
            let buf = AlignedBuf::with_capacity(asked);
            assert_eq!(buf.capacity(), expected, "asked {asked}");
            assert_eq!(buf.len(), 0);
            assert!(buf.is_empty());
            assert_eq!(buf.as_ptr() as usize % ALIGN, 0, "asked {asked}");
        }
    }

    #[test]
    fn zero_capacity_is_aligned_and_empty() {
        let mut buf = AlignedBuf::with_capacity(0);
        assert_eq!(buf.capacity(), 0);
        assert_eq!(buf.as_ptr() as usize % ALIGN, 0);
        assert!(buf.as_slice().is_empty());
        assert!(buf.as_full_mut_slice().is_empty());
    }

    #[test]
    fn allocation_is_zeroed() {
        let buf = AlignedBuf::with_capacity(5 * ALIGN);
        assert!(buf.as_full_slice().iter().all(|&b| b == 0));
    }

    #[test]
    fn set_len_exposes_written_bytes() {
        let mut buf = AlignedBuf::with_capacity(100);
        buf.as_full_mut_slice()[..3].copy_from_slice(b"abc");
        buf.set_len(3);
        assert_eq!(buf.as_slice(), b"abc");
        buf.as_mut_slice()[1] = b'X';
        assert_eq!(buf.as_slice(), b"aXc");
        buf.set_len(buf.capacity());
        assert_eq!(buf.as_slice().len(), ALIGN);
        buf.clear();
        assert!(buf.is_empty());
        assert_eq!(&buf.as_full_slice()[..3], b"aXc");
    }

    #[test]
    fn set_len_beyond_capacity_panics() {
        let result = std::panic::catch_unwind(|| {
            let mut buf = AlignedBuf::with_capacity(1);
            buf.set_len(ALIGN + 1);
        });
        assert!(result.is_err());
    }

    #[test]
    fn from_slice_copies_data() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let buf = AlignedBuf::from_slice(&data);
        assert_eq!(buf.as_slice(), &data[..]);
        assert_eq!(buf.capacity(), 3 * ALIGN);
        assert!(buf.as_full_slice()[data.len()..].iter().all(|&b| b == 0));
    }

    #[test]
    fn overflowing_capacity_is_an_error() {
        let err = AlignedBuf::try_with_capacity(usize::MAX - 1).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::OutOfMemory);
        let err = AlignedBuf::try_with_capacity(isize::MAX as usize).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::OutOfMemory);
    }

    #[test]
    fn large_buffers_are_their_own_huge_aligned_zeroed_mappings() {
        for asked in [
            HUGE_MIN,
            HUGE_MIN + 1,
            HUGE_ALIGN,
            HUGE_ALIGN + ALIGN,
            5 * HUGE_MIN - 3,
        ] {
            let mut buf = AlignedBuf::with_capacity(asked);
            let expected = asked.next_multiple_of(HUGE_ALIGN);
            assert_eq!(buf.capacity(), expected, "asked {asked}");
            assert_eq!(buf.as_ptr() as usize % HUGE_ALIGN, 0, "asked {asked}");
            assert!(buf.as_full_slice().iter().all(|&b| b == 0), "asked {asked}");
            // Every byte of the mapping is writable and reads back.
            let full = buf.as_full_mut_slice();
            full[0] = 1;
            full[expected - 1] = 2;
            buf.set_len(expected);
            assert_eq!((buf.as_slice()[0], buf.as_slice()[expected - 1]), (1, 2));
        }
        // Rounded up to just below the threshold: a heap buffer, rounded to ALIGN only.
        let small = AlignedBuf::with_capacity(HUGE_MIN - ALIGN - 1);
        assert_eq!(small.capacity(), HUGE_MIN - ALIGN);
        // Mapping and unmapping many in turn neither fails nor keeps the memory.
        for _ in 0..256 {
            drop(AlignedBuf::with_capacity(8 * HUGE_MIN));
        }
    }

    #[test]
    fn buffer_moves_between_threads() {
        let buf = AlignedBuf::from_slice(b"hello");
        let back = std::thread::spawn(move || buf).join().unwrap();
        assert_eq!(back.as_slice(), b"hello");
    }
}
