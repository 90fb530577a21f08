//! The gateway's one hash: blake2b with an 8-byte digest, read big-endian. Session
//! ownership (`rust/shard.rs`) and the compiled front's upstream retry order
//! (`rust/front/upstream.rs`) both use it, and both must agree byte for byte with the Python
//! side (`hashlib.blake2b(data, digest_size=8)`), so it lives in one place.

use blake2::digest::consts::U8;
use blake2::{Blake2b, Digest};

/// blake2b with an 8-byte digest, read big-endian (one key: the `blake2` crate).
#[inline]
pub fn blake2b64(data: &[u8]) -> u64 {
    u64::from_be_bytes(Blake2b::<U8>::digest(data).into())
}
