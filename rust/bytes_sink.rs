//! `BytesSink`: a `bytes` object of known size, filled in place through a writable
//! memoryview and then handed out as an ordinary, immutable `bytes`.
//!
//! Why: a reply body of known length (Content-Length) can then be received straight into the
//! object that the records keep (`socket.recv_into`), with the kernel's copy the only one.
//! A `bytearray` would do the receiving, but it is mutable, so everything that keeps a view of
//! it (the R3 span of a record) would have to copy it first; turning it into `bytes` is a copy
//! too. The bytes object stays private to the sink until `finish`, so no Python code can
//! observe it changing: the same pattern CPython uses for `os.read` and friends.

use std::ffi::c_void;
use std::os::raw::c_int;

use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::buffer::{new_bytes, Filler};
use crate::gil::maybe_unlocked;

const SPENT: &str = "BytesSink.finish(filled) was already called: the sink is spent";
const OPEN_VIEWS: &str =
    "BytesSink.finish(filled): views of the sink are still open; release them first";

/// A `bytes` of `size` bytes, writable through `view()` until `finish(filled)`, which zeroes
/// whatever lies past the `filled` bytes the caller wrote.
#[pyclass(module = "sessiongate._core")]
pub struct BytesSink {
    /// None once `finish` has handed the object out.
    bytes: Option<Py<PyBytes>>,
    /// The write cursor of `bytes` (for the pre-fault and the zeroed tail).
    fill: Filler,
    size: usize,
    /// Buffer views currently exported (memoryviews over the sink).
    exports: usize,
}

#[pymethods]
impl BytesSink {
    #[new]
    fn new(py: Python<'_>, size: isize) -> PyResult<Self> {
        let len = usize::try_from(size).map_err(|_| {
            PyValueError::new_err(format!("BytesSink size must be >= 0, not {size}"))
        })?;
        // A new bytes object (huge-page backed when large: buffer::new_bytes). Its page
        // faults (most of the cost of fresh memory) are taken now, with the GIL released, so
        // a caller can pay them in a thread rather than in the receive on its event loop. It
        // is not zeroed here: the socket writes every byte of a complete body, and zeroing
        // warm memory first was a fifth of an R3 turn's CPU. `finish` zeroes what the caller
        // did not fill, so no stale heap bytes are ever handed out.
        let (bytes, mut fill) = new_bytes(py, len)?;
        maybe_unlocked(py, len, || fill.prefault_rest());
        Ok(Self {
            bytes: Some(bytes.unbind()),
            fill,
            size: len,
            exports: 0,
        })
    }

    /// A writable memoryview of the whole sink (release it before `finish`).
    fn view<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        // SAFETY: `slf` is a valid object implementing the buffer protocol below.
        unsafe { Bound::from_owned_ptr_or_err(py, ffi::PyMemoryView_FromObject(slf.as_ptr())) }
    }

    /// The `bytes`, its first `filled` bytes as written through views and the rest zero;
    /// the sink is spent afterwards.
    fn finish<'py>(&mut self, py: Python<'py>, filled: isize) -> PyResult<Bound<'py, PyBytes>> {
        if self.bytes.is_none() {
            return Err(PyBufferError::new_err(SPENT));
        }
        let filled = usize::try_from(filled)
            .ok()
            .filter(|&n| n <= self.size)
            .ok_or_else(|| PyValueError::new_err(bad_filled(filled, self.size)))?;
        if self.exports > 0 {
            return Err(PyBufferError::new_err(OPEN_VIEWS));
        }
        let fill = &mut self.fill;
        fill.skip_to(filled);
        maybe_unlocked(py, self.size - filled, || fill.zero_rest());
        match self.bytes.take() {
            Some(bytes) => Ok(bytes.into_bound(py)),
            None => Err(PyBufferError::new_err(SPENT)),
        }
    }

    fn __len__(&self) -> usize {
        self.size
    }

    fn __repr__(&self) -> String {
        let state = if self.bytes.is_some() {
            "open"
        } else {
            "spent"
        };
        format!("BytesSink(size={}, {state})", self.size)
    }

    /// # Safety
    /// Called by CPython with a valid `view` to fill (the buffer protocol's contract).
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let py = slf.py();
        let mut this = slf.borrow_mut();
        let Some(bytes) = this.bytes.as_ref() else {
            return Err(PyBufferError::new_err(SPENT));
        };
        // The object is private to the sink until `finish` (see the module comment), so
        // writing into its storage never changes a `bytes` that Python code can see.
        let data = ffi::PyBytes_AsString(bytes.as_ptr());
        if data.is_null() {
            return Err(PyErr::fetch(py));
        }
        let len = isize::try_from(this.size)
            .map_err(|_| PyBufferError::new_err("BytesSink is too large for a buffer view"))?;
        if ffi::PyBuffer_FillInfo(view, slf.as_ptr(), data.cast::<c_void>(), len, 0, flags) != 0 {
            return Err(PyErr::fetch(py));
        }
        this.exports += 1;
        Ok(())
    }

    /// # Safety
    /// Called by CPython once per successful `__getbuffer__`.
    unsafe fn __releasebuffer__(slf: Bound<'_, Self>, _view: *mut ffi::Py_buffer) {
        let mut this = slf.borrow_mut();
        this.exports = this.exports.saturating_sub(1);
    }
}

fn bad_filled(filled: isize, size: usize) -> String {
    format!("BytesSink.finish(filled): filled must be between 0 and {size}, not {filled}")
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<BytesSink>()?;
    Ok(())
}
