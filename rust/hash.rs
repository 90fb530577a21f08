//! The gateway's one hash: blake2b with an 8-byte digest, read big-endian. Session
//! ownership (`rust/shard.rs`), the engine policy consistent_hashing and the compiled front's
//! upstream retry order (`rust/front/upstream.rs`) all use it, and all must agree byte for
//! byte with the Python side (`python/sessiongate/hashing.py`), so it lives in one place.

use blake2::digest::consts::U8;
use blake2::{Blake2b, Digest};

/// blake2b with an 8-byte digest, read big-endian (one key: the `blake2` crate).
#[inline]
pub fn blake2b64(data: &[u8]) -> u64 {
    u64::from_be_bytes(Blake2b::<U8>::digest(data).into())
}

/// The rendezvous (highest random weight) weight of `url` for `key`: `blake2b64` of
/// `key \0 url`. The highest weight wins, so an engine going away moves only its own keys.
pub fn rendezvous_weight(key: &[u8], url: &str) -> u64 {
    let mut hasher = Blake2b::<U8>::new();
    hasher.update(key);
    hasher.update(b"\0");
    hasher.update(url.as_bytes());
    u64::from_be_bytes(hasher.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendezvous_weight_is_the_hash_of_key_nul_url() {
        assert_eq!(
            rendezvous_weight(b"key", "http://a"),
            blake2b64(b"key\0http://a")
        );
    }
}
