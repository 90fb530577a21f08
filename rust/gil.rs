//! When the core releases the GIL: one rule for every primitive that works over bytes.
//!
//! Work over `size` bytes (a copy into a new `bytes`, a JSON scan, base64 decoding, zeroing a
//! sink) runs with the GIL released when `size >= GIL_RELEASE`; the small Python objects
//! around it are built with the GIL held. The one exception is batch shard hashing
//! (`rust/shard.rs`), whose work is counted in keys, not bytes.

use pyo3::prelude::*;

/// 128 KiB: the smallest work worth handing the GIL to another thread for.
///
/// All of this work runs at roughly memory speed: scanning or copying 128 KiB takes ~4 µs
/// on the 2-vCPU reference machine (`_json_reject` of a 128 KiB string: 4.1 µs per call).
/// Releasing and re-taking an uncontended GIL adds nothing measurable at that size (4,041 vs
/// 4,053 ns per call, min of 30 rounds, just above vs just below the threshold). With a busy
/// pure-Python thread beside it, releasing costs the call ~3 µs more (24.7 vs 22.0 µs) and
/// lets that thread run 2.4x as much meanwhile. Below this, the other thread would get only a
/// sliver of time per release; far above it (the frame codec used 1 MiB), other threads wait
/// out copies of tens of microseconds for a GIL the copy does not need.
pub(crate) const GIL_RELEASE: usize = 128 << 10;

/// Runs `f`, which works over `size` bytes, with the GIL released when `size` reaches
/// [`GIL_RELEASE`].
pub(crate) fn maybe_unlocked<T: Send>(
    py: Python<'_>,
    size: usize,
    f: impl FnOnce() -> T + Send,
) -> T {
    if size >= GIL_RELEASE {
        py.allow_threads(f)
    } else {
        f()
    }
}
