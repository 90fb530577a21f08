//! Requests the front parses and Python answers: the connection stays with the front, only
//! the request (method, target, headers, body) crosses to Python's event loop, and the reply
//! comes back as parts through a channel. This replaces the connection hand-off for every
//! request whose transport is plain (see `route.rs`, `head.rs`), so a session turn costs
//! Python its session work and not an HTTP server's.

use std::os::fd::FromRawFd;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};
use tokio::sync::mpsc;

/// Queued reply bytes past which `send` tells Python to wait for a `writable` wake-up.
pub const HIGH_WATER: usize = 1 << 20;
/// Queued reply bytes at or under which a waiting Python sender is woken.
pub const LOW_WATER: usize = 256 << 10;

/// `DispatchedRequest.send`'s answers.
const SENT: i64 = 0;
const FULL: i64 = 1;
const GONE: i64 = -1;

/// One piece of a reply, from Python to the connection task.
pub enum Part {
    /// Status and headers; `Some(body)` for a whole reply, `None` when parts follow.
    Head {
        status: u16,
        headers: Vec<(Vec<u8>, Vec<u8>)>,
        body: Option<Bytes>,
    },
    Body(Bytes),
    /// Body bytes in an open file: its first `u64` bytes, sent by the kernel (`sendfile`).
    File(std::fs::File, u64),
    /// Lend the connection to the worker listening at this path: it writes the body's
    /// chunks itself, and the parts after this one come once it is done (lend.rs).
    Lend(std::path::PathBuf),
    End,
    /// The reply cannot be completed: cut it (close the connection).
    Abort,
}

/// Flow control between Python's sends and the connection's writes.
#[derive(Default)]
pub struct Flow {
    /// Body bytes sent by Python and not yet written to the client.
    pub queued: usize,
    /// Python was told FULL and waits for a `writable` event with this request's id.
    pub waiting: bool,
    /// The client is gone (or the front stopped): further parts are dropped.
    pub gone: bool,
}

pub type SharedFlow = Arc<Mutex<Flow>>;

pub fn lock_flow(flow: &SharedFlow) -> std::sync::MutexGuard<'_, Flow> {
    flow.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A request as the front read it.
pub struct AskedRequest {
    pub id: u64,
    pub method: String,
    /// The request target as sent (origin form, visible ASCII).
    pub target: String,
    /// Lowercased names, values as raw bytes (decoded as latin-1 for Python).
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Bytes,
}

/// A request for Python; see `python/sessiongate/_core.pyi`.
#[pyclass(module = "sessiongate._core", frozen)]
pub struct DispatchedRequest {
    request: AskedRequest,
    replies: mpsc::UnboundedSender<Part>,
    flow: SharedFlow,
    /// Set by the first `reply`/`start`: a second head is a bug in the caller.
    started: Mutex<bool>,
}

impl DispatchedRequest {
    pub fn new(
        request: AskedRequest,
        replies: mpsc::UnboundedSender<Part>,
        flow: SharedFlow,
    ) -> Self {
        Self {
            request,
            replies,
            flow,
            started: Mutex::new(false),
        }
    }

    fn begin(&self) -> PyResult<()> {
        let mut started = self.started.lock().unwrap_or_else(|p| p.into_inner());
        if *started {
            return Err(PyValueError::new_err(format!(
                "request {}: the reply was already started",
                self.request.id
            )));
        }
        *started = true;
        Ok(())
    }

    fn check_started(&self) -> PyResult<()> {
        if *self.started.lock().unwrap_or_else(|p| p.into_inner()) {
            Ok(())
        } else {
            Err(PyValueError::new_err(format!(
                "request {}: send() or end() before start()",
                self.request.id
            )))
        }
    }

    /// Validate and queue the reply's head (with the whole body, if given).
    fn head(
        &self,
        status: i64,
        headers: Vec<(String, String)>,
        body: Option<Bytes>,
    ) -> PyResult<bool> {
        let status = status_code(status)?;
        let headers = head_headers(headers)?;
        self.begin()?;
        Ok(self.push(Part::Head {
            status,
            headers,
            body,
        }))
    }

    /// Queue `part` unless the client is gone; false when it is.
    fn push(&self, part: Part) -> bool {
        if lock_flow(&self.flow).gone {
            return false;
        }
        self.replies.send(part).is_ok()
    }
}

fn head_headers(headers: Vec<(String, String)>) -> PyResult<Vec<(Vec<u8>, Vec<u8>)>> {
    headers
        .into_iter()
        .map(|(name, value)| {
            let name = latin1(&name, "header name")?;
            let value = latin1(&value, "header value")?;
            // What uvicorn refuses too: a name that is not a token, a value with CR/LF/NUL.
            if name.is_empty() || !name.iter().all(|&b| is_token(b)) {
                return Err(PyValueError::new_err(format!(
                    "invalid reply header name {:?}",
                    String::from_utf8_lossy(&name)
                )));
            }
            if value.iter().any(|&b| b == b'\r' || b == b'\n' || b == 0) {
                return Err(PyValueError::new_err(format!(
                    "invalid reply header value for {:?}",
                    String::from_utf8_lossy(&name)
                )));
            }
            Ok((name.to_ascii_lowercase(), value))
        })
        .collect()
}

fn latin1(text: &str, what: &str) -> PyResult<Vec<u8>> {
    text.chars()
        .map(|c| u8::try_from(u32::from(c)).ok())
        .collect::<Option<Vec<u8>>>()
        .ok_or_else(|| PyValueError::new_err(format!("reply {what} {text:?} is not latin-1")))
}

fn is_token(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn status_code(status: i64) -> PyResult<u16> {
    u16::try_from(status)
        .ok()
        .filter(|s| (100..=999).contains(s))
        .ok_or_else(|| PyValueError::new_err(format!("invalid HTTP status {status}")))
}

#[pymethods]
impl DispatchedRequest {
    #[getter]
    fn id(&self) -> u64 {
        self.request.id
    }

    #[getter]
    fn method(&self) -> &str {
        &self.request.method
    }

    #[getter]
    fn target(&self) -> &str {
        &self.request.target
    }

    /// `[(name, value)]`, names lowercased, both as latin-1 text (as the ASGI server gives).
    #[getter]
    fn headers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for (name, value) in &self.request.headers {
            let value: String = value.iter().map(|&b| char::from(b)).collect();
            let pair = PyTuple::new(py, [PyString::new(py, name), PyString::new(py, &value)])?;
            list.append(pair)?;
        }
        Ok(list)
    }

    #[getter]
    fn body<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.request.body)
    }

    /// The whole reply: the front adds `content-length`. False when the client is gone.
    /// A `bytes` body is sent from the Python object itself, never copied here.
    fn reply(
        &self,
        status: i64,
        headers: Vec<(String, String)>,
        body: PyBackedBytes,
    ) -> PyResult<bool> {
        self.head(status, headers, Some(Bytes::from_owner(body)))
    }

    /// The head of a streamed reply (chunked unless `headers` declare a content-length).
    fn start(&self, status: i64, headers: Vec<(String, String)>) -> PyResult<bool> {
        self.head(status, headers, None)
    }

    /// Queue a body part: 0 sent, 1 sent but the queue is full (wait for this id to come
    /// back from `take_writable` before the next), -1 the client is gone (nothing sent).
    fn send(&self, data: PyBackedBytes) -> PyResult<i64> {
        self.check_started()?;
        if data.is_empty() {
            return Ok(SENT);
        }
        let size = data.len();
        let mut flow = lock_flow(&self.flow);
        if flow.gone {
            return Ok(GONE);
        }
        // The part holds the Python object (a reference, not a copy of a large chunk).
        if self
            .replies
            .send(Part::Body(Bytes::from_owner(data)))
            .is_err()
        {
            flow.gone = true;
            return Ok(GONE);
        }
        flow.queued += size;
        if flow.queued > HIGH_WATER {
            flow.waiting = true;
            return Ok(FULL);
        }
        Ok(SENT)
    }

    /// Queue a body part held in an open file: its first `length` bytes, which the front
    /// hands to the kernel (`sendfile`) without reading them. The front owns `fd` from this
    /// call on, whatever it answers, and closes it. Answers as `send`: the file's length
    /// counts in the queue until it is sent.
    fn send_file(&self, fd: i32, length: u64) -> PyResult<i64> {
        if fd < 0 {
            return Err(PyValueError::new_err(format!(
                "invalid file descriptor {fd}"
            )));
        }
        // SAFETY: the caller gives up an open descriptor it no longer uses (the contract of
        // this method); from here the File owns and closes it.
        let file = unsafe { std::fs::File::from_raw_fd(fd) };
        self.check_started()?;
        let mut flow = lock_flow(&self.flow);
        if flow.gone {
            return Ok(GONE);
        }
        if self.replies.send(Part::File(file, length)).is_err() {
            flow.gone = true;
            return Ok(GONE);
        }
        flow.queued = flow
            .queued
            .saturating_add(usize::try_from(length).unwrap_or(usize::MAX));
        if flow.queued > HIGH_WATER {
            flow.waiting = true;
            return Ok(FULL);
        }
        Ok(SENT)
    }

    /// Lend the connection to the worker listening on the UNIX socket at `path`: once the
    /// parts before are out, the front passes it the client's socket (a chunked reply) or
    /// a refusal (any other framing), and sends the parts after this one when they come.
    /// The caller sends the next part only once the worker is done. False when the client
    /// is gone.
    fn lend(&self, path: std::path::PathBuf) -> PyResult<bool> {
        self.check_started()?;
        Ok(self.push(Part::Lend(path)))
    }

    /// The end of a streamed reply. False when the client is gone.
    fn end(&self) -> PyResult<bool> {
        self.check_started()?;
        Ok(self.push(Part::End))
    }

    /// Give up on a started reply (its stream failed): the front closes the connection, so
    /// the client sees a cut reply rather than a short one taken as whole.
    fn abort(&self) {
        lock_flow(&self.flow).gone = true;
        let _ = self.replies.send(Part::Abort);
    }

    /// Whether the client is still there (as far as the front knows).
    #[getter]
    fn connected(&self) -> bool {
        !lock_flow(&self.flow).gone && !self.replies.is_closed()
    }

    fn __repr__(&self) -> String {
        format!(
            "<DispatchedRequest {} {} {}>",
            self.request.id, self.request.method, self.request.target
        )
    }
}
