//! R3 decode: the base64 text of `routed_experts` (little-endian int32, docs/relay.md
//! "`decode_r3`") to a typed array, without a Python list in between.
//!
//! `decode_r3(data, *, layers, topk)` returns a read-only `memoryview` of format `'i'` and
//! shape `(n_tokens, layers, topk)` over a new bytes object (one-dimensional and empty when
//! there is no data: CPython cannot cast to a shape containing 0). Values are converted to
//! native order, so the view reads correctly on any host. The pure-Python twin
//! (`decode_r3` in `_py_relay.py`) gives identical views and errors.
//!
//! Base64 rules (both twins): the standard alphabet, length a multiple of 4, at most two
//! `=` and only at the end; no whitespace or other characters. Bits past the last byte are
//! ignored.

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyMemoryView, PyString, PyTuple};

use crate::buffer::{new_bytes, Filler, Input};
use crate::gil::maybe_unlocked;
use crate::types::{int_arg, IntArg};

/// Largest accepted `layers` / `topk`.
pub const MAX_DIM: u64 = 1 << 20;

const INVALID: u8 = 0xff;

const fn decode_table() -> [u8; 256] {
    let mut table = [INVALID; 256];
    let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut i = 0;
    while i < 64 {
        table[alphabet[i] as usize] = i as u8;
        i += 1;
    }
    table
}

static DECODE: [u8; 256] = decode_table();

/// Number of '=' at the end of `s`.
fn trailing_pad(s: &[u8]) -> usize {
    s.iter().rev().take_while(|&&c| c == b'=').count()
}

/// Why `s` is not valid base64 under the rules above, or None if it is.
pub fn b64_problem(s: &[u8]) -> Option<String> {
    let n = s.len();
    let pad = trailing_pad(s);
    if let Some(i) = s[..n - pad]
        .iter()
        .position(|&c| DECODE[usize::from(c)] == INVALID)
    {
        return Some(if s[i] == b'=' {
            format!("'=' at offset {i} is not at the end")
        } else {
            format!("character at offset {i} is not in the base64 alphabet")
        });
    }
    if pad > 2 {
        return Some(format!("{pad} '=' at the end (at most 2)"));
    }
    if !n.is_multiple_of(4) {
        return Some(format!("length {n} is not a multiple of 4"));
    }
    None
}

/// Decoded size of text that passed the length and padding checks.
fn decoded_len(n: usize, pad: usize) -> usize {
    n / 4 * 3 - pad.min(2)
}

/// Decodes `s` (length a multiple of 4, ending in `pad` <= 2 '=') into `out` (exactly
/// `decoded_len(s.len(), pad)` bytes), converting each int32 to native order. False if a
/// character is outside the alphabet.
fn decode_into(s: &[u8], pad: usize, out: &mut Filler) -> bool {
    let body = &s[..s.len() - pad];
    let full = body.len() / 4 * 4;
    // Decode through a small buffer that stays in L1 (3072 bytes = whole int32 values).
    let mut buf = [0u8; 3072];
    let mut w = 0;
    let mut bad = 0u8;
    for quad in body[..full].chunks_exact(4) {
        let a = DECODE[usize::from(quad[0])];
        let b = DECODE[usize::from(quad[1])];
        let c = DECODE[usize::from(quad[2])];
        let d = DECODE[usize::from(quad[3])];
        bad |= a | b | c | d;
        let v = (u32::from(a) << 18) | (u32::from(b) << 12) | (u32::from(c) << 6) | u32::from(d);
        buf[w] = (v >> 16) as u8;
        buf[w + 1] = (v >> 8) as u8;
        buf[w + 2] = v as u8;
        w += 3;
        if w == buf.len() {
            if bad & 0x80 != 0 {
                return false;
            }
            to_native(&mut buf[..w]);
            out.put(&buf[..w]);
            w = 0;
        }
    }
    let rest = &body[full..];
    if !rest.is_empty() {
        // 2 or 3 characters (the padding guarantees it): 1 or 2 more bytes.
        let mut v = 0u32;
        for (k, &c) in rest.iter().enumerate() {
            let x = DECODE[usize::from(c)];
            bad |= x;
            v |= u32::from(x) << (18 - 6 * k);
        }
        buf[w] = (v >> 16) as u8;
        w += 1;
        if rest.len() == 3 {
            buf[w] = (v >> 8) as u8;
            w += 1;
        }
    }
    if bad & 0x80 != 0 {
        return false;
    }
    to_native(&mut buf[..w]);
    out.put(&buf[..w]);
    true
}

/// Little-endian int32 to native order (a no-op on little-endian hosts).
#[inline]
fn to_native(_buf: &mut [u8]) {
    #[cfg(target_endian = "big")]
    for word in _buf.chunks_exact_mut(4) {
        word.reverse();
    }
}

fn dim_arg(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<u64> {
    let bad = |got: String| {
        PyValueError::new_err(format!(
            "decode_r3() argument '{arg}' must be in 1..{MAX_DIM}, got {got}"
        ))
    };
    match int_arg(obj, "decode_r3", arg)? {
        IntArg::Value(v) if (1..=MAX_DIM).contains(&v) => Ok(v),
        IntArg::Value(v) => Err(bad(v.to_string())),
        IntArg::OutOfRange { text, .. } => Err(bad(text)),
    }
}

fn not_base64(problem: &str) -> PyErr {
    PyValueError::new_err(format!("R3 data is not valid base64: {problem}"))
}

/// The base64 text of `routed_experts` as an int32 memoryview `(n_tokens, layers, topk)`.
#[pyfunction]
#[pyo3(signature = (data, *, layers, topk))]
fn decode_r3<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
    layers: &Bound<'py, PyAny>,
    topk: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    // The text: a str (its UTF-8, or "surrogatepass" bytes: offsets of the first bad
    // character agree with str indices either way, since everything before it is ASCII),
    // or any C-contiguous bytes-like object.
    let text_owner: Bound<'py, PyAny>;
    let input;
    let text: &[u8] = if let Ok(s) = data.downcast::<PyString>() {
        match s.to_str() {
            Ok(t) => t.as_bytes(),
            Err(_) => {
                text_owner = s.call_method1(intern!(py, "encode"), ("utf-8", "surrogatepass"))?;
                text_owner.downcast::<PyBytes>()?.as_bytes()
            }
        }
    } else {
        input = Input::get_as(data, "decode_r3", "data", "str or a bytes-like object")?;
        input.as_slice()
    };
    let layers = dim_arg(layers, "layers")?;
    let topk = dim_arg(topk, "topk")?;
    let row = 4 * layers * topk;

    let n = text.len();
    let pad = trailing_pad(text);
    if pad > 2 || !n.is_multiple_of(4) {
        let problem = b64_problem(text).unwrap_or_default();
        return Err(not_base64(&problem));
    }
    let size = decoded_len(n, pad);
    if !(size as u64).is_multiple_of(row) {
        if let Some(problem) = b64_problem(text) {
            return Err(not_base64(&problem));
        }
        return Err(PyValueError::new_err(format!(
            "R3 data decodes to {size} bytes, not a multiple of 4*layers*topk = \
             4*{layers}*{topk} = {row} bytes"
        )));
    }
    let (bytes, mut fill) = new_bytes(py, size)?;
    let ok = maybe_unlocked(py, n, || decode_into(text, pad, &mut fill));
    if !ok {
        let problem = b64_problem(text).unwrap_or_default();
        return Err(not_base64(&problem));
    }
    let view = PyMemoryView::from(bytes.as_any())?;
    let tokens = size as u64 / row;
    if tokens == 0 {
        return view.call_method1(intern!(py, "cast"), ("i",));
    }
    let shape = PyTuple::new(py, [tokens, layers, topk])?;
    view.call_method1(intern!(py, "cast"), ("i", shape))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(decode_r3, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems() {
        assert_eq!(b64_problem(b""), None);
        assert_eq!(b64_problem(b"QUJD"), None);
        assert_eq!(b64_problem(b"QQ=="), None);
        assert_eq!(
            b64_problem(b"QQ=A").as_deref(),
            Some("'=' at offset 2 is not at the end")
        );
        assert_eq!(
            b64_problem(b"QU\nD").as_deref(),
            Some("character at offset 2 is not in the base64 alphabet")
        );
        assert_eq!(
            b64_problem(b"Q===").as_deref(),
            Some("3 '=' at the end (at most 2)")
        );
        assert_eq!(
            b64_problem(b"QUJDR").as_deref(),
            Some("length 5 is not a multiple of 4")
        );
    }
}
