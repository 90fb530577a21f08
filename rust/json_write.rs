//! JSON text writers shared by the primitives that write JSON into bytes: the envelope meta
//! (`rust/frame.rs`), the spliced request members (`rust/relay.rs`, `rust/stamp.rs`). Each
//! writes exactly what CPython's `json.dumps(..., separators=(",", ":"),
//! ensure_ascii=False)` writes for the same value, since the twins use `json.dumps`.

/// A JSON string literal with CPython's `ensure_ascii=False` escaping: `"` `\` and control
/// characters only; everything else is written as UTF-8.
pub(crate) fn write_json_str(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.reserve(s.len() + 2);
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &c) in bytes.iter().enumerate() {
        let escape: &[u8] = match c {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        if escape.is_empty() {
            out.extend_from_slice(b"\\u00");
            out.push(HEX[usize::from(c >> 4)]);
            out.push(HEX[usize::from(c & 0xf)]);
        } else {
            out.extend_from_slice(escape);
        }
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

const DIGIT_PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
2021222324252627282930313233343536373839\
4041424344454647484950515253545556575859\
6061626364656667686970717273747576777879\
8081828384858687888990919293949596979899";

/// The decimal text of `v` (what `int.__repr__` and `json.dumps` write), two digits per
/// step: token-id arrays of tens of thousands of ints go through here.
pub(crate) fn write_i64(out: &mut Vec<u8>, v: i64) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    let mut n = v.unsigned_abs();
    while n >= 100 {
        let d = (n % 100) as usize * 2;
        n /= 100;
        i -= 2;
        buf[i..i + 2].copy_from_slice(&DIGIT_PAIRS[d..d + 2]);
    }
    if n >= 10 {
        let d = n as usize * 2;
        i -= 2;
        buf[i..i + 2].copy_from_slice(&DIGIT_PAIRS[d..d + 2]);
    } else {
        i -= 1;
        buf[i] = b'0' + n as u8;
    }
    if v < 0 {
        out.push(b'-');
    }
    out.extend_from_slice(&buf[i..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_string_escapes() {
        let mut out = Vec::new();
        write_json_str(&mut out, "a\"b\\c\n\u{1}\u{7f}é");
        assert_eq!(out, "\"a\\\"b\\\\c\\n\\u0001\u{7f}é\"".as_bytes());
    }

    #[test]
    fn ints() {
        for v in [0i64, 7, -7, 10, 99, 100, 12345, i64::MAX, i64::MIN] {
            let mut out = Vec::new();
            write_i64(&mut out, v);
            assert_eq!(out, v.to_string().as_bytes());
        }
    }
}
