//! The routing key material of a request body, read with the crate's validating scanner
//! (`json_scan.rs`) without building a document: the twin of `key_material` in
//! `python/sessiongate/engines/policy/base.py`. Units are the token ids or the
//! text's code points (as Python's `str` has them, lone surrogates included), collected into
//! one vector per request, never one allocation per token.

use std::borrow::Cow;

use crate::json_scan::{unescape, NumKind, Scan, Scanner};

/// What the body says about the prompt; `Default` is "nothing" (not a JSON object).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Material {
    pub ids: Option<Vec<u32>>,
    pub text: Vec<u32>,
    pub adapter: Option<Vec<u8>>,
    pub extra_key: Option<Vec<u8>>,
    /// The request id (`rid`, a string), which sticky keys are read from.
    pub rid: Option<Vec<u8>>,
}

const INPUT_IDS: usize = 0;
const PROMPT: usize = 1;
const TEXT: usize = 2;
const MESSAGES: usize = 3;
const LORA_PATH: usize = 4;
const MODEL: usize = 5;
const EXTRA_KEY: usize = 6;
const RID: usize = 7;
const NAMES: [&[u8]; 8] = [
    b"input_ids",
    b"prompt",
    b"text",
    b"messages",
    b"lora_path",
    b"model",
    b"extra_key",
    b"rid",
];

/// The key material of `body`; with `text_with_ids` false the text is left empty when the
/// body has token ids (a caller matching ids never looks at it).
pub fn key_material(body: &[u8], text_with_ids: bool) -> Material {
    read(body, text_with_ids).unwrap_or_default()
}

fn read(body: &[u8], text_with_ids: bool) -> Scan<Material> {
    let mut sc = Scanner::new(body);
    sc.ws();
    if sc.peek() != Some(b'{') {
        return Ok(Material::default());
    }
    // Where each member's value starts; a duplicate key's last value wins, as in json.loads.
    let mut at: [Option<usize>; 8] = [None; 8];
    // The token ids of `input_ids` and `prompt`, read while validating (one pass over them).
    let mut ids_of: [Option<Vec<u32>>; 2] = [None, None];
    if !sc.object_start()? {
        loop {
            let key = sc.key()?;
            let slot = NAMES.iter().position(|name| sc.key_is(&key, name));
            let start = sc.pos;
            match slot {
                Some(slot @ (INPUT_IDS | PROMPT)) => ids_of[slot] = token_ids(&mut sc)?,
                _ => sc.value()?,
            }
            if let Some(slot) = slot {
                at[slot] = Some(start);
            }
            if !sc.object_next()? {
                break;
            }
        }
    }
    sc.finish()?;
    let [input_ids, prompt_ids] = ids_of;
    let ids = input_ids.or(prompt_ids);
    let mut text = Vec::new();
    if text_with_ids || ids.is_none() {
        read_text(body, &at, &mut text)?;
    }
    let adapter = match at[LORA_PATH].and_then(|p| string_at(body, p)) {
        Some(lora) => Some(lora.into_owned()),
        None => at[MODEL]
            .and_then(|p| string_at(body, p))
            .filter(|model| model.contains(&b':'))
            .map(Cow::into_owned),
    };
    let extra_key = at[EXTRA_KEY]
        .and_then(|p| string_at(body, p))
        .map(Cow::into_owned);
    let rid = at[RID]
        .and_then(|p| string_at(body, p))
        .map(Cow::into_owned);
    Ok(Material {
        ids,
        text,
        adapter,
        extra_key,
        rid,
    })
}

fn at(body: &[u8], pos: usize) -> Scanner<'_> {
    let mut sc = Scanner::new(body);
    sc.pos = pos;
    sc
}

/// The decoded string at `pos`, None when the value there is not a string.
fn string_at(body: &[u8], pos: usize) -> Option<Cow<'_, [u8]>> {
    let mut sc = at(body, pos);
    if sc.peek() != Some(b'"') {
        return None;
    }
    let s = sc.string().ok()?;
    let raw = &body[s.start..s.end];
    Some(if s.escaped {
        Cow::Owned(unescape(raw))
    } else {
        Cow::Borrowed(raw)
    })
}

/// Validates and skips the value at the cursor; when it is an array of integers in
/// [0, 2**32) (possibly empty), those are returned.
fn token_ids(sc: &mut Scanner<'_>) -> Scan<Option<Vec<u32>>> {
    if sc.peek() != Some(b'[') {
        sc.value()?;
        return Ok(None);
    }
    let mut ids = Some(Vec::new());
    if sc.array_start()? {
        return Ok(ids);
    }
    loop {
        let start = sc.pos;
        let id = match plain_int(sc) {
            Some(id) => id,
            // scalar, not number: "-Infinity" starts like a number too.
            None => match sc.peek() {
                Some(b'-' | b'0'..=b'9') => match sc.scalar()? {
                    Some(NumKind::Int) => small_int(&sc.s[start..sc.pos]),
                    _ => None,
                },
                _ => {
                    sc.value()?;
                    None
                }
            },
        };
        match (id, ids.as_mut()) {
            (Some(id), Some(list)) => list.push(id),
            _ => ids = None,
        }
        if !sc.array_next()? {
            return Ok(ids);
        }
    }
}

/// The fast path of a token id: unsigned digits not followed by a fraction or an exponent,
/// read with a local cursor (the scanner's general number path stores its cursor per
/// digit). `Some(value)` with the cursor moved past the digits (`value` None when it is out
/// of [0, 2**32)); None, cursor untouched, for anything else (the scanner then decides).
fn plain_int(sc: &mut Scanner<'_>) -> Option<Option<u32>> {
    let s = sc.s;
    let start = sc.pos;
    let first = *s.get(start)?;
    if !first.is_ascii_digit() {
        return None;
    }
    let mut end = start + 1;
    let mut value = u64::from(first - b'0');
    // A leading zero is a whole number: what follows is the scanner's to reject.
    if first != b'0' {
        while let Some(&d) = s.get(end) {
            if !d.is_ascii_digit() {
                break;
            }
            value = value.saturating_mul(10).saturating_add(u64::from(d - b'0'));
            end += 1;
        }
    }
    if matches!(s.get(end), Some(b'.' | b'e' | b'E')) || end - start > 20 {
        return None;
    }
    sc.pos = end;
    Some(u32::try_from(value).ok())
}

/// A validated integer literal's value when it is in [0, 2**32) ("-0" is 0, as in Python).
fn small_int(literal: &[u8]) -> Option<u32> {
    let (negative, digits) = match literal.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, literal),
    };
    if negative {
        return digits.iter().all(|&d| d == b'0').then_some(0);
    }
    if digits.len() > 10 {
        return None;
    }
    let value = digits
        .iter()
        .fold(0u64, |v, &d| v * 10 + u64::from(d - b'0'));
    u32::try_from(value).ok()
}

/// Appends the code points of a decoded string: UTF-8 with surrogates in their 3-byte forms
/// (what `unescape` makes of `\uD800`), so each unit is one code point of the Python `str`.
fn push_code_points(bytes: &[u8], out: &mut Vec<u32>) {
    out.reserve(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        // ASCII runs (most prompts) widen in one vectorisable pass.
        let run = bytes[i..].iter().take_while(|b| b.is_ascii()).count();
        out.extend(bytes[i..i + run].iter().map(|&b| u32::from(b)));
        i += run;
        let Some(&lead) = bytes.get(i) else {
            break;
        };
        let (len, mut cp) = match lead {
            0x00..=0x7F => {
                out.push(u32::from(lead));
                i += 1;
                continue;
            }
            0xF0..=0xFF => (4, u32::from(lead & 0x07)),
            0xE0..=0xEF => (3, u32::from(lead & 0x0F)),
            _ => (2, u32::from(lead & 0x1F)),
        };
        for k in 1..len {
            cp = (cp << 6) | u32::from(bytes.get(i + k).copied().unwrap_or(0x80) & 0x3F);
        }
        out.push(cp);
        i += len;
    }
}

/// Appends one piece of text, a space before it unless it is the first.
fn push_piece(piece: &[u8], first: &mut bool, out: &mut Vec<u32>) {
    if !std::mem::take(first) {
        out.push(u32::from(b' '));
    }
    push_code_points(piece, out);
}

/// `text`, else `prompt` (a string or strings), else the message contents.
fn read_text(body: &[u8], fields: &[Option<usize>; 8], out: &mut Vec<u32>) -> Scan<()> {
    if let Some(text) = fields[TEXT].and_then(|p| string_at(body, p)) {
        push_code_points(&text, out);
        return Ok(());
    }
    if let Some(pos) = fields[PROMPT] {
        if let Some(prompt) = string_at(body, pos) {
            push_code_points(&prompt, out);
            return Ok(());
        }
        if prompt_strings(body, pos, out)? {
            return Ok(());
        }
        out.clear();
    }
    if let Some(pos) = fields[MESSAGES] {
        message_text(body, pos, out)?;
    }
    Ok(())
}

/// A `prompt` array of strings, joined; false (with `out` partly filled) when it is not one.
fn prompt_strings(body: &[u8], pos: usize, out: &mut Vec<u32>) -> Scan<bool> {
    let mut sc = at(body, pos);
    if sc.peek() != Some(b'[') {
        return Ok(false);
    }
    if sc.array_start()? {
        return Ok(true);
    }
    let mut first = true;
    loop {
        let Some(piece) = string_at(body, sc.pos) else {
            return Ok(false);
        };
        push_piece(&piece, &mut first, out);
        sc.value()?;
        if !sc.array_next()? {
            return Ok(true);
        }
    }
}

/// The value position of the last member `name` of the object at `sc` (consumed whole).
fn last_member(sc: &mut Scanner<'_>, name: &[u8]) -> Scan<Option<usize>> {
    let mut found = None;
    if sc.object_start()? {
        return Ok(None);
    }
    loop {
        let key = sc.key()?;
        if sc.key_is(&key, name) {
            found = Some(sc.pos);
        }
        sc.value()?;
        if !sc.object_next()? {
            return Ok(found);
        }
    }
}

/// The string contents and the `text` of content parts of a `messages` array, joined.
fn message_text(body: &[u8], pos: usize, out: &mut Vec<u32>) -> Scan<()> {
    let mut sc = at(body, pos);
    if sc.peek() != Some(b'[') || sc.array_start()? {
        return Ok(());
    }
    let mut first = true;
    loop {
        if sc.peek() == Some(b'{') {
            if let Some(content) = last_member(&mut sc, b"content")? {
                content_text(body, content, &mut first, out)?;
            }
        } else {
            sc.value()?;
        }
        if !sc.array_next()? {
            return Ok(());
        }
    }
}

fn content_text(body: &[u8], pos: usize, first: &mut bool, out: &mut Vec<u32>) -> Scan<()> {
    if let Some(text) = string_at(body, pos) {
        push_piece(&text, first, out);
        return Ok(());
    }
    let mut sc = at(body, pos);
    if sc.peek() != Some(b'[') || sc.array_start()? {
        return Ok(());
    }
    loop {
        if sc.peek() == Some(b'{') {
            if let Some(text) = last_member(&mut sc, b"text")?.and_then(|p| string_at(body, p)) {
                push_piece(&text, first, out);
            }
        } else {
            sc.value()?;
        }
        if !sc.array_next()? {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn units(s: &str) -> Vec<u32> {
        s.chars().map(u32::from).collect()
    }

    #[test]
    fn ids_text_adapter_and_extra_key() {
        let m = key_material(
            br#"{"input_ids":[1,2,-0],"lora_path":"a","extra_key":"k"}"#,
            true,
        );
        assert_eq!(m.ids, Some(vec![1, 2, 0]));
        assert_eq!(m.adapter.as_deref(), Some(&b"a"[..]));
        assert_eq!(m.extra_key.as_deref(), Some(&b"k"[..]));
        let m = key_material(br#"{"input_ids":[1,-2],"text":"hi"}"#, true);
        assert_eq!((m.ids, m.text), (None, units("hi")));
        let m = key_material(br#"{"prompt":["a","b\u00e9"],"model":"base:lora"}"#, true);
        assert_eq!(m.text, units("a b\u{e9}"));
        assert_eq!(m.adapter.as_deref(), Some(&b"base:lora"[..]));
        let chat = br#"{"messages":[{"content":"x","content":"sys"},3,
            {"content":[{"type":"text","text":"u"},{"type":"image"}]}]}"#;
        assert_eq!(key_material(chat, true).text, units("sys u"));
        assert_eq!(key_material(b"[1]", true), Material::default());
        assert_eq!(
            key_material(br#"{"text":"a"} x"#, true),
            Material::default()
        );
        let m = key_material(
            br#"{"input_ids":[1,-Infinity],"prompt":[2,NaN],"text":"t"}"#,
            true,
        );
        assert_eq!((m.ids, m.text), (None, units("t")));
        let m = key_material(br#"{"text":"\ud800x"}"#, true);
        assert_eq!(m.text, vec![0xD800, u32::from(b'x')]);
    }
}
