//! Shard selection and session ids (docs/architecture.md "Why this shape": ownership is
//! stateless; docs/api.md: ids are 1-256 visible ASCII characters).
//!
//! `shard(key, n) = u64::from_be_bytes(blake2b(key, digest_size = 8)) % n`, byte-for-byte the
//! function of the pure-Python twin (`python/sessiongate/primitives/_py_shard.py`), so the
//! router, the workers and the rollout framework's Python server agree on ownership.

use pyo3::exceptions::{PyOSError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};
use pyo3::{ffi, intern};

use crate::hash::blake2b64;
use crate::types::{int_arg, type_name, IntArg};

/// Longest accepted session id, in characters (all ASCII, so also bytes).
pub const MAX_SESSION_ID_LEN: usize = 256;

/// Batches at least this long hash with the GIL released: below it the release and
/// re-acquire cost more than the hashing they would let other threads overlap with.
const GIL_RELEASE_MIN_KEYS: usize = 64;

/// `blake2b64` of the keys `data[ends[i-1]..ends[i]]` (the first starts at 0) into `out`.
///
/// Single-threaded on purpose: splitting a 10,000-key batch over two threads was slower on
/// the 2-vCPU reference machine (thread start-up outweighs ~0.35 ms of hashing), and the
/// caller already runs this without the GIL, so other Python threads keep going.
pub fn blake2b64_batch(data: &[u8], ends: &[usize], out: &mut [u64]) {
    multi::hash_run(data, 0, ends, out);
}

/// Many short keys at once: blake2b's compression run for 4 (AVX2) or 8 (AVX-512) keys in
/// the lanes of SIMD registers. Keys longer than one 128-byte block use the scalar path.
mod multi {
    // The lane machinery serves the x86 kernels; other targets take the scalar path.
    #![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    use super::blake2b64;

    const IV: [u64; 8] = [
        0x6a09_e667_f3bc_c908,
        0xbb67_ae85_84ca_a73b,
        0x3c6e_f372_fe94_f82b,
        0xa54f_f53a_5f1d_36f1,
        0x510e_527f_ade6_82d1,
        0x9b05_688c_2b3e_6c1f,
        0x1f83_d9ab_fb41_bd6b,
        0x5be0_cd19_137e_2179,
    ];
    /// h[0] for an unkeyed 8-byte digest: IV[0] ^ 0x0101_0000 ^ (key_len << 8) ^ digest_len.
    const H0: u64 = IV[0] ^ 0x0101_0008;
    const SIGMA: [[usize; 16]; 12] = [
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
        [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
        [11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4],
        [7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8],
        [9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13],
        [2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9],
        [12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11],
        [13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10],
        [6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5],
        [10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0],
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
        [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
    ];
    const BLOCK: usize = 128;

    /// A vector of 64-bit lanes, one key per lane.
    pub(super) trait Lanes: Copy {
        fn splat(x: u64) -> Self;
        fn add(self, o: Self) -> Self;
        fn xor(self, o: Self) -> Self;
        /// Rotate right by 32, 24, 16 or 63 (the only amounts blake2b uses).
        fn ror(self, n: u32) -> Self;
    }

    #[inline(always)]
    fn g<T: Lanes>(v: &mut [T; 16], [a, b, c, d]: [usize; 4], x: T, y: T) {
        v[a] = v[a].add(v[b]).add(x);
        v[d] = v[d].xor(v[a]).ror(32);
        v[c] = v[c].add(v[d]);
        v[b] = v[b].xor(v[c]).ror(24);
        v[a] = v[a].add(v[b]).add(y);
        v[d] = v[d].xor(v[a]).ror(16);
        v[c] = v[c].add(v[d]);
        v[b] = v[b].xor(v[c]).ror(63);
    }

    /// The final (and only) compression of a one-block message of `len` bytes; returns the
    /// first state word, whose little-endian bytes are the 8-byte digest.
    #[inline(always)]
    pub(super) fn compress_one_block<T: Lanes>(m: &[T; 16], len: T) -> T {
        let mut v = [T::splat(0); 16];
        v[0] = T::splat(H0);
        v[1..8].copy_from_slice(&[
            T::splat(IV[1]),
            T::splat(IV[2]),
            T::splat(IV[3]),
            T::splat(IV[4]),
            T::splat(IV[5]),
            T::splat(IV[6]),
            T::splat(IV[7]),
        ]);
        for i in 0..4 {
            v[8 + i] = T::splat(IV[i]);
        }
        v[12] = T::splat(IV[4]).xor(len); // byte counter, low word
        v[13] = T::splat(IV[5]);
        v[14] = T::splat(!IV[6]); // last-block flag
        v[15] = T::splat(IV[7]);
        for s in SIGMA.iter() {
            g(&mut v, [0, 4, 8, 12], m[s[0]], m[s[1]]);
            g(&mut v, [1, 5, 9, 13], m[s[2]], m[s[3]]);
            g(&mut v, [2, 6, 10, 14], m[s[4]], m[s[5]]);
            g(&mut v, [3, 7, 11, 15], m[s[6]], m[s[7]]);
            g(&mut v, [0, 5, 10, 15], m[s[8]], m[s[9]]);
            g(&mut v, [1, 6, 11, 12], m[s[10]], m[s[11]]);
            g(&mut v, [2, 7, 8, 13], m[s[12]], m[s[13]]);
            g(&mut v, [3, 4, 9, 14], m[s[14]], m[s[15]]);
        }
        T::splat(H0).xor(v[0]).xor(v[8])
    }

    /// Message words of up to `L` keys (each at most one block), transposed so that
    /// `words[j][lane]` is word j of the key in `lane`; unused lanes hash the empty key.
    #[inline(always)]
    fn transpose<const L: usize>(keys: &[&[u8]]) -> ([[u64; L]; 16], [u64; L]) {
        let mut words = [[0u64; L]; 16];
        let mut lens = [0u64; L];
        for (lane, key) in keys.iter().enumerate() {
            let mut chunks = key.chunks_exact(8);
            for (j, chunk) in (&mut chunks).enumerate() {
                let mut w = [0u8; 8];
                w.copy_from_slice(chunk);
                words[j][lane] = u64::from_le_bytes(w);
            }
            let tail = chunks.remainder();
            if !tail.is_empty() {
                let mut w = [0u8; 8];
                w[..tail.len()].copy_from_slice(tail);
                words[key.len() / 8][lane] = u64::from_le_bytes(w);
            }
            lens[lane] = key.len() as u64;
        }
        (words, lens)
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use super::{compress_one_block, transpose, Lanes};
        use std::arch::x86_64::*;

        #[derive(Clone, Copy)]
        struct Avx2(__m256i);

        impl Lanes for Avx2 {
            #[inline(always)]
            fn splat(x: u64) -> Self {
                // SAFETY (all methods): only reached from `hash4`, which requires AVX2.
                unsafe { Avx2(_mm256_set1_epi64x(x as i64)) }
            }
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                unsafe { Avx2(_mm256_add_epi64(self.0, o.0)) }
            }
            #[inline(always)]
            fn xor(self, o: Self) -> Self {
                unsafe { Avx2(_mm256_xor_si256(self.0, o.0)) }
            }
            #[inline(always)]
            fn ror(self, n: u32) -> Self {
                unsafe {
                    Avx2(match n {
                        32 => _mm256_shuffle_epi32(self.0, 0b10_11_00_01),
                        24 => _mm256_shuffle_epi8(
                            self.0,
                            _mm256_setr_epi8(
                                3, 4, 5, 6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10, 3, 4, 5, 6,
                                7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10,
                            ),
                        ),
                        16 => _mm256_shuffle_epi8(
                            self.0,
                            _mm256_setr_epi8(
                                2, 3, 4, 5, 6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9, 2, 3, 4, 5,
                                6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9,
                            ),
                        ),
                        // 63: (x >> 63) | (x << 1)
                        _ => _mm256_or_si256(
                            _mm256_srli_epi64(self.0, 63),
                            _mm256_add_epi64(self.0, self.0),
                        ),
                    })
                }
            }
        }

        #[derive(Clone, Copy)]
        struct Avx512(__m512i);

        impl Lanes for Avx512 {
            #[inline(always)]
            fn splat(x: u64) -> Self {
                // SAFETY (all methods): only reached from `hash8`, which requires AVX-512F.
                unsafe { Avx512(_mm512_set1_epi64(x as i64)) }
            }
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                unsafe { Avx512(_mm512_add_epi64(self.0, o.0)) }
            }
            #[inline(always)]
            fn xor(self, o: Self) -> Self {
                unsafe { Avx512(_mm512_xor_si512(self.0, o.0)) }
            }
            #[inline(always)]
            fn ror(self, n: u32) -> Self {
                unsafe {
                    Avx512(match n {
                        32 => _mm512_ror_epi64(self.0, 32),
                        24 => _mm512_ror_epi64(self.0, 24),
                        16 => _mm512_ror_epi64(self.0, 16),
                        _ => _mm512_ror_epi64(self.0, 63),
                    })
                }
            }
        }

        /// Digests of up to 4 one-block keys.
        ///
        /// # Safety
        /// The CPU must support AVX2.
        #[target_feature(enable = "avx2")]
        pub(in super::super) unsafe fn hash4(keys: &[&[u8]], out: &mut [u64]) {
            let (words, lens) = transpose::<4>(keys);
            let mut res = [0u64; 4];
            // SAFETY: unaligned loads/stores of 32-byte arrays; AVX2 is enabled here.
            unsafe {
                let m: [Avx2; 16] =
                    std::array::from_fn(|j| Avx2(_mm256_loadu_si256(words[j].as_ptr().cast())));
                let len = Avx2(_mm256_loadu_si256(lens.as_ptr().cast()));
                let h = compress_one_block(&m, len);
                _mm256_storeu_si256(res.as_mut_ptr().cast(), h.0);
            }
            for (slot, h) in out.iter_mut().zip(res) {
                *slot = h.swap_bytes();
            }
        }

        /// Digests of up to 8 one-block keys.
        ///
        /// # Safety
        /// The CPU must support AVX-512F.
        #[target_feature(enable = "avx512f")]
        pub(in super::super) unsafe fn hash8(keys: &[&[u8]], out: &mut [u64]) {
            let (words, lens) = transpose::<8>(keys);
            let mut res = [0u64; 8];
            // SAFETY: unaligned loads/stores of 64-byte arrays; AVX-512F is enabled here.
            unsafe {
                let m: [Avx512; 16] =
                    std::array::from_fn(|j| Avx512(_mm512_loadu_si512(words[j].as_ptr().cast())));
                let len = Avx512(_mm512_loadu_si512(lens.as_ptr().cast()));
                let h = compress_one_block(&m, len);
                _mm512_storeu_si512(res.as_mut_ptr().cast(), h.0);
            }
            for (slot, h) in out.iter_mut().zip(res) {
                *slot = h.swap_bytes();
            }
        }
    }

    /// One group of at most `width` keys hashed together.
    type GroupFn = fn(&[&[u8]], &mut [u64]);

    /// The widest kernel this CPU runs, or None for the scalar path.
    fn kernel() -> Option<(usize, GroupFn)> {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                // SAFETY: AVX-512F support was just checked.
                return Some((8, |keys, out| unsafe { x86::hash8(keys, out) }));
            }
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 support was just checked.
                return Some((4, |keys, out| unsafe { x86::hash4(keys, out) }));
            }
        }
        None
    }

    /// Hashes the keys `data[start..ends[0]]`, `data[ends[0]..ends[1]]`, ... into `out`.
    pub(super) fn hash_run(data: &[u8], start: usize, ends: &[usize], out: &mut [u64]) {
        let Some((width, group)) = kernel() else {
            let mut from = start;
            for (end, slot) in ends.iter().zip(out.iter_mut()) {
                *slot = blake2b64(&data[from..*end]);
                from = *end;
            }
            return;
        };
        // Short keys gather into groups of `width`; a long key is hashed on its own.
        let mut keys: [&[u8]; 8] = [&[]; 8];
        let mut slots = [0usize; 8];
        let mut filled = 0;
        let mut res = [0u64; 8];
        let mut from = start;
        for (i, end) in ends.iter().enumerate() {
            let key = &data[from..*end];
            from = *end;
            if key.len() > BLOCK {
                out[i] = blake2b64(key);
                continue;
            }
            keys[filled] = key;
            slots[filled] = i;
            filled += 1;
            if filled == width {
                group(&keys[..width], &mut res[..width]);
                for (slot, h) in slots[..width].iter().zip(res) {
                    out[*slot] = h;
                }
                filled = 0;
            }
        }
        if filled > 0 {
            group(&keys[..filled], &mut res[..width]);
            for (slot, h) in slots[..filled].iter().zip(res) {
                out[*slot] = h;
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn batch_matches_scalar() {
            // Lengths around the word and block boundaries, and one multi-block key.
            let mut data = Vec::new();
            let mut ends = Vec::new();
            for len in (0..=130).chain([64, 200, 1000, 7, 32, 32, 32]) {
                data.extend((0..len).map(|i| (i * 7 + len) as u8));
                ends.push(data.len());
            }
            let mut out = vec![0u64; ends.len()];
            hash_run(&data, 0, &ends, &mut out);
            let mut from = 0;
            for (end, h) in ends.iter().zip(&out) {
                assert_eq!(*h, blake2b64(&data[from..*end]), "key {from}..{end}");
                from = *end;
            }
        }
    }
}

/// Hash of `key` reduced to a shard index. `modulus` None means "larger than any u64",
/// where Python's `h % n` is `h` itself.
#[inline]
pub fn shard_of(key: &[u8], modulus: Option<u64>) -> u64 {
    reduce(blake2b64(key), modulus)
}

#[inline]
fn reduce(hash: u64, modulus: Option<u64>) -> u64 {
    match modulus {
        Some(m) => hash % m,
        None => hash,
    }
}

/// `n` as a modulus: `Some(n)` for 1..=u64::MAX, `None` for larger ints.
fn modulus_arg(n: &Bound<'_, PyAny>, func: &str) -> PyResult<Option<u64>> {
    match int_arg(n, func, "n")? {
        IntArg::Value(0) => Err(PyValueError::new_err(format!(
            "{func}(): n must be >= 1, got 0"
        ))),
        IntArg::Value(v) => Ok(Some(v)),
        IntArg::OutOfRange {
            negative: true,
            text,
        } => Err(PyValueError::new_err(format!(
            "{func}(): n must be >= 1, got {text}"
        ))),
        IntArg::OutOfRange {
            negative: false, ..
        } => Ok(None),
    }
}

/// The bytes a key hashes: UTF-8 of a str (borrowed from CPython's cache), or a bytes value.
/// `None` when the key is neither.
#[inline]
fn key_bytes<'a>(key: &'a Bound<'_, PyAny>) -> Option<PyResult<&'a [u8]>> {
    if let Ok(s) = key.downcast::<PyString>() {
        Some(s.to_str().map(str::as_bytes))
    } else if let Ok(b) = key.downcast::<PyBytes>() {
        Some(Ok(b.as_bytes()))
    } else {
        None
    }
}

/// `int.from_bytes(blake2b(key, digest_size=8).digest(), "big") % n`; str keys are UTF-8.
#[pyfunction]
fn shard_index(key: &Bound<'_, PyAny>, n: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let (Some(data), Some(m)) = (exact_str_bytes(key), exact_modulus(n)) {
        return Ok(shard_of(data, Some(m)));
    }
    let data = key_bytes(key).ok_or_else(|| {
        PyTypeError::new_err(format!(
            "shard_index() argument 'key' must be str or bytes, not {}",
            type_name(key)
        ))
    })??;
    Ok(shard_of(data, modulus_arg(n, "shard_index")?))
}

/// UTF-8 of an exact str through CPython's cache, without pyo3's generic checks (this is
/// the per-call hot path: a type-pointer compare instead of a flags lookup). None when the
/// key is anything else or has no UTF-8 form; the generic path then reports why.
#[inline]
fn exact_str_bytes<'a>(key: &'a Bound<'_, PyAny>) -> Option<&'a [u8]> {
    // SAFETY: the pointer checks are on a live object; PyUnicode_AsUTF8AndSize returns a
    // buffer owned by the str (valid as long as `key`), or NULL with an exception set.
    unsafe {
        if ffi::PyUnicode_CheckExact(key.as_ptr()) == 0 {
            return None;
        }
        let mut size: ffi::Py_ssize_t = 0;
        let ptr = ffi::PyUnicode_AsUTF8AndSize(key.as_ptr(), &mut size);
        if ptr.is_null() {
            ffi::PyErr_Clear();
            return None;
        }
        Some(std::slice::from_raw_parts(ptr.cast::<u8>(), size as usize))
    }
}

/// An exact int in 1..=u64::MAX, read without `__index__`; None sends the caller to the
/// generic path (which gives the exact errors).
#[inline]
fn exact_modulus(n: &Bound<'_, PyAny>) -> Option<u64> {
    // SAFETY: type check on a live object, then a plain read of an exact int.
    unsafe {
        if ffi::PyLong_CheckExact(n.as_ptr()) == 0 {
            return None;
        }
        let v = ffi::PyLong_AsUnsignedLongLong(n.as_ptr());
        if v == u64::MAX && !ffi::PyErr_Occurred().is_null() {
            ffi::PyErr_Clear();
            return None;
        }
        (v >= 1).then_some(v)
    }
}

/// Keys copied out of their Python objects so they can be hashed without the GIL.
#[derive(Default)]
struct KeyBatch {
    data: Vec<u8>,
    ends: Vec<usize>,
}

impl KeyBatch {
    fn push(&mut self, item: &Bound<'_, PyAny>, index: usize) -> PyResult<()> {
        if let Some(bytes) = exact_str_bytes(item) {
            self.data.extend_from_slice(bytes);
            self.ends.push(self.data.len());
            return Ok(());
        }
        let bytes = key_bytes(item).ok_or_else(|| {
            PyTypeError::new_err(format!(
                "shard_indices() argument 'keys' item {index} must be str or bytes, not {}",
                type_name(item)
            ))
        })??;
        self.data.extend_from_slice(bytes);
        self.ends.push(self.data.len());
        Ok(())
    }
}

/// `[shard_index(k, n) for k in keys]`; the hashing runs with the GIL released.
#[pyfunction]
fn shard_indices<'py>(
    py: Python<'py>,
    keys: &Bound<'py, PyAny>,
    n: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyList>> {
    if keys.is_instance_of::<PyString>()
        || keys.is_instance_of::<PyBytes>()
        || keys.is_instance_of::<pyo3::types::PyByteArray>()
        || keys.is_instance_of::<pyo3::types::PyMemoryView>()
    {
        // A str is iterable too, but hashing its characters one by one is never what is meant.
        return Err(PyTypeError::new_err(format!(
            "shard_indices() argument 'keys' must be an iterable of str or bytes, not {}",
            type_name(keys)
        )));
    }
    let modulus = modulus_arg(n, "shard_indices")?;
    let mut batch = KeyBatch::default();
    if let Ok(list) = keys.downcast::<PyList>() {
        batch.ends.reserve(list.len());
        batch.data.reserve(list.len() * 40);
        for (i, item) in list.iter().enumerate() {
            batch.push(&item, i)?;
        }
    } else if let Ok(tuple) = keys.downcast::<PyTuple>() {
        batch.ends.reserve(tuple.len());
        for (i, item) in tuple.iter().enumerate() {
            batch.push(&item, i)?;
        }
    } else {
        for (i, item) in keys.try_iter()?.enumerate() {
            batch.push(&item?, i)?;
        }
    }
    let mut hashes = vec![0u64; batch.ends.len()];
    if batch.ends.len() >= GIL_RELEASE_MIN_KEYS {
        py.allow_threads(|| blake2b64_batch(&batch.data, &batch.ends, &mut hashes));
    } else {
        blake2b64_batch(&batch.data, &batch.ends, &mut hashes);
    }
    PyList::new(py, hashes.into_iter().map(|h| reduce(h, modulus)))
}

/// The text before the first '.', or the whole id: a child session shards with its root.
#[pyfunction]
fn shard_key<'py>(session_id: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let s = session_id.downcast::<PyString>().map_err(|_| {
        PyTypeError::new_err(format!(
            "shard_key() argument 'session_id' must be str, not {}",
            type_name(session_id)
        ))
    })?;
    let py = session_id.py();
    // Index by code point through the C API: works for any str, with no UTF-8 conversion.
    // SAFETY: `s` is a live str object for the duration of these calls.
    unsafe {
        let len = ffi::PyUnicode_GetLength(s.as_ptr());
        let dot = ffi::PyUnicode_FindChar(s.as_ptr(), u32::from('.'), 0, len, 1);
        match dot {
            -1 => Ok(session_id.clone()),
            -2 => Err(PyErr::fetch(py)),
            _ => Bound::from_owned_ptr_or_err(py, ffi::PyUnicode_Substring(s.as_ptr(), 0, dot)),
        }
    }
}

/// Checks a session id; `what` names it in the message ("session id", "parent session id").
fn check_session_id(s: &Bound<'_, PyString>, what: &str) -> PyResult<()> {
    if let Ok(text) = s.to_str() {
        let b = text.as_bytes();
        if (1..=MAX_SESSION_ID_LEN).contains(&b.len())
            && b.iter().all(|c| (0x21..=0x7e).contains(c))
        {
            return Ok(());
        }
    }
    Err(session_id_error(s, what))
}

/// The precise error for an invalid id, counted in code points like Python's `len()`
/// (a str with lone surrogates has no UTF-8 form, so read it through the C API).
fn session_id_error(s: &Bound<'_, PyString>, what: &str) -> PyErr {
    // SAFETY: `s` is a live str object; indices stay within 0..len.
    let len = unsafe { ffi::PyUnicode_GetLength(s.as_ptr()) };
    if !(1..=MAX_SESSION_ID_LEN as isize).contains(&len) {
        return PyValueError::new_err(format!(
            "{what} must be 1-{MAX_SESSION_ID_LEN} characters long, got {len}"
        ));
    }
    for pos in 0..len {
        let ch = unsafe { ffi::PyUnicode_ReadChar(s.as_ptr(), pos) };
        if !(0x21..=0x7e).contains(&ch) {
            return PyValueError::new_err(format!(
                "{what} has invalid character U+{ch:04X} at position {pos}; \
                 only visible ASCII (0x21-0x7E) is allowed"
            ));
        }
    }
    PyValueError::new_err(format!("{what} is invalid"))
}

/// Returns `session_id` unchanged if it is 1-256 visible ASCII characters, else ValueError.
#[pyfunction]
fn validate_session_id<'py>(session_id: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let s = session_id.downcast::<PyString>().map_err(|_| {
        PyTypeError::new_err(format!(
            "validate_session_id() argument 'session_id' must be str, not {}",
            type_name(session_id)
        ))
    })?;
    check_session_id(s, "session id")?;
    Ok(session_id.clone())
}

/// 32 lowercase hex chars of a random (version 4) UUID from the OS random source.
pub fn uuid4_hex() -> Result<[u8; 32], getrandom::Error> {
    let mut raw = [0u8; 16];
    getrandom::fill(&mut raw)?;
    raw[6] = (raw[6] & 0x0f) | 0x40; // version 4
    raw[8] = (raw[8] & 0x3f) | 0x80; // RFC 4122 variant
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 32];
    for (i, byte) in raw.iter().enumerate() {
        out[2 * i] = HEX[usize::from(byte >> 4)];
        out[2 * i + 1] = HEX[usize::from(byte & 0x0f)];
    }
    Ok(out)
}

/// A root id (uuid4 hex) or, with `parent`, `<root of parent>.<uuid4 hex>`.
#[pyfunction]
#[pyo3(signature = (parent=None))]
fn new_session_id(parent: Option<&Bound<'_, PyAny>>) -> PyResult<String> {
    let hex = uuid4_hex()
        .map_err(|e| PyOSError::new_err(format!("cannot read the OS random source: {e}")))?;
    // uuid4_hex yields ASCII only, so this cannot fail; map instead of unwrap all the same.
    let hex = std::str::from_utf8(&hex).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let Some(parent) = parent else {
        return Ok(hex.to_owned());
    };
    let s = parent.downcast::<PyString>().map_err(|_| {
        PyTypeError::new_err(format!(
            "new_session_id() argument 'parent' must be str or None, not {}",
            type_name(parent)
        ))
    })?;
    check_session_id(s, "parent session id")?;
    let text = s.to_str()?;
    let root = text.split_once('.').map_or(text, |(root, _)| root);
    if root.len() + 33 > MAX_SESSION_ID_LEN {
        return Err(PyValueError::new_err(format!(
            "parent session id's root part is {} characters long; a child id \
             (root + '.' + 32 hex) would exceed {MAX_SESSION_ID_LEN} characters",
            root.len()
        )));
    }
    Ok(format!("{root}.{hex}"))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add(intern!(m.py(), "MAX_SESSION_ID_LEN"), MAX_SESSION_ID_LEN)?;
    m.add_function(wrap_pyfunction!(shard_index, m)?)?;
    m.add_function(wrap_pyfunction!(shard_indices, m)?)?;
    m.add_function(wrap_pyfunction!(shard_key, m)?)?;
    m.add_function(wrap_pyfunction!(validate_session_id, m)?)?;
    m.add_function(wrap_pyfunction!(new_session_id, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid4_shape() {
        let id = uuid4_hex().expect("OS randomness");
        assert!(id
            .iter()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_eq!(id[12], b'4');
        assert!(matches!(id[16], b'8' | b'9' | b'a' | b'b'));
        assert_ne!(uuid4_hex().expect("OS randomness"), id);
    }

    #[test]
    fn modulus_none_keeps_hash() {
        let h = blake2b64(b"abc");
        assert_eq!(shard_of(b"abc", None), h);
        assert_eq!(shard_of(b"abc", Some(1)), 0);
        assert_eq!(shard_of(b"abc", Some(1000)), h % 1000);
    }
}
