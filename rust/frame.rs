//! IPC frame codec and request/reply envelope (docs/ipc.md "Frame layout" and "Envelope").
//!
//! ```text
//! frame    = u64 BE length (9 + payload) | u64 BE request_id | u8 type | payload
//! envelope = u64 BE meta_len | compact JSON meta | raw body
//! ```
//!
//! Every function matches the pure-Python twin (`python/sessiongate/primitives/_py_frame.py`)
//! in results, exception classes and messages (the shared classes: `rust/error.rs`).

use std::fmt::Write as _;

use pyo3::exceptions::{PyRecursionError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{
    PyBytes, PyDict, PyFloat, PyInt, PyList, PyMemoryView, PySlice, PyString, PyTuple,
};
use pyo3::{ffi, intern};

use crate::buffer::{new_bytes, Filler, Input};
use crate::error::SharedError;
use crate::gil::maybe_unlocked;
use crate::json_scan::push_code_point;
use crate::json_write::{write_i64, write_json_str};
use crate::types::{int_arg, type_name, IntArg};

pub const FRAME_REQUEST: u8 = 1;
pub const FRAME_REPLY: u8 = 2;
pub const FRAME_ERROR: u8 = 3;
/// u64 length + u64 request id + u8 type.
pub const FRAME_HEADER_SIZE: usize = 17;
/// The length field counts the request id, the type and the payload.
const LENGTH_OVERHEAD: u64 = 9;
pub const DEFAULT_MAX_FRAME: u64 = 64 << 30;

/// Deepest JSON nesting accepted in envelope meta (CPython's default recursion limit).
const MAX_JSON_DEPTH: usize = 1000;

// ---------------------------------------------------------------------------------------
// Errors

fn too_large(py: Python<'_>, payload_len: u64, limit: u64) -> PyErr {
    SharedError::FrameTooLarge.new_err(
        py,
        format!(
            "frame length {} (9 + {payload_len}-byte payload) exceeds max_frame {limit}",
            u128::from(payload_len) + u128::from(LENGTH_OVERHEAD)
        ),
    )
}

// ---------------------------------------------------------------------------------------
// Arguments

fn u64_arg(obj: &Bound<'_, PyAny>, func: &str, arg: &str, hi: u64) -> PyResult<u64> {
    match int_arg(obj, func, arg)? {
        IntArg::Value(v) if v <= hi => Ok(v),
        IntArg::Value(v) => Err(range_error(func, arg, hi, &v.to_string())),
        IntArg::OutOfRange { text, .. } => Err(range_error(func, arg, hi, &text)),
    }
}

fn range_error(func: &str, arg: &str, hi: u64, got: &str) -> PyErr {
    PyValueError::new_err(format!(
        "{func}() argument '{arg}' must be in 0..{hi}, got {got}"
    ))
}

/// `max_frame`: None means the default; ints above u64::MAX mean "no cap".
fn max_frame_arg(obj: Option<&Bound<'_, PyAny>>, func: &str) -> PyResult<u64> {
    let Some(obj) = obj else {
        return Ok(DEFAULT_MAX_FRAME);
    };
    if obj.is_none() {
        return Ok(DEFAULT_MAX_FRAME);
    }
    match int_arg(obj, func, "max_frame")? {
        IntArg::Value(v) if v >= LENGTH_OVERHEAD => Ok(v),
        IntArg::Value(v) => Err(min_error(func, &v.to_string())),
        IntArg::OutOfRange {
            negative: true,
            text,
        } => Err(min_error(func, &text)),
        IntArg::OutOfRange {
            negative: false, ..
        } => Ok(u64::MAX),
    }
}

fn min_error(func: &str, got: &str) -> PyErr {
    PyValueError::new_err(format!(
        "{func}() argument 'max_frame' must be >= 9, got {got}"
    ))
}

// ---------------------------------------------------------------------------------------
// Output

/// Appends `src` to `fill` through the caches (a frame is read back at once: sent, or
/// parsed), under the GIL rule of `rust/gil.rs`.
fn put_copy(py: Python<'_>, fill: &mut Filler, src: &[u8]) {
    maybe_unlocked(py, src.len(), || fill.put_cached(src));
}

fn header_bytes(frame_type: u8, request_id: u64, payload_len: u64) -> [u8; FRAME_HEADER_SIZE] {
    let mut head = [0u8; FRAME_HEADER_SIZE];
    head[..8].copy_from_slice(&(payload_len + LENGTH_OVERHEAD).to_be_bytes());
    head[8..16].copy_from_slice(&request_id.to_be_bytes());
    head[16] = frame_type;
    head
}

// ---------------------------------------------------------------------------------------
// Frames

/// The 17 header bytes of a frame whose payload is written separately (vectored write).
#[pyfunction]
#[pyo3(
    signature = (frame_type, request_id, payload_len, *, max_frame=None),
    text_signature = "(frame_type, request_id, payload_len, *, max_frame=DEFAULT_MAX_FRAME)"
)]
fn encode_frame_header<'py>(
    py: Python<'py>,
    frame_type: &Bound<'py, PyAny>,
    request_id: &Bound<'py, PyAny>,
    payload_len: &Bound<'py, PyAny>,
    max_frame: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyBytes>> {
    const FUNC: &str = "encode_frame_header";
    let ftype = u64_arg(frame_type, FUNC, "frame_type", 255)? as u8;
    let rid = u64_arg(request_id, FUNC, "request_id", u64::MAX)?;
    let plen = u64_arg(payload_len, FUNC, "payload_len", u64::MAX)?;
    let limit = max_frame_arg(max_frame, FUNC)?;
    if plen > limit - LENGTH_OVERHEAD {
        return Err(too_large(py, plen, limit));
    }
    Ok(PyBytes::new(py, &header_bytes(ftype, rid, plen)))
}

/// One whole frame as bytes (the payload is copied exactly once).
#[pyfunction]
#[pyo3(
    signature = (frame_type, request_id, payload, *, max_frame=None),
    text_signature = "(frame_type, request_id, payload, *, max_frame=DEFAULT_MAX_FRAME)"
)]
fn encode_frame<'py>(
    py: Python<'py>,
    frame_type: &Bound<'py, PyAny>,
    request_id: &Bound<'py, PyAny>,
    payload: &Bound<'py, PyAny>,
    max_frame: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyBytes>> {
    const FUNC: &str = "encode_frame";
    let ftype = u64_arg(frame_type, FUNC, "frame_type", 255)? as u8;
    let rid = u64_arg(request_id, FUNC, "request_id", u64::MAX)?;
    let src = Input::get(payload, FUNC, "payload")?;
    let limit = max_frame_arg(max_frame, FUNC)?;
    let data = src.as_slice();
    let plen = data.len() as u64;
    if plen > limit - LENGTH_OVERHEAD {
        return Err(too_large(py, plen, limit));
    }
    let (out, mut fill) = new_bytes(py, FRAME_HEADER_SIZE + data.len())?;
    fill.put_cached(&header_bytes(ftype, rid, plen));
    put_copy(py, &mut fill, data);
    debug_assert!(fill.is_full());
    Ok(out)
}

/// The payload of the frame in progress, written straight into its final bytes object.
struct Pending {
    frame_type: u8,
    request_id: u64,
    /// Private to the decoder until `fill` is full; owns the memory `fill` writes.
    payload: Py<PyBytes>,
    fill: Filler,
}

/// Incremental frame decoder: `feed` bytes as they arrive, get back whole frames.
///
/// Each payload byte is copied exactly once: from the fed buffer into the bytes object that
/// is handed out (allocated at its exact size as soon as the header is known).
#[pyclass(module = "sessiongate._core")]
pub struct FrameDecoder {
    max_frame: u64,
    /// Partial header while not inside a payload.
    head: [u8; FRAME_HEADER_SIZE],
    head_len: usize,
    pending: Option<Pending>,
    /// Stream offset of the frame in progress, for error messages.
    offset: u64,
    /// Set by the first decode error; every later `feed` fails.
    error: Option<String>,
}

type Frame<'py> = Bound<'py, PyTuple>;

/// `(type, request_id, payload)`. One PyTuple_Pack call instead of PyTuple_New plus three
/// PyTuple_SetItem calls: the stable ABI has no inline item access, and this runs per frame.
fn frame_tuple<'py>(
    py: Python<'py>,
    frame_type: u8,
    request_id: u64,
    payload: &Bound<'py, PyAny>,
) -> PyResult<Frame<'py>> {
    let frame_type = frame_type.into_pyobject(py)?;
    let request_id = request_id.into_pyobject(py)?;
    // SAFETY: PyTuple_Pack takes borrowed references (it adds its own) and returns a new
    // reference or NULL with an exception set.
    unsafe {
        let tuple = ffi::PyTuple_Pack(
            3,
            frame_type.as_ptr(),
            request_id.as_ptr(),
            payload.as_ptr(),
        );
        Ok(Bound::from_owned_ptr_or_err(py, tuple)?.downcast_into_unchecked())
    }
}

impl FrameDecoder {
    fn fail(&mut self, py: Python<'_>, class: SharedError, msg: String) -> PyErr {
        self.error = Some(msg.clone());
        self.head_len = 0;
        self.pending = None;
        class.new_err(py, msg)
    }

    fn check_length(&mut self, py: Python<'_>, length: u64) -> PyResult<()> {
        if length < LENGTH_OVERHEAD {
            let msg = format!(
                "corrupt frame at stream offset {}: length field {length} is below the \
                 9-byte minimum",
                self.offset
            );
            return Err(self.fail(py, SharedError::FrameCorrupt, msg));
        }
        if length > self.max_frame {
            let msg = format!(
                "frame at stream offset {} has length {length} (9 + {}-byte payload), above \
                 max_frame {}",
                self.offset,
                length - LENGTH_OVERHEAD,
                self.max_frame
            );
            return Err(self.fail(py, SharedError::FrameTooLarge, msg));
        }
        Ok(())
    }

    /// Starts the payload of a frame whose header was just read; `data[*pos..]` is the rest of
    /// the fed buffer. Emits the frame when the payload is all there.
    fn start_payload<'py>(
        &mut self,
        py: Python<'py>,
        head: &[u8; FRAME_HEADER_SIZE],
        data: &[u8],
        pos: &mut usize,
        out: &mut Vec<Frame<'py>>,
    ) -> PyResult<()> {
        let length = u64::from_be_bytes(read8(head, 0));
        let request_id = u64::from_be_bytes(read8(head, 8));
        let frame_type = head[16];
        let plen = length - LENGTH_OVERHEAD;
        let avail = data.len() - *pos;
        if plen <= avail as u64 {
            // plen fits in usize: it is at most `avail`.
            let end = *pos + plen as usize;
            let payload = PyBytes::new(py, &data[*pos..end]);
            *pos = end;
            self.offset += 8 + length;
            out.push(frame_tuple(py, frame_type, request_id, &payload)?);
            return Ok(());
        }
        let len = match usize::try_from(plen) {
            Ok(len) => len,
            Err(_) => {
                let msg = format!(
                    "cannot hold the {plen}-byte payload of the frame at stream offset {}",
                    self.offset
                );
                return Err(self.fail(py, SharedError::FrameTooLarge, msg));
            }
        };
        let (payload, mut fill) = match new_bytes(py, len) {
            Ok(pair) => pair,
            Err(err) => {
                // The header is consumed, so the stream cannot continue without this frame.
                self.fail(
                    py,
                    SharedError::Frame,
                    format!(
                        "could not allocate {len} bytes for the payload of the frame at \
                         stream offset {}",
                        self.offset
                    ),
                );
                return Err(err);
            }
        };
        put_copy(py, &mut fill, &data[*pos..]);
        *pos = data.len();
        self.pending = Some(Pending {
            frame_type,
            request_id,
            payload: payload.unbind(),
            fill,
        });
        Ok(())
    }

    /// Adds fed bytes to the pending payload; emits the frame when it is complete.
    fn fill_pending<'py>(
        &mut self,
        py: Python<'py>,
        data: &[u8],
        pos: &mut usize,
        out: &mut Vec<Frame<'py>>,
    ) -> PyResult<()> {
        let Some(p) = self.pending.as_mut() else {
            return Ok(());
        };
        let take = p.fill.remaining().min(data.len() - *pos);
        put_copy(py, &mut p.fill, &data[*pos..*pos + take]);
        *pos += take;
        if p.fill.is_full() {
            if let Some(done) = self.pending.take() {
                self.offset += FRAME_HEADER_SIZE as u64 + done.fill.len() as u64;
                let payload = done.payload.into_bound(py).into_any();
                out.push(frame_tuple(py, done.frame_type, done.request_id, &payload)?);
            }
        }
        Ok(())
    }
}

fn read8(buf: &[u8], at: usize) -> [u8; 8] {
    let mut word = [0u8; 8];
    word.copy_from_slice(&buf[at..at + 8]);
    word
}

#[pymethods]
impl FrameDecoder {
    #[new]
    #[pyo3(signature = (max_frame=None), text_signature = "(max_frame=DEFAULT_MAX_FRAME)")]
    fn new(max_frame: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        Ok(Self {
            max_frame: max_frame_arg(max_frame, "FrameDecoder")?,
            head: [0u8; FRAME_HEADER_SIZE],
            head_len: 0,
            pending: None,
            offset: 0,
            error: None,
        })
    }

    /// The largest accepted length field (9 + payload length).
    #[getter]
    fn max_frame(&self) -> u64 {
        self.max_frame
    }

    /// Bytes of the incomplete frame held by the decoder (header + payload so far).
    #[getter]
    fn buffered(&self) -> usize {
        match &self.pending {
            Some(p) => FRAME_HEADER_SIZE + p.fill.written(),
            None => self.head_len,
        }
    }

    /// Wire size (8 + length) of the incomplete frame once its length is known.
    #[getter]
    fn pending_frame_size(&self) -> Option<u64> {
        match &self.pending {
            Some(p) => Some(FRAME_HEADER_SIZE as u64 + p.fill.len() as u64),
            None if self.head_len >= 8 => Some(8 + u64::from_be_bytes(read8(&self.head, 0))),
            None => None,
        }
    }

    /// True after a decode error: every later `feed` raises FrameError.
    #[getter]
    fn closed(&self) -> bool {
        self.error.is_some()
    }

    /// Consume `data`; return `(type, request_id, payload)` for each completed frame.
    fn feed<'py>(
        &mut self,
        py: Python<'py>,
        data: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        if let Some(err) = &self.error {
            return Err(SharedError::Frame.new_err(
                py,
                format!("FrameDecoder is closed after an earlier error: {err}"),
            ));
        }
        let src = Input::get(data, "feed", "data")?;
        let data = src.as_slice();
        let mut out: Vec<Frame<'py>> = Vec::new();
        let mut pos = 0usize;
        while pos < data.len() {
            if self.pending.is_some() {
                self.fill_pending(py, data, &mut pos, &mut out)?;
                continue;
            }
            let avail = data.len() - pos;
            if self.head_len == 0 && avail >= FRAME_HEADER_SIZE {
                // Fast path: the whole header is in this buffer.
                let mut head = [0u8; FRAME_HEADER_SIZE];
                head.copy_from_slice(&data[pos..pos + FRAME_HEADER_SIZE]);
                self.check_length(py, u64::from_be_bytes(read8(&head, 0)))?;
                pos += FRAME_HEADER_SIZE;
                self.start_payload(py, &head, data, &mut pos, &mut out)?;
                continue;
            }
            // Header split across feeds: collect it, checking the length once it is known.
            let had = self.head_len;
            let take = (FRAME_HEADER_SIZE - had).min(avail);
            self.head[had..had + take].copy_from_slice(&data[pos..pos + take]);
            self.head_len += take;
            pos += take;
            if had < 8 && self.head_len >= 8 {
                self.check_length(py, u64::from_be_bytes(read8(&self.head, 0)))?;
            }
            if self.head_len == FRAME_HEADER_SIZE {
                self.head_len = 0;
                let head = self.head;
                self.start_payload(py, &head, data, &mut pos, &mut out)?;
            }
        }
        PyList::new(py, out)
    }
}

// ---------------------------------------------------------------------------------------
// Envelope: JSON meta written and read directly from / to Python objects

/// Appends `obj` as compact JSON exactly like
/// `json.dumps(obj, separators=(",", ":"), ensure_ascii=False)` (CPython's C encoder).
struct JsonWriter {
    out: Vec<u8>,
    /// Containers being written, for CPython's "Circular reference detected" check.
    path: Vec<*mut ffi::PyObject>,
}

impl JsonWriter {
    fn value(&mut self, obj: &Bound<'_, PyAny>) -> PyResult<()> {
        let ptr = obj.as_ptr();
        // Same order of checks as the C encoder: None, True, False, str, int, float, ...
        if obj.is_none() {
            self.out.extend_from_slice(b"null");
        } else if ptr == unsafe { ffi::Py_True() } {
            self.out.extend_from_slice(b"true");
        } else if ptr == unsafe { ffi::Py_False() } {
            self.out.extend_from_slice(b"false");
        } else if let Ok(s) = obj.downcast::<PyString>() {
            write_json_str(&mut self.out, s.to_str()?);
        } else if obj.is_instance_of::<PyInt>() {
            write_int(&mut self.out, obj)?;
        } else if let Ok(f) = obj.downcast::<PyFloat>() {
            write_float(&mut self.out, f)?;
        } else if let Ok(list) = obj.downcast::<PyList>() {
            self.array(ptr, list.iter())?;
        } else if let Ok(tuple) = obj.downcast::<PyTuple>() {
            self.array(ptr, tuple.iter())?;
        } else if let Ok(dict) = obj.downcast::<PyDict>() {
            self.dict(dict)?;
        } else {
            return Err(PyTypeError::new_err(format!(
                "Object of type {} is not JSON serializable",
                type_name(obj)
            )));
        }
        Ok(())
    }

    fn array<'py>(
        &mut self,
        ptr: *mut ffi::PyObject,
        items: impl Iterator<Item = Bound<'py, PyAny>>,
    ) -> PyResult<()> {
        self.enter(ptr)?;
        self.out.push(b'[');
        for (i, item) in items.enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            self.value(&item)?;
        }
        self.out.push(b']');
        self.path.pop();
        Ok(())
    }

    fn enter(&mut self, ptr: *mut ffi::PyObject) -> PyResult<()> {
        if self.path.contains(&ptr) {
            return Err(PyValueError::new_err("Circular reference detected"));
        }
        if self.path.len() >= MAX_JSON_DEPTH {
            return Err(PyRecursionError::new_err(
                "maximum recursion depth exceeded while encoding a JSON object",
            ));
        }
        self.path.push(ptr);
        Ok(())
    }

    fn dict(&mut self, dict: &Bound<'_, PyDict>) -> PyResult<()> {
        let py = dict.py();
        self.enter(dict.as_ptr())?;
        self.out.push(b'{');
        let mut first = true;
        let mut entry = |w: &mut Self, key: Bound<'_, PyAny>, value: Bound<'_, PyAny>| {
            if !first {
                w.out.push(b',');
            }
            first = false;
            w.key(&key)?;
            w.out.push(b':');
            w.value(&value)
        };
        if dict.is_exact_instance_of::<PyDict>() {
            for (key, value) in dict.iter() {
                entry(self, key, value)?;
            }
        } else {
            // Subclasses go through items(), as the C encoder's PyMapping_Items does.
            for item in dict.call_method0(intern!(py, "items"))?.try_iter()? {
                let (key, value): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item?.extract()?;
                entry(self, key, value)?;
            }
        }
        self.out.push(b'}');
        self.path.pop();
        Ok(())
    }

    fn key(&mut self, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let ptr = key.as_ptr();
        if let Ok(s) = key.downcast::<PyString>() {
            write_json_str(&mut self.out, s.to_str()?);
            return Ok(());
        }
        self.out.push(b'"');
        if let Ok(f) = key.downcast::<PyFloat>() {
            write_float(&mut self.out, f)?;
        } else if ptr == unsafe { ffi::Py_True() } {
            self.out.extend_from_slice(b"true");
        } else if ptr == unsafe { ffi::Py_False() } {
            self.out.extend_from_slice(b"false");
        } else if key.is_none() {
            self.out.extend_from_slice(b"null");
        } else if key.is_instance_of::<PyInt>() {
            write_int(&mut self.out, key)?;
        } else {
            return Err(PyTypeError::new_err(format!(
                "keys must be str, int, float, bool or None, not {}",
                type_name(key)
            )));
        }
        self.out.push(b'"');
        Ok(())
    }
}

/// `int.__repr__(obj)`: decimal digits, ignoring any `__repr__` of an int subclass.
fn write_int(out: &mut Vec<u8>, obj: &Bound<'_, PyAny>) -> PyResult<()> {
    let mut overflow = 0;
    // SAFETY: obj is an int (PyLong_Check passed), so this reads its value directly.
    let v = unsafe { ffi::PyLong_AsLongLongAndOverflow(obj.as_ptr(), &mut overflow) };
    if overflow == 0 {
        if v == -1 {
            if let Some(err) = PyErr::take(obj.py()) {
                return Err(err);
            }
        }
        write_i64(out, v);
        return Ok(());
    }
    let py = obj.py();
    let text = py
        .get_type::<PyInt>()
        .getattr(intern!(py, "__repr__"))?
        .call1((obj,))?;
    out.extend_from_slice(text.downcast::<PyString>()?.to_str()?.as_bytes());
    Ok(())
}

/// `fmt::Write` into a byte vector.
struct StrOut<'a>(&'a mut Vec<u8>);

impl std::fmt::Write for StrOut<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

/// A float as the JSON encoder writes it: `float.__repr__`, or Infinity / -Infinity / NaN.
///
/// Python's repr picks, among the shortest round-tripping digit strings, the one nearest the
/// exact value with ties to even; Rust's shortest formatting breaks such ties differently
/// (562949953421312.25 -> "...312.3" vs Python's "...312.2"). So only integral values, whose
/// repr is plainly the integer plus ".0", are formatted here; the rest ask CPython.
fn write_float(out: &mut Vec<u8>, f: &Bound<'_, PyFloat>) -> PyResult<()> {
    let v = f.value();
    if v.is_nan() {
        out.extend_from_slice(b"NaN");
    } else if v.is_infinite() {
        out.extend_from_slice(if v > 0.0 { b"Infinity" } else { b"-Infinity" });
    } else if v.fract() == 0.0
        && v.abs() < 9_007_199_254_740_992.0
        && !(v == 0.0 && v.is_sign_negative())
    {
        // |v| < 2**53: exactly an i64, and Python prints it as "<int>.0".
        let _ = write!(StrOut(out), "{}.0", v as i64);
    } else {
        // float.__repr__ of an exact float (a subclass's own __repr__ must not be used).
        let exact = PyFloat::new(f.py(), v);
        out.extend_from_slice(exact.repr()?.to_str()?.as_bytes());
    }
    Ok(())
}

/// `u64 BE meta_len | compact JSON meta | body` (the body is copied exactly once).
#[pyfunction]
#[pyo3(signature = (meta, body=None), text_signature = "(meta, body=b'')")]
fn encode_envelope<'py>(
    py: Python<'py>,
    meta: &Bound<'py, PyAny>,
    body: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let dict = meta.downcast::<PyDict>().map_err(|_| {
        PyTypeError::new_err(format!(
            "encode_envelope() argument 'meta' must be dict, not {}",
            type_name(meta)
        ))
    })?;
    let src = match body {
        Some(body) => Some(Input::get(body, "encode_envelope", "body")?),
        None => None,
    };
    let mut writer = JsonWriter {
        out: Vec::with_capacity(256),
        path: Vec::new(),
    };
    writer.dict(dict)?;
    let json = writer.out;
    let body = src.as_ref().map_or(&[][..], Input::as_slice);
    let (out, mut fill) = new_bytes(py, 8 + json.len() + body.len())?;
    fill.put_cached(&(json.len() as u64).to_be_bytes());
    fill.put_cached(&json);
    put_copy(py, &mut fill, body);
    debug_assert!(fill.is_full());
    Ok(out)
}

/// A JSON syntax error at a byte offset of the meta text.
struct JsonSyntax {
    at: usize,
    msg: &'static str,
}

enum JsonFail {
    Syntax(JsonSyntax),
    Py(PyErr),
}

impl From<PyErr> for JsonFail {
    fn from(err: PyErr) -> Self {
        JsonFail::Py(err)
    }
}

impl From<std::convert::Infallible> for JsonFail {
    fn from(never: std::convert::Infallible) -> Self {
        match never {}
    }
}

fn syntax<T>(at: usize, msg: &'static str) -> Result<T, JsonFail> {
    Err(JsonFail::Syntax(JsonSyntax { at, msg }))
}

/// Parses JSON text into Python objects exactly like `json.loads` (CPython's C scanner):
/// same grammar (NaN / Infinity / -Infinity allowed, lone surrogate escapes kept), same
/// object types, duplicate keys keep the last value.
struct JsonReader<'a, 'py> {
    py: Python<'py>,
    s: &'a [u8],
    pos: usize,
    depth: usize,
}

impl<'py> JsonReader<'_, 'py> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn literal(&mut self, word: &[u8]) -> bool {
        if self.s[self.pos..].starts_with(word) {
            self.pos += word.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self) -> Result<Bound<'py, PyAny>, JsonFail> {
        let py = self.py;
        let Some(c) = self.peek() else {
            return syntax(self.pos, "Expecting value");
        };
        match c {
            b'"' => Ok(self.string()?.into_any()),
            b'{' => self.object(),
            b'[' => self.array(),
            b'n' if self.literal(b"null") => Ok(py.None().into_bound(py)),
            b't' if self.literal(b"true") => Ok(true.into_pyobject(py)?.to_owned().into_any()),
            b'f' if self.literal(b"false") => Ok(false.into_pyobject(py)?.to_owned().into_any()),
            b'N' if self.literal(b"NaN") => Ok(PyFloat::new(py, f64::NAN).into_any()),
            b'I' if self.literal(b"Infinity") => Ok(PyFloat::new(py, f64::INFINITY).into_any()),
            b'-' if self.literal(b"-Infinity") => {
                Ok(PyFloat::new(py, f64::NEG_INFINITY).into_any())
            }
            _ => self.number(),
        }
    }

    fn nest(&mut self) -> Result<(), JsonFail> {
        self.depth += 1;
        if self.depth > MAX_JSON_DEPTH {
            return syntax(self.pos, "nesting deeper than 1000 levels");
        }
        Ok(())
    }

    fn object(&mut self) -> Result<Bound<'py, PyAny>, JsonFail> {
        self.nest()?;
        self.pos += 1;
        self.skip_ws();
        let dict = PyDict::new(self.py);
        if self.peek() == Some(b'}') {
            self.pos += 1;
            self.depth -= 1;
            return Ok(dict.into_any());
        }
        loop {
            if self.peek() != Some(b'"') {
                return syntax(
                    self.pos,
                    "Expecting property name enclosed in double quotes",
                );
            }
            let key = self.string()?;
            self.skip_ws();
            if self.peek() != Some(b':') {
                return syntax(self.pos, "Expecting ':' delimiter");
            }
            self.pos += 1;
            self.skip_ws();
            let value = self.value()?;
            dict.set_item(key, value)?;
            self.skip_ws();
            match self.peek() {
                Some(b'}') => break,
                Some(b',') => self.pos += 1,
                _ => return syntax(self.pos, "Expecting ',' delimiter"),
            }
            self.skip_ws();
        }
        self.pos += 1;
        self.depth -= 1;
        Ok(dict.into_any())
    }

    fn array(&mut self) -> Result<Bound<'py, PyAny>, JsonFail> {
        self.nest()?;
        self.pos += 1;
        self.skip_ws();
        let mut items: Vec<Bound<'py, PyAny>> = Vec::new();
        if self.peek() == Some(b']') {
            self.pos += 1;
        } else {
            loop {
                items.push(self.value()?);
                self.skip_ws();
                match self.peek() {
                    Some(b']') => break,
                    Some(b',') => self.pos += 1,
                    _ => return syntax(self.pos, "Expecting ',' delimiter"),
                }
                self.skip_ws();
            }
            self.pos += 1;
        }
        self.depth -= 1;
        Ok(PyList::new(self.py, items)?.into_any())
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
        self.pos - start
    }

    fn number(&mut self) -> Result<Bound<'py, PyAny>, JsonFail> {
        let py = self.py;
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.peek() {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return syntax(start, "Expecting value"),
        }
        let mut is_float = false;
        if self.peek() == Some(b'.') && matches!(self.s.get(self.pos + 1), Some(b'0'..=b'9')) {
            self.pos += 1;
            self.digits();
            is_float = true;
        }
        if let Some(b'e' | b'E') = self.peek() {
            // An exponent needs at least one digit; otherwise the number ends before the 'e'.
            let mark = self.pos;
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            if self.digits() > 0 {
                is_float = true;
            } else {
                self.pos = mark;
            }
        }
        // The scanned text is ASCII by construction.
        let text = std::str::from_utf8(&self.s[start..self.pos]).unwrap_or("");
        if is_float {
            let v: f64 = text.parse().unwrap_or(f64::NAN);
            return Ok(PyFloat::new(py, v).into_any());
        }
        if let Ok(v) = text.parse::<i64>() {
            return Ok(v.into_pyobject(py)?.into_any());
        }
        // Beyond i64: let int() build it (and apply CPython's digit limit like json does).
        Ok(py.get_type::<PyInt>().call1((text,))?)
    }

    fn hex4(&self, at: usize) -> Option<u32> {
        let quad = self.s.get(at..at + 4)?;
        let mut v = 0u32;
        for &c in quad {
            v = (v << 4) | char::from(c).to_digit(16)?;
        }
        Some(v)
    }

    fn string(&mut self) -> Result<Bound<'py, PyString>, JsonFail> {
        let begin = self.pos;
        let start = self.pos + 1;
        let mut i = start;
        // Fast path: no escapes.
        loop {
            match self.s.get(i) {
                None => return syntax(begin, "Unterminated string starting at"),
                Some(b'"') => {
                    self.pos = i + 1;
                    // The meta was validated as UTF-8 and quotes are ASCII boundaries.
                    let text = std::str::from_utf8(&self.s[start..i]).unwrap_or("");
                    return Ok(PyString::new(self.py, text));
                }
                Some(b'\\') => break,
                Some(0..=0x1f) => return syntax(i, "Invalid control character at"),
                Some(_) => i += 1,
            }
        }
        let mut buf: Vec<u8> = self.s[start..i].to_vec();
        let mut lone_surrogate = false;
        loop {
            match self.s.get(i) {
                None => return syntax(begin, "Unterminated string starting at"),
                Some(b'"') => break,
                Some(b'\\') => {
                    let Some(&esc) = self.s.get(i + 1) else {
                        return syntax(begin, "Unterminated string starting at");
                    };
                    let simple = match esc {
                        b'"' => b'"',
                        b'\\' => b'\\',
                        b'/' => b'/',
                        b'b' => 0x08,
                        b'f' => 0x0c,
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        b'u' => 0,
                        _ => return syntax(i, "Invalid \\escape"),
                    };
                    if esc != b'u' {
                        buf.push(simple);
                        i += 2;
                        continue;
                    }
                    let Some(mut cp) = self.hex4(i + 2) else {
                        return syntax(i, "Invalid \\uXXXX escape");
                    };
                    i += 6;
                    if (0xd800..=0xdbff).contains(&cp)
                        && self.s.get(i) == Some(&b'\\')
                        && self.s.get(i + 1) == Some(&b'u')
                    {
                        let Some(low) = self.hex4(i + 2) else {
                            return syntax(i, "Invalid \\uXXXX escape");
                        };
                        if (0xdc00..=0xdfff).contains(&low) {
                            cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
                            i += 6;
                        }
                    }
                    push_code_point(&mut buf, cp);
                    lone_surrogate |= (0xd800..=0xdfff).contains(&cp);
                }
                Some(0..=0x1f) => return syntax(i, "Invalid control character at"),
                Some(&c) => {
                    buf.push(c);
                    i += 1;
                }
            }
        }
        self.pos = i + 1;
        if !lone_surrogate {
            let text = std::str::from_utf8(&buf).unwrap_or("");
            return Ok(PyString::new(self.py, text));
        }
        // Python strs may hold lone surrogates: decode the generalised UTF-8 with
        // "surrogatepass", which maps the 3-byte surrogate forms back to code points.
        // SAFETY: buf outlives the call; the result is a new reference or NULL + exception.
        let obj = unsafe {
            Bound::from_owned_ptr_or_err(
                self.py,
                ffi::PyUnicode_DecodeUTF8(
                    buf.as_ptr().cast(),
                    buf.len() as ffi::Py_ssize_t,
                    c"surrogatepass".as_ptr(),
                ),
            )
        }?;
        Ok(obj.downcast_into::<PyString>().map_err(PyErr::from)?)
    }
}

fn json_kind(obj: &Bound<'_, PyAny>) -> &'static str {
    if obj.is_none() {
        "null"
    } else if obj.is_instance_of::<pyo3::types::PyBool>() {
        "boolean"
    } else if obj.is_instance_of::<PyString>() {
        "string"
    } else if obj.is_instance_of::<PyList>() {
        "array"
    } else {
        "number"
    }
}

/// Why `std::str::from_utf8` stopped, in the words of Python's UTF-8 decoder.
fn utf8_reason(err: &std::str::Utf8Error, rest: &[u8]) -> &'static str {
    match err.error_len() {
        None => "unexpected end of data",
        Some(_)
            if rest
                .first()
                .is_some_and(|b| (0x80..0xc2).contains(b) || *b > 0xf4) =>
        {
            "invalid start byte"
        }
        Some(_) => "invalid continuation byte",
    }
}

/// Splits an envelope into its meta dict and a zero-copy memoryview of the body.
#[pyfunction]
fn decode_envelope<'py>(
    py: Python<'py>,
    payload: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyAny>)> {
    let src = Input::get(payload, "decode_envelope", "payload")?;
    let data = src.as_slice();
    let size = data.len();
    if size < 8 {
        return Err(SharedError::Frame.new_err(
            py,
            format!("envelope truncated at offset 0: need 8 bytes for meta_len, got {size}"),
        ));
    }
    let meta_len = u64::from_be_bytes(read8(data, 0));
    if meta_len > (size - 8) as u64 {
        return Err(SharedError::Frame.new_err(
            py,
            format!(
                "envelope truncated at offset 8: meta_len {meta_len} runs past the end of the \
                 {size}-byte payload"
            ),
        ));
    }
    let end = 8 + meta_len as usize;
    let text = &data[8..end];
    if let Err(err) = std::str::from_utf8(text) {
        let at = err.valid_up_to();
        return Err(SharedError::Frame.new_err(
            py,
            format!(
                "envelope meta at offset {} is not valid UTF-8: {}",
                8 + at,
                utf8_reason(&err, &text[at..])
            ),
        ));
    }
    let mut reader = JsonReader {
        py,
        s: text,
        pos: 0,
        depth: 0,
    };
    reader.skip_ws();
    let parsed = reader.value().and_then(|v| {
        reader.skip_ws();
        if reader.pos == text.len() {
            Ok(v)
        } else {
            syntax(reader.pos, "Extra data")
        }
    });
    let meta = match parsed {
        Ok(meta) => meta,
        Err(JsonFail::Syntax(JsonSyntax { at, msg })) => {
            return Err(SharedError::Frame.new_err(
                py,
                format!(
                    "envelope meta at offset {} is not valid JSON: {msg}",
                    8 + at
                ),
            ));
        }
        Err(JsonFail::Py(err)) => {
            // int() digit limit and the like: the text is not usable JSON for us either.
            return Err(SharedError::Frame.new_err(
                py,
                format!("envelope meta at offset 8 is not valid JSON: {err}"),
            ));
        }
    };
    let meta = match meta.downcast_into::<PyDict>() {
        Ok(dict) => dict,
        Err(err) => {
            let kind = json_kind(err.into_inner().as_any());
            return Err(SharedError::Frame.new_err(
                py,
                format!("envelope meta at offset 8 must be a JSON object, got {kind}"),
            ));
        }
    };
    let base = if src.flat {
        PyMemoryView::from(&src.obj)?.into_any()
    } else {
        PyMemoryView::from(&src.obj)?.call_method1(intern!(py, "cast"), ("B",))?
    };
    let body = base.get_item(PySlice::new(py, end as isize, size as isize, 1))?;
    Ok((meta, body))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("FRAME_REQUEST", FRAME_REQUEST)?;
    m.add("FRAME_REPLY", FRAME_REPLY)?;
    m.add("FRAME_ERROR", FRAME_ERROR)?;
    m.add("FRAME_HEADER_SIZE", FRAME_HEADER_SIZE)?;
    m.add("DEFAULT_MAX_FRAME", DEFAULT_MAX_FRAME)?;
    m.add_class::<FrameDecoder>()?;
    m.add_function(wrap_pyfunction!(encode_frame, m)?)?;
    m.add_function(wrap_pyfunction!(encode_frame_header, m)?)?;
    m.add_function(wrap_pyfunction!(encode_envelope, m)?)?;
    m.add_function(wrap_pyfunction!(decode_envelope, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_layout() {
        let head = header_bytes(FRAME_REPLY, 7, 3);
        assert_eq!(&head[..8], &12u64.to_be_bytes());
        assert_eq!(&head[8..16], &7u64.to_be_bytes());
        assert_eq!(head[16], FRAME_REPLY);
    }
}
