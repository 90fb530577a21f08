//! JSON text writers shared by the primitives that write JSON into bytes: the envelope meta
//! (`rust/frame.rs`, [`write_py_dict`]), the spliced request members (`rust/relay.rs`,
//! `rust/stamp.rs`). Each writes exactly what CPython's `json.dumps(..., separators=(",",
//! ":"), ensure_ascii=False)` writes for the same value, since the twins use `json.dumps`.

use std::fmt::Write as _;

use pyo3::exceptions::{PyRecursionError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use pyo3::{ffi, intern};

use crate::types::type_name;

/// A JSON string literal with CPython's `ensure_ascii=False` escaping: `"` `\` and control
/// characters only; everything else is written as UTF-8.
pub(crate) fn write_json_str(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.reserve(s.len() + 2);
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &c) in bytes.iter().enumerate() {
        let escape: &[u8] = match c {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        if escape.is_empty() {
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(c >> 4)]);
            out.push(HEX[usize::from(c & 0xf)]);
        } else {
            out.extend_from_slice(escape);
        }
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

const DIGIT_PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
2021222324252627282930313233343536373839\
4041424344454647484950515253545556575859\
6061626364656667686970717273747576777879\
8081828384858687888990919293949596979899";

/// The decimal text of `v` (what `int.__repr__` and `json.dumps` write), two digits per
/// step: token-id arrays of tens of thousands of ints go through here.
pub(crate) fn write_i64(out: &mut Vec<u8>, v: i64) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    let mut n = v.unsigned_abs();
    while n >= 100 {
        let d = (n % 100) as usize * 2;
        n /= 100;
        i -= 2;
        buf[i..i + 2].copy_from_slice(&DIGIT_PAIRS[d..d + 2]);
    }
    if n >= 10 {
        let d = n as usize * 2;
        i -= 2;
        buf[i..i + 2].copy_from_slice(&DIGIT_PAIRS[d..d + 2]);
    } else {
        i -= 1;
        buf[i] = b'0' + n as u8;
    }
    if v < 0 {
        out.push(b'-');
    }
    out.extend_from_slice(&buf[i..]);
}

/// Appends `dict` as compact JSON exactly like
/// `json.dumps(dict, separators=(",", ":"), ensure_ascii=False)` (CPython's C encoder), with
/// the encoder's errors: TypeError for what JSON cannot hold, ValueError on a circular
/// reference, RecursionError beyond `max_depth` containers.
pub(crate) fn write_py_dict(
    out: &mut Vec<u8>,
    dict: &Bound<'_, PyDict>,
    max_depth: usize,
) -> PyResult<()> {
    let mut writer = PyWriter {
        out,
        path: Vec::new(),
        max_depth,
    };
    writer.dict(dict)
}

/// The state of [`write_py_dict`].
struct PyWriter<'o> {
    out: &'o mut Vec<u8>,
    /// Containers being written, for CPython's "Circular reference detected" check.
    path: Vec<*mut ffi::PyObject>,
    max_depth: usize,
}

impl PyWriter<'_> {
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
            write_json_str(self.out, s.to_str()?);
        } else if obj.is_instance_of::<PyInt>() {
            write_int(self.out, obj)?;
        } else if let Ok(f) = obj.downcast::<PyFloat>() {
            write_float(self.out, f)?;
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
        if self.path.len() >= self.max_depth {
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
            write_json_str(self.out, s.to_str()?);
            return Ok(());
        }
        self.out.push(b'"');
        if let Ok(f) = key.downcast::<PyFloat>() {
            write_float(self.out, f)?;
        } else if ptr == unsafe { ffi::Py_True() } {
            self.out.extend_from_slice(b"true");
        } else if ptr == unsafe { ffi::Py_False() } {
            self.out.extend_from_slice(b"false");
        } else if key.is_none() {
            self.out.extend_from_slice(b"null");
        } else if key.is_instance_of::<PyInt>() {
            write_int(self.out, key)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_string_escapes() {
        let mut out = Vec::new();
        write_json_str(&mut out, "a\"b\\c\n\u{1}\u{7f}é");
        assert_eq!(out, "\"a\\\"b\\\\c\\n\\u0001\u{7f}é\"".as_bytes());
    }

    #[test]
    fn ints() {
        for v in [0i64, 7, -7, 10, 99, 100, 12345, i64::MAX, i64::MIN] {
            let mut out = Vec::new();
            write_i64(&mut out, v);
            assert_eq!(out, v.to_string().as_bytes());
        }
    }
}
