//! Argument conversion for the exported functions: reading Python arguments the way
//! CPython's own argument parsing does, so the Rust core and its pure-Python twins raise the
//! same exception types with the same messages.

use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;

/// `type(obj).__name__`, for error messages.
pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".to_owned())
}

/// An integer argument read through `__index__`, as Python's `operator.index` does.
pub(crate) enum IntArg {
    Value(u64),
    /// Outside 0..=u64::MAX; `text` is the value as Python prints it.
    OutOfRange {
        negative: bool,
        text: String,
    },
}

/// `obj` as an integer argument `arg` of `func`; a TypeError naming both when it is no int.
/// Range checks (and their messages) are the caller's: each primitive words its own.
pub(crate) fn int_arg(obj: &Bound<'_, PyAny>, func: &str, arg: &str) -> PyResult<IntArg> {
    match obj.extract::<u64>() {
        Ok(v) => Ok(IntArg::Value(v)),
        Err(err) if err.is_instance_of::<PyOverflowError>(obj.py()) => {
            // SAFETY: PyNumber_Index returns a new reference or NULL with an exception set.
            let index = unsafe {
                Bound::from_owned_ptr_or_err(obj.py(), ffi::PyNumber_Index(obj.as_ptr()))
            }?;
            let negative = index.lt(0)?;
            Ok(IntArg::OutOfRange {
                negative,
                text: index.str()?.to_string(),
            })
        }
        Err(err) if err.is_instance_of::<PyTypeError>(obj.py()) => {
            Err(PyTypeError::new_err(format!(
                "{func}() argument '{arg}' must be int, not {}",
                type_name(obj)
            )))
        }
        Err(err) => Err(err),
    }
}
