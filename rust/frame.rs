//! IPC frame codec and request/reply envelope (docs/ipc.md "Frame layout" and "Envelope").
//!
//! ```text
//! frame    = u64 BE length (9 + payload) | u64 BE request_id | u8 type | payload
//! envelope = u64 BE meta_len | compact JSON meta | raw body
//! ```
//!
//! Every function matches the pure-Python twin (`python/sessiongate/primitives/_py_frame.py`)
//! in results, exception classes and messages (the shared classes: `rust/error.rs`).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyMemoryView, PySlice, PyString, PyTuple};
use pyo3::{ffi, intern};

use crate::buffer::{new_bytes, Filler, Input};
use crate::error::SharedError;
use crate::gil::maybe_unlocked;
use crate::json_scan::{read_py, ReadFail, Reject, TOO_DEEP};
use crate::json_write::write_py_dict;
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
// Envelope: the JSON meta written from and read into Python objects (`json_write.rs`,
// `json_scan.rs`)

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
    let mut json = Vec::with_capacity(256);
    write_py_dict(&mut json, dict, MAX_JSON_DEPTH)?;
    let body = src.as_ref().map_or(&[][..], Input::as_slice);
    let (out, mut fill) = new_bytes(py, 8 + json.len() + body.len())?;
    fill.put_cached(&(json.len() as u64).to_be_bytes());
    fill.put_cached(&json);
    put_copy(py, &mut fill, body);
    debug_assert!(fill.is_full());
    Ok(out)
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
    let meta = match read_py(py, text, MAX_JSON_DEPTH) {
        Ok(meta) => meta,
        Err(ReadFail::Reject(Reject { at, why })) => {
            let why = if why == TOO_DEEP {
                "nesting deeper than 1000 levels"
            } else {
                why
            };
            return Err(SharedError::Frame.new_err(
                py,
                format!(
                    "envelope meta at offset {} is not valid JSON: {why}",
                    8 + at
                ),
            ));
        }
        Err(ReadFail::Py(err)) => {
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
