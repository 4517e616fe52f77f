//! The tree a document decodes into before its objects are typed: a `serde_json::Value`, built
//! from either route (serde_json over the converter's JSON, or serde_yaml), with two rules the
//! plain `Value` lacks:
//!
//! - a mapping key given twice is an error (YAML forbids it and kubectl refuses such files;
//!   the plain `Value` silently keeps the last one, so a manifest could mean something else
//!   than it says);
//! - an integer beyond 64 bits becomes a float instead of failing the whole document, so the
//!   typed decoding rejects only the object holding it (with a warning naming it), and a huge
//!   number in a field nobody reads costs nothing.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// A document tree; see the module docs.
pub(super) struct Tree(pub Value);

impl<'de> Deserialize<'de> for Tree {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Tree, D::Error> {
        deserializer.deserialize_any(TreeVisitor).map(Tree)
    }
}

struct TreeVisitor;

fn float(v: f64) -> Value {
    // As serde_json's own Value: non-finite floats (`.inf`, `.nan`) become null.
    Number::from_f64(v).map_or(Value::Null, Value::Number)
}

impl<'de> Visitor<'de> for TreeVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML or JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_i128<E>(self, v: i128) -> Result<Value, E> {
        Ok(match (i64::try_from(v), u64::try_from(v)) {
            (Ok(small), _) => Value::Number(small.into()),
            (_, Ok(small)) => Value::Number(small.into()),
            #[allow(clippy::cast_precision_loss)]
            _ => float(v as f64),
        })
    }

    fn visit_u128<E>(self, v: u128) -> Result<Value, E> {
        Ok(match u64::try_from(v) {
            Ok(small) => Value::Number(small.into()),
            #[allow(clippy::cast_precision_loss)]
            Err(_) => float(v as f64),
        })
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(float(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        Tree::deserialize(deserializer).map(|t| t.0)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(Tree(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(de::Error::custom(format_args!("duplicate mapping key {key:?}")));
            }
            let Tree(value) = map.next_value()?;
            out.insert(key, value);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yaml(text: &str) -> Result<Value, String> {
        serde_yaml::from_str::<Tree>(text).map(|t| t.0).map_err(|e| e.to_string())
    }

    #[test]
    fn same_tree_as_the_plain_value_for_ordinary_documents() {
        let text = "a: 1\nb: [x, 2.5, null, true, -3]\nc: {d: ~, e: .inf}\nf: \"é\"\n";
        let plain: Value = serde_yaml::from_str(text).unwrap();
        assert_eq!(yaml(text).unwrap(), plain);
        let json = r#"{"a": [1, -2, 3.5, "x", null, {"b": false}]}"#;
        let plain: Value = serde_json::from_str(json).unwrap();
        assert_eq!(serde_json::from_str::<Tree>(json).unwrap().0, plain);
    }

    #[test]
    fn repeated_keys_are_errors_at_any_depth_in_either_syntax() {
        assert!(yaml("a: 1\na: 2\n").unwrap_err().contains("duplicate mapping key \"a\""));
        let nested = yaml("x:\n  y: 1\n  z: 2\n  y: 3\n").unwrap_err();
        assert!(nested.contains("duplicate mapping key \"y\"") && nested.contains("line 2"), "{nested}");
        let json = serde_json::from_str::<Tree>(r#"{"m": {"k": 1, "k": 2}}"#).err().unwrap().to_string();
        assert!(json.contains("duplicate mapping key \"k\""), "{json}");
    }

    #[test]
    fn integers_beyond_64_bits_become_floats() {
        assert_eq!(yaml("a: 99999999999999999999999").unwrap()["a"], serde_json::json!(1e23));
        assert_eq!(yaml("a: -9223372036854775809").unwrap()["a"], serde_json::json!(-9.223372036854776e18));
        assert_eq!(yaml("a: 18446744073709551615").unwrap()["a"], serde_json::json!(u64::MAX));
        assert_eq!(yaml("a: -9223372036854775808").unwrap()["a"], serde_json::json!(i64::MIN));
    }
}
