//! Bytes-like arguments: a read-only view of any C-contiguous buffer, shared by every
//! primitive that takes bytes (frames, envelopes, the JSON relay, R3, stamping).

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyMemoryView};

use crate::shard::type_name;

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

pub(crate) fn not_contiguous(func: &str, arg: &str) -> PyErr {
    PyTypeError::new_err(format!(
        "{func}() argument '{arg}' must be a C-contiguous bytes-like object"
    ))
}
