//! A validating, non-allocating JSON scanner over bytes, for the primitives that splice JSON
//! (`rust/relay.rs`, `rust/stamp.rs`). It reports byte spans instead of building values;
//! [`read_py`] builds Python values on it for the one primitive that reads whole JSON
//! documents into objects (the envelope meta, `rust/frame.rs`).
//!
//! Grammar: exactly what CPython's `json.loads` accepts on strict UTF-8 input: the JSON
//! grammar plus `NaN`, `Infinity` and `-Infinity`, escapes `\uXXXX` that may be lone
//! surrogates, whitespace `[ \t\n\r]`, no control characters inside strings. Anything this
//! scanner does not accept is a [`Reject`]; callers then hand the input to the pure-Python
//! twin, whose `json.loads` has the last word (and the exact error message). Inputs that only
//! the twin accepts: UTF-8 with a BOM, UTF-16/32, encoded surrogates ("surrogatepass"),
//! nesting deeper than [`MAX_DEPTH`], integers longer than [`MAX_INT_DIGITS`] digits (CPython
//! may refuse those, depending on `sys.set_int_max_str_digits`). A reject's reason is worded as
//! `json.JSONDecodeError`'s message for the same error, at the same offset.
//!
//! Strings are skipped 64 bytes at a time (SSE2 on x86_64, 8 bytes at a time elsewhere), so a
//! 100 MiB base64 member costs about one pass over memory.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString};

/// Deepest nesting accepted here; deeper documents go to the twin (CPython's own limit
/// depends on the recursion limit and the current stack, so stay well below it).
pub const MAX_DEPTH: usize = 256;
/// Longest integer literal accepted here: CPython's `int()` digit limit can be lowered to
/// 640 (`sys.int_info.str_digits_check_threshold`) but not below, so shorter ones always parse.
pub const MAX_INT_DIGITS: usize = 640;

/// Why the scanner gave up, and where (the splicing primitives hand the input to the twin,
/// whose message users see; the envelope reports it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    pub at: usize,
    pub why: &'static str,
}

pub type Scan<T> = Result<T, Reject>;

fn reject<T>(at: usize, why: &'static str) -> Scan<T> {
    Err(Reject { at, why })
}

/// The reason for nesting deeper than the scanner's limit (callers may name the limit).
pub const TOO_DEEP: &str = "nesting too deep";
const EXPECTING_VALUE: &str = "Expecting value";
const UNTERMINATED: &str = "Unterminated string starting at";

/// A string's content span (between the quotes) and whether it holds any escape.
#[derive(Debug, Clone, Copy)]
pub struct Str {
    pub start: usize,
    pub end: usize,
    pub escaped: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumKind {
    /// `-?(0|[1-9][0-9]*)`: a Python int.
    Int,
    /// With a fraction or an exponent, or NaN / Infinity / -Infinity: a Python float.
    Float,
}

/// What kind of value starts at a position (from its first byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Object,
    Array,
    String,
    Number,
    Bool,
    Null,
}

impl Kind {
    pub fn of(first: u8) -> Kind {
        match first {
            b'{' => Kind::Object,
            b'[' => Kind::Array,
            b'"' => Kind::String,
            b't' | b'f' => Kind::Bool,
            b'n' => Kind::Null,
            _ => Kind::Number,
        }
    }

    /// The JSON name of the kind, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Object => "object",
            Kind::Array => "array",
            Kind::String => "string",
            Kind::Number => "number",
            Kind::Bool => "boolean",
            Kind::Null => "null",
        }
    }
}

/// A member's key as it appears in an object.
#[derive(Debug, Clone, Copy)]
pub struct Key {
    /// Offset of the key's opening quote.
    pub start: usize,
    pub text: Str,
}

pub struct Scanner<'a> {
    pub s: &'a [u8],
    pub pos: usize,
    depth: usize,
    max_depth: usize,
    max_int_digits: usize,
}

impl<'a> Scanner<'a> {
    /// A scanner with the limits under which CPython surely agrees ([`MAX_DEPTH`],
    /// [`MAX_INT_DIGITS`]).
    pub fn new(s: &'a [u8]) -> Self {
        Self::with_limits(s, MAX_DEPTH, MAX_INT_DIGITS)
    }

    /// A scanner with other limits, for a caller that does not hand rejects to a twin.
    pub fn with_limits(s: &'a [u8], max_depth: usize, max_int_digits: usize) -> Self {
        Scanner {
            s,
            pos: 0,
            depth: 0,
            max_depth,
            max_int_digits,
        }
    }

    #[inline]
    pub fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    #[inline]
    pub fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.s.get(self.pos) {
            self.pos += 1;
        }
    }

    /// After the top-level value: only whitespace may follow.
    pub fn finish(&mut self) -> Scan<()> {
        self.ws();
        if self.pos != self.s.len() {
            return reject(self.pos, "Extra data");
        }
        Ok(())
    }

    /// The kind of the value at the cursor (which must be at a value's first byte).
    pub fn kind(&self) -> Scan<Kind> {
        match self.peek() {
            Some(c) => Ok(Kind::of(c)),
            None => reject(self.pos, EXPECTING_VALUE),
        }
    }

    fn enter(&mut self) -> Scan<()> {
        self.depth += 1;
        if self.depth > self.max_depth {
            return reject(self.pos, TOO_DEEP);
        }
        Ok(())
    }

    /// Validates and skips one value at the cursor (no leading whitespace).
    pub fn value(&mut self) -> Scan<()> {
        match self.peek() {
            Some(b'"') => self.string().map(|_| ()),
            Some(b'{') => {
                if self.object_start()? {
                    return Ok(());
                }
                loop {
                    self.key()?;
                    self.value()?;
                    if !self.object_next()? {
                        return Ok(());
                    }
                }
            }
            Some(b'[') => {
                if self.array_start()? {
                    return Ok(());
                }
                loop {
                    self.value()?;
                    if !self.array_next()? {
                        return Ok(());
                    }
                }
            }
            _ => self.scalar().map(|_| ()),
        }
    }

    /// A number or a literal (null, true, false, NaN, Infinity, -Infinity).
    pub fn scalar(&mut self) -> Scan<Option<NumKind>> {
        let rest = &self.s[self.pos.min(self.s.len())..];
        let (len, kind) = match rest.first() {
            Some(b'n') if rest.starts_with(b"null") => (4, None),
            Some(b't') if rest.starts_with(b"true") => (4, None),
            Some(b'f') if rest.starts_with(b"false") => (5, None),
            Some(b'N') if rest.starts_with(b"NaN") => (3, Some(NumKind::Float)),
            Some(b'I') if rest.starts_with(b"Infinity") => (8, Some(NumKind::Float)),
            Some(b'-') if rest.starts_with(b"-Infinity") => (9, Some(NumKind::Float)),
            Some(b'-' | b'0'..=b'9') => return self.number().map(Some),
            _ => return reject(self.pos, EXPECTING_VALUE),
        };
        self.pos += len;
        Ok(kind)
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while let Some(b'0'..=b'9') = self.s.get(self.pos) {
            self.pos += 1;
        }
        self.pos - start
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?`, as CPython's scanner reads it: a
    /// '.' or an exponent without digits ends the number before it (the caller then fails
    /// on the stray character).
    pub fn number(&mut self) -> Scan<NumKind> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        let int_start = self.pos;
        match self.peek() {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return reject(start, EXPECTING_VALUE),
        }
        let int_digits = self.pos - int_start;
        let mut kind = NumKind::Int;
        if self.peek() == Some(b'.') && matches!(self.s.get(self.pos + 1), Some(b'0'..=b'9')) {
            self.pos += 1;
            self.digits();
            kind = NumKind::Float;
        }
        if let Some(b'e' | b'E') = self.peek() {
            let mark = self.pos;
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            if self.digits() > 0 {
                kind = NumKind::Float;
            } else {
                self.pos = mark;
            }
        }
        if kind == NumKind::Int && int_digits > self.max_int_digits {
            return reject(start, "integer too long for every int() digit limit");
        }
        Ok(kind)
    }

    /// A string at the cursor (which must be at its opening quote).
    pub fn string(&mut self) -> Scan<Str> {
        let s = self.s;
        let begin = self.pos;
        if s.get(begin) != Some(&b'"') {
            return reject(begin, "expecting string");
        }
        let start = begin + 1;
        let mut i = start;
        let mut escaped = false;
        loop {
            i = find_special(s, i);
            match s.get(i) {
                None => return reject(begin, UNTERMINATED),
                Some(b'"') => {
                    self.pos = i + 1;
                    return Ok(Str {
                        start,
                        end: i,
                        escaped,
                    });
                }
                Some(b'\\') => {
                    escaped = true;
                    i = escape_end(s, i, begin)?;
                }
                Some(&c) if c < 0x20 => return reject(i, "Invalid control character at"),
                Some(_) => {
                    // A run of non-ASCII characters (text in most languages but English).
                    while s.get(i).is_some_and(|&c| c >= 0x80) {
                        i = utf8_char_end(s, i)?;
                    }
                }
            }
        }
    }

    /// `{` and the whitespace after it; true when the object is empty (`}` consumed too).
    pub fn object_start(&mut self) -> Scan<bool> {
        self.container_start(b'}')
    }

    /// A member's key, the ':' and the whitespace up to the value.
    pub fn key(&mut self) -> Scan<Key> {
        let start = self.pos;
        if self.peek() != Some(b'"') {
            return reject(
                self.pos,
                "Expecting property name enclosed in double quotes",
            );
        }
        let text = self.string()?;
        self.ws();
        if self.peek() != Some(b':') {
            return reject(self.pos, "Expecting ':' delimiter");
        }
        self.pos += 1;
        self.ws();
        Ok(Key { start, text })
    }

    /// The members of the object at the cursor (at its `{`), in order, with their spans:
    /// `member` reads each one's value (the cursor at it, its key given) and says whether the
    /// member is to be removed. The splicing primitives' one member loop.
    pub fn members(
        &mut self,
        mut member: impl FnMut(&mut Self, &Key) -> Scan<bool>,
    ) -> Scan<Vec<Member>> {
        let mut members = Vec::new();
        if self.object_start()? {
            return Ok(members);
        }
        loop {
            let key = self.key()?;
            let remove = member(self, &key)?;
            members.push(Member {
                key_start: key.start,
                value_end: self.pos,
                remove,
            });
            if !self.object_next()? {
                return Ok(members);
            }
        }
    }

    /// The members of the object at the cursor, those whose key is one of `names` marked
    /// for removal.
    pub fn members_removing<N: AsRef<[u8]>>(&mut self, names: &[N]) -> Scan<Vec<Member>> {
        self.members(|sc, key| {
            let remove = names.iter().any(|name| sc.key_is(key, name.as_ref()));
            sc.value()?;
            Ok(remove)
        })
    }

    /// After a member's value: true if another member follows (cursor at its key),
    /// false at the end of the object (`}` consumed).
    pub fn object_next(&mut self) -> Scan<bool> {
        self.container_next(b'}')
    }

    /// `[` and the whitespace after it; true when the array is empty (`]` consumed too).
    pub fn array_start(&mut self) -> Scan<bool> {
        self.container_start(b']')
    }

    /// After an element: true if another element follows (cursor at it), false at the end
    /// of the array (`]` consumed).
    pub fn array_next(&mut self) -> Scan<bool> {
        self.container_next(b']')
    }

    /// The opening bracket and the whitespace after it; true when the container is empty
    /// (its `close` consumed too).
    fn container_start(&mut self, close: u8) -> Scan<bool> {
        self.enter()?;
        self.pos += 1;
        self.ws();
        if self.peek() == Some(close) {
            self.pos += 1;
            self.depth -= 1;
            return Ok(true);
        }
        Ok(false)
    }

    /// After an item: true at ',' (cursor at the next item), false at `close` (consumed).
    fn container_next(&mut self, close: u8) -> Scan<bool> {
        self.ws();
        match self.peek() {
            Some(b',') => {
                self.pos += 1;
                self.ws();
                Ok(true)
            }
            Some(c) if c == close => {
                self.pos += 1;
                self.depth -= 1;
                Ok(false)
            }
            _ => reject(self.pos, "Expecting ',' delimiter"),
        }
    }

    /// Does `key` decode to `name`? (Raw comparison unless the key has escapes.)
    pub fn key_is(&self, key: &Key, name: &[u8]) -> bool {
        let raw = &self.s[key.text.start..key.text.end];
        if !key.text.escaped {
            return raw == name;
        }
        unescape(raw) == name
    }
}

/// End of the escape sequence starting at the backslash at `i`, in the string whose
/// opening quote is at `begin`.
fn escape_end(s: &[u8], i: usize, begin: usize) -> Scan<usize> {
    match s.get(i + 1) {
        Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => Ok(i + 2),
        Some(b'u') => {
            if hex4(s, i + 2).is_none() {
                return reject(i, "Invalid \\uXXXX escape");
            }
            Ok(i + 6)
        }
        Some(_) => reject(i, "Invalid \\escape"),
        None => reject(begin, UNTERMINATED),
    }
}

fn hex4(s: &[u8], at: usize) -> Option<u32> {
    let quad = s.get(at..at + 4)?;
    let mut v = 0u32;
    for &c in quad {
        v = (v << 4) | char::from(c).to_digit(16)?;
    }
    Some(v)
}

/// End of the (strict, shortest-form, non-surrogate) UTF-8 character starting at `i`.
#[inline]
fn utf8_char_end(s: &[u8], i: usize) -> Scan<usize> {
    let b0 = s[i];
    let cont = |k: usize, lo: u8, hi: u8| s.get(i + k).is_some_and(|&b| (lo..=hi).contains(&b));
    let ok = match b0 {
        0xc2..=0xdf => cont(1, 0x80, 0xbf).then_some(2),
        0xe0 => (cont(1, 0xa0, 0xbf) && cont(2, 0x80, 0xbf)).then_some(3),
        0xe1..=0xec | 0xee..=0xef => (cont(1, 0x80, 0xbf) && cont(2, 0x80, 0xbf)).then_some(3),
        // 0xed 0xa0..=0xbf would be a surrogate: only the twin ("surrogatepass") takes those.
        0xed => (cont(1, 0x80, 0x9f) && cont(2, 0x80, 0xbf)).then_some(3),
        0xf0 => (cont(1, 0x90, 0xbf) && cont(2, 0x80, 0xbf) && cont(3, 0x80, 0xbf)).then_some(4),
        0xf1..=0xf3 => {
            (cont(1, 0x80, 0xbf) && cont(2, 0x80, 0xbf) && cont(3, 0x80, 0xbf)).then_some(4)
        }
        0xf4 => (cont(1, 0x80, 0x8f) && cont(2, 0x80, 0xbf) && cont(3, 0x80, 0xbf)).then_some(4),
        _ => None,
    };
    match ok {
        Some(n) => Ok(i + n),
        None => reject(i, "invalid UTF-8"),
    }
}

/// Index of the first byte at or after `i` that is '"', '\\', a control character or
/// non-ASCII; `s.len()` if there is none.
#[inline]
pub fn find_special(s: &[u8], i: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        // AVX2 when the CPU has it (std caches the answer): in cache the skip is
        // compute-bound (a 1 MiB string: SSE2 25 GB/s, AVX2 45 GB/s), and it was a tenth of
        // an R3 turn's worker CPU. Short strings stay on SSE2.
        if s.len() >= i.saturating_add(AVX2_FROM) && std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return unsafe { find_special_avx2(s, i) };
        }
        find_special_sse2(s, i)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        find_special_swar(s, i)
    }
}

#[inline]
fn is_special(c: u8) -> bool {
    c == b'"' || c == b'\\' || !(0x20..0x80).contains(&c)
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn find_special_sse2(s: &[u8], mut i: usize) -> usize {
    use std::arch::x86_64::*;
    let len = s.len();
    // SAFETY: SSE2 is part of the x86_64 baseline; every load reads 16 bytes inside `s`
    // (checked by the loop conditions), unaligned loads are allowed.
    unsafe {
        let quote = _mm_set1_epi8(b'"' as i8);
        let bslash = _mm_set1_epi8(b'\\' as i8);
        let space = _mm_set1_epi8(0x20);
        // Signed compare: bytes >= 0x80 are negative, so `x < 0x20` also flags non-ASCII.
        let special = |p: *const u8| {
            let x = _mm_loadu_si128(p as *const __m128i);
            _mm_or_si128(
                _mm_or_si128(_mm_cmpeq_epi8(x, quote), _mm_cmpeq_epi8(x, bslash)),
                _mm_cmplt_epi8(x, space),
            )
        };
        let base = s.as_ptr();
        while i + 64 <= len {
            let p = base.add(i);
            let a = special(p);
            let b = special(p.add(16));
            let c = special(p.add(32));
            let d = special(p.add(48));
            let any = _mm_or_si128(_mm_or_si128(a, b), _mm_or_si128(c, d));
            if _mm_movemask_epi8(any) != 0 {
                for (k, m) in [a, b, c, d].into_iter().enumerate() {
                    let bits = _mm_movemask_epi8(m);
                    if bits != 0 {
                        return i + 16 * k + bits.trailing_zeros() as usize;
                    }
                }
            }
            i += 64;
        }
        while i + 16 <= len {
            let bits = _mm_movemask_epi8(special(base.add(i)));
            if bits != 0 {
                return i + bits.trailing_zeros() as usize;
            }
            i += 16;
        }
    }
    while i < len && !is_special(s[i]) {
        i += 1;
    }
    i
}

/// Strings shorter than this are skipped with SSE2 (a few 16-byte steps; no gain from AVX2).
#[cfg(target_arch = "x86_64")]
const AVX2_FROM: usize = 256;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn find_special_avx2(s: &[u8], mut i: usize) -> usize {
    use std::arch::x86_64::*;
    let len = s.len();
    let quote = _mm256_set1_epi8(b'"' as i8);
    let bslash = _mm256_set1_epi8(b'\\' as i8);
    let space = _mm256_set1_epi8(0x20);
    // As in SSE2: a signed `0x20 > x` also flags non-ASCII (negative) bytes.
    let special = |p: *const u8| {
        // SAFETY: callers pass a pointer with 32 readable bytes (checked by the loop).
        let x = unsafe { _mm256_loadu_si256(p as *const __m256i) };
        _mm256_or_si256(
            _mm256_or_si256(_mm256_cmpeq_epi8(x, quote), _mm256_cmpeq_epi8(x, bslash)),
            _mm256_cmpgt_epi8(space, x),
        )
    };
    let base = s.as_ptr();
    while i + 64 <= len {
        // SAFETY: `i + 64 <= len`, so both 32-byte loads are inside `s`.
        let (a, b) = unsafe { (special(base.add(i)), special(base.add(i + 32))) };
        let low = _mm256_movemask_epi8(a) as u32;
        let high = _mm256_movemask_epi8(b) as u32;
        let bits = (u64::from(high) << 32) | u64::from(low);
        if bits != 0 {
            return i + bits.trailing_zeros() as usize;
        }
        i += 64;
    }
    find_special_sse2(s, i)
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn find_special_swar(s: &[u8], mut i: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let has_zero = |v: u64| v.wrapping_sub(ONES) & !v & HIGH;
    while i + 8 <= s.len() {
        let mut word = [0u8; 8];
        word.copy_from_slice(&s[i..i + 8]);
        let v = u64::from_le_bytes(word);
        // Non-ASCII, below 0x20, '"' or '\\' (the has-zero tricks may flag a byte after a
        // true hit, never miss one; the exact byte is found below).
        let hit = (v & HIGH)
            | v.wrapping_sub(ONES * 0x20) & !v & HIGH
            | has_zero(v ^ (ONES * u64::from(b'"')))
            | has_zero(v ^ (ONES * u64::from(b'\\')));
        if hit != 0 {
            break;
        }
        i += 8;
    }
    while i < s.len() && !is_special(s[i]) {
        i += 1;
    }
    i
}

/// The text of a validated string's content (`raw`, between the quotes) with escapes
/// decoded as CPython's `json` does (a high surrogate followed by a `\u` low surrogate is
/// joined, any other surrogate stays alone), encoded as UTF-8 with lone surrogates in their
/// 3-byte forms: exactly `s.encode("utf-8", "surrogatepass")` of the Python string.
pub fn unescape(raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let c = raw[i];
        if c != b'\\' {
            out.push(c);
            i += 1;
            continue;
        }
        let Some(&esc) = raw.get(i + 1) else {
            break;
        };
        let simple = match esc {
            b'b' => 0x08,
            b'f' => 0x0c,
            b'n' => b'\n',
            b'r' => b'\r',
            b't' => b'\t',
            b'u' => 0,
            other => other,
        };
        if esc != b'u' {
            out.push(simple);
            i += 2;
            continue;
        }
        let mut cp = hex4(raw, i + 2).unwrap_or(0xfffd);
        i += 6;
        if (0xd800..=0xdbff).contains(&cp)
            && raw.get(i) == Some(&b'\\')
            && raw.get(i + 1) == Some(&b'u')
        {
            if let Some(low) = hex4(raw, i + 2) {
                if (0xdc00..=0xdfff).contains(&low) {
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
                    i += 6;
                }
            }
        }
        push_code_point(&mut out, cp);
    }
    out
}

/// UTF-8 encoding of a code point, surrogates included (as their 3-byte forms).
pub(crate) fn push_code_point(buf: &mut Vec<u8>, cp: u32) {
    if cp < 0x80 {
        buf.push(cp as u8);
    } else if cp < 0x800 {
        buf.extend_from_slice(&[0xc0 | (cp >> 6) as u8, 0x80 | (cp & 0x3f) as u8]);
    } else if cp < 0x10000 {
        buf.extend_from_slice(&[
            0xe0 | (cp >> 12) as u8,
            0x80 | ((cp >> 6) & 0x3f) as u8,
            0x80 | (cp & 0x3f) as u8,
        ]);
    } else {
        buf.extend_from_slice(&[
            0xf0 | (cp >> 18) as u8,
            0x80 | ((cp >> 12) & 0x3f) as u8,
            0x80 | ((cp >> 6) & 0x3f) as u8,
            0x80 | (cp & 0x3f) as u8,
        ]);
    }
}

/// Validates a whole document: `Ok(())` iff this scanner accepts it.
pub fn validate(s: &[u8]) -> Scan<()> {
    let mut sc = Scanner::new(s);
    sc.ws();
    sc.value()?;
    sc.finish()
}

/// One member of an object, for splicing: where its key starts, where its value ends, and
/// whether it is to be removed.
#[derive(Debug, Clone, Copy)]
pub struct Member {
    pub key_start: usize,
    pub value_end: usize,
    pub remove: bool,
}

/// Byte ranges to cut from an object so that exactly the members marked `remove` disappear
/// and the rest keep their text and separators (one comma per removed member goes with it).
/// Ranges come out sorted and disjoint, appended to `cuts`.
pub fn member_cuts(members: &[Member], cuts: &mut Vec<(usize, usize)>) {
    let first = cuts.len();
    let mut last_kept: Option<usize> = None;
    let n = members.len();
    // kept_after[i]: some member after i is kept.
    let mut kept_after = vec![false; n];
    let mut any = false;
    for i in (0..n).rev() {
        kept_after[i] = any;
        any |= !members[i].remove;
    }
    for (i, m) in members.iter().enumerate() {
        if !m.remove {
            last_kept = Some(i);
            continue;
        }
        let range = if kept_after[i] {
            // A later member exists: take this one up to the next key (its comma included).
            (m.key_start, members[i + 1].key_start)
        } else if let Some(k) = last_kept {
            // Trailing removed members: cut from the end of the last kept value.
            (members[k].value_end, m.value_end)
        } else if i + 1 < n {
            (m.key_start, members[i + 1].key_start)
        } else {
            (m.key_start, m.value_end)
        };
        cuts.push(range);
    }
    // Merge overlaps (trailing removed members share their start).
    let tail = &mut cuts[first..];
    tail.sort_unstable();
    let mut merged: Vec<(usize, usize)> = Vec::with_capacity(tail.len());
    for &(a, b) in tail.iter() {
        match merged.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    cuts.truncate(first);
    cuts.extend(merged);
}

/// Total length of `len` bytes with the (sorted, disjoint) `cuts` removed.
pub fn spliced_len(len: usize, cuts: &[(usize, usize)]) -> usize {
    len - cuts.iter().map(|(a, b)| b - a).sum::<usize>()
}

/// Calls `put` with each piece of `s` that survives the (sorted, disjoint) `cuts`.
pub fn for_each_kept(s: &[u8], cuts: &[(usize, usize)], mut put: impl FnMut(&[u8])) {
    let mut at = 0;
    for &(a, b) in cuts {
        if a > at {
            put(&s[at..a]);
        }
        at = b;
    }
    if at < s.len() {
        put(&s[at..]);
    }
}

// ---------------------------------------------------------------------------------------
// Python values

/// Why [`read_py`] failed: the text is not JSON (for the scanner), or making a value raised
/// (an int beyond CPython's digit limit, a failed allocation).
pub enum ReadFail {
    Reject(Reject),
    Py(PyErr),
}

impl From<Reject> for ReadFail {
    fn from(reject: Reject) -> Self {
        ReadFail::Reject(reject)
    }
}

impl From<PyErr> for ReadFail {
    fn from(err: PyErr) -> Self {
        ReadFail::Py(err)
    }
}

/// `json.loads` of a whole document (valid UTF-8) into Python objects: CPython's grammar and
/// values (NaN / Infinity / -Infinity, lone surrogate escapes kept, the last of duplicate
/// keys wins), nesting up to `max_depth`, integers of any length (`int()` applies CPython's
/// digit limit).
pub fn read_py<'py>(
    py: Python<'py>,
    s: &[u8],
    max_depth: usize,
) -> Result<Bound<'py, PyAny>, ReadFail> {
    let mut sc = Scanner::with_limits(s, max_depth, usize::MAX);
    sc.ws();
    let value = py_value(py, &mut sc)?;
    sc.finish()?;
    Ok(value)
}

fn py_value<'py>(py: Python<'py>, sc: &mut Scanner<'_>) -> Result<Bound<'py, PyAny>, ReadFail> {
    match sc.kind()? {
        Kind::Object => {
            let dict = PyDict::new(py);
            if !sc.object_start()? {
                loop {
                    let key = sc.key()?;
                    let key = py_str(py, sc.s, key.text)?;
                    dict.set_item(key, py_value(py, sc)?)?;
                    if !sc.object_next()? {
                        break;
                    }
                }
            }
            Ok(dict.into_any())
        }
        Kind::Array => {
            let mut items = Vec::new();
            if !sc.array_start()? {
                loop {
                    items.push(py_value(py, sc)?);
                    if !sc.array_next()? {
                        break;
                    }
                }
            }
            Ok(PyList::new(py, items)?.into_any())
        }
        Kind::String => {
            let text = sc.string()?;
            Ok(py_str(py, sc.s, text)?.into_any())
        }
        Kind::Number | Kind::Bool | Kind::Null => {
            let start = sc.pos;
            let kind = sc.scalar()?;
            py_scalar(py, &sc.s[start..sc.pos], kind)
        }
    }
}

/// The value of a scanned number or literal (`text`, ASCII).
fn py_scalar<'py>(
    py: Python<'py>,
    text: &[u8],
    kind: Option<NumKind>,
) -> Result<Bound<'py, PyAny>, ReadFail> {
    let float = |v: f64| Ok(PyFloat::new(py, v).into_any());
    match (kind, text) {
        (None, b"null") => Ok(py.None().into_bound(py)),
        (None, b"true") => Ok(PyBool::new(py, true).to_owned().into_any()),
        (None, _) => Ok(PyBool::new(py, false).to_owned().into_any()),
        (Some(_), b"NaN") => float(f64::NAN),
        (Some(_), b"Infinity") => float(f64::INFINITY),
        (Some(_), b"-Infinity") => float(f64::NEG_INFINITY),
        (Some(NumKind::Float), _) => {
            let text = std::str::from_utf8(text).unwrap_or("");
            float(text.parse().unwrap_or(f64::NAN))
        }
        (Some(NumKind::Int), _) => {
            let text = std::str::from_utf8(text).unwrap_or("");
            if let Ok(v) = text.parse::<i64>() {
                return Ok(PyInt::new(py, v).into_any());
            }
            // Beyond i64: int() builds it, under CPython's digit limit as json's does.
            Ok(py.get_type::<PyInt>().call1((text,))?)
        }
    }
}

/// The Python str of a scanned string.
fn py_str<'py>(py: Python<'py>, s: &[u8], text: Str) -> PyResult<Bound<'py, PyString>> {
    let raw = &s[text.start..text.end];
    let decoded;
    let bytes = if text.escaped {
        decoded = unescape(raw);
        &decoded[..]
    } else {
        raw
    };
    if let Ok(text) = std::str::from_utf8(bytes) {
        return Ok(PyString::new(py, text));
    }
    // Only escaped lone surrogates make it invalid UTF-8 (the scanner validated the rest):
    // "surrogatepass" maps their 3-byte forms back to code points, as Python strs hold them.
    // SAFETY: `bytes` outlives the call; the result is a new reference or NULL + exception.
    let obj = unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            ffi::PyUnicode_DecodeUTF8(
                bytes.as_ptr().cast(),
                bytes.len() as ffi::Py_ssize_t,
                c"surrogatepass".as_ptr(),
            ),
        )
    }?;
    Ok(obj.downcast_into::<PyString>()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> bool {
        validate(s.as_bytes()).is_ok()
    }

    #[test]
    fn grammar() {
        for good in [
            "{}",
            " [ ] ",
            r#"{"a":[1,-0,2.5e-3,1E+2,NaN,Infinity,-Infinity,true,false,null,"x\u00e9\ud800"]}"#,
            "\"caf\u{e9} \u{1f600}\"",
            "0",
        ] {
            assert!(ok(good), "{good}");
        }
        for bad in [
            "",
            "{",
            "[1,]",
            "{\"a\"}",
            "01",
            "1.",
            "-",
            "1e",
            "[1 2]",
            "\"\\x\"",
            "\"\\u12\"",
            "\"a\nb\"",
            "nul",
            "{} x",
            "{'a':1}",
            "[-Inf]",
        ] {
            assert!(!ok(bad), "{bad}");
        }
        assert!(validate(b"\"\xed\xa0\x80\"").is_err());
        assert!(validate(b"\"\xc0\x80\"").is_err());
        assert!(validate("[".repeat(MAX_DEPTH + 1).as_bytes()).is_err());
    }

    #[test]
    fn rejects_say_what_json_loads_says_where_it_says_it() {
        let why = |s: &str| validate(s.as_bytes()).err().map(|r| (r.at, r.why));
        assert_eq!(why(r#"{"a":}"#), Some((5, "Expecting value")));
        assert_eq!(why("{} {}"), Some((3, "Extra data")));
        assert_eq!(why(r#"{"a" 1}"#), Some((5, "Expecting ':' delimiter")));
        assert_eq!(why("[1 2]"), Some((3, "Expecting ',' delimiter")));
        assert_eq!(why("\"ab\\"), Some((0, "Unterminated string starting at")));
        assert_eq!(why("\"a\u{1}\""), Some((2, "Invalid control character at")));
        assert_eq!(
            why(r#"["\ud800\u12"]"#),
            Some((8, "Invalid \\uXXXX escape"))
        );
        let deep = "[".repeat(11);
        let mut sc = Scanner::with_limits(deep.as_bytes(), 10, MAX_INT_DIGITS);
        assert_eq!(
            sc.value().err().map(|r| (r.at, r.why)),
            Some((10, TOO_DEEP))
        );
    }

    #[test]
    fn long_strings_find_every_special_byte() {
        for at in 0..200 {
            for bad in [b'"', b'\\', 0x01, 0x80] {
                let mut s = vec![b'a'; 200];
                s[at] = bad;
                assert_eq!(find_special(&s, 0), at);
            }
        }
        assert_eq!(find_special(&[b'a'; 100], 0), 100);
    }

    /// Every path (AVX2 where the CPU has it, SSE2 or SWAR, the byte loop) finds the same
    /// first special byte, from every start and at every distance past the 64-byte steps.
    #[test]
    fn long_strings_every_path_agrees() {
        let len = 768; // three times the AVX2 threshold
        for at in (0..len).step_by(7).chain([len - 1]) {
            for bad in [b'"', b'\\', 0x1f, 0xff] {
                let mut s = vec![b'Q'; len];
                s[at] = bad;
                for from in [0, 1, 31, 33, 63, at.saturating_sub(1), at] {
                    let expected = (from..len).find(|&k| is_special(s[k])).unwrap_or(len);
                    assert_eq!(
                        find_special(&s, from),
                        expected,
                        "bad {bad:#x} at {at} from {from}"
                    );
                }
            }
        }
        assert_eq!(find_special(&vec![b'+'; len], 5), len);
    }

    #[test]
    fn unescape_like_cpython() {
        assert_eq!(unescape(br"a\/\n\u00e9"), "a/\né".as_bytes());
        assert_eq!(unescape(br"\ud83d\ude00"), "\u{1f600}".as_bytes());
        assert_eq!(unescape(br"\ud83dx"), b"\xed\xa0\xbdx");
    }

    #[test]
    fn cuts() {
        let m = |k, v, r| Member {
            key_start: k,
            value_end: v,
            remove: r,
        };
        // {"a":1,"b":2,"c":3}: keys at 1, 7, 13; values end at 6, 12, 18.
        let s = br#"{"a":1,"b":2,"c":3}"#;
        let members = |r: [bool; 3]| [m(1, 6, r[0]), m(7, 12, r[1]), m(13, 18, r[2])];
        let cases: [([bool; 3], &str); 7] = [
            ([true, false, false], r#"{"b":2,"c":3}"#),
            ([false, true, false], r#"{"a":1,"c":3}"#),
            ([false, false, true], r#"{"a":1,"b":2}"#),
            ([true, true, false], r#"{"c":3}"#),
            ([false, true, true], r#"{"a":1}"#),
            ([true, false, true], r#"{"b":2}"#),
            ([true, true, true], r#"{}"#),
        ];
        for (remove, want) in cases {
            let mut cuts = Vec::new();
            member_cuts(&members(remove), &mut cuts);
            let mut out = Vec::new();
            for_each_kept(s, &cuts, |p| out.extend_from_slice(p));
            assert_eq!(String::from_utf8(out).unwrap(), want, "{remove:?}");
        }
    }
}
