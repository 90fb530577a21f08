//! Session routing stamping (docs/routing.md "Stamping in Rust"):
//!
//! - `HeaderStamper(session, parent, root)`: header names per tier, validated once (RFC 9110
//!   tokens, not owned by the gateway, unique case-insensitively), kept as interned Python
//!   strings; `stamp(session_id, parent_id, root_id)` builds the header dict of one request
//!   (a raw METH_FASTCALL method: see below). Every built-in header mode is one of these.
//! - `nvext_session_control(body, session_id, action, timeout)`: the request JSON with
//!   `nvext.session_control` set for NVIDIA Dynamo, by splicing the bytes (the rest of the body
//!   is copied, not re-serialised).
//!
//! Both match the pure-Python twins in `python/sessiongate/primitives/_py_stamp.py`: same
//! results (bodies parse equal; byte-equal for compact bodies without duplicate keys), same
//! exception classes and messages. Bodies the scanner of `rust/json_scan.rs` does not accept
//! (invalid JSON and the rare inputs only CPython reads) and ids that are not valid UTF-8 (lone
//! surrogates) are handed to the twin.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PyString, PyTuple};
use pyo3::{ffi, intern, Borrowed};

use crate::buffer::{new_bytes, Filler, Input};
use crate::error::SharedError;
use crate::gil::maybe_unlocked;
use crate::json_scan::{member_cuts, Kind, Member, Scan, Scanner};
use crate::json_write::{write_i64, write_json_str};
use crate::types::type_name;

// ---------------------------------------------------------------------------------------
// Header names (the rules of python/sessiongate/primitives/header_names.py)

/// RFC 9110 `tchar` besides letters and digits.
const TCHAR_PUNCT: &[u8] = b"!#$%&'*+-.^_`|~";

/// Names the gateway or the HTTP client set themselves (lowercase); a mode may not stamp them.
/// Same set as `RESERVED_HEADER_NAMES` in primitives/header_names.py (a test compares them).
const RESERVED_HEADER_NAMES: [&str; 12] = [
    "connection",
    "content-length",
    "content-type",
    "expect",
    "host",
    "http2-settings",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

const TIERS: [&str; 3] = ["session", "parent", "root"];

fn is_tchar(c: u32) -> bool {
    u8::try_from(c).is_ok_and(|b| b.is_ascii_alphanumeric() || TCHAR_PUNCT.contains(&b))
}

/// `name` if it may be stamped, else ValueError with `validate_header_name`'s message.
fn check_header_name(name: &Bound<'_, PyString>) -> PyResult<()> {
    if let Ok(text) = name.to_str() {
        if text.is_empty() {
            return Err(PyValueError::new_err("header name is empty"));
        }
        if text.bytes().all(|b| is_tchar(u32::from(b))) {
            let lower = text.to_ascii_lowercase();
            if RESERVED_HEADER_NAMES.contains(&lower.as_str()) {
                return Err(PyValueError::new_err(format!(
                    "header name {} is set by the gateway itself and cannot carry session identity",
                    name.repr()?
                )));
            }
            return Ok(());
        }
    }
    Err(not_a_token(name))
}

/// The "not an RFC 9110 token" error: the offending characters, distinct and sorted, each as
/// Python's `repr` writes it (read through the C API: the name may hold lone surrogates).
fn not_a_token(name: &Bound<'_, PyString>) -> PyErr {
    let py = name.py();
    let build = || -> PyResult<String> {
        let ptr = name.as_ptr();
        // SAFETY: `name` is a live str object; indices stay within 0..len.
        let len = unsafe { ffi::PyUnicode_GetLength(ptr) };
        let mut bad: Vec<(u32, isize)> = Vec::new();
        for pos in 0..len {
            let ch = unsafe { ffi::PyUnicode_ReadChar(ptr, pos) };
            if !is_tchar(ch) && !bad.iter().any(|&(c, _)| c == ch) {
                bad.push((ch, pos));
            }
        }
        bad.sort_unstable();
        let mut shown = Vec::with_capacity(bad.len());
        for (_, pos) in bad {
            // SAFETY: as above; PyUnicode_Substring returns a new reference or NULL + error.
            let one = unsafe {
                Bound::from_owned_ptr_or_err(py, ffi::PyUnicode_Substring(ptr, pos, pos + 1))
            }?;
            shown.push(one.repr()?.to_string());
        }
        Ok(format!(
            "header name {} is not an RFC 9110 token (offending characters: {}); use letters, \
             digits and !#$%&'*+-.^_`|~ only",
            name.repr()?,
            shown.join(", ")
        ))
    };
    match build() {
        Ok(msg) => PyValueError::new_err(msg),
        Err(err) => err,
    }
}

/// The names of one tier: a list or tuple of valid header names.
fn tier_names<'py>(arg: &Bound<'py, PyAny>, tier: &str) -> PyResult<Vec<Bound<'py, PyString>>> {
    let items: Vec<Bound<'py, PyAny>> = if let Ok(list) = arg.downcast::<PyList>() {
        list.iter().collect()
    } else if let Ok(tuple) = arg.downcast::<PyTuple>() {
        tuple.iter().collect()
    } else {
        return Err(PyTypeError::new_err(format!(
            "HeaderStamper() argument '{tier}' must be a list or tuple of str, not {}",
            type_name(arg)
        )));
    };
    let mut names = Vec::with_capacity(items.len());
    for (index, item) in items.into_iter().enumerate() {
        let name = item.downcast_into::<PyString>().map_err(|err| {
            PyTypeError::new_err(format!(
                "HeaderStamper() argument '{tier}' item {index} must be str, not {}",
                type_name(err.into_inner().as_any())
            ))
        })?;
        check_header_name(&name)?;
        names.push(name);
    }
    Ok(names)
}

/// Refuses a name used twice (in one tier or in two), compared case-insensitively: one of
/// the two headers would silently win. Same message as `IdentityHeaders.Options`.
fn check_unique(tiers: &[Vec<Bound<'_, PyString>>; 3]) -> PyResult<()> {
    // (lowercase name, tier index, name as given)
    let mut seen: Vec<(String, usize, &Bound<'_, PyString>)> = Vec::new();
    for (t, names) in tiers.iter().enumerate() {
        for name in names {
            // Validated tokens are ASCII.
            let lower = name.to_str()?.to_ascii_lowercase();
            if let Some(&(_, prior_t, prior)) = seen.iter().find(|(l, _, _)| *l == lower) {
                let place = if prior_t == t {
                    format!("twice in {}", TIERS[t])
                } else {
                    format!("in {} and {}", TIERS[prior_t], TIERS[t])
                };
                return Err(PyValueError::new_err(format!(
                    "header name {name_repr} appears {place} (as {} and {name_repr}; names are \
                     compared case-insensitively); give each header one job",
                    prior.repr()?,
                    name_repr = name.repr()?,
                )));
            }
            seen.push((lower, t, name));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// HeaderStamper

/// Header names per tier, validated once; `stamp` builds one request's header dict.
#[pyclass(module = "sessiongate._core", frozen)]
pub struct HeaderStamper {
    /// Interned names: dict insertion reuses their cached hashes.
    session: Vec<Py<PyString>>,
    parent: Vec<Py<PyString>>,
    root: Vec<Py<PyString>>,
}

fn names_tuple<'py>(py: Python<'py>, names: &[Py<PyString>]) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(py, names.iter().map(|n| n.bind(py)))
}

#[pymethods]
impl HeaderStamper {
    #[new]
    #[pyo3(signature = (session, parent, root))]
    fn new(
        py: Python<'_>,
        session: &Bound<'_, PyAny>,
        parent: &Bound<'_, PyAny>,
        root: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let tiers = [
            tier_names(session, TIERS[0])?,
            tier_names(parent, TIERS[1])?,
            tier_names(root, TIERS[2])?,
        ];
        check_unique(&tiers)?;
        let intern = |names: &[Bound<'_, PyString>]| -> PyResult<Vec<Py<PyString>>> {
            names
                .iter()
                .map(|n| Ok(PyString::intern(py, n.to_str()?).unbind()))
                .collect()
        };
        Ok(Self {
            session: intern(&tiers[0])?,
            parent: intern(&tiers[1])?,
            root: intern(&tiers[2])?,
        })
    }

    /// Names that carry the session id.
    #[getter]
    fn session<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        names_tuple(py, &self.session)
    }

    /// Names that carry the parent id (child sessions only).
    #[getter]
    fn parent<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        names_tuple(py, &self.parent)
    }

    /// Names that carry the root id.
    #[getter]
    fn root<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        names_tuple(py, &self.root)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "HeaderStamper(session={}, parent={}, root={})",
            names_tuple(py, &self.session)?.repr()?,
            names_tuple(py, &self.parent)?.repr()?,
            names_tuple(py, &self.root)?.repr()?,
        ))
    }
}

// ---------------------------------------------------------------------------------------
// HeaderStamper.stamp: a raw METH_FASTCALL method
//
// `stamp` runs once per upstream request and does very little (a dict of one to a few
// entries), so PyO3's generic method wrapper (GIL bookkeeping, argument parsing) costs about
// a quarter of its time (~45 ns instead of ~36 ns for one header, docs/performance.md). It is
// therefore a plain CPython method descriptor, installed on the class by `register`: the
// common call (three positional arguments of the right types) touches nothing but the C API;
// everything else takes `stamp_slow`, which binds arguments and reports errors exactly like
// the twin (a Python method) does.

const STAMP_ARGS: [&str; 3] = ["session_id", "parent_id", "root_id"];

/// A `PyMethodDef` in a static (it must outlive the type; the pointers are to static data).
struct MethodDef(ffi::PyMethodDef);

// SAFETY: the definition is immutable and only holds pointers to static C strings and a
// function; CPython reads it under the GIL.
unsafe impl Sync for MethodDef {}

static STAMP_DEF: MethodDef = MethodDef(ffi::PyMethodDef {
    ml_name: c"stamp".as_ptr(),
    ml_meth: ffi::PyMethodDefPointer {
        PyCFunctionFastWithKeywords: stamp_method,
    },
    ml_flags: ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
    ml_doc: c"stamp($self, session_id, parent_id, root_id)
--

A new dict: `session_id` under every session name, `parent_id` under every parent name
unless it is None, `root_id` under every root name."
        .as_ptr(),
});

/// Adds `stamp` to the class.
fn install_stamp(py: Python<'_>) -> PyResult<()> {
    let cls = py.get_type::<HeaderStamper>();
    // SAFETY: the type object is live; STAMP_DEF is static and never written (CPython takes
    // a mutable pointer but does not modify the definition).
    let descr = unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            ffi::PyDescr_NewMethod(
                cls.as_type_ptr(),
                std::ptr::addr_of!(STAMP_DEF.0) as *mut ffi::PyMethodDef,
            ),
        )
    }?;
    cls.setattr(intern!(py, "stamp"), descr)
}

/// `vectorcall` entry point of `HeaderStamper.stamp`.
///
/// # Safety
/// Called by CPython with the GIL held: `slf` is a `HeaderStamper` (the method descriptor
/// checks the type, and the class cannot be subclassed), `args` holds `nargs` positional
/// arguments followed by one value per name in `kwnames` (NULL when there are none).
unsafe extern "C" fn stamp_method(
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    let outcome = std::panic::catch_unwind(|| {
        let py = Python::assume_gil_acquired();
        if nargs == 3 && kwnames.is_null() {
            let args = std::slice::from_raw_parts(args, 3);
            let (sid, pid, rid) = (args[0], args[1], args[2]);
            let is_str = |o: *mut ffi::PyObject| ffi::PyUnicode_Check(o) != 0;
            if is_str(sid) && is_str(rid) && (pid == ffi::Py_None() || is_str(pid)) {
                let this = Borrowed::from_ptr(py, slf);
                let this = this.downcast_unchecked::<HeaderStamper>().get();
                return stamp_dict(this, sid, pid, rid);
            }
        }
        stamp_slow(py, slf, args, nargs, kwnames)
    });
    match outcome {
        Ok(out) => out,
        Err(_) => {
            ffi::PyErr_SetString(
                ffi::PyExc_SystemError,
                c"HeaderStamper.stamp() panicked".as_ptr(),
            );
            std::ptr::null_mut()
        }
    }
}

/// The header dict (a new reference, or NULL with an exception set).
///
/// # Safety
/// GIL held; `sid` and `rid` are str, `pid` is str or None.
unsafe fn stamp_dict(
    this: &HeaderStamper,
    sid: *mut ffi::PyObject,
    pid: *mut ffi::PyObject,
    rid: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    let out = ffi::PyDict_New();
    if out.is_null() {
        return out;
    }
    let parent: &[Py<PyString>] = if pid == ffi::Py_None() {
        &[]
    } else {
        &this.parent
    };
    for (names, value) in [
        (&this.session[..], sid),
        (parent, pid),
        (&this.root[..], rid),
    ] {
        for name in names {
            // Exact interned str keys: the insert runs no Python code.
            if ffi::PyDict_SetItem(out, name.as_ptr(), value) < 0 {
                ffi::Py_DecRef(out);
                return std::ptr::null_mut();
            }
        }
    }
    out
}

/// Any other call: keyword arguments, a wrong count, wrong types. Binds the arguments like
/// a Python method with the same signature, with the same error messages as the twin.
///
/// # Safety
/// As for `stamp_method`.
unsafe fn stamp_slow(
    py: Python<'_>,
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    match bind_stamp_args(py, args, nargs, kwnames) {
        Ok([sid, pid, rid]) => {
            let check = |value: *mut ffi::PyObject, arg: usize, or_none: bool| {
                if ffi::PyUnicode_Check(value) != 0 || (or_none && value == ffi::Py_None()) {
                    return Ok(());
                }
                let value = Borrowed::from_ptr(py, value);
                Err(format!(
                    "stamp() argument '{}' must be str{}, not {}",
                    STAMP_ARGS[arg],
                    if or_none { " or None" } else { "" },
                    type_name(&value)
                ))
            };
            match check(sid, 0, false)
                .and_then(|()| check(pid, 1, true))
                .and_then(|()| check(rid, 2, false))
            {
                Ok(()) => {
                    let this = Borrowed::from_ptr(py, slf);
                    stamp_dict(
                        this.downcast_unchecked::<HeaderStamper>().get(),
                        sid,
                        pid,
                        rid,
                    )
                }
                Err(msg) => raise_type_error(&msg),
            }
        }
        Err(msg) => raise_type_error(&msg),
    }
}

/// The three arguments by position, or the TypeError message CPython gives for a method
/// `stamp(self, session_id, parent_id, root_id)` called this way.
///
/// # Safety
/// As for `stamp_method`.
unsafe fn bind_stamp_args(
    py: Python<'_>,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> Result<[*mut ffi::PyObject; 3], String> {
    const WHERE: &str = "HeaderStamper.stamp()";
    let positional = usize::try_from(nargs).unwrap_or(0);
    if positional > 3 {
        return Err(format!(
            "{WHERE} takes 4 positional arguments but {} were given",
            positional + 1
        ));
    }
    let n_kw = if kwnames.is_null() {
        0
    } else {
        usize::try_from(ffi::PyTuple_Size(kwnames)).unwrap_or(0)
    };
    let values: &[*mut ffi::PyObject] = if args.is_null() || positional + n_kw == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(args, positional + n_kw)
    };
    let mut slots = [std::ptr::null_mut(); 3];
    slots[..positional].copy_from_slice(&values[..positional]);
    for (k, &value) in values[positional..].iter().enumerate() {
        // Keyword names are str (CPython checks that before the call).
        let name = Borrowed::from_ptr(py, ffi::PyTuple_GetItem(kwnames, k as ffi::Py_ssize_t));
        let name = name.str().map(|s| s.to_string()).unwrap_or_default();
        let Some(slot) = STAMP_ARGS.iter().position(|a| *a == name) else {
            return Err(format!(
                "{WHERE} got an unexpected keyword argument '{name}'"
            ));
        };
        if !slots[slot].is_null() {
            return Err(format!("{WHERE} got multiple values for argument '{name}'"));
        }
        slots[slot] = value;
    }
    let missing: Vec<String> = (0..3)
        .filter(|&i| slots[i].is_null())
        .map(|i| format!("'{}'", STAMP_ARGS[i]))
        .collect();
    let listed = match missing.as_slice() {
        [] => return Ok(slots),
        [one] => one.clone(),
        [a, b] => format!("{a} and {b}"),
        [first @ .., last] => format!("{}, and {last}", first.join(", ")),
    };
    let plural = if missing.len() == 1 { "" } else { "s" };
    Err(format!(
        "{WHERE} missing {} required positional argument{plural}: {listed}",
        missing.len()
    ))
}

/// Sets a TypeError and returns NULL (messages hold no NUL bytes: they quote Rust literals,
/// keyword names and type names).
///
/// # Safety
/// GIL held.
unsafe fn raise_type_error(msg: &str) -> *mut ffi::PyObject {
    let text = std::ffi::CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    ffi::PyErr_SetString(ffi::PyExc_TypeError, text.as_ptr());
    std::ptr::null_mut()
}

// ---------------------------------------------------------------------------------------
// nvext.session_control: scan

/// An object: the offset of its `{` and its members (those marked `remove` are cut), and
/// what `inner` found in the value of the last member of the name looked for.
#[derive(Debug)]
struct Obj<T> {
    open: usize,
    members: Vec<Member>,
    found: Option<T>,
}

/// A member's value: its span, and the scan of it when it is an object.
#[derive(Debug)]
struct Slot<T> {
    start: usize,
    end: usize,
    inner: Option<T>,
}

/// `session_control`: the mode's keys marked for removal.
type Control = Obj<()>;
/// `nvext`: earlier duplicates of `session_control` marked for removal.
type Nvext = Obj<Slot<Control>>;
/// The body: earlier duplicates of `nvext` marked for removal.
type Body = Obj<Slot<Nvext>>;

/// The object at the cursor. Members named `name` have their value read by `inner`; all but
/// the last of them are marked for removal (JSON parsers keep the last duplicate, so the
/// last one is the member that counts; the others would confuse stricter parsers).
fn object_named<T>(
    sc: &mut Scanner<'_>,
    name: &[u8],
    inner: &mut dyn FnMut(&mut Scanner<'_>) -> Scan<T>,
) -> Scan<Obj<T>> {
    let open = sc.pos;
    let mut found = None;
    let mut members = sc.members(|sc, key| {
        let hit = sc.key_is(key, name);
        if hit {
            found = Some(inner(sc)?);
        } else {
            sc.value()?;
        }
        Ok(hit)
    })?;
    // The last of the members named `name` stays.
    if let Some(member) = members.iter_mut().rev().find(|m| m.remove) {
        member.remove = false;
    }
    Ok(Obj {
        open,
        members,
        found,
    })
}

/// The value at the cursor; `inner` reads it when it is an object.
fn slot<T>(
    sc: &mut Scanner<'_>,
    inner: &mut dyn FnMut(&mut Scanner<'_>) -> Scan<T>,
) -> Scan<Slot<T>> {
    let start = sc.pos;
    let inner = if sc.kind()? == Kind::Object {
        Some(inner(sc)?)
    } else {
        sc.value()?;
        None
    };
    Ok(Slot {
        start,
        end: sc.pos,
        inner,
    })
}

/// The `session_control` object at the cursor, every member named in `keys` marked.
fn control(sc: &mut Scanner<'_>, keys: &[&[u8]]) -> Scan<Control> {
    let open = sc.pos;
    Ok(Obj {
        open,
        members: sc.members_removing(keys)?,
        found: None,
    })
}

/// The whole document: the kind of its top-level value and, for an object, its scan.
struct BodyScan {
    kind: Kind,
    body: Option<Body>,
}

fn scan_body(s: &[u8], keys: &[&[u8]]) -> Scan<BodyScan> {
    let mut sc = Scanner::new(s);
    sc.ws();
    let kind = sc.kind()?;
    let body = if kind == Kind::Object {
        let mut in_control = |sc: &mut Scanner<'_>| control(sc, keys);
        let mut control_slot = |sc: &mut Scanner<'_>| slot(sc, &mut in_control);
        let mut in_nvext =
            |sc: &mut Scanner<'_>| object_named(sc, b"session_control", &mut control_slot);
        let mut nvext_slot = |sc: &mut Scanner<'_>| slot(sc, &mut in_nvext);
        Some(object_named(&mut sc, b"nvext", &mut nvext_slot)?)
    } else {
        sc.value()?;
        None
    };
    sc.finish()?;
    Ok(BodyScan { kind, body })
}

// ---------------------------------------------------------------------------------------
// nvext.session_control: splice

/// Replace `s[start..end]` by `text` (an insertion when the range is empty).
#[derive(Debug, PartialEq, Eq)]
struct Edit {
    start: usize,
    end: usize,
    text: Vec<u8>,
}

/// Cuts the members of `obj` marked for removal (each with its comma).
fn cut_removed<T>(obj: &Obj<T>, edits: &mut Vec<Edit>) {
    if obj.members.iter().any(|m| m.remove) {
        let mut cuts = Vec::new();
        member_cuts(&obj.members, &mut cuts);
        edits.extend(cuts.into_iter().map(|(start, end)| Edit {
            start,
            end,
            text: Vec::new(),
        }));
    }
}

/// Adds the member text `parts` (concatenated) as the last member of `obj`.
fn append<T>(obj: &Obj<T>, parts: &[&[u8]], edits: &mut Vec<Edit>) {
    let (at, comma) = match obj.members.iter().rev().find(|m| !m.remove) {
        Some(member) => (member.value_end, true),
        None => (obj.open + 1, false),
    };
    let mut text = Vec::with_capacity(parts.iter().map(|p| p.len()).sum::<usize>() + 1);
    if comma {
        text.push(b',');
    }
    for part in parts {
        text.extend_from_slice(part);
    }
    edits.push(Edit {
        start: at,
        end: at,
        text,
    });
}

/// Replaces the value of `slot` by `parts` (concatenated).
fn replace<T>(slot: &Slot<T>, parts: &[&[u8]], edits: &mut Vec<Edit>) {
    edits.push(Edit {
        start: slot.start,
        end: slot.end,
        text: parts.concat(),
    });
}

/// The edits that set `nvext.session_control` to carry `members` (the mode's members, as
/// compact JSON text without braces). Sorted and disjoint: every cut and insertion inside an
/// object lies between its `{` and its last kept member's end, nested edits lie inside their
/// parent's value, and a replaced value has no nested edits.
fn plan(body: &Body, members: &[u8]) -> Vec<Edit> {
    let mut edits = Vec::new();
    cut_removed(body, &mut edits);
    match &body.found {
        None => append(
            body,
            &[br#""nvext":{"session_control":{"#, members, b"}}"],
            &mut edits,
        ),
        Some(nvext_slot) => match &nvext_slot.inner {
            None => replace(
                nvext_slot,
                &[br#"{"session_control":{"#, members, b"}}"],
                &mut edits,
            ),
            Some(nvext) => {
                cut_removed(nvext, &mut edits);
                match &nvext.found {
                    None => append(
                        nvext,
                        &[br#""session_control":{"#, members, b"}"],
                        &mut edits,
                    ),
                    Some(control_slot) => match &control_slot.inner {
                        None => replace(control_slot, &[b"{", members, b"}"], &mut edits),
                        Some(control) => {
                            cut_removed(control, &mut edits);
                            append(control, &[members], &mut edits);
                        }
                    },
                }
            }
        },
    }
    // An insertion sorts before a cut that starts at the same offset.
    edits.sort_unstable_by_key(|e| (e.start, e.end));
    edits
}

fn spliced_size(len: usize, edits: &[Edit]) -> usize {
    edits
        .iter()
        .fold(len, |n, e| n - (e.end - e.start) + e.text.len())
}

/// Writes `data` with `edits` applied into `fill` (which has room for exactly that).
fn apply(data: &[u8], edits: &[Edit], fill: &mut Filler) {
    let mut at = 0;
    for edit in edits {
        fill.put(&data[at..edit.start]);
        fill.put(&edit.text);
        at = edit.end;
    }
    fill.put(&data[at..]);
}

/// `data` with `edits` applied, as a Vec (tests).
#[cfg(test)]
fn applied(data: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut at = 0;
    for edit in edits {
        out.extend_from_slice(&data[at..edit.start]);
        out.extend_from_slice(&edit.text);
        at = edit.end;
    }
    out.extend_from_slice(&data[at..]);
    out
}

// ---------------------------------------------------------------------------------------
// nvext_session_control

static TWIN_NVEXT: GILOnceCell<Py<PyAny>> = GILOnceCell::new();

/// The twin's `nvext_session_control`, for what the fast path leaves to CPython.
fn twin_nvext<'py>(
    py: Python<'py>,
    args: (
        &Bound<'py, PyAny>,
        &Bound<'py, PyAny>,
        &Bound<'py, PyAny>,
        &Bound<'py, PyAny>,
    ),
) -> PyResult<Bound<'py, PyBytes>> {
    let func = TWIN_NVEXT.get_or_try_init(py, || {
        py.import("sessiongate.primitives._py_stamp")?
            .getattr("nvext_session_control")
            .map(Bound::unbind)
    })?;
    Ok(func.bind(py).call1(args)?.downcast_into::<PyBytes>()?)
}

fn str_arg<'a, 'py>(value: &'a Bound<'py, PyAny>, arg: &str) -> PyResult<&'a Bound<'py, PyString>> {
    value.downcast::<PyString>().map_err(|_| {
        PyTypeError::new_err(format!(
            "nvext_session_control() argument '{arg}' must be str, not {}",
            type_name(value)
        ))
    })
}

/// Appends the decimal text of the int `timeout` (`int.__repr__`, as `json.dumps` writes it).
fn write_timeout(out: &mut Vec<u8>, timeout: &Bound<'_, PyAny>) -> PyResult<()> {
    if timeout.is_instance_of::<PyBool>() || !timeout.is_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err(format!(
            "nvext_session_control() argument 'timeout' must be int or None, not {}",
            type_name(timeout)
        )));
    }
    match timeout.extract::<i64>() {
        Ok(v) => write_i64(out, v),
        Err(_) => {
            // Beyond i64: the exact int's str (subclasses print as plain ints too).
            // SAFETY: PyNumber_Index returns a new reference or NULL with an exception set.
            let exact = unsafe {
                Bound::from_owned_ptr_or_err(timeout.py(), ffi::PyNumber_Index(timeout.as_ptr()))
            }?;
            out.extend_from_slice(exact.str()?.to_str()?.as_bytes());
        }
    }
    Ok(())
}

const KEYS_BIND: [&[u8]; 3] = [b"session_id", b"action", b"timeout"];
const KEYS_CLOSE: [&[u8]; 2] = [b"session_id", b"action"];

/// The request JSON with `nvext.session_control` carrying `session_id`, `action` and, unless
/// `timeout` is None, `timeout` (docs/routing.md, `dynamo_nvext`).
#[pyfunction]
#[pyo3(signature = (body, session_id, action, timeout))]
fn nvext_session_control<'py>(
    py: Python<'py>,
    body: &Bound<'py, PyAny>,
    session_id: &Bound<'py, PyAny>,
    action: &Bound<'py, PyAny>,
    timeout: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let input = Input::get(body, "nvext_session_control", "body")?;
    let sid = str_arg(session_id, "session_id")?;
    let act = str_arg(action, "action")?;
    let (Ok(sid), Ok(act)) = (sid.to_str(), act.to_str()) else {
        // Lone surrogates (no UTF-8 form): the twin writes them as escapes.
        return twin_nvext(py, (body, session_id, action, timeout));
    };
    let mut members: Vec<u8> = Vec::with_capacity(64 + sid.len() + act.len());
    members.extend_from_slice(br#""session_id":"#);
    write_json_str(&mut members, sid);
    members.extend_from_slice(br#","action":"#);
    write_json_str(&mut members, act);
    let keys: &[&[u8]] = if timeout.is_none() {
        &KEYS_CLOSE
    } else {
        members.extend_from_slice(br#","timeout":"#);
        write_timeout(&mut members, timeout)?;
        &KEYS_BIND
    };

    let data = input.as_slice();
    let scan = match maybe_unlocked(py, data.len(), || scan_body(data, keys)) {
        Ok(scan) => scan,
        Err(_) => return twin_nvext(py, (body, session_id, action, timeout)),
    };
    let Some(doc) = scan.body else {
        return Err(SharedError::RequestRewrite.new_err(
            py,
            format!(
                "request body must be a JSON object, got {}",
                scan.kind.name()
            ),
        ));
    };
    let edits = plan(&doc, &members);
    let total = spliced_size(data.len(), &edits);
    let (out, mut fill) = new_bytes(py, total)?;
    maybe_unlocked(py, total, || apply(data, &edits, &mut fill));
    debug_assert!(fill.is_full());
    Ok(out)
}

/// Test hook (`rust/testing.rs`): `RESERVED_HEADER_NAMES` as compiled in (compared with
/// primitives/header_names.py).
#[pyfunction]
pub(crate) fn reserved_header_names(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
    PyTuple::new(py, RESERVED_HEADER_NAMES)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<HeaderStamper>()?;
    install_stamp(m.py())?;
    m.add_function(wrap_pyfunction!(nvext_session_control, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const BIND: &str = r#""session_id":"s","action":"bind","timeout":5"#;

    fn stamped(body: &str, keys: &[&[u8]]) -> String {
        let scan = scan_body(body.as_bytes(), keys).expect("valid JSON");
        let doc = scan.body.expect("an object");
        let edits = plan(&doc, BIND.as_bytes());
        let out = applied(body.as_bytes(), &edits);
        assert_eq!(out.len(), spliced_size(body.len(), &edits));
        String::from_utf8(out).unwrap_or_default()
    }

    #[test]
    fn splices() {
        let sc = |inner: &str| format!(r#"{{"session_control":{{{inner}}}}}"#);
        let cases: Vec<(&str, String)> = vec![
            ("{}", format!(r#"{{"nvext":{}}}"#, sc(BIND))),
            (" { } ", format!(r#" {{"nvext":{} }} "#, sc(BIND))),
            (r#"{"a":1}"#, format!(r#"{{"a":1,"nvext":{}}}"#, sc(BIND))),
            (
                r#"{"nvext":3,"a":1}"#,
                format!(r#"{{"nvext":{},"a":1}}"#, sc(BIND)),
            ),
            (
                r#"{"nvext":{"x":[1]}}"#,
                format!(r#"{{"nvext":{{"x":[1],"session_control":{{{BIND}}}}}}}"#),
            ),
            (
                r#"{"nvext":{"session_control":null,"x":1}}"#,
                format!(r#"{{"nvext":{{"session_control":{{{BIND}}},"x":1}}}}"#),
            ),
            (
                r#"{"nvext":{"session_control":{"timeout":1,"k":2,"action":"x"}}}"#,
                format!(r#"{{"nvext":{{"session_control":{{"k":2,{BIND}}}}}}}"#),
            ),
            (
                r#"{"nvext":{"session_control":{ "session_id" : "c" , "action":"x"}}}"#,
                format!(r#"{{"nvext":{}}}"#, sc(&format!("{BIND} "))),
            ),
            // Duplicates: the last nvext / session_control counts, earlier ones go.
            (
                r#"{"nvext":{"a":1},"m":0,"nvext":{"b":2}}"#,
                format!(r#"{{"m":0,"nvext":{{"b":2,"session_control":{{{BIND}}}}}}}"#),
            ),
            (
                r#"{"nvext":{"session_control":{"k":1},"session_control":[]}}"#,
                format!(r#"{{"nvext":{}}}"#, sc(BIND)),
            ),
            (
                r#"{"\u006evext":{"session_control":{"session_id":"a","session_id":"b"}}}"#,
                format!(r#"{{"\u006evext":{}}}"#, sc(BIND)),
            ),
            // Nested nvext members elsewhere are not touched.
            (
                r#"{"m":[{"nvext":1}]}"#,
                format!(r#"{{"m":[{{"nvext":1}}],"nvext":{}}}"#, sc(BIND)),
            ),
        ];
        for (body, want) in cases {
            assert_eq!(stamped(body, &KEYS_BIND), want, "{body}");
        }
        // Without a timeout, the client's timeout survives.
        assert_eq!(
            stamped(
                r#"{"nvext":{"session_control":{"timeout":1,"action":"x"}}}"#,
                &KEYS_CLOSE
            ),
            format!(r#"{{"nvext":{{"session_control":{{"timeout":1,{BIND}}}}}}}"#)
        );
    }

    #[test]
    fn rejects_like_the_scanner() {
        for bad in ["", "{", r#"{"nvext":}"#, r#"{"a":1} x"#, "[1,]"] {
            assert!(scan_body(bad.as_bytes(), &KEYS_BIND).is_err(), "{bad}");
        }
        for other in ["[]", "1", "\"s\"", "null"] {
            let scan = scan_body(other.as_bytes(), &KEYS_BIND).expect("valid JSON");
            assert!(scan.body.is_none());
        }
    }

    #[test]
    fn tchars() {
        for c in "!#$%&'*+-.^_`|~09azAZ".chars() {
            assert!(is_tchar(u32::from(c)), "{c}");
        }
        for c in " \"(),/:;<=>?@[\\]{}\u{7f}\u{e9}".chars() {
            assert!(!is_tchar(u32::from(c)), "{c}");
        }
    }
}
