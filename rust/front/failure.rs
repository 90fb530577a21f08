//! What the relay says and does when an engine fails, as the Python engine client does: the
//! 502 texts and where a request goes after its connection could not be made. Each function
//! is the twin of one Python function (`engines/client.py::transport_error_text`,
//! `http/client.py::connect_failed_text` and `connect_timed_out`,
//! `engines/pool.py::retry_target`), exposed to the hypothesis twin test
//! (`tests/engines/test_engine_client_twin.py`, through the test hooks of `rust/testing.rs`), so a client gets the same words and the same
//! second engine whichever front served it.

use pyo3::prelude::*;

/// The 502 message of an exchange that failed below HTTP: `kind` names the failure the way
/// the Python client's exception class does (`ConnectFailed`, `TimeoutError`, ...).
#[pyfunction(name = "front_transport_error_text")]
pub fn transport_error_text(
    method: &str,
    url: &str,
    path: &str,
    kind: &str,
    detail: &str,
) -> String {
    format!("upstream transport error: {method} {url}{path} failed ({kind}: {detail})")
}

/// The detail of a connection that could not be made to `host:port`, `why` as the OS said.
#[pyfunction(name = "front_connect_failed_text")]
pub fn connect_failed_text(host: &str, port: u16, why: &str) -> String {
    format!("cannot connect to {host}:{port}: {why}")
}

/// The host of an authority as Python's `urlsplit(url).hostname` gives it: lowercased, an
/// IPv6 address without its brackets.
#[pyfunction(name = "front_url_hostname")]
pub fn url_hostname(host: &str) -> String {
    let bare = match host.strip_prefix('[') {
        Some(rest) => rest.strip_suffix(']').unwrap_or(rest),
        None => host,
    };
    bare.to_ascii_lowercase()
}

/// `why` of a connection not made within `seconds` (Python's `str(float)` of them).
#[pyfunction(name = "front_connect_timed_out")]
pub fn connect_timed_out(seconds: f64) -> String {
    format!("timed out after {}s", py_float(seconds))
}

/// Python's `str(x)` (`repr`) of a float: the shortest digits that read back as `x`, fixed
/// notation for decimal exponents -4..=15 (with ".0" when whole), else `d.ddde±XX`.
pub fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    // Rust's `{:e}` is the shortest round-trip form too: "1.5e-7", "-2e16", "0e0".
    let sci = format!("{x:e}");
    let (mantissa, exp) = match sci.split_once('e') {
        Some((m, e)) => (m, e.parse::<i32>().unwrap_or(0)),
        None => (sci.as_str(), 0),
    };
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    if !(-4..16).contains(&exp) {
        let shortest: String = mantissa.chars().filter(|c| *c != '.').collect();
        let digits = even_on_tie(&shortest, x, exp).unwrap_or(shortest);
        let mantissa = match digits.split_at(1) {
            (first, "") => first.to_string(),
            (first, rest) => format!("{first}.{rest}"),
        };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{mantissa}e{exp_sign}{:02}", exp.unsigned_abs());
    }
    let shortest: String = mantissa.chars().filter(|c| *c != '.').collect();
    let digits = even_on_tie(&shortest, x, exp).unwrap_or(shortest);
    let body = if exp < 0 {
        let zeros = "0".repeat(usize::try_from(-exp - 1).unwrap_or(0));
        format!("0.{zeros}{digits}")
    } else {
        let whole = usize::try_from(exp + 1).unwrap_or(1);
        if digits.len() <= whole {
            format!("{digits:0<whole$}.0")
        } else {
            format!("{}.{}", &digits[..whole], &digits[whole..])
        }
    };
    format!("{sign}{body}")
}

/// The shortest digits Python's `repr` takes when `x` lies exactly halfway between two
/// shortest candidates that both read back as `x`: the even one (David Gay's correctly
/// rounded shortest form), where Rust's shortest form may take the odd one
/// (562949953421312.25 -> Python "...312.2", Rust "...312.3"). None when `x` is no such tie,
/// when the even neighbour does not read back as `x` (below a power of two the gap halves:
/// 2^-24 is "5.960464477539063e-08" in both), or needs another digit.
fn even_on_tie(shortest: &str, x: f64, exp: i32) -> Option<String> {
    let n = shortest.len();
    // A double's exact decimal expansion has at most 767 significant digits: this is exact.
    let exact = format!("{:.800e}", x.abs());
    let digits: String = exact
        .split_once('e')?
        .0
        .chars()
        .filter(|c| *c != '.')
        .collect();
    let (head, tail) = digits.split_at(n.min(digits.len()));
    if !tail.starts_with('5') || !tail[1..].bytes().all(|b| b == b'0') {
        return None;
    }
    // `x` is exactly halfway between `head` and `head` + 1 in the last place.
    let last = head.bytes().last()?.checked_sub(b'0')?;
    let even = if last % 2 == 0 {
        head.to_string()
    } else {
        let mut up = head.as_bytes().to_vec();
        let mut carried = true;
        for byte in up.iter_mut().rev() {
            if *byte == b'9' {
                *byte = b'0';
            } else {
                *byte += 1;
                carried = false;
                break;
            }
        }
        if carried {
            return None; // all nines: the neighbour has another digit, keep Rust's form
        }
        String::from_utf8(up).ok()?
    };
    let (first, rest) = even.split_at(1);
    let reads_back = format!("{first}.{rest}e{exp}").parse::<f64>().ok() == Some(x.abs());
    reads_back.then_some(even)
}

/// Where a request goes after engine `failed` could not be connected to: the first engine in
/// `order` (the rendezvous order of the empty key) other than `failed` that is available,
/// else the first other one; None with a single engine.
pub fn retry_target(
    order: &[usize],
    failed: usize,
    available: impl Fn(usize) -> bool,
) -> Option<usize> {
    if order.len() <= 1 {
        return None;
    }
    let others = order.iter().copied().filter(|&i| i != failed);
    others
        .clone()
        .find(|&i| available(i))
        .or_else(|| others.clone().next())
}

/// `retry_target` over an availability list, for the twin test (an index past it: not
/// available).
#[pyfunction]
pub(crate) fn front_retry_target(
    order: Vec<usize>,
    failed: usize,
    available: Vec<bool>,
) -> Option<usize> {
    retry_target(&order, failed, |i| {
        available.get(i).copied().unwrap_or(false)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_read_as_python_writes_them() {
        for (x, want) in [
            (10.0, "10.0"),
            (0.5, "0.5"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (123.456, "123.456"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345e20, "1.2345e+20"),
            (-2.5, "-2.5"),
            (0.0, "0.0"),
            (1e100, "1e+100"),
        ] {
            assert_eq!(py_float(x), want, "{x}");
        }
    }

    #[test]
    fn a_retry_goes_to_the_first_available_other_engine() {
        let order = [2, 0, 1];
        assert_eq!(retry_target(&order, 2, |_| true), Some(0));
        assert_eq!(retry_target(&order, 2, |i| i == 1), Some(1));
        assert_eq!(retry_target(&order, 2, |_| false), Some(0));
        assert_eq!(retry_target(&[0], 0, |_| true), None);
    }
}
