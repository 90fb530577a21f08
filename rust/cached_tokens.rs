//! The first `"cached_tokens": <int>` of a reply, read piece by piece as the reply is relayed
//! (twin: `CachedTokensWatch` of `python/sessiongate/primitives/_py_relay.py`).
//!
//! cache_aware learns from it which prefixes an engine lost (docs/routing.md, "What a reply's
//! cached_tokens teaches"). SGLang writes it in `meta_info` of `/generate` (every chunk of a
//! stream) and in `usage.prompt_tokens_details` of the OpenAI routes, before any
//! `routed_experts`, so the watch stops at the first one and never reads the R3 bytes after.
//! Matching the quoted key followed by a colon is enough without parsing: inside a JSON
//! string every quote is escaped, so `cached_tokens":` cannot occur there.

use memchr::memmem;

const NEEDLE: &[u8] = b"\"cached_tokens\"";
/// More digits than this may not fit a u64: not a count of tokens.
const MAX_DIGITS: usize = 18;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Looking for the key; `usize`: how much of it ended the last piece.
    Search(usize),
    /// After the key, before its colon.
    Key,
    /// After the colon, before the value.
    Colon,
    /// In the value's digits: the value so far and its digit count.
    Digits(u64, usize),
    Done(Option<u64>),
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// The watch over one reply's bytes.
pub struct CachedTokens {
    state: State,
    finder: memmem::Finder<'static>,
}

impl Default for CachedTokens {
    fn default() -> Self {
        Self::new()
    }
}

impl CachedTokens {
    pub fn new() -> Self {
        Self {
            state: State::Search(0),
            finder: memmem::Finder::new(NEEDLE),
        }
    }

    /// Whether the value is known (or known to be absent): later pieces are not read.
    pub fn done(&self) -> bool {
        matches!(self.state, State::Done(_))
    }

    /// Read the reply's next bytes.
    pub fn feed(&mut self, piece: &[u8]) {
        let mut i = 0;
        while i < piece.len() {
            match self.state {
                State::Done(_) => return,
                State::Search(held) => {
                    if held > 0 {
                        let want = &NEEDLE[held..];
                        let have = &piece[i..piece.len().min(i + want.len())];
                        if want.starts_with(have) {
                            i += have.len();
                            self.state = if have.len() == want.len() {
                                State::Key
                            } else {
                                State::Search(held + have.len())
                            };
                            continue;
                        }
                        // The key's only quotes are its first and last byte, so no other
                        // match can start inside the part held: search this piece afresh.
                        self.state = State::Search(0);
                    }
                    match self.finder.find(&piece[i..]) {
                        Some(at) => {
                            i += at + NEEDLE.len();
                            self.state = State::Key;
                        }
                        None => {
                            self.state = State::Search(tail_match(&piece[i..]));
                            return;
                        }
                    }
                }
                State::Key => {
                    let b = piece[i];
                    if b == b':' {
                        self.state = State::Colon;
                        i += 1;
                    } else if is_space(b) {
                        i += 1;
                    } else {
                        // A string "cached_tokens" that is not a key: search on from here.
                        self.state = State::Search(0);
                    }
                }
                State::Colon => {
                    let b = piece[i];
                    if is_space(b) {
                        i += 1;
                    } else if b.is_ascii_digit() {
                        self.state = State::Digits(0, 0);
                    } else {
                        self.state = State::Done(None);
                    }
                }
                State::Digits(value, count) => {
                    let b = piece[i];
                    if b.is_ascii_digit() {
                        self.state = if count == MAX_DIGITS {
                            State::Done(None)
                        } else {
                            State::Digits(value * 10 + u64::from(b - b'0'), count + 1)
                        };
                        i += 1;
                    } else if matches!(b, b'.' | b'e' | b'E') {
                        self.state = State::Done(None); // a float is not a count
                    } else {
                        self.state = State::Done(Some(value));
                    }
                }
            }
        }
    }

    /// The value once the reply has ended (or as soon as known).
    pub fn finish(&self) -> Option<u64> {
        match self.state {
            State::Done(value) => value,
            State::Digits(value, _) => Some(value),
            _ => None,
        }
    }
}

/// How many leading bytes of the key end `piece` (the key's start, cut by the piece's end).
fn tail_match(piece: &[u8]) -> usize {
    let from = piece.len().saturating_sub(NEEDLE.len() - 1);
    let tail = &piece[from..];
    // The key has one quote before its last byte, its first: a cut key starts at a quote.
    match memchr::memrchr(b'"', tail) {
        Some(at) if NEEDLE.starts_with(&tail[at..]) => tail.len() - at,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of the first `"cached_tokens"` key in `pieces` read in order, None when there
    /// is none or it is not a non-negative integer of at most 18 digits.
    fn cached_tokens_in<'a>(pieces: impl IntoIterator<Item = &'a [u8]>) -> Option<u64> {
        let mut watch = CachedTokens::new();
        for piece in pieces {
            watch.feed(piece);
            if watch.done() {
                break;
            }
        }
        watch.finish()
    }

    fn every_split(body: &[u8]) -> Vec<Option<u64>> {
        let mut seen = vec![cached_tokens_in([body])];
        for cut in 0..=body.len() {
            seen.push(cached_tokens_in([&body[..cut], &body[cut..]]));
        }
        seen.push(cached_tokens_in(body.chunks(1)));
        seen
    }

    #[test]
    fn every_cut_reads_the_same_value() {
        for (body, want) in [
            (
                &br#"{"meta_info":{"prompt_tokens":9,"cached_tokens":1234,"x":1}}"#[..],
                Some(1234),
            ),
            (
                br#"{"usage":{"prompt_tokens_details":{"cached_tokens" : 	7}}}"#,
                Some(7),
            ),
            (br#"{"cached_tokens":0}"#, Some(0)),
            (br#"{"cached_tokens":12"#, Some(12)),
            (br#"{"cached_tokens":null}"#, None),
            (br#"{"cached_tokens":-3}"#, None),
            (br#"{"cached_tokens":1.5}"#, None),
            (br#"{"cached_tokens":2e3}"#, None),
            (br#"{"cached_tokens":1234567890123456789}"#, None),
            (
                br#"{"text":"\"cached_tokens\": 5","cached_tokens":6}"#,
                Some(6),
            ),
            (br#"["cached_tokens","cached_tokens":8]"#, Some(8)),
            (
                br#"{"cached_tokens_details":{"device":3},"cached_tokens":4}"#,
                Some(4),
            ),
            (br#"{"x":""cached_tokens":9}"#, Some(9)),
            (br#"{"prompt_tokens":3}"#, None),
            (b"", None),
        ] {
            for got in every_split(body) {
                assert_eq!(got, want, "{}", String::from_utf8_lossy(body));
            }
        }
    }

    #[test]
    fn the_watch_stops_at_the_first_value() {
        let mut watch = CachedTokens::new();
        watch.feed(br#"data: {"meta_info":{"cached_tokens":5,"#);
        assert!(watch.done());
        watch.feed(br#""cached_tokens":6}}"#);
        assert_eq!(watch.finish(), Some(5));
    }
}
