//! Typed options from Python dicts. The Python side validates its configuration
//! (`EngineRoutingConfig`, `ReliabilityConfig`) and hands the values over as a dict; here the
//! dict becomes JSON text (Python's `json.dumps`) and serde reads it into the primitive's own
//! struct (`#[serde(default, deny_unknown_fields)]`), so no primitive walks a dict by hand.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyDictMethods};
use pyo3::{intern, IntoPyObjectExt};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

/// `dict` (None: the defaults) as a `T`; a ValueError says what is wrong, prefixed by
/// "bad {what}: " and naming the key.
pub fn from_py_dict<T: DeserializeOwned + Default>(
    what: &str,
    dict: Option<&Bound<'_, PyDict>>,
) -> PyResult<T> {
    let Some(dict) = dict else {
        return Ok(T::default());
    };
    let py = dict.py();
    let kwargs = PyDict::new(py);
    // No option takes NaN or an infinity, and serde reads neither.
    kwargs.set_item(intern!(py, "allow_nan"), false.into_py_any(py)?)?;
    let text: String = py
        .import(intern!(py, "json"))?
        .call_method(intern!(py, "dumps"), (dict,), Some(&kwargs))
        .map_err(|err| PyValueError::new_err(format!("bad {what}: {err}")))?
        .extract()?;
    from_json(what, &text).map_err(PyValueError::new_err)
}

/// A JSON object's text as a `T`, or what is wrong with it (its key named when one is).
pub fn from_json<T: DeserializeOwned>(what: &str, text: &str) -> Result<T, String> {
    serde_json::from_str(text).map_err(|err| {
        // serde names the type it expected, not the key: find the member that fails alone.
        let culprit = serde_json::from_str::<Map<String, Value>>(text)
            .ok()
            .into_iter()
            .flatten()
            .find_map(|(key, value)| {
                let alone = Value::Object(Map::from_iter([(key.clone(), value)]));
                serde_json::from_value::<T>(alone)
                    .err()
                    .map(|err| format!("{key}: {err}"))
            });
        format!("bad {what}: {}", culprit.unwrap_or_else(|| err.to_string()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default, serde::Deserialize)]
    #[serde(default, deny_unknown_fields)]
    struct Opts {
        count: u32,
        name: String,
    }

    #[test]
    fn typed_with_the_key_named() {
        let ok: Opts = from_json("opts", r#"{"count": 3}"#).unwrap_or_default();
        assert_eq!((ok.count, ok.name.as_str()), (3, ""));
        let bad = from_json::<Opts>("opts", r#"{"name": "x", "count": -1}"#).err();
        assert_eq!(
            bad.as_deref(),
            Some("bad opts: count: invalid value: integer `-1`, expected u32")
        );
        let unknown = from_json::<Opts>("opts", r#"{"other": 1}"#).err();
        assert_eq!(
            unknown.as_deref(),
            Some("bad opts: other: unknown field `other`, expected `count` or `name`")
        );
    }
}
