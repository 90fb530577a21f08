//! The exception classes the primitives raise besides the built-in ones.
//!
//! They are defined once, in the pure-Python module `sessiongate.primitives.errors`, so the
//! Rust core and the pure-Python twins raise the *same* classes (`except FrameError` works
//! whichever implementation is active, and the twins work where the compiled module is
//! missing). The core imports each class the first time it raises it and keeps it for the
//! life of the interpreter.

use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::PyType;

/// The module that defines the shared classes.
const MODULE: &str = "sessiongate.primitives.errors";

/// A class of `sessiongate.primitives.errors` (docs/ipc.md "Errors", docs/relay.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SharedError {
    /// `FrameError(ValueError)`: a frame or envelope cannot be encoded or decoded.
    Frame,
    /// `FrameTooLarge(FrameError)`: a frame is longer than `max_frame`.
    FrameTooLarge,
    /// `FrameCorrupt(FrameError)`: a frame's length field is below the 9-byte minimum.
    FrameCorrupt,
    /// `ReplyContractError(ValueError)`: an upstream reply breaks the chat contract.
    ReplyContract,
    /// `RequestRewriteError(ValueError)`: a request body cannot take the upstream fields.
    RequestRewrite,
}

static CLASSES: [GILOnceCell<Py<PyType>>; 5] = [const { GILOnceCell::new() }; 5];

impl SharedError {
    fn name(self) -> &'static str {
        match self {
            Self::Frame => "FrameError",
            Self::FrameTooLarge => "FrameTooLarge",
            Self::FrameCorrupt => "FrameCorrupt",
            Self::ReplyContract => "ReplyContractError",
            Self::RequestRewrite => "RequestRewriteError",
        }
    }

    /// An exception of this class with message `msg` (or the ImportError, should the
    /// Python module be unimportable: that failure is the more useful one to see).
    pub(crate) fn new_err(self, py: Python<'_>, msg: impl Into<String>) -> PyErr {
        match CLASSES[self as usize].import(py, MODULE, self.name()) {
            Ok(cls) => PyErr::from_type(cls.clone(), msg.into()),
            Err(import_error) => import_error,
        }
    }
}
