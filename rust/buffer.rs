//! Bytes in and out of the primitives.
//!
//! - [`Input`]: a read-only view of any C-contiguous bytes-like argument, shared by every
//!   primitive that takes bytes (frames, envelopes, the JSON relay, R3, stamping).
//! - [`new_bytes`]: the one way the core makes a `bytes` result: allocated at its final size
//!   with its contents uninitialised, then written exactly once through a [`Filler`], so a
//!   result costs one copy of its data and no zero-fill.
//!
//! Safety of `new_bytes` / `Filler`: the object comes from `PyBytes_FromStringAndSize(NULL,
//! n)`, which is documented for exactly this (allocate, then write the contents before
//! anyone reads them). Until the primitive returns it, no Python code can reach the object,
//! so writing into an immutable `bytes` changes nothing anyone can see, and doing so without
//! the GIL races with nothing. Every write is bounds-checked against the size (a bug panics,
//! it never writes past the end), and the ranges never overlap the source (the target is
//! new). The object is either filled completely before it is returned (callers
//! `debug_assert!` [`Filler::is_full`]) or dropped unseen on an error. The caller keeps the
//! object alive while it writes through the `Filler` (both live in one scope, or side by
//! side in one struct for the frame decoder's pending payload).

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyMemoryError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyMemoryView};
use pyo3::{ffi, intern};

use crate::types::type_name;

// ---------------------------------------------------------------------------------------
// Input

/// A read-only view of a C-contiguous bytes-like argument, valid while it lives (the
/// exported buffer pins the memory; bytes objects are immutable).
pub(crate) struct Input<'py> {
    /// The object whose buffer is read: the argument itself, or a `cast("B")` memoryview.
    pub(crate) obj: Bound<'py, PyAny>,
    buffer: Option<PyBuffer<u8>>,
    /// True when `obj` is bytes or a flat unsigned-byte buffer, so slicing a memoryview of
    /// it yields byte offsets (else `obj` must be cast first).
    pub(crate) flat: bool,
}

impl<'py> Input<'py> {
    /// Same checks and messages as the Python twins' byte views.
    pub(crate) fn get(obj: &Bound<'py, PyAny>, func: &str, arg: &str) -> PyResult<Self> {
        Self::get_as(obj, func, arg, "a bytes-like object")
    }

    /// `get`, naming what is `expected` when `obj` is not a buffer at all.
    pub(crate) fn get_as(
        obj: &Bound<'py, PyAny>,
        func: &str,
        arg: &str,
        expected: &str,
    ) -> PyResult<Self> {
        if obj.is_exact_instance_of::<PyBytes>() {
            return Ok(Self {
                obj: obj.clone(),
                buffer: None,
                flat: true,
            });
        }
        let py = obj.py();
        match PyBuffer::<u8>::get(obj) {
            Ok(buffer) if buffer.is_c_contiguous() => {
                let flat = buffer.dimensions() == 1 && buffer.format().to_bytes() == b"B";
                return Ok(Self {
                    obj: obj.clone(),
                    buffer: Some(buffer),
                    flat,
                });
            }
            Ok(_) => return Err(not_contiguous(func, arg)),
            Err(_) => {}
        }
        // Not a buffer, or items wider than a byte: go through memoryview like the twins.
        let view = py.get_type::<PyMemoryView>().call1((obj,)).map_err(|_| {
            PyTypeError::new_err(format!(
                "{func}() argument '{arg}' must be {expected}, not {}",
                type_name(obj)
            ))
        })?;
        if !view.getattr(intern!(py, "c_contiguous"))?.is_truthy()? {
            return Err(not_contiguous(func, arg));
        }
        let view = view.call_method1(intern!(py, "cast"), ("B",))?;
        let buffer = PyBuffer::<u8>::get(&view)?;
        Ok(Self {
            obj: view,
            buffer: Some(buffer),
            flat: true,
        })
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        match &self.buffer {
            None => self
                .obj
                .downcast::<PyBytes>()
                .map(|b| b.as_bytes())
                .unwrap_or(&[]),
            Some(buffer) => {
                let len = buffer.len_bytes();
                if len == 0 {
                    return &[];
                }
                // SAFETY: the buffer is C-contiguous, `len` bytes long, and stays exported
                // (so neither freed nor resized) for as long as `self` lives.
                unsafe { std::slice::from_raw_parts(buffer.buf_ptr() as *const u8, len) }
            }
        }
    }
}

fn not_contiguous(func: &str, arg: &str) -> PyErr {
    PyTypeError::new_err(format!(
        "{func}() argument '{arg}' must be a C-contiguous bytes-like object"
    ))
}

// ---------------------------------------------------------------------------------------
// Output: new bytes objects written in place

/// A new `bytes` object of `len` bytes, uninitialised, and the cursor that must fill all of
/// it before Python code can see the object (see the module comment for why this is sound).
/// Large objects are asked to be backed by huge pages ([`advise_huge_pages`]).
pub(crate) fn new_bytes(py: Python<'_>, len: usize) -> PyResult<(Bound<'_, PyBytes>, Filler)> {
    let size = isize::try_from(len)
        .map_err(|_| PyMemoryError::new_err(format!("cannot allocate {len} bytes")))?;
    // SAFETY: PyBytes_FromStringAndSize(NULL, n) returns a new reference (or NULL with an
    // exception set) to an n-byte bytes object whose contents the caller must write;
    // PyBytes_AsString of it is the start of those n bytes, owned by the object.
    unsafe {
        let raw = ffi::PyBytes_FromStringAndSize(std::ptr::null(), size);
        let obj = Bound::from_owned_ptr_or_err(py, raw)?.downcast_into_unchecked::<PyBytes>();
        let ptr = ffi::PyBytes_AsString(raw) as *mut u8;
        advise_huge_pages(ptr, len);
        Ok((obj, Filler { ptr, len, pos: 0 }))
    }
}

/// Write cursor into a bytes object from [`new_bytes`]: raw pointers, not `&mut [u8]`,
/// because the memory is uninitialised until written.
pub(crate) struct Filler {
    ptr: *mut u8,
    len: usize,
    pos: usize,
}

// SAFETY: the target is a bytes object no other code can see yet; filling it from a thread
// that runs without the GIL is sound.
unsafe impl Send for Filler {}
// SAFETY: nothing is read or written through the pointer from `&self`; the shared methods
// read only the plain `len` / `pos` fields. (Needed because the frame decoder, a pyclass and
// so `Sync`, keeps the filler of its pending payload.)
unsafe impl Sync for Filler {}

impl Filler {
    /// Appends `src`, with streaming stores from [`STREAM_COPY`] up: for results that are
    /// kept rather than read back at once (a client body, R3 text). Panics (an internal bug,
    /// never input-dependent: callers size the object from the data they write) rather than
    /// write past the end.
    pub(crate) fn put(&mut self, src: &[u8]) {
        self.copy(src, src.len() >= STREAM_COPY);
    }

    /// Appends `src` through the caches, whatever its size: for results read back at once
    /// (a frame goes to the socket next, a payload to the parser). The allocator usually
    /// hands back memory that is still cached, and streaming stores past it made the frame
    /// codec's 1 MiB and 4 MiB envelope encodes 1.25x and 1.5x slower (at 16 MiB, 2x faster:
    /// a candidate for tuning `STREAM_COPY` per size, measured for every caller at once).
    pub(crate) fn put_cached(&mut self, src: &[u8]) {
        self.copy(src, false);
    }

    fn copy(&mut self, src: &[u8], streaming: bool) {
        assert!(src.len() <= self.len - self.pos, "Filler overflow");
        // SAFETY: bounds checked above; the target is new, so the ranges never overlap.
        unsafe {
            let dst = self.ptr.add(self.pos);
            if streaming {
                stream_copy(dst, src);
            } else {
                std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
            }
        }
        self.pos += src.len();
    }

    /// The size of the object being filled.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes written so far.
    pub(crate) fn written(&self) -> usize {
        self.pos
    }

    /// Bytes still to write.
    pub(crate) fn remaining(&self) -> usize {
        self.len - self.pos
    }

    pub(crate) fn is_full(&self) -> bool {
        self.pos == self.len
    }

    /// Takes the page faults of what is left to fill now, without writing all of it: one
    /// zero byte per 4 KiB page. Memory the allocator hands back warm costs next to nothing
    /// here, where zeroing it all costs a pass over it (a fifth of an R3 turn's CPU).
    pub(crate) fn prefault_rest(&mut self) {
        let mut at = self.pos;
        while at < self.len {
            // SAFETY: `at` lies in `pos..len`, inside the new bytes object this filler writes;
            // a volatile write so the touch is not optimised away.
            unsafe { std::ptr::write_volatile(self.ptr.add(at), 0) };
            at += PAGE;
        }
    }

    /// Moves the cursor to `pos` (bytes before it were written by someone else, e.g. a
    /// socket through a buffer view). Panics past the end (an internal bug).
    pub(crate) fn skip_to(&mut self, pos: usize) {
        assert!(pos <= self.len, "Filler overflow");
        self.pos = pos;
    }

    /// Zeroes what is left to fill (and so takes its page faults now).
    pub(crate) fn zero_rest(&mut self) {
        // SAFETY: `pos..len` lies inside the new bytes object this filler writes.
        unsafe { std::ptr::write_bytes(self.ptr.add(self.pos), 0, self.len - self.pos) };
        self.pos = self.len;
    }
}

/// The page size the pre-fault steps by (the smallest on x86_64 and aarch64 Linux).
const PAGE: usize = 4096;

/// Copies at least this large bypass the caches: the target is not read back soon (it is
/// handed to Python), and streaming stores skip reading each target line before writing it.
const STREAM_COPY: usize = 1 << 20;

/// `copy_nonoverlapping` with non-temporal stores (SSE2) on x86_64.
///
/// # Safety
/// `dst` must be valid for `src.len()` bytes of writes and must not overlap `src`.
unsafe fn stream_copy(dst: *mut u8, src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        let len = src.len();
        // Bytes up to the first 16-byte aligned target address.
        let head = (16 - (dst as usize & 15)) & 15;
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst, head);
        let mut i = head;
        while i + 64 <= len {
            let s = src.as_ptr().add(i) as *const __m128i;
            let d = dst.add(i) as *mut __m128i;
            let a = _mm_loadu_si128(s);
            let b = _mm_loadu_si128(s.add(1));
            let c = _mm_loadu_si128(s.add(2));
            let e = _mm_loadu_si128(s.add(3));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
            i += 64;
        }
        _mm_sfence();
        std::ptr::copy_nonoverlapping(src.as_ptr().add(i), dst.add(i), len - i);
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
}

/// Outputs at least this large ask for transparent huge pages before they are written.
const HUGE_PAGE_ADVICE: usize = 4 << 20;

/// Asks Linux to back the (not yet touched) buffer with transparent huge pages: a fresh
/// 128 MiB buffer otherwise takes 32,768 page faults on first write, which cost more than
/// the JSON scan itself, and a gateway worker's CPU per 16 MiB-R3 turn (its `BytesSink`)
/// was 15-16 ms with the advice vs 29-35 ms without (see docs/performance.md). A VM whose
/// host takes back free memory can hand out cold huge pages right after an idle spell
/// (35-52 ms per 22 MiB then); measured over whole runs, the advice still wins. Advisory
/// only: contents are unaffected and failures are ignored.
fn advise_huge_pages(ptr: *mut u8, len: usize) {
    #[cfg(target_os = "linux")]
    if len >= HUGE_PAGE_ADVICE {
        const PAGE: usize = 4096;
        const MADV_HUGEPAGE: std::ffi::c_int = 14;
        extern "C" {
            fn madvise(
                addr: *mut std::ffi::c_void,
                len: usize,
                advice: std::ffi::c_int,
            ) -> std::ffi::c_int;
        }
        let start = (ptr as usize).next_multiple_of(PAGE);
        let end = (ptr as usize + len) / PAGE * PAGE;
        if end > start {
            // SAFETY: the range lies inside the buffer just allocated for us; MADV_HUGEPAGE
            // only changes how the kernel backs those pages.
            unsafe { madvise(start as *mut std::ffi::c_void, end - start, MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len, HUGE_PAGE_ADVICE);
}
