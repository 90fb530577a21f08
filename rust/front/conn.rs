//! One client connection: read requests, serve stateless proxy ones, pass the API's other
//! requests to Python and write its replies (`dispatch.rs`), and hand the connection to
//! Python at the first request whose transport or route only the Python server handles.

use std::future::Future;
use std::os::fd::{AsFd, AsRawFd};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::{Body as _, Frame, Incoming};
use hyper::http::uri::PathAndQuery;
use hyper::{Method, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tokio::time::{timeout, timeout_at, Instant};

use super::bulk::BulkPart;
use super::dispatch::{lock_flow, AskedRequest, DispatchedRequest, Part, SharedFlow, LOW_WATER};
use super::head;
use super::lend;
use super::reply::{self, Framing};
use super::route::{decide, has_session_header, target_path, Decision};
use super::server::{OpenConnection, Shared};
use super::upstream::{forward_headers, InFlight, Outgoing};
use crate::cached_tokens::CachedTokens;

/// A head this long without its end goes to Python, which has its own cap and 431.
const MAX_HEAD: usize = 64 << 10;
/// More headers than this: Python's parser decides.
const MAX_HEADERS: usize = 128;
/// Bytes the client may pipeline while its request is upstream before we stop reading.
const WATCH_LIMIT: usize = 1 << 20;
/// Replies with a declared length up to this are written in one go, head and body.
const HOLD_LIMIT: u64 = 64 << 10;
/// Bytes per `sendfile` call of a file reply: between calls the connection's task yields,
/// so a large reply never holds a runtime thread for long.
const SENDFILE_SLICE: u64 = 1 << 20;
/// Chunk size of a file part in a chunked reply: the frames' chunk size.
const FILE_CHUNK: u64 = 256 << 10;
/// Pending relay output is written once it reaches this, even if more is ready.
const FLUSH_AT: usize = 64 << 10;
/// Body pieces at least this large are written from the upstream's buffer, not copied.
const DIRECT_WRITE: usize = 16 << 10;
/// Buffers grown past this by a large request or reply are given back between requests,
/// so an idle kept-alive connection holds only a small one.
const KEEP_CAPACITY: usize = 256 << 10;
/// After an error reply, how long input is drained before closing (see `linger`).
const LINGER: Duration = Duration::from_secs(2);
const READ_BUF: usize = 8 << 10;
/// Less free room than this before a read: make some (see `make_room`).
const MIN_READ: usize = 2 << 10;

enum Exit {
    Close,
    /// An error reply went out: half-close and drain before closing.
    Linger,
    Handoff,
}

/// What the front needs of a request it serves.
struct Prepared {
    head_len: usize,
    body_len: usize,
    close: bool,
    job: Job,
}

enum Job {
    /// Relayed upstream by the front.
    Proxy {
        method: Method,
        path_and_query: PathAndQuery,
        headers: hyper::HeaderMap,
    },
    /// Answered by Python: the request as it came, names lowercased.
    Dispatch {
        method: String,
        target: String,
        headers: Vec<(String, Vec<u8>)>,
    },
}

enum Parsed {
    Partial,
    Handoff,
    Serve(Prepared),
}

struct Conn<'a> {
    shared: &'a Shared,
    stream: &'a mut TcpStream,
    buf: &'a mut BytesMut,
    out: Vec<u8>,
    shutdown: watch::Receiver<bool>,
}

pub async fn serve(open: OpenConnection, mut stream: TcpStream, shutdown: watch::Receiver<bool>) {
    let accepted = Instant::now();
    let shared = open.shared().as_ref();
    let mut buf = BytesMut::with_capacity(READ_BUF);
    let mut conn = Conn {
        shared,
        stream: &mut stream,
        buf: &mut buf,
        out: Vec::new(),
        shutdown: shutdown.clone(),
    };
    match conn.run(accepted).await {
        Exit::Close => {}
        Exit::Linger => linger(&mut stream, shutdown).await,
        Exit::Handoff => shared.hand_off(stream, buf.freeze()),
    }
    drop(open);
}

/// Half-close after an error reply and drop what the client still sends for a while:
/// closing with unread input makes the kernel send a reset, which can destroy the reply
/// before the client reads it.
/// Ends early on shutdown: the reply is out, nothing is in flight.
async fn linger(stream: &mut TcpStream, mut shutdown: watch::Receiver<bool>) {
    let _ = stream.shutdown().await;
    let deadline = Instant::now() + LINGER;
    let mut sink = [0u8; 4096];
    loop {
        tokio::select! {
            biased;
            _ = shutdown.wait_for(|stopping| *stopping) => return,
            read = timeout_at(deadline, stream.read(&mut sink)) => match read {
                Ok(Ok(n)) if n > 0 => {}
                _ => return,
            },
        }
    }
}

impl Conn<'_> {
    async fn run(&mut self, accepted: Instant) -> Exit {
        let shared: &Shared = self.shared;
        let config = &shared.config;
        let mut fresh = true;
        loop {
            if self.buf.capacity() > KEEP_CAPACITY && self.buf.len() < READ_BUF {
                *self.buf = BytesMut::from(&self.buf[..]);
            }
            if self.out.capacity() > KEEP_CAPACITY {
                self.out = Vec::new();
            }
            // 1. The first byte of a request: a fresh connection has the header timeout
            // from its accept, a kept-alive one the keep-alive timeout. Nothing: silent close.
            let head_deadline = if self.buf.is_empty() {
                let wait_until = if fresh {
                    accepted + config.header_timeout
                } else {
                    Instant::now() + config.keepalive_timeout
                };
                make_room(self.buf);
                let read = tokio::select! {
                    biased;
                    _ = self.shutdown.wait_for(|stopping| *stopping) => return Exit::Close,
                    read = timeout_at(wait_until, self.stream.read_buf(self.buf)) => read,
                };
                if !matches!(read, Ok(Ok(n)) if n > 0) {
                    return Exit::Close;
                }
                if fresh {
                    wait_until
                } else {
                    Instant::now() + config.header_timeout
                }
            } else if fresh {
                accepted + config.header_timeout
            } else {
                // Pipelined bytes: the clock starts now.
                Instant::now() + config.header_timeout
            };
            fresh = false;

            // 2. The complete head.
            let request = loop {
                match self.parse() {
                    Parsed::Serve(request) => break request,
                    Parsed::Handoff => return Exit::Handoff,
                    Parsed::Partial if self.buf.len() > MAX_HEAD => return Exit::Handoff,
                    Parsed::Partial => {}
                }
                make_room(self.buf);
                match timeout_at(head_deadline, self.stream.read_buf(self.buf)).await {
                    Ok(Ok(n)) if n > 0 => {}
                    Ok(_) => return Exit::Close,
                    Err(_) => {
                        let message = format!(
                            "request headers not received within {} s",
                            config.header_timeout_text
                        );
                        let _ = self
                            .stream
                            .write_all(&reply::error(408, &message, true))
                            .await;
                        self.shared.stats.record(408, None);
                        return Exit::Linger;
                    }
                }
            };
            let started = Instant::now();

            // 3. The body, each read within the body timeout.
            let total = request.head_len + request.body_len;
            if self.buf.len() < total {
                self.buf.reserve(total - self.buf.len());
            }
            while self.buf.len() < total {
                match timeout(config.body_timeout, self.stream.read_buf(self.buf)).await {
                    Ok(Ok(n)) if n > 0 => {}
                    Ok(_) => return Exit::Close,
                    Err(_) => {
                        let message = format!(
                            "request body not received within {} s",
                            config.body_timeout_text
                        );
                        let _ = self
                            .stream
                            .write_all(&reply::error(408, &message, true))
                            .await;
                        self.shared.stats.record(408, Some(started.elapsed()));
                        return Exit::Linger;
                    }
                }
            }
            let _head = self.buf.split_to(request.head_len);
            let body = self.buf.split_to(request.body_len).freeze();

            let (method, path_and_query, headers) = match request.job {
                Job::Proxy {
                    method,
                    path_and_query,
                    headers,
                } => (method, path_and_query, headers),
                Job::Dispatch {
                    method,
                    target,
                    headers,
                } => {
                    // 4'. Python's reply.
                    let close = request.close;
                    if !self.answer(method, target, headers, body, close).await {
                        return Exit::Close;
                    }
                    if close || *self.shutdown.borrow() {
                        let _ = self.stream.shutdown().await;
                        return Exit::Close;
                    }
                    continue;
                }
            };

            // 4. Upstream, then the reply.
            let outgoing = Outgoing {
                method,
                path_and_query,
                headers,
                body,
            };
            let Some(result) = self.exchange(outgoing).await else {
                return Exit::Close; // the client went away; the exchange was dropped
            };
            let close = request.close || *self.shutdown.borrow();
            let (status, intact) = match result {
                // The engine counts the request in flight until its reply is relayed.
                Ok((reply, mut in_flight)) => {
                    let mut watch = in_flight.cached_watch();
                    let relayed = self.relay(reply, close, watch.as_mut()).await;
                    in_flight.set_cached(watch.and_then(|w| w.finish()));
                    relayed
                }
                Err(message) => (502, self.write_error(502, &message, close).await),
            };
            self.shared.stats.record(status, Some(started.elapsed()));
            if !intact {
                return Exit::Close;
            }
            if close {
                let _ = self.stream.shutdown().await;
                return Exit::Close;
            }
        }
    }

    /// Parse the head in the buffer and decide what to do with it.
    fn parse(&self) -> Parsed {
        let shared: &Shared = self.shared;
        let config = &shared.config;
        let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut head = httparse::Request::new(&mut slots);
        let head_len = match head.parse(self.buf) {
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) => return Parsed::Partial,
            // Python answers malformed requests (its JSON 400) and too many headers.
            Err(_) => return Parsed::Handoff,
        };
        let (Some(method), Some(target), Some(version)) = (head.method, head.path, head.version)
        else {
            return Parsed::Handoff;
        };
        // httparse takes a bare LF for a line end, the Python server's parser does not: the
        // one 400 for both fronts is Python's (docs/reliability.md, "HTTP/1.1 rules").
        if has_bare_lf(&self.buf[..head_len]) {
            return Parsed::Handoff;
        }
        // The Python server routes on the path without its fragment, the twin on the target
        // up to "?": where they could differ, Python decides.
        if target.contains('#') {
            return Parsed::Handoff;
        }
        let headers = &*head.headers;
        let wire = || headers.iter().map(|h| (h.name.as_bytes(), h.value));
        let has_session = || has_session_header(wire(), &config.session_names);
        let mut decision = decide(method.as_bytes(), target.as_bytes(), has_session);
        if decision == Decision::Proxy && !shared.relays() {
            // The engine set is Python's now (engine registry): its core proxies the request.
            decision = Decision::Dispatch;
        }
        if decision == Decision::Handoff || (decision == Decision::Dispatch && !config.dispatch) {
            return Parsed::Handoff;
        }
        let named = || headers.iter().map(|h| (h.name, h.value));
        let api_key = config.api_key.as_deref();
        let Some(fast) = head::check(version, named(), config.max_body, api_key) else {
            return Parsed::Handoff;
        };
        let Ok(body_len) = usize::try_from(fast.content_length) else {
            return Parsed::Handoff;
        };
        if decision == Decision::Dispatch {
            let headers = headers
                .iter()
                .map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec()))
                .collect();
            return Parsed::Serve(Prepared {
                head_len,
                body_len,
                close: fast.close,
                job: Job::Dispatch {
                    method: method.to_string(),
                    target: target.to_string(),
                    headers,
                },
            });
        }
        let method = if method == "GET" {
            Method::GET
        } else {
            Method::POST
        };
        // An empty query is no query (the Python side forwards none either).
        let path = target_path(target.as_bytes());
        let target = if target.len() == path.len() + 1 {
            &target[..path.len()]
        } else {
            target
        };
        // Targets the URL type cannot carry (non-ASCII bytes): Python forwards those.
        let Ok(path_and_query) = PathAndQuery::try_from(target) else {
            return Parsed::Handoff;
        };
        let Some(headers) = forward_headers(named(), api_key.is_some()) else {
            return Parsed::Handoff;
        };
        Parsed::Serve(Prepared {
            head_len,
            body_len,
            close: fast.close,
            job: Job::Proxy {
                method,
                path_and_query,
                headers,
            },
        })
    }

    /// The upstream exchange up to the reply head, watching the client meanwhile: None when
    /// it hung up (the exchange is dropped, which cancels it). Bytes it sends (a pipelined
    /// request) are kept for later.
    async fn exchange(
        &mut self,
        outgoing: Outgoing,
    ) -> Option<Result<(Response<Incoming>, InFlight), String>> {
        let pool = self.shared.pool();
        let upstream = pool.send(outgoing);
        tokio::pin!(upstream);
        let mut watching = self.buf.len() <= WATCH_LIMIT;
        loop {
            if watching {
                make_room(self.buf);
            }
            tokio::select! {
                biased;
                result = &mut upstream => return Some(result),
                read = self.stream.read_buf(self.buf), if watching => match read {
                    Ok(n) if n > 0 => watching = self.buf.len() <= WATCH_LIMIT,
                    _ => return None,
                },
            }
        }
    }

    /// A JSON error reply; false when the client could not take it.
    async fn write_error(&mut self, status: u16, message: &str, close: bool) -> bool {
        let bytes = reply::error(status, message, close);
        self.stream.write_all(&bytes).await.is_ok()
    }

    async fn flush(&mut self) -> bool {
        let ok = self.stream.write_all(&self.out).await.is_ok();
        self.out.clear();
        ok
    }

    /// `n` queued body bytes were written: wake a Python sender waiting for room.
    fn taken(&self, id: u64, flow: &SharedFlow, n: usize) {
        let mut state = lock_flow(flow);
        state.queued = state.queued.saturating_sub(n);
        if state.waiting && state.queued <= LOW_WATER {
            state.waiting = false;
            self.shared.writable(id);
        }
    }

    /// `length` bytes of `file` from `start` to the client, copied by the kernel from the
    /// file's pages to the socket (`sendfile`) on the bulk thread (bulk.rs), a slice at a
    /// time. False when the client is gone or the file is shorter.
    async fn send_file(&mut self, file: &std::fs::File, start: u64, length: u64) -> bool {
        let Ok(mut offset) = libc::off_t::try_from(start) else {
            return false;
        };
        let Some(bulk) = BulkPart::new(self.stream.as_fd(), file.as_fd()) else {
            return self.send_file_here(file, offset, length).await;
        };
        let mut left = length;
        while left > 0 {
            let count = usize::try_from(left.min(SENDFILE_SLICE)).unwrap_or(1 << 20);
            match bulk.send(offset, count).await {
                Ok((0, _)) => return false, // the file ended early: the reply is cut
                Ok((n, next)) => {
                    left = left.saturating_sub(n as u64);
                    offset = next;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if !self.await_writable().await {
                        return false;
                    }
                }
                Err(_) => return false,
            }
        }
        true
    }

    /// After a write made outside tokio found the socket full: until it has room. Tokio's
    /// readiness is cleared only when the socket, polled, is full indeed: clearing it on a
    /// socket with room would leave tokio's next write waiting for an edge that never comes.
    async fn await_writable(&mut self) -> bool {
        let socket = self.stream.as_raw_fd();
        loop {
            if self.stream.writable().await.is_err() {
                return false;
            }
            let room = self.stream.try_io(Interest::WRITABLE, || {
                let mut poll = libc::pollfd {
                    fd: socket,
                    events: libc::POLLOUT,
                    revents: 0,
                };
                // SAFETY: one live pollfd for a descriptor the stream keeps open; no wait.
                match unsafe { libc::poll(&mut poll, 1, 0) } {
                    0 => Err(std::io::Error::from(std::io::ErrorKind::WouldBlock)),
                    // Room, or an error (of the socket, or EINTR) the next send tells.
                    _ => Ok(()),
                }
            });
            match room {
                Ok(()) => return true,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(_) => return false,
            }
        }
    }

    /// `send_file` on the runtime's thread, when the bulk thread cannot be used.
    async fn send_file_here(
        &mut self,
        file: &std::fs::File,
        mut offset: libc::off_t,
        length: u64,
    ) -> bool {
        let socket = self.stream.as_raw_fd();
        let source = file.as_raw_fd();
        let mut left = length;
        while left > 0 {
            let count = usize::try_from(left.min(SENDFILE_SLICE)).unwrap_or(1 << 20);
            let sent = self.stream.try_io(Interest::WRITABLE, || {
                // SAFETY: both descriptors stay open for the call (the stream and `file` are
                // borrowed); `offset` is a live local the kernel advances.
                let n = unsafe { libc::sendfile(socket, source, &mut offset, count) };
                u64::try_from(n).map_err(|_| std::io::Error::last_os_error())
            });
            match sent {
                Ok(0) => return false,
                Ok(n) => {
                    left = left.saturating_sub(n);
                    tokio::task::yield_now().await; // a fast client never fills the socket
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if self.stream.writable().await.is_err() {
                        return false;
                    }
                }
                Err(_) => return false,
            }
        }
        true
    }

    /// Relay an upstream reply; the status the client got, and whether the connection can
    /// carry another request.
    /// `watch` reads the body's `cached_tokens` on the way (`InFlight::cached_watch`).
    async fn relay(
        &mut self,
        reply: Response<Incoming>,
        close: bool,
        mut watch: Option<&mut CachedTokens>,
    ) -> (u16, bool) {
        let (parts, mut body) = reply.into_parts();
        let status = parts.status.as_u16();
        let framing = if reply::bodiless(status) {
            Framing::Empty
        } else {
            match body.size_hint().exact() {
                Some(n) => Framing::Length(n),
                None => Framing::Chunked,
            }
        };
        self.out.clear();
        reply::relay_head(&mut self.out, status, &parts.headers, framing, close);
        if framing == Framing::Empty {
            return (status, self.flush().await);
        }
        let chunked = framing == Framing::Chunked;
        // A small body of known length is gathered and written with its head at once.
        let hold = matches!(framing, Framing::Length(n) if n <= HOLD_LIMIT);
        let upstream_timeout = self.shared.config.upstream_timeout;
        let mut written = false;
        loop {
            let frame: Option<Result<Frame<Bytes>, Option<hyper::Error>>> =
                if self.out.is_empty() || hold {
                    match timeout(upstream_timeout, body.frame()).await {
                        Ok(frame) => frame.map(|r| r.map_err(Some)),
                        Err(_) => Some(Err(None)),
                    }
                } else {
                    // Output is pending: add to it only what is ready now, else send it.
                    match ready_now(body.frame()).await {
                        Some(frame) => frame.map(|r| r.map_err(Some)),
                        None => {
                            written = true;
                            if !self.flush().await {
                                return (status, false);
                            }
                            continue;
                        }
                    }
                };
            match frame {
                None => {
                    if chunked {
                        self.out.extend_from_slice(reply::LAST_CHUNK);
                    }
                    return (status, self.flush().await);
                }
                Some(Ok(frame)) => {
                    // Trailers are not relayed.
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    if data.is_empty() {
                        continue;
                    }
                    if let Some(watch) = watch.as_deref_mut().filter(|w| !w.done()) {
                        watch.feed(&data);
                    }
                    if !hold && data.len() >= DIRECT_WRITE {
                        if chunked {
                            reply::chunk_size(&mut self.out, data.len());
                        }
                        written = true;
                        if !self.flush().await || self.stream.write_all(&data).await.is_err() {
                            return (status, false);
                        }
                        if chunked {
                            self.out.extend_from_slice(b"\r\n");
                        }
                        continue;
                    }
                    if chunked {
                        reply::chunk(&mut self.out, &data);
                    } else {
                        self.out.extend_from_slice(&data);
                    }
                    if self.out.len() >= FLUSH_AT && !hold {
                        written = true;
                        if !self.flush().await {
                            return (status, false);
                        }
                    }
                }
                Some(Err(error)) => {
                    if !written {
                        // Nothing went out yet: the client can still get a clean 502.
                        let detail =
                            error.map_or_else(|| "timed out".to_string(), |e| e.to_string());
                        let message =
                            format!("upstream transport error while reading the reply: {detail}");
                        self.out.clear();
                        return (502, self.write_error(502, &message, close).await);
                    }
                    // The head is out: a cut reply (no terminating chunk, or short of its
                    // length) is all that can tell the client.
                    let _ = self.flush().await;
                    return (status, false);
                }
            }
        }
    }

    /// Pass a request to Python and write its reply; whether the connection can carry
    /// another request.
    async fn answer(
        &mut self,
        method: String,
        target: String,
        headers: Vec<(String, Vec<u8>)>,
        body: Bytes,
        close: bool,
    ) -> bool {
        let shared = self.shared;
        let (replies, mut parts) = mpsc::unbounded_channel();
        let flow = SharedFlow::default();
        let id = shared.request_id();
        let asked = AskedRequest {
            id,
            method,
            target,
            headers,
            body,
        };
        let request = DispatchedRequest::new(asked, replies, flow.clone());
        if !shared.dispatch(request) {
            return false; // stopped: nobody will answer
        }
        // The head, watching the client meanwhile (as `exchange` does).
        let mut watching = self.buf.len() <= WATCH_LIMIT;
        let head = loop {
            if watching {
                make_room(self.buf);
            }
            tokio::select! {
                biased;
                part = parts.recv() => break part,
                read = self.stream.read_buf(self.buf), if watching => match read {
                    Ok(n) if n > 0 => watching = self.buf.len() <= WATCH_LIMIT,
                    _ => {
                        // Python finishes the request; its reply goes nowhere.
                        lock_flow(&flow).gone = true;
                        return false;
                    }
                },
            }
        };
        // Python dropped the request without a reply (it stopped): close.
        let Some(Part::Head {
            status,
            headers,
            body,
        }) = head
        else {
            return false;
        };
        let declared = app_framing(&headers);
        let close = close || declared.close || *self.shutdown.borrow();
        self.out.clear();
        if let Some(body) = body {
            let framing = Framing::Length(body.len() as u64);
            reply::app_head(&mut self.out, status, &headers, framing, close);
            if body.len() as u64 <= HOLD_LIMIT {
                self.out.extend_from_slice(&body);
                return self.flush().await;
            }
            return self.flush().await && self.stream.write_all(&body).await.is_ok();
        }
        let framing = if reply::bodiless(status) {
            Framing::Empty
        } else {
            declared.length.map_or(Framing::Chunked, Framing::Length)
        };
        reply::app_head(&mut self.out, status, &headers, framing, close);
        let mut lent = false;
        let intact = self
            .stream_parts(id, &mut parts, &flow, framing, &mut lent)
            .await;
        if !intact && lent {
            lend::cut(self.stream.as_raw_fd());
        }
        if !intact {
            let mut flow = lock_flow(&flow);
            flow.gone = true;
            if std::mem::take(&mut flow.waiting) {
                shared.writable(id); // it learns GONE at its next send
            }
        }
        intact
    }

    /// The parts of a streamed reply after its head (in `self.out`): written as they come,
    /// those ready together in one write. False when the reply was cut.
    async fn stream_parts(
        &mut self,
        id: u64,
        parts: &mut mpsc::UnboundedReceiver<Part>,
        flow: &SharedFlow,
        framing: Framing,
        lent: &mut bool,
    ) -> bool {
        let mut remaining = match framing {
            Framing::Length(n) => n,
            _ => 0,
        };
        loop {
            let part = if self.out.is_empty() {
                parts.recv().await
            } else {
                match parts.try_recv() {
                    Ok(part) => Some(part),
                    Err(mpsc::error::TryRecvError::Empty) => {
                        if !self.flush().await {
                            return false;
                        }
                        continue;
                    }
                    Err(mpsc::error::TryRecvError::Disconnected) => None,
                }
            };
            match part {
                Some(Part::Body(data)) => {
                    match framing {
                        Framing::Chunked => reply::chunk(&mut self.out, &data),
                        Framing::Length(_) => {
                            // Past the declared length is dropped (as uvicorn refuses it).
                            let n = remaining.min(data.len() as u64);
                            self.out
                                .extend_from_slice(&data[..usize::try_from(n).unwrap_or(0)]);
                            remaining -= n;
                        }
                        Framing::Empty => {}
                    }
                    self.taken(id, flow, data.len());
                    if self.out.len() >= FLUSH_AT && !self.flush().await {
                        return false;
                    }
                }
                Some(Part::File(file, length)) => {
                    let n = match framing {
                        Framing::Length(_) => remaining.min(length),
                        Framing::Chunked => length,
                        Framing::Empty => 0,
                    };
                    // Chunked: pieces of FILE_CHUNK, as frames' parts would be (clients
                    // that decode chunks in Python take far longer over 4 MiB chunks).
                    let piece = if framing == Framing::Chunked {
                        FILE_CHUNK
                    } else {
                        n
                    };
                    let mut offset = 0;
                    while offset < n {
                        let size = piece.min(n - offset);
                        if framing == Framing::Chunked {
                            if offset > 0 {
                                self.out.extend_from_slice(b"\r\n");
                            }
                            reply::chunk_size(&mut self.out, usize::try_from(size).unwrap_or(0));
                        }
                        if !self.flush().await || !self.send_file(&file, offset, size).await {
                            return false;
                        }
                        offset += size;
                    }
                    if framing == Framing::Chunked && n > 0 {
                        self.out.extend_from_slice(b"\r\n");
                    }
                    if let Framing::Length(_) = framing {
                        remaining -= n;
                    }
                    self.taken(id, flow, usize::try_from(length).unwrap_or(usize::MAX));
                }
                Some(Part::Lend(path)) => {
                    if framing != Framing::Chunked {
                        // The worker writes chunks only: it sends the body the usual way.
                        if lend::lend(&path, None).is_err() {
                            return false;
                        }
                        continue;
                    }
                    // The head and every earlier part must be out before the worker writes.
                    if !self.flush().await {
                        // The client is gone: the refusal spares the worker its wait.
                        let _ = lend::lend(&path, None);
                        return false;
                    }
                    *lent = true;
                    if lend::lend(&path, Some(self.stream.as_raw_fd())).is_err() {
                        return false; // the worker is gone (cancelled): the reply is cut
                    }
                }
                Some(Part::End) => {
                    if framing == Framing::Chunked {
                        self.out.extend_from_slice(reply::LAST_CHUNK);
                    }
                    // Short of a declared length, the client must not take it as whole.
                    return self.flush().await && remaining == 0;
                }
                // A second head is refused by `DispatchedRequest`; none can arrive.
                Some(Part::Head { .. } | Part::Abort) => {
                    let _ = self.flush().await;
                    return false;
                }
                // Dropped without its end: the reply is cut.
                None => {
                    let _ = self.flush().await;
                    return false;
                }
            }
        }
    }
}

/// What a Python reply's own headers say about its framing (as uvicorn reads them).
struct Declared {
    length: Option<u64>,
    close: bool,
}

fn app_framing(headers: &[(Vec<u8>, Vec<u8>)]) -> Declared {
    let mut declared = Declared {
        length: None,
        close: false,
    };
    for (name, value) in headers {
        if name == b"content-length" && declared.length.is_none() {
            declared.length = std::str::from_utf8(value)
                .ok()
                .and_then(|v| v.trim().parse().ok());
        } else if name == b"connection" {
            declared.close |= value
                .split(|&b| b == b',')
                .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close"));
        }
    }
    declared
}

/// Whether a request head ends a line with a LF not preceded by CR.
fn has_bare_lf(head: &[u8]) -> bool {
    head.iter()
        .enumerate()
        .any(|(i, &b)| b == b'\n' && (i == 0 || head[i - 1] != b'\r'))
}

/// `read_buf` on a full buffer only adds 64 bytes of room: reserve a useful amount instead
/// (which also reclaims the space of requests already split off, once they are dropped).
fn make_room(buf: &mut BytesMut) {
    if buf.capacity() - buf.len() < MIN_READ {
        buf.reserve(READ_BUF);
    }
}

/// `future`'s output if it is ready without waiting.
async fn ready_now<F: Future>(future: F) -> Option<F::Output> {
    tokio::select! {
        biased;
        output = future => Some(output),
        () = std::future::ready(()) => None,
    }
}
