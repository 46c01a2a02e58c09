//! The canonical forms `IdempotencyLayer` fingerprints a request by: its media type, its
//! query, and a JSON or form body, each reduced so that spellings of one request that a
//! server reads alike fingerprint alike, and requests a server reads differently never
//! do.

use std::borrow::Cow;

use http::HeaderMap;
use http::header::CONTENT_TYPE;
use serde::de::{Deserializer as _, MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};
use serde_json::value::RawValue;

/// Bytes fingerprinted as bytes (a `&[u8]` serializes as a sequence of numbers).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct ByteStr<'a>(pub(super) Cow<'a, [u8]>);

impl Serialize for ByteStr<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

/// Every `Content-Type` value of a request, normalised: the media type in lowercase,
/// its parameters with lowercase names, unquoted values (`charset`'s in lowercase, as
/// RFC 9110 makes it case-insensitive) and sorted. A value that is not visible ASCII
/// is kept byte for byte.
///
/// `application/JSON; charset="UTF-8"` and `application/json;charset=utf-8` are one
/// media type; `text/plain` and `application/json` are not, so the same key with
/// another media type is another request.
pub(super) fn content_types(headers: &HeaderMap) -> Vec<ByteStr<'_>> {
    headers
        .get_all(CONTENT_TYPE)
        .iter()
        .map(|value| match value.to_str() {
            Ok(text) => ByteStr(Cow::Owned(normalize_media_type(text).into_bytes())),
            Err(_) => ByteStr(Cow::Borrowed(value.as_bytes())),
        })
        .collect()
}

/// How a request body is read, by its one `Content-Type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum BodyKind {
    /// `application/json` or a `+json` type (`application/problem+json`,
    /// `application/merge-patch+json`).
    Json,
    /// `application/x-www-form-urlencoded`.
    Form,
    /// Anything else, no `Content-Type`, or more than one.
    Bytes,
}

/// How the request's body is read, from its one `Content-Type`.
pub(super) fn body_kind(headers: &HeaderMap) -> BodyKind {
    let mut values = headers.get_all(CONTENT_TYPE).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return BodyKind::Bytes;
    };
    let Ok(text) = value.to_str() else {
        return BodyKind::Bytes;
    };
    let essence = text.split(';').next().unwrap_or("").trim();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return BodyKind::Bytes;
    };
    if !kind.eq_ignore_ascii_case("application") {
        return BodyKind::Bytes;
    }
    let json = subtype.eq_ignore_ascii_case("json")
        || subtype
            .get(subtype.len().saturating_sub(5)..)
            .is_some_and(|tail| tail.eq_ignore_ascii_case("+json"));
    if json {
        BodyKind::Json
    } else if subtype.eq_ignore_ascii_case("x-www-form-urlencoded") {
        BodyKind::Form
    } else {
        BodyKind::Bytes
    }
}

fn normalize_media_type(text: &str) -> String {
    let mut pieces = split_unquoted(text, ';').into_iter();
    let essence = pieces.next().unwrap_or("").trim().to_ascii_lowercase();
    let mut params: Vec<(String, String)> = pieces
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (name, value) = p.split_once('=').unwrap_or((p, ""));
            let name = name.trim().to_ascii_lowercase();
            let mut value = unquote(value.trim());
            if name == "charset" {
                value.make_ascii_lowercase();
            }
            (name, value)
        })
        .collect();
    params.sort();
    let mut out = essence;
    for (name, value) in params {
        // Quoted on output whenever it holds a separator, so the form stays unambiguous.
        let plain = !value.is_empty()
            && value
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$&-^_.+~*'`|%".contains(&b));
        out.push(';');
        out.push_str(&name);
        out.push('=');
        if plain {
            out.push_str(&value);
        } else {
            out.push('"');
            for c in value.chars() {
                if c == '"' || c == '\\' {
                    out.push('\\');
                }
                out.push(c);
            }
            out.push('"');
        }
    }
    out
}

/// `text` split at each `sep` outside a quoted string.
fn split_unquoted(text: &str, sep: char) -> Vec<&str> {
    let mut pieces = Vec::new();
    let (mut start, mut quoted, mut escaped) = (0, false, false);
    for (i, c) in text.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            c if c == sep && !quoted => {
                pieces.push(&text[start..i]);
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    pieces.push(&text[start..]);
    pieces
}

/// A parameter value with its quotes and backslash escapes removed.
fn unquote(value: &str) -> String {
    let Some(inner) = value
        .strip_prefix('"')
        .and_then(|rest| rest.strip_suffix('"'))
    else {
        return value.to_owned();
    };
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.extend(chars.next()),
            c => out.push(c),
        }
    }
    out
}

/// A query string or an `application/x-www-form-urlencoded` body as the pairs a form
/// decoder reads from it, sorted by name: `b=2&a=1` and `a=1&b=%32` are one request.
/// Each pair is split at its first `=` (none: an empty value), `+` is a space and
/// percent escapes are decoded to bytes, so no two that decode differently share a
/// form; empty pairs (`&&`) are skipped, as form decoders skip them. The values of a
/// repeated name keep their order (`tag=a&tag=b` is not `tag=b&tag=a`), since decoders
/// read them as a list.
pub(super) fn canonical_form(form: &[u8]) -> Vec<(ByteStr<'static>, ByteStr<'static>)> {
    let decode = |part: &[u8]| -> Vec<u8> {
        let spaced: Vec<u8> = part
            .iter()
            .map(|&b| if b == b'+' { b' ' } else { b })
            .collect();
        percent_encoding::percent_decode(&spaced).collect()
    };
    let mut pairs: Vec<(ByteStr<'static>, ByteStr<'static>)> = form
        .split(|&b| b == b'&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (name, value) = match pair.iter().position(|&b| b == b'=') {
                Some(i) => (&pair[..i], &pair[i + 1..]),
                None => (pair, &[][..]),
            };
            (
                ByteStr(Cow::Owned(decode(name))),
                ByteStr(Cow::Owned(decode(value))),
            )
        })
        .collect();
    // Stable, by name only: a repeated name's values stay in order.
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    pairs
}

/// A JSON document by its content: objects as maps (the fingerprint sorts their
/// entries), strings unescaped, numbers by their literal text (no float rounding, so
/// `1e400`, `0.1000000000000000000001` and 20-digit integers stay distinct from their
/// neighbours), whitespace gone.
///
/// An object that repeats a member name has no one meaning (serde_json's `Value` keeps
/// the last, a derived struct refuses it, other readers keep the first), so sorting its
/// entries could make two requests a server reads differently alike:
/// [`repeated_member`](Json::repeated_member) finds it, and the layer refuses such a
/// body before it runs.
#[derive(Debug)]
pub(super) enum Json<'a> {
    Null,
    Bool(bool),
    Number(&'a str),
    String(String),
    Array(Vec<Json<'a>>),
    Object(Vec<(String, Json<'a>)>),
    /// A subtree below [`MAX_DEPTH`], by its exact text.
    Verbatim(&'a str),
}

/// Nesting below which a JSON subtree is fingerprinted by its text: each level is
/// parsed again from its raw text, so this bounds the work per request to this many
/// passes over the body.
const MAX_DEPTH: usize = 32;

impl<'a> Json<'a> {
    /// The canonical form of `bytes`, or `None` if they are not one JSON document.
    pub(super) fn parse(bytes: &'a [u8]) -> Option<Json<'a>> {
        let raw: &'a RawValue = serde_json::from_slice(bytes).ok()?;
        Json::from_raw(raw, 0).ok()
    }

    /// The first member name that an object in the document repeats (names compared
    /// unescaped, so `"a"` and `"\u0061"` are one name). A subtree below [`MAX_DEPTH`]
    /// is not searched: it is fingerprinted by its exact text, so no reordering of it
    /// fingerprints alike anyway.
    pub(super) fn repeated_member(&self) -> Option<&str> {
        match self {
            Json::Object(entries) => {
                let mut names: Vec<&str> = entries.iter().map(|(name, _)| name.as_str()).collect();
                names.sort_unstable();
                if let Some(pair) = names.windows(2).find(|pair| pair[0] == pair[1]) {
                    return Some(pair[0]);
                }
                entries
                    .iter()
                    .find_map(|(_, value)| value.repeated_member())
            }
            Json::Array(items) => items.iter().find_map(Json::repeated_member),
            _ => None,
        }
    }

    fn from_raw(raw: &'a RawValue, depth: usize) -> Result<Json<'a>, serde_json::Error> {
        let text = raw.get().trim();
        if depth >= MAX_DEPTH && (text.starts_with('{') || text.starts_with('[')) {
            return Ok(Json::Verbatim(text));
        }
        // `raw` is one valid JSON value already: its first byte says which.
        let mut de = serde_json::Deserializer::from_str(text);
        Ok(match text.as_bytes().first() {
            Some(b'{') => Json::Object(de.deserialize_map(Entries(depth))?),
            Some(b'[') => Json::Array(de.deserialize_seq(Items(depth))?),
            Some(b'"') => Json::String(serde::Deserialize::deserialize(&mut de)?),
            Some(b't') => Json::Bool(true),
            Some(b'f') => Json::Bool(false),
            Some(b'n') => Json::Null,
            _ => Json::Number(text),
        })
    }
}

struct Entries(usize);

impl<'de> Visitor<'de> for Entries {
    type Value = Vec<(String, Json<'de>)>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut entries = Vec::new();
        while let Some((key, raw)) = map.next_entry::<String, &'de RawValue>()? {
            let value = Json::from_raw(raw, self.0 + 1).map_err(serde::de::Error::custom)?;
            entries.push((key, value));
        }
        Ok(entries)
    }
}

struct Items(usize);

impl<'de> Visitor<'de> for Items {
    type Value = Vec<Json<'de>>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON array")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(raw) = seq.next_element::<&'de RawValue>()? {
            items.push(Json::from_raw(raw, self.0 + 1).map_err(serde::de::Error::custom)?);
        }
        Ok(items)
    }
}

impl Serialize for Json<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Variants by name, so a number, a string and verbatim text never coincide.
        match self {
            Json::Null => s.serialize_unit_variant("Json", 0, "null"),
            Json::Bool(b) => s.serialize_newtype_variant("Json", 1, "bool", b),
            Json::Number(text) => s.serialize_newtype_variant("Json", 2, "number", text),
            Json::String(text) => s.serialize_newtype_variant("Json", 3, "string", text),
            Json::Array(items) => s.serialize_newtype_variant("Json", 4, "array", &Seq(items)),
            Json::Object(entries) => {
                s.serialize_newtype_variant("Json", 5, "object", &Map(entries))
            }
            Json::Verbatim(text) => s.serialize_newtype_variant("Json", 6, "verbatim", text),
        }
    }
}

struct Seq<'b, 'a>(&'b [Json<'a>]);

impl Serialize for Seq<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for item in self.0 {
            seq.serialize_element(item)?;
        }
        seq.end()
    }
}

/// An object's entries as a map: idem's fingerprint encoding sorts map entries, so key
/// order does not count.
struct Map<'b, 'a>(&'b [(String, Json<'a>)]);

impl Serialize for Map<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (key, value) in self.0 {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn fp<T: Serialize + ?Sized>(value: &T) -> [u8; 32] {
        crate::fingerprint(value).unwrap()
    }

    fn json(text: &str) -> [u8; 32] {
        fp(&Json::parse(text.as_bytes()).unwrap_or_else(|| panic!("{text} is JSON")))
    }

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(CONTENT_TYPE, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn media_types_normalise() {
        let norm = |v: &str| -> Vec<Vec<u8>> {
            let h = headers(&[v]);
            content_types(&h)
                .into_iter()
                .map(|b| b.0.into_owned())
                .collect()
        };
        assert_eq!(
            norm(r#"Application/JSON ; Charset="UTF-8";  q=1"#),
            norm("application/json;q=1;charset=utf-8")
        );
        assert_eq!(
            norm(r#"multipart/form-data; boundary="a;b""#)[0],
            br#"multipart/form-data;boundary="a;b""#
        );
        assert_ne!(norm("text/plain"), norm("application/json"));
        assert_ne!(norm("text/plain; x=A"), norm("text/plain; x=a"));
        assert_ne!(norm(r#"a/b; x="1;y=2""#), norm("a/b; x=1; y=2"));
        assert!(content_types(&HeaderMap::new()).is_empty());
    }

    #[test]
    fn body_media_types() {
        for json in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/merge-patch+json",
        ] {
            assert_eq!(body_kind(&headers(&[json])), BodyKind::Json, "{json}");
        }
        for form in [
            "application/x-www-form-urlencoded",
            "Application/X-WWW-Form-Urlencoded; charset=utf-8",
        ] {
            assert_eq!(body_kind(&headers(&[form])), BodyKind::Form, "{form}");
        }
        for bytes in [
            "text/json",
            "application/jsonx",
            "application/x-json5",
            "json",
            "multipart/form-data; boundary=x",
            "text/x-www-form-urlencoded",
        ] {
            assert_eq!(body_kind(&headers(&[bytes])), BodyKind::Bytes, "{bytes}");
        }
        assert_eq!(
            body_kind(&headers(&["application/json", "application/json"])),
            BodyKind::Bytes
        );
        assert_eq!(body_kind(&HeaderMap::new()), BodyKind::Bytes);
    }

    #[test]
    fn forms_canonicalise() {
        let q = |s: &[u8]| fp(&canonical_form(s));
        assert_eq!(q(b"b=2&a=1"), q(b"a=1&b=%32"));
        assert_eq!(q(b"a=x+y"), q(b"a=x%20y"));
        assert_eq!(q(b"a&&b="), q(b"b&a="));
        assert_eq!(q(b"amount=100&currency=eur"), q(b"currency=eur&amount=100"));
        assert_ne!(q(b"a=1&b=2"), q(b"a=1%26b%3D2"));
        assert_ne!(q(b"a=%FF"), q(b"a=%FE"));
        assert_ne!(q(b"a=\xff"), q(b"a=\xfe"));
        assert_ne!(q(b"a=1"), q(b"a=2"));
        // A repeated name is a list: its order counts, its place among others does not.
        assert_ne!(q(b"tag=a&tag=b"), q(b"tag=b&tag=a"));
        assert_eq!(q(b"tag=a&x=1&tag=b"), q(b"x=1&tag=a&tag=b"));
    }

    #[test]
    fn json_by_content() {
        assert_eq!(
            json(r#"{"b": [1, "x"], "a": {"d": null, "c": true}}"#),
            json(" {\"a\":{\"c\":true,\"d\":null},\n\"b\":[1,\"x\"]} ")
        );
        assert_eq!(json(r#""\u00e9""#), json(r#""é""#));
        assert_ne!(json("[1, 2]"), json("[2, 1]"));
        assert_ne!(json("1"), json("1.0"));
        assert_ne!(json("1"), json(r#""1""#));
        assert_ne!(
            json("18446744073709551616"),
            json("18446744073709551617"),
            "integers past u64 are not rounded"
        );
        assert_ne!(json("0.1"), json("0.1000000000000000000001"));
        assert!(Json::parse(b"{").is_none());
        assert!(Json::parse(b"1 2").is_none());
    }

    #[test]
    fn repeated_members_are_found() {
        let repeated = |text: &str| {
            Json::parse(text.as_bytes())
                .unwrap()
                .repeated_member()
                .map(str::to_owned)
        };
        assert_eq!(
            repeated(r#"{"amount":1,"amount":1000}"#).as_deref(),
            Some("amount")
        );
        assert_eq!(repeated(r#"{"a":1,"\u0061":2}"#).as_deref(), Some("a"));
        assert_eq!(
            repeated(r#"{"x":[{"b":1},{"c":{"d":1,"e":2,"d":3}}]}"#).as_deref(),
            Some("d")
        );
        assert_eq!(repeated(r#"{"a":{"a":1},"b":[{"a":2}]}"#), None);
        assert_eq!(repeated("[1, 1]"), None);
    }

    #[test]
    fn deep_json_is_bounded_and_still_by_content_above_the_bound() {
        let deep = |inner: &str| format!("{}{inner}{}", "[".repeat(40), "]".repeat(40));
        assert_eq!(json(&deep("1")), json(&deep("1")));
        assert_ne!(json(&deep("1")), json(&deep("2")));
        assert!(matches!(
            Json::parse(deep("1").as_bytes()),
            Some(Json::Array(_))
        ));
    }
}
