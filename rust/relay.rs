//! JSON relay primitives for the upstream chat path (docs/relay.md):
//!
//! - `extract_reply(body)`: validate an upstream reply against the chat contract
//!   (docs/relay.md "`extract_reply`" and "Contract errors"), return the completion ids, logprobs, finish reason, assistant
//!   message, the raw `routed_experts` / `indexer_topk` texts, the weight version and cached
//!   tokens, and the client body: the original bytes with every `routed_experts` /
//!   `indexer_topk` member of every `choices[i].meta_info` cut out.
//!   One pass over the bytes with the GIL released; nothing but the small members is turned
//!   into Python objects.
//! - `rewrite_request(body, fields)`: the client request with top-level members set, by
//!   splicing (the rest of the body is copied, not re-serialized).
//!
//! Both match the pure-Python twins in `python/sessiongate/primitives/_py_relay.py`: same
//! results (client bodies parse equal), same exception classes and messages. Bodies the
//! scanner of `rust/json_scan.rs` does not accept (invalid JSON, and the rare valid inputs
//! it leaves to CPython: BOM / UTF-16 / UTF-32, encoded surrogates, very deep nesting, huge
//! integers) are handed to the twin, whose `json.loads` gives the verdict and the message.

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBytes, PyDict, PyList, PyMemoryView, PySlice, PyString, PyType};
use pyo3::{ffi, intern};

use crate::buffer::{new_bytes, Filler, Input};
use crate::cached_tokens::CachedTokens;
use crate::error::SharedError;
use crate::gil::maybe_unlocked;
use crate::json_scan::{
    for_each_kept, member_cuts, spliced_len, unescape, validate, Kind, Member, NumKind, Scan,
    Scanner, Str,
};
use crate::json_write::{write_i64, write_json_str};
use crate::types::type_name;

// ---------------------------------------------------------------------------------------
// Errors and the twin

const CONTRACT_PREFIX: &str = "upstream reply breaks the chat contract: ";

fn contract_error(py: Python<'_>, detail: &str) -> PyErr {
    SharedError::ReplyContract.new_err(py, format!("{CONTRACT_PREFIX}{detail}"))
}

static TWIN: GILOnceCell<Py<PyModule>> = GILOnceCell::new();
static JSON_LOADS: GILOnceCell<Py<PyAny>> = GILOnceCell::new();

/// `name` from the pure-Python twin module.
fn twin<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    let module = TWIN.get_or_try_init(py, || {
        py.import("sessiongate.primitives._py_relay")
            .map(Bound::unbind)
    })?;
    module.bind(py).getattr(name)
}

/// `json.loads` of a slice of a document the scanner accepted (strict UTF-8 JSON), so the
/// result is exactly the matching part of `json.loads(document)`.
fn json_loads<'py>(py: Python<'py>, text: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    let loads = JSON_LOADS.get_or_try_init(py, || {
        py.import("json")?.getattr("loads").map(Bound::unbind)
    })?;
    loads.bind(py).call1((PyBytes::new(py, text),))
}

// ---------------------------------------------------------------------------------------
// Reply scan (no GIL)

const K_CHOICES: &[u8] = b"choices";
const K_MESSAGE: &[u8] = b"message";
const K_CONTENT: &[u8] = b"content";
const K_META: &[u8] = b"meta_info";
const K_FINISH: &[u8] = b"finish_reason";
const K_LOGPROBS: &[u8] = b"output_token_logprobs";
const K_COMPLETION: &[u8] = b"completion_tokens";
const K_PROMPT: &[u8] = b"prompt_tokens";
const K_R3: &[u8] = b"routed_experts";
const K_TOPK: &[u8] = b"indexer_topk";
const K_CACHED: &[u8] = b"cached_tokens";
const K_WEIGHT: &[u8] = b"weight_version";
const K_E2E: &[u8] = b"e2e_latency";
const K_METADATA: &[u8] = b"metadata";

/// An int-valued member: a JSON integer that fits i64, or anything else.
#[derive(Debug, Clone, Copy)]
enum IntField {
    Int(i64),
    Other,
}

/// A str-valued member: a JSON string, or anything else.
#[derive(Debug, Clone, Copy)]
enum StrField {
    Str(Str),
    Other,
}

/// A base64 member (`routed_experts`, `indexer_topk`): null, a string, or a contract error.
#[derive(Debug, Clone, Copy)]
enum R3Field {
    Null,
    Str(Str),
    Other(Kind),
}

#[derive(Debug, Default)]
struct Entries {
    ids: Vec<i64>,
    logprobs: Vec<f64>,
    count: usize,
    /// The first malformed entry: its index and span.
    first_bad: Option<(usize, usize, usize)>,
}

/// What the contract needs from one `meta_info` object (the last one of a choice wins).
#[derive(Debug, Default)]
struct Meta {
    /// None: absent; Some(None): not an array.
    entries: Option<Option<Entries>>,
    completion_tokens: Option<IntField>,
    prompt_tokens: Option<IntField>,
    finish_reason: Option<(usize, usize)>,
    routed_experts: Option<R3Field>,
    indexer_topk: Option<R3Field>,
    cached_tokens: Option<IntField>,
    weight_version: Option<StrField>,
    /// None: absent; Some(None): not a number.
    e2e_latency: Option<Option<f64>>,
}

/// A message object's span, and whether its `content` is absent (None) or null (Some(true)).
type MessageInfo = ((usize, usize), Option<bool>);

#[derive(Debug, Default)]
struct Choice {
    /// None: absent; Some(None): not an object; Some(Some((span, content))) where content
    /// is None when absent, Some(true) when null.
    message: Option<Option<MessageInfo>>,
    /// None: absent; Some(None): not an object.
    meta: Option<Option<Meta>>,
    finish_reason: Option<(usize, usize)>,
}

#[derive(Debug)]
enum Choices {
    NotArray,
    Empty,
    FirstNotObject,
    First(Box<Choice>),
}

#[derive(Debug, Default)]
struct ReplyScan {
    /// The kind of the top-level value.
    top: Option<Kind>,
    /// The last top-level `choices` member.
    choices: Option<Choices>,
    /// `weight_version` of the last top-level `metadata` member (None: that member is
    /// absent, not an object, or has no `weight_version`).
    metadata_weight_version: Option<StrField>,
    /// Ranges of the record-only members to cut, sorted and disjoint.
    cuts: Vec<(usize, usize)>,
    /// Some value the fast path cannot represent (an integer beyond i64): use the twin.
    needs_twin: bool,
}

/// A JSON integer that fits i64 (the text is a validated integer literal).
fn parse_i64(text: &[u8]) -> Option<i64> {
    let (neg, digits) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, text),
    };
    let mut v: i64 = 0;
    for &d in digits {
        let d = i64::from(d.wrapping_sub(b'0'));
        v = v.checked_mul(10)?;
        v = if neg {
            v.checked_sub(d)?
        } else {
            v.checked_add(d)?
        };
    }
    Some(v)
}

/// A JSON number (or NaN / Infinity / -Infinity) as Python's `float()` reads it.
fn parse_f64(text: &[u8]) -> f64 {
    match text {
        b"NaN" => f64::NAN,
        b"Infinity" => f64::INFINITY,
        b"-Infinity" => f64::NEG_INFINITY,
        _ => std::str::from_utf8(text)
            .ok()
            .and_then(|t| t.parse().ok())
            .unwrap_or(f64::NAN),
    }
}

struct ReplyScanner<'a> {
    sc: Scanner<'a>,
    out: ReplyScan,
}

impl<'a> ReplyScanner<'a> {
    fn run(s: &'a [u8]) -> Scan<ReplyScan> {
        let mut this = ReplyScanner {
            sc: Scanner::new(s),
            out: ReplyScan::default(),
        };
        this.top()?;
        Ok(this.out)
    }

    fn top(&mut self) -> Scan<()> {
        self.sc.ws();
        let kind = self.sc.kind()?;
        self.out.top = Some(kind);
        if kind != Kind::Object {
            self.sc.value()?;
            return self.sc.finish();
        }
        if !self.sc.object_start()? {
            loop {
                let key = self.sc.key()?;
                if self.sc.key_is(&key, K_CHOICES) {
                    let choices = self.choices()?;
                    self.out.choices = Some(choices);
                } else if self.sc.key_is(&key, K_METADATA) {
                    self.out.metadata_weight_version = self.metadata()?;
                } else {
                    self.sc.value()?;
                }
                if !self.sc.object_next()? {
                    break;
                }
            }
        }
        self.sc.finish()
    }

    /// The top-level `metadata` member: its (last) `weight_version`, if it is an object.
    fn metadata(&mut self) -> Scan<Option<StrField>> {
        let mut weight_version = None;
        if self.sc.kind()? != Kind::Object {
            self.sc.value()?;
            return Ok(weight_version);
        }
        if self.sc.object_start()? {
            return Ok(weight_version);
        }
        loop {
            let key = self.sc.key()?;
            if self.sc.key_is(&key, K_WEIGHT) {
                weight_version = Some(self.str_field()?);
            } else {
                self.sc.value()?;
            }
            if !self.sc.object_next()? {
                return Ok(weight_version);
            }
        }
    }

    fn choices(&mut self) -> Scan<Choices> {
        if self.sc.kind()? != Kind::Array {
            self.sc.value()?;
            return Ok(Choices::NotArray);
        }
        if self.sc.array_start()? {
            return Ok(Choices::Empty);
        }
        let mut first = Choices::FirstNotObject;
        let mut index = 0usize;
        loop {
            if self.sc.kind()? == Kind::Object {
                let choice = self.choice(index == 0)?;
                if index == 0 {
                    first = Choices::First(Box::new(choice));
                }
            } else {
                self.sc.value()?;
            }
            index += 1;
            if !self.sc.array_next()? {
                return Ok(first);
            }
        }
    }

    /// One element of `choices`; only the first one's members are collected, but every
    /// one's `meta_info` loses its record-only members.
    fn choice(&mut self, collect: bool) -> Scan<Choice> {
        let mut choice = Choice::default();
        if self.sc.object_start()? {
            return Ok(choice);
        }
        loop {
            let key = self.sc.key()?;
            if self.sc.key_is(&key, K_META) {
                choice.meta = Some(if self.sc.kind()? == Kind::Object {
                    Some(self.meta(collect)?)
                } else {
                    self.sc.value()?;
                    None
                });
            } else if collect && self.sc.key_is(&key, K_MESSAGE) {
                choice.message = Some(if self.sc.kind()? == Kind::Object {
                    let start = self.sc.pos;
                    let content = self.message()?;
                    Some(((start, self.sc.pos), content))
                } else {
                    self.sc.value()?;
                    None
                });
            } else if collect && self.sc.key_is(&key, K_FINISH) {
                let start = self.sc.pos;
                self.sc.value()?;
                choice.finish_reason = Some((start, self.sc.pos));
            } else {
                self.sc.value()?;
            }
            if !self.sc.object_next()? {
                return Ok(choice);
            }
        }
    }

    /// A message object; returns whether `content` is present and null (last one wins).
    fn message(&mut self) -> Scan<Option<bool>> {
        let mut content = None;
        if self.sc.object_start()? {
            return Ok(content);
        }
        loop {
            let key = self.sc.key()?;
            if self.sc.key_is(&key, K_CONTENT) {
                content = Some(self.sc.kind()? == Kind::Null);
            }
            self.sc.value()?;
            if !self.sc.object_next()? {
                return Ok(content);
            }
        }
    }

    fn meta(&mut self, collect: bool) -> Scan<Meta> {
        let mut meta = Meta::default();
        let mut members: Vec<Member> = Vec::new();
        let mut removing = false;
        if self.sc.object_start()? {
            return Ok(meta);
        }
        loop {
            let key = self.sc.key()?;
            let mut remove = false;
            if self.sc.key_is(&key, K_R3) {
                remove = true;
                let field = self.b64_field()?;
                if collect {
                    meta.routed_experts = Some(field);
                }
            } else if self.sc.key_is(&key, K_TOPK) {
                remove = true;
                let field = self.b64_field()?;
                if collect {
                    meta.indexer_topk = Some(field);
                }
            } else if collect && self.sc.key_is(&key, K_LOGPROBS) {
                meta.entries = Some(self.entries()?);
            } else if collect && self.sc.key_is(&key, K_COMPLETION) {
                meta.completion_tokens = Some(self.int_field()?);
            } else if collect && self.sc.key_is(&key, K_PROMPT) {
                meta.prompt_tokens = Some(self.int_field()?);
            } else if collect && self.sc.key_is(&key, K_CACHED) {
                meta.cached_tokens = Some(self.int_field()?);
            } else if collect && self.sc.key_is(&key, K_WEIGHT) {
                meta.weight_version = Some(self.str_field()?);
            } else if collect && self.sc.key_is(&key, K_E2E) {
                meta.e2e_latency = Some(self.float_field()?);
            } else if collect && self.sc.key_is(&key, K_FINISH) {
                let start = self.sc.pos;
                self.sc.value()?;
                meta.finish_reason = Some((start, self.sc.pos));
            } else {
                self.sc.value()?;
            }
            members.push(Member {
                key_start: key.start,
                value_end: self.sc.pos,
                remove,
            });
            removing |= remove;
            if !self.sc.object_next()? {
                break;
            }
        }
        if removing {
            member_cuts(&members, &mut self.out.cuts);
        }
        Ok(meta)
    }

    /// A base64 member: its text when it is a string (read without copying).
    fn b64_field(&mut self) -> Scan<R3Field> {
        Ok(match self.sc.kind()? {
            Kind::String => R3Field::Str(self.sc.string()?),
            Kind::Null => {
                self.sc.value()?;
                R3Field::Null
            }
            other => {
                self.sc.value()?;
                R3Field::Other(other)
            }
        })
    }

    fn str_field(&mut self) -> Scan<StrField> {
        if self.sc.kind()? == Kind::String {
            return Ok(StrField::Str(self.sc.string()?));
        }
        self.sc.value()?;
        Ok(StrField::Other)
    }

    /// A number member as Python's `float()` reads it (an integer too), else None.
    fn float_field(&mut self) -> Scan<Option<f64>> {
        if self.sc.kind()? != Kind::Number {
            self.sc.value()?;
            return Ok(None);
        }
        let start = self.sc.pos;
        self.sc.scalar()?;
        Ok(Some(parse_f64(&self.sc.s[start..self.sc.pos])))
    }

    fn int_field(&mut self) -> Scan<IntField> {
        if self.sc.kind()? != Kind::Number {
            self.sc.value()?;
            return Ok(IntField::Other);
        }
        let start = self.sc.pos;
        if self.sc.scalar()? != Some(NumKind::Int) {
            return Ok(IntField::Other);
        }
        match parse_i64(&self.sc.s[start..self.sc.pos]) {
            Some(v) => Ok(IntField::Int(v)),
            None => {
                self.out.needs_twin = true;
                Ok(IntField::Other)
            }
        }
    }

    /// `output_token_logprobs`: None if it is not an array.
    fn entries(&mut self) -> Scan<Option<Entries>> {
        if self.sc.kind()? != Kind::Array {
            self.sc.value()?;
            return Ok(None);
        }
        let mut entries = Entries::default();
        if self.sc.array_start()? {
            return Ok(Some(entries));
        }
        loop {
            let start = self.sc.pos;
            let good = self.entry(&mut entries)?;
            if !good && entries.first_bad.is_none() {
                entries.first_bad = Some((entries.count, start, self.sc.pos));
            }
            entries.count += 1;
            if !self.sc.array_next()? {
                return Ok(Some(entries));
            }
        }
    }

    /// One `[logprob, token_id, ...]` entry (Python's checks: a list of at least two items,
    /// an int (not bool) token id, an int, float or bool logprob). True when well formed.
    fn entry(&mut self, entries: &mut Entries) -> Scan<bool> {
        if self.sc.kind()? != Kind::Array {
            self.sc.value()?;
            return Ok(false);
        }
        if self.sc.array_start()? {
            return Ok(false);
        }
        let start = self.sc.pos;
        let logprob = match self.sc.kind()? {
            Kind::Number => {
                let kind = self.sc.scalar()?;
                let text = &self.sc.s[start..self.sc.pos];
                if kind == Some(NumKind::Int) {
                    match parse_i64(text) {
                        // Python's float(int) rounds to nearest, ties to even, like `as`.
                        Some(v) => Some(v as f64),
                        None => {
                            self.out.needs_twin = true;
                            None
                        }
                    }
                } else {
                    Some(parse_f64(text))
                }
            }
            Kind::Bool => {
                let truth = self.sc.peek() == Some(b't');
                self.sc.value()?;
                Some(if truth { 1.0 } else { 0.0 })
            }
            _ => {
                self.sc.value()?;
                None
            }
        };
        if !self.sc.array_next()? {
            return Ok(false);
        }
        let start = self.sc.pos;
        let id = match self.sc.kind()? {
            Kind::Number => {
                if self.sc.scalar()? == Some(NumKind::Int) {
                    let id = parse_i64(&self.sc.s[start..self.sc.pos]);
                    if id.is_none() {
                        self.out.needs_twin = true;
                    }
                    id
                } else {
                    None
                }
            }
            _ => {
                self.sc.value()?;
                None
            }
        };
        while self.sc.array_next()? {
            self.sc.value()?;
        }
        match (logprob, id) {
            (Some(logprob), Some(id)) => {
                entries.logprobs.push(logprob);
                entries.ids.push(id);
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

/// A reply that meets the contract, as offsets and plain values.
struct Good {
    ids: Vec<i64>,
    logprobs: Vec<f64>,
    completion_tokens: i64,
    finish_reason: Option<(usize, usize)>,
    message: (usize, usize),
    routed_experts: Option<Str>,
    indexer_topk: Option<Str>,
    prompt_tokens: Option<i64>,
    cached_tokens: Option<i64>,
    weight_version: Option<Str>,
    e2e_latency: Option<f64>,
    cuts: Vec<(usize, usize)>,
}

enum Verdict {
    Good(Box<Good>),
    /// The detail after the contract prefix.
    Broken(String),
    /// A malformed `output_token_logprobs` entry (its repr needs Python).
    BadEntry(usize, (usize, usize)),
    /// Leave the body to the twin.
    Twin,
}

/// The contract checks, in the order of `parse_reply` (python/sessiongate/session/reply.py).
fn judge(scan: ReplyScan) -> Verdict {
    use Verdict::Broken;
    if scan.needs_twin {
        return Verdict::Twin;
    }
    if scan.top != Some(Kind::Object) {
        return Broken("body is not a JSON object".into());
    }
    let Some(Choices::First(choice)) = scan.choices else {
        return Broken("'choices' is missing or empty".into());
    };
    let choice = *choice;
    let Some(Some((message, content))) = choice.message else {
        return Broken("choices[0].message is missing".into());
    };
    if content != Some(false) {
        return Broken("choices[0].message.content is null".into());
    }
    let Some(Some(meta)) = choice.meta else {
        return Broken("choices[0].meta_info is missing (was return_meta_info honoured?)".into());
    };
    let Some(Some(entries)) = meta.entries else {
        return Broken("choices[0].meta_info.output_token_logprobs is missing".into());
    };
    let Some(IntField::Int(completion_tokens)) = meta.completion_tokens else {
        return Broken("choices[0].meta_info.completion_tokens is missing".into());
    };
    if i64::try_from(entries.count) != Ok(completion_tokens) {
        return Broken(format!(
            "output_token_logprobs has {} entries but completion_tokens is {completion_tokens}",
            entries.count
        ));
    }
    if let Some((index, start, end)) = entries.first_bad {
        return Verdict::BadEntry(index, (start, end));
    }
    let b64 = |field: Option<R3Field>, name: &str| match field {
        None | Some(R3Field::Null) => Ok(None),
        Some(R3Field::Str(text)) => Ok(Some(text)),
        Some(R3Field::Other(kind)) => Err(Broken(format!(
            "choices[0].meta_info.{name} is not a base64 string (got {})",
            kind.name()
        ))),
    };
    let routed_experts = match b64(meta.routed_experts, "routed_experts") {
        Ok(text) => text,
        Err(verdict) => return verdict,
    };
    let indexer_topk = match b64(meta.indexer_topk, "indexer_topk") {
        Ok(text) => text,
        Err(verdict) => return verdict,
    };
    let int = |field: Option<IntField>| match field {
        Some(IntField::Int(v)) => Some(v),
        _ => None,
    };
    let weight_version = match (meta.weight_version, scan.metadata_weight_version) {
        (Some(StrField::Str(text)), _) | (_, Some(StrField::Str(text))) => Some(text),
        _ => None,
    };
    Verdict::Good(Box::new(Good {
        ids: entries.ids,
        logprobs: entries.logprobs,
        completion_tokens,
        finish_reason: meta.finish_reason.or(choice.finish_reason),
        message,
        routed_experts,
        indexer_topk,
        prompt_tokens: int(meta.prompt_tokens),
        cached_tokens: int(meta.cached_tokens),
        weight_version,
        e2e_latency: meta.e2e_latency.flatten(),
        cuts: scan.cuts,
    }))
}

fn scan_reply(data: &[u8]) -> Verdict {
    match ReplyScanner::run(data) {
        Ok(scan) => judge(scan),
        Err(_) => Verdict::Twin,
    }
}

// ---------------------------------------------------------------------------------------
// extract_reply

/// What `extract_reply` returns: the fields the session core needs from an upstream reply.
#[pyclass(module = "sessiongate._core", frozen)]
pub struct ExtractedReply {
    /// Sampled token ids: `output_token_logprobs[i][1]` of `choices[0].meta_info`.
    #[pyo3(get)]
    completion_ids: Py<PyAny>,
    /// Their logprobs as floats: `output_token_logprobs[i][0]`.
    #[pyo3(get)]
    logprobs: Py<PyAny>,
    /// `choices[0].meta_info.completion_tokens`.
    #[pyo3(get)]
    completion_tokens: Py<PyAny>,
    /// `meta_info.finish_reason` if present, else `choices[0].finish_reason` (or None).
    #[pyo3(get)]
    finish_reason: Py<PyAny>,
    /// `{"role": "assistant", "content": ..., "reasoning_content"?: ..., "tool_calls"?: ...}`
    /// from `choices[0].message`.
    #[pyo3(get)]
    message: Py<PyAny>,
    /// The reply for the client: the original bytes without the record-only members.
    #[pyo3(get)]
    client_body: Py<PyAny>,
    /// `choices[0].meta_info.prompt_tokens` when it is an int, else None.
    #[pyo3(get)]
    prompt_tokens: Py<PyAny>,
    /// `choices[0].meta_info.cached_tokens` when it is an int, else None.
    #[pyo3(get)]
    cached_tokens: Py<PyAny>,
    /// `choices[0].meta_info.weight_version` if a string, else the top-level
    /// `metadata.weight_version` if a string, else None.
    #[pyo3(get)]
    weight_version: Py<PyAny>,
    /// `choices[0].meta_info.e2e_latency` as a float when it is a number (not a bool), else
    /// None: the engine's seconds from receiving the request to finishing it.
    #[pyo3(get)]
    e2e_latency: Py<PyAny>,
    r3: B64Text,
    topk: B64Text,
}

/// Where a base64 member (`routed_experts`, `indexer_topk`) comes from.
enum B64Text {
    Absent,
    /// A bytes object already (escaped text, an input that is not `bytes`, the twin's result).
    Bytes(Py<PyAny>),
    /// A span of the (immutable) reply bytes: viewed without a copy, copied on first access
    /// of the bytes attribute.
    Span {
        body: Py<PyBytes>,
        start: usize,
        end: usize,
        copy: GILOnceCell<Py<PyAny>>,
    },
}

impl B64Text {
    /// The text of `text` in `data` (the bytes of `body`): a span of `body` when it is
    /// `bytes` and the text has no escapes, else a new bytes object; one still to be filled
    /// is pushed to `fills` with its source.
    fn new<'a>(
        body: &Bound<'_, PyAny>,
        data: &'a [u8],
        text: Option<Str>,
        fills: &mut Vec<(&'a [u8], Filler)>,
    ) -> PyResult<Self> {
        let py = body.py();
        let Some(text) = text else {
            return Ok(Self::Absent);
        };
        if text.escaped {
            let raw = unescape(&data[text.start..text.end]);
            return Ok(Self::Bytes(PyBytes::new(py, &raw).into_any().unbind()));
        }
        match body.downcast_exact::<PyBytes>() {
            // Immutable: keep a reference and copy only if asked.
            Ok(bytes) => Ok(Self::Span {
                body: bytes.clone().unbind(),
                start: text.start,
                end: text.end,
                copy: GILOnceCell::new(),
            }),
            Err(_) => {
                let raw = &data[text.start..text.end];
                let (bytes, fill) = new_bytes(py, raw.len())?;
                fills.push((raw, fill));
                Ok(Self::Bytes(bytes.into_any().unbind()))
            }
        }
    }

    /// From the twin's bytes (or None).
    fn from_twin(value: Bound<'_, PyAny>) -> Self {
        if value.is_none() {
            Self::Absent
        } else {
            Self::Bytes(value.unbind())
        }
    }

    /// The text as bytes (None if absent), copied from a span on first access.
    fn bytes(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match self {
            Self::Absent => Ok(py.None()),
            Self::Bytes(bytes) => Ok(bytes.clone_ref(py)),
            Self::Span {
                body,
                start,
                end,
                copy,
            } => copy
                .get_or_try_init(py, || {
                    let body = body.bind(py);
                    let src = &body.as_bytes()[*start..*end];
                    let (bytes, mut fill) = new_bytes(py, src.len())?;
                    maybe_unlocked(py, src.len(), || fill.put(src));
                    Ok::<_, PyErr>(bytes.into_any().unbind())
                })
                .map(|bytes| bytes.clone_ref(py)),
        }
    }

    /// The text as a read-only memoryview (None if absent): a slice of a span's reply.
    fn view(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match self {
            Self::Absent => Ok(py.None()),
            Self::Bytes(bytes) => Ok(PyMemoryView::from(bytes.bind(py))?.into_any().unbind()),
            Self::Span {
                body, start, end, ..
            } => {
                let view = PyMemoryView::from(body.bind(py).as_any())?;
                let slice = PySlice::new(py, *start as isize, *end as isize, 1);
                Ok(view.get_item(slice)?.unbind())
            }
        }
    }

    fn repr(&self, py: Python<'_>) -> PyResult<String> {
        Ok(match self {
            Self::Absent => "None".to_owned(),
            Self::Bytes(bytes) => format!("<{} bytes>", bytes.bind(py).len()?),
            Self::Span { start, end, .. } => format!("<{} bytes>", end - start),
        })
    }
}

#[pymethods]
impl ExtractedReply {
    /// The base64 text of `choices[0].meta_info.routed_experts` as bytes (None if absent
    /// or null). Copied from the reply on first access; `routed_experts_view` avoids that.
    #[getter]
    fn routed_experts(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.r3.bytes(py)
    }

    /// The same text as a read-only memoryview, without a copy when the reply was `bytes`
    /// (a slice of it, which keeps the reply alive); None if absent or null.
    #[getter]
    fn routed_experts_view(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.r3.view(py)
    }

    /// The base64 text of `choices[0].meta_info.indexer_topk` as bytes (None if absent or
    /// null). Copied from the reply on first access; `indexer_topk_view` avoids that.
    #[getter]
    fn indexer_topk(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.topk.bytes(py)
    }

    /// The same text as a read-only memoryview, without a copy when the reply was `bytes`
    /// (a slice of it, which keeps the reply alive); None if absent or null.
    #[getter]
    fn indexer_topk_view(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.topk.view(py)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "ExtractedReply(completion_tokens={}, finish_reason={}, prompt_tokens={}, \
             routed_experts={})",
            self.completion_tokens.bind(py).repr()?,
            self.finish_reason.bind(py).repr()?,
            self.prompt_tokens.bind(py).repr()?,
            self.r3.repr(py)?,
        ))
    }
}

impl ExtractedReply {
    /// The same fields, read from the twin's result.
    fn from_twin(reply: &Bound<'_, PyAny>) -> PyResult<Self> {
        let get = |name: &str| reply.getattr(name).map(Bound::unbind);
        Ok(Self {
            completion_ids: get("completion_ids")?,
            logprobs: get("logprobs")?,
            completion_tokens: get("completion_tokens")?,
            finish_reason: get("finish_reason")?,
            message: get("message")?,
            client_body: get("client_body")?,
            prompt_tokens: get("prompt_tokens")?,
            cached_tokens: get("cached_tokens")?,
            weight_version: get("weight_version")?,
            e2e_latency: get("e2e_latency")?,
            r3: B64Text::from_twin(reply.getattr("routed_experts")?),
            topk: B64Text::from_twin(reply.getattr("indexer_topk")?),
        })
    }
}

/// A JSON string of a document the scanner accepted, as the `str` `json.loads` makes of it.
fn py_str<'py>(py: Python<'py>, data: &[u8], text: Str) -> PyResult<Bound<'py, PyAny>> {
    if !text.escaped {
        if let Ok(plain) = std::str::from_utf8(&data[text.start..text.end]) {
            return Ok(PyString::new(py, plain).into_any());
        }
    }
    // With its quotes (`start` is one past the opening quote, `end` at the closing one):
    // escapes, lone surrogates included, as json.loads reads them.
    json_loads(py, &data[text.start - 1..text.end + 1])
}

/// Validate an upstream chat reply and extract what the session core needs (docs/relay.md).
#[pyfunction]
fn extract_reply(py: Python<'_>, body: &Bound<'_, PyAny>) -> PyResult<ExtractedReply> {
    let input = Input::get(body, "extract_reply", "body")?;
    let data = input.as_slice();
    let verdict = maybe_unlocked(py, data.len(), || scan_reply(data));
    let good = match verdict {
        Verdict::Good(good) => good,
        Verdict::Broken(detail) => return Err(contract_error(py, &detail)),
        Verdict::BadEntry(index, (start, end)) => {
            let entry = json_loads(py, &data[start..end])?.repr()?;
            let builtins = py.import("builtins")?;
            let short = builtins.getattr("format")?.call1((entry, ".80"))?;
            return Err(contract_error(
                py,
                &format!("output_token_logprobs[{index}] is not [logprob, token_id, ...]: {short}"),
            ));
        }
        Verdict::Twin => {
            let reply = twin(py, "extract_reply")?.call1((body,))?;
            return ExtractedReply::from_twin(&reply);
        }
    };

    let message = json_loads(py, &data[good.message.0..good.message.1])?;
    let message = message.downcast::<PyDict>()?;
    let assistant = PyDict::new(py);
    assistant.set_item(intern!(py, "role"), intern!(py, "assistant"))?;
    if let Some(content) = message.get_item(intern!(py, "content"))? {
        assistant.set_item(intern!(py, "content"), content)?;
    }
    if let Some(reasoning) = message.get_item(intern!(py, "reasoning_content"))? {
        if reasoning.is_instance_of::<PyString>() {
            assistant.set_item(intern!(py, "reasoning_content"), reasoning)?;
        }
    }
    if let Some(calls) = message.get_item(intern!(py, "tool_calls"))? {
        if calls.is_truthy()? {
            assistant.set_item(intern!(py, "tool_calls"), calls)?;
        }
    }
    let finish_reason = match good.finish_reason {
        Some((start, end)) => json_loads(py, &data[start..end])?,
        None => py.None().into_bound(py),
    };
    let weight_version = match good.weight_version {
        Some(text) => py_str(py, data, text)?,
        None => py.None().into_bound(py),
    };

    let (client_body, mut client_fill) = new_bytes(py, spliced_len(data.len(), &good.cuts))?;
    let mut fills: Vec<(&[u8], Filler)> = Vec::new();
    let r3 = B64Text::new(body, data, good.routed_experts, &mut fills)?;
    let topk = B64Text::new(body, data, good.indexer_topk, &mut fills)?;
    let cuts = &good.cuts;
    let copied = data.len() - good.cuts.iter().map(|(a, b)| b - a).sum::<usize>()
        + fills.iter().map(|(raw, _)| raw.len()).sum::<usize>();
    maybe_unlocked(py, copied, || {
        for_each_kept(data, cuts, |piece| client_fill.put(piece));
        for (raw, fill) in fills.iter_mut() {
            fill.put(raw);
        }
    });
    debug_assert!(client_fill.is_full());

    Ok(ExtractedReply {
        completion_ids: PyList::new(py, &good.ids)?.into_any().unbind(),
        logprobs: PyList::new(py, &good.logprobs)?.into_any().unbind(),
        completion_tokens: good
            .completion_tokens
            .into_pyobject(py)?
            .into_any()
            .unbind(),
        finish_reason: finish_reason.unbind(),
        message: assistant.into_any().unbind(),
        client_body: client_body.into_any().unbind(),
        prompt_tokens: good.prompt_tokens.into_pyobject(py)?.into_any().unbind(),
        cached_tokens: good.cached_tokens.into_pyobject(py)?.into_any().unbind(),
        weight_version: weight_version.unbind(),
        e2e_latency: good.e2e_latency.into_pyobject(py)?.into_any().unbind(),
        r3,
        topk,
    })
}

/// Test hook (`rust/testing.rs`): None when the Rust scanner accepts `body` as JSON, else
/// why it does not.
#[pyfunction]
pub(crate) fn json_reject(py: Python<'_>, body: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    let input = Input::get(body, "json_reject", "body")?;
    let data = input.as_slice();
    Ok(maybe_unlocked(py, data.len(), || validate(data))
        .err()
        .map(|r| format!("{} at byte {}", r.why, r.at)))
}

/// `CachedTokensWatch` of the twin: the same watch fed piece by piece (the Python pools'
/// streamed replies).
#[pyclass(name = "CachedTokensWatch", module = "sessiongate._core")]
struct PyCachedTokensWatch {
    // Boxed: the memmem searcher holds 32-byte-aligned SIMD state, and a pyclass's storage
    // is not aligned past 16 bytes (a misaligned AVX load crashes).
    watch: Box<CachedTokens>,
}

#[pymethods]
impl PyCachedTokensWatch {
    #[new]
    fn new() -> Self {
        Self {
            watch: Box::new(CachedTokens::new()),
        }
    }

    fn feed(&mut self, piece: &Bound<'_, PyAny>) -> PyResult<()> {
        let input = Input::get(piece, "feed", "piece")?;
        if !self.watch.done() {
            self.watch.feed(input.as_slice());
        }
        Ok(())
    }

    #[getter]
    fn done(&self) -> bool {
        self.watch.done()
    }

    fn finish(&self) -> Option<u64> {
        self.watch.finish()
    }
}

// ---------------------------------------------------------------------------------------
// rewrite_request

/// The top level of a request body: its kind, the offset of its `{`, and its members.
struct RequestScan {
    kind: Kind,
    open: usize,
    members: Vec<Member>,
}

fn scan_request(s: &[u8], names: &[Vec<u8>]) -> Scan<RequestScan> {
    let mut sc = Scanner::new(s);
    sc.ws();
    let kind = sc.kind()?;
    let open = sc.pos;
    let members = if kind == Kind::Object {
        sc.members_removing(names)?
    } else {
        sc.value()?;
        Vec::new()
    };
    sc.finish()?;
    Ok(RequestScan {
        kind,
        open,
        members,
    })
}

/// Deepest container nesting the fast serializer writes itself (then `json.dumps` takes
/// over, with its own circular-reference and recursion checks).
const MAX_WRITE_DEPTH: usize = 64;

/// Appends `obj` as `json.dumps(obj, separators=(",", ":"), ensure_ascii=False)` would
/// write it, for the plain types (None, bool, exact int / float / str / list / tuple, and
/// exact dicts with str keys). Ok(false) means "not a plain value": the caller truncates
/// and lets `json.dumps` do it.
///
/// # Safety
/// `obj` must be a valid object pointer and the GIL must be held. No Python code runs
/// while this walks containers (only C-level conversions of exact built-in types), so the
/// borrowed items stay valid.
unsafe fn write_plain(out: &mut Vec<u8>, obj: *mut ffi::PyObject, depth: usize) -> bool {
    if obj == ffi::Py_None() {
        out.extend_from_slice(b"null");
    } else if obj == ffi::Py_True() {
        out.extend_from_slice(b"true");
    } else if obj == ffi::Py_False() {
        out.extend_from_slice(b"false");
    } else if ffi::PyLong_CheckExact(obj) != 0 {
        let mut overflow = 0;
        let v = ffi::PyLong_AsLongLongAndOverflow(obj, &mut overflow);
        if overflow != 0 || (v == -1 && !ffi::PyErr_Occurred().is_null()) {
            ffi::PyErr_Clear();
            return false;
        }
        write_i64(out, v);
    } else if ffi::PyUnicode_CheckExact(obj) != 0 {
        let mut size: ffi::Py_ssize_t = 0;
        let ptr = ffi::PyUnicode_AsUTF8AndSize(obj, &mut size);
        if ptr.is_null() {
            // Lone surrogates: json.dumps + the twin's fallback for them.
            ffi::PyErr_Clear();
            return false;
        }
        let bytes = std::slice::from_raw_parts(ptr as *const u8, size as usize);
        match std::str::from_utf8(bytes) {
            Ok(text) => write_json_str(out, text),
            Err(_) => return false,
        }
    } else if ffi::PyFloat_CheckExact(obj) != 0 {
        let v = ffi::PyFloat_AsDouble(obj);
        if v.is_nan() {
            out.extend_from_slice(b"NaN");
        } else if v.is_infinite() {
            out.extend_from_slice(if v > 0.0 { b"Infinity" } else { b"-Infinity" });
        } else {
            // float.__repr__ (shortest round trip, Python's exponent rules).
            let repr = ffi::PyObject_Repr(obj);
            if repr.is_null() {
                ffi::PyErr_Clear();
                return false;
            }
            let mut size: ffi::Py_ssize_t = 0;
            let ptr = ffi::PyUnicode_AsUTF8AndSize(repr, &mut size);
            if ptr.is_null() {
                ffi::PyErr_Clear();
                ffi::Py_DecRef(repr);
                return false;
            }
            out.extend_from_slice(std::slice::from_raw_parts(ptr as *const u8, size as usize));
            ffi::Py_DecRef(repr);
        }
    } else if ffi::PyList_CheckExact(obj) != 0 || ffi::PyTuple_CheckExact(obj) != 0 {
        if depth >= MAX_WRITE_DEPTH {
            return false;
        }
        let is_list = ffi::PyList_CheckExact(obj) != 0;
        out.push(b'[');
        let mut i: ffi::Py_ssize_t = 0;
        loop {
            let len = if is_list {
                ffi::PyList_Size(obj)
            } else {
                ffi::PyTuple_Size(obj)
            };
            if i >= len {
                break;
            }
            let item = if is_list {
                ffi::PyList_GetItem(obj, i)
            } else {
                ffi::PyTuple_GetItem(obj, i)
            };
            if item.is_null() {
                ffi::PyErr_Clear();
                return false;
            }
            if i > 0 {
                out.push(b',');
            }
            if !write_plain(out, item, depth + 1) {
                return false;
            }
            i += 1;
        }
        out.push(b']');
    } else if ffi::PyDict_CheckExact(obj) != 0 {
        if depth >= MAX_WRITE_DEPTH {
            return false;
        }
        out.push(b'{');
        let mut pos: ffi::Py_ssize_t = 0;
        let mut key: *mut ffi::PyObject = std::ptr::null_mut();
        let mut value: *mut ffi::PyObject = std::ptr::null_mut();
        let mut first = true;
        while ffi::PyDict_Next(obj, &mut pos, &mut key, &mut value) != 0 {
            if ffi::PyUnicode_CheckExact(key) == 0 {
                return false;
            }
            if !first {
                out.push(b',');
            }
            first = false;
            if !write_plain(out, key, depth + 1) {
                return false;
            }
            out.push(b':');
            if !write_plain(out, value, depth + 1) {
                return false;
            }
        }
        out.push(b'}');
    } else {
        return false;
    }
    true
}

/// Appends the compact JSON of `obj`: the fast writer, else the twin's `_encode` (which
/// is `json.dumps`, with `ensure_ascii=True` for strings UTF-8 cannot hold).
fn encode_value(out: &mut Vec<u8>, obj: &Bound<'_, PyAny>) -> PyResult<()> {
    if write_int64_array(out, obj)? {
        return Ok(());
    }
    let mark = out.len();
    // SAFETY: obj is a live object and we hold the GIL (we have a Bound).
    if unsafe { write_plain(out, obj.as_ptr(), 0) } {
        return Ok(());
    }
    out.truncate(mark);
    let encoded = twin(obj.py(), "_encode")?.call1((obj,))?;
    out.extend_from_slice(encoded.downcast::<PyBytes>()?.as_bytes());
    Ok(())
}

static ARRAY_TYPE: GILOnceCell<Py<PyType>> = GILOnceCell::new();

/// An `array('q')` (a session's token ids) written as the JSON array of its ints, straight
/// from its buffer: false for anything else (other arrays go to the twin, which writes
/// every integer array as its `tolist()`).
fn write_int64_array(out: &mut Vec<u8>, obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = obj.py();
    let array_type = ARRAY_TYPE.import(py, "array", "array")?;
    if !obj.get_type().is(array_type) {
        return Ok(false);
    }
    let Ok(buffer) = PyBuffer::<i64>::get(obj) else {
        return Ok(false);
    };
    if buffer.format().to_bytes() != b"q" {
        return Ok(false);
    }
    let Some(items) = buffer.as_slice(py) else {
        return Ok(false);
    };
    out.reserve(items.len() * 7 + 2);
    out.push(b'[');
    for (index, item) in items.iter().enumerate() {
        if index > 0 {
            out.push(b',');
        }
        write_i64(out, item.get());
    }
    out.push(b']');
    Ok(true)
}

/// The UTF-8 of a field name as the scanner's `unescape` would produce it
/// (`encode("utf-8", "surrogatepass")`).
fn name_bytes(name: &Bound<'_, PyString>) -> PyResult<Vec<u8>> {
    match name.to_str() {
        Ok(text) => Ok(text.as_bytes().to_vec()),
        Err(_) => {
            let py = name.py();
            let raw = name.call_method1(intern!(py, "encode"), ("utf-8", "surrogatepass"))?;
            Ok(raw.downcast::<PyBytes>()?.as_bytes().to_vec())
        }
    }
}

/// The client's request body with the top-level members in `fields` set (docs/relay.md).
#[pyfunction]
fn rewrite_request<'py>(
    py: Python<'py>,
    body: &Bound<'py, PyAny>,
    fields: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let input = Input::get(body, "rewrite_request", "body")?;
    let dict = fields.downcast::<PyDict>().map_err(|_| {
        PyTypeError::new_err(format!(
            "rewrite_request() argument 'fields' must be dict, not {}",
            type_name(fields)
        ))
    })?;
    let mut names = Vec::with_capacity(dict.len());
    for key in dict.keys() {
        let name = key.downcast::<PyString>().map_err(|_| {
            PyTypeError::new_err(format!(
                "rewrite_request() keys of 'fields' must be str, not {}",
                type_name(&key)
            ))
        })?;
        names.push(name_bytes(name)?);
    }
    let data = input.as_slice();
    let scan = match maybe_unlocked(py, data.len(), || scan_request(data, &names)) {
        Ok(scan) => scan,
        Err(_) => {
            let out = twin(py, "rewrite_request")?.call1((body, fields))?;
            return Ok(out.downcast_into::<PyBytes>()?);
        }
    };
    if scan.kind != Kind::Object {
        return Err(SharedError::RequestRewrite.new_err(
            py,
            format!(
                "request body must be a JSON object, got {}",
                scan.kind.name()
            ),
        ));
    }
    let mut cuts = Vec::new();
    member_cuts(&scan.members, &mut cuts);
    let last_kept = scan.members.iter().rev().find(|m| !m.remove);
    let (insert_at, mut comma) = match last_kept {
        Some(member) => (member.value_end, true),
        None => (scan.open + 1, false),
    };
    let mut insert: Vec<u8> = Vec::new();
    // A snapshot: json.dumps (the fallback) may run code that touches `fields`.
    for item in dict.items().iter() {
        let (key, value): (Bound<'py, PyAny>, Bound<'py, PyAny>) = item.extract()?;
        if comma {
            insert.push(b',');
        }
        comma = true;
        encode_value(&mut insert, &key)?;
        insert.push(b':');
        encode_value(&mut insert, &value)?;
    }
    let total = spliced_len(data.len(), &cuts) + insert.len();
    let (out, mut fill) = new_bytes(py, total)?;
    maybe_unlocked(py, total, || {
        let mut inserted = false;
        let mut emit = |a: usize, b: usize| {
            if !inserted && a <= insert_at && insert_at <= b {
                fill.put(&data[a..insert_at]);
                fill.put(&insert);
                fill.put(&data[insert_at..b]);
                inserted = true;
            } else {
                fill.put(&data[a..b]);
            }
        };
        let mut at = 0;
        for &(a, b) in &cuts {
            emit(at, a);
            at = b;
        }
        emit(at, data.len());
    });
    debug_assert!(fill.is_full());
    Ok(out)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ExtractedReply>()?;
    m.add_function(wrap_pyfunction!(extract_reply, m)?)?;
    m.add_function(wrap_pyfunction!(rewrite_request, m)?)?;
    m.add_class::<PyCachedTokensWatch>()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ints() {
        for v in [0i64, 7, -7, 10, 99, 100, 12345, i64::MAX, i64::MIN] {
            assert_eq!(parse_i64(v.to_string().as_bytes()), Some(v));
        }
        assert_eq!(parse_i64(b"9223372036854775808"), None);
        assert_eq!(parse_i64(b"-0"), Some(0));
    }

    fn client(body: &str) -> String {
        match scan_reply(body.as_bytes()) {
            Verdict::Good(good) => {
                let mut out = Vec::new();
                for_each_kept(body.as_bytes(), &good.cuts, |p| out.extend_from_slice(p));
                String::from_utf8(out).unwrap_or_default()
            }
            _ => panic!("not a good reply"),
        }
    }

    #[test]
    fn splice_meta() {
        let head = r#"{"choices":[{"message":{"content":"x"},"meta_info":{"#;
        let tail = r#"}}]}"#;
        let base = r#""output_token_logprobs":[[-0.5,7,null]],"completion_tokens":1"#;
        for (meta, want) in [
            (
                format!(r#""routed_experts":"QUJD",{base}"#),
                base.to_owned(),
            ),
            (
                format!(r#"{base},"routed_experts":"QUJD""#),
                base.to_owned(),
            ),
            (
                format!(r#"{base}, "routed_experts" : "QUJD" , "indexer_topk":"QQ==""#),
                base.to_owned(),
            ),
        ] {
            assert_eq!(
                client(&format!("{head}{meta}{tail}")),
                format!("{head}{want}{tail}")
            );
        }
    }

    fn good(body: &str) -> Box<Good> {
        match scan_reply(body.as_bytes()) {
            Verdict::Good(good) => good,
            _ => panic!("not a good reply: {body}"),
        }
    }

    fn text(body: &str, span: Option<Str>) -> Option<&str> {
        span.map(|s| &body[s.start..s.end])
    }

    #[test]
    fn meta_extras() {
        let reply = |meta: &str, top: &str| {
            format!(
                r#"{{{top}"choices":[{{"message":{{"content":"x"}},"meta_info":{{"output_token_logprobs":[[-0.5,7,"a"]],"completion_tokens":1{meta}}}}}]}}"#
            )
        };
        let body = reply(
            r#","weight_version":"w1","cached_tokens":3,"indexer_topk":"QUJD""#,
            r#""metadata":{"weight_version":"top"},"#,
        );
        let g = good(&body);
        assert_eq!(text(&body, g.weight_version), Some("w1"));
        assert_eq!(text(&body, g.indexer_topk), Some("QUJD"));
        assert_eq!(g.cached_tokens, Some(3));
        // Not a string in meta_info: the top-level metadata's; last members win.
        let body = reply(
            r#","weight_version":null,"cached_tokens":true"#,
            r#""metadata":{"weight_version":"a","weight_version":"top"},"#,
        );
        let g = good(&body);
        assert_eq!(text(&body, g.weight_version), Some("top"));
        assert_eq!(g.cached_tokens, None);
        let body = reply(
            r#","weight_version":"w","weight_version":7"#,
            r#""metadata":{"weight_version":"top"},"metadata":[],"#,
        );
        assert!(good(&body).weight_version.is_none());
        // e2e_latency: any number as a float (an integer too), else None; the last one wins.
        assert_eq!(
            good(&reply(r#","e2e_latency":0.25"#, "")).e2e_latency,
            Some(0.25)
        );
        assert_eq!(
            good(&reply(r#","e2e_latency":-2"#, "")).e2e_latency,
            Some(-2.0)
        );
        assert_eq!(
            good(&reply(r#","e2e_latency":1e400"#, "")).e2e_latency,
            Some(f64::INFINITY)
        );
        assert_eq!(good(&reply("", "")).e2e_latency, None);
        for other in [r#""1""#, "true", "null", "[1]"] {
            let body = reply(&format!(r#","e2e_latency":1.5,"e2e_latency":{other}"#), "");
            assert_eq!(good(&body).e2e_latency, None, "{other}");
        }
        match scan_reply(reply(r#","indexer_topk":[1]"#, "").as_bytes()) {
            Verdict::Broken(detail) => assert_eq!(
                detail,
                "choices[0].meta_info.indexer_topk is not a base64 string (got array)"
            ),
            _ => panic!("indexer_topk [1] must break the contract"),
        }
    }
}
