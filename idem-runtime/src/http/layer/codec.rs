//! The record of a response ([`Recorded`]): JSON bodies as JSON, other bytes as base64,
//! header values as bytes; its size bounds, and the reading of version-1 records.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use http::StatusCode;
use http::header::{HeaderName, HeaderValue};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;

use crate::error::IdemError;

/// What a recorded response's record holds beyond its body and headers, at most: the
/// status, the field names, the body's tag and base64's padding.
pub(super) const ENVELOPE_BYTES: usize = 64;

/// What each recorded header counts toward `max_response_bytes` beyond its name and
/// value: HTTP/2's per-field overhead (RFC 9113, section 6.5.2). It also covers the
/// header's framing in the record, so the record's size is bounded by the response's.
pub(super) const HEADER_OVERHEAD: usize = 32;

/// The record's schema: JSON bodies as JSON, other bytes as base64, header values as
/// bytes. Version 1 (text or hex bodies, text header values) is read by [`upgrade`].
pub(super) const RECORD_VERSION: u32 = 2;

/// The largest response a store whose outcome cap is `cap` always holds once recorded.
/// A response of size `n` records in at most `ENVELOPE_BYTES + 4n/3` bytes: a body is
/// recorded as it is (JSON), as an escaped string only when that is no longer than its
/// base64, or in base64 (`4⌈n/3⌉`); a header likewise, its framing within
/// `HEADER_OVERHEAD`.
pub(super) fn largest_recordable(cap: usize) -> usize {
    cap.saturating_sub(ENVELOPE_BYTES) / 4 * 3
}

/// The outcome cap that records every response of up to `max` bytes.
pub(super) fn cap_for(max: usize) -> usize {
    max.div_ceil(3)
        .saturating_mul(4)
        .saturating_add(ENVELOPE_BYTES)
}

/// A response as recorded: replayed with the same status, headers and body.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub(super) struct Recorded {
    pub(super) status: u16,
    pub(super) headers: Vec<(String, HeaderBytes)>,
    pub(super) body: RecordedBody,
}

/// A body as recorded, in the most compact form that keeps it exact.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum RecordedBody {
    /// A JSON document, embedded as it is: readable in the store, and no larger there.
    Json(Box<RawValue>),
    /// UTF-8 text that is not JSON, where escaping it costs no more than base64 would.
    Text(String),
    /// Any other bytes.
    Base64(Base64),
}

impl PartialEq for RecordedBody {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (RecordedBody::Json(a), RecordedBody::Json(b)) => a.get() == b.get(),
            (RecordedBody::Text(a), RecordedBody::Text(b)) => a == b,
            (RecordedBody::Base64(a), RecordedBody::Base64(b)) => a == b,
            _ => false,
        }
    }
}

impl RecordedBody {
    pub(super) fn new(bytes: &[u8]) -> Self {
        let Ok(text) = std::str::from_utf8(bytes) else {
            return RecordedBody::Base64(Base64(bytes.to_vec()));
        };
        // Only a document with no whitespace around it: a raw value drops that, and the
        // replay must be byte for byte.
        if let Ok(raw) = serde_json::from_str::<&RawValue>(text)
            && raw.get().len() == text.len()
        {
            return RecordedBody::Json(raw.to_owned());
        }
        if escaped_len(text) <= base64_len(text.len()) {
            RecordedBody::Text(text.to_owned())
        } else {
            RecordedBody::Base64(Base64(bytes.to_vec()))
        }
    }

    pub(super) fn into_bytes(self) -> Vec<u8> {
        match self {
            RecordedBody::Json(raw) => Box::<str>::from(raw).into_string().into_bytes(),
            RecordedBody::Text(text) => text.into_bytes(),
            RecordedBody::Base64(Base64(bytes)) => bytes,
        }
    }
}

/// A header value as recorded: a string where it is UTF-8 and escaping it costs no more
/// than base64, else its bytes in base64 (values may hold any byte but controls).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub(super) enum HeaderBytes {
    Text(String),
    Bytes { base64: Base64 },
}

impl HeaderBytes {
    pub(super) fn new(value: &HeaderValue) -> Self {
        match std::str::from_utf8(value.as_bytes()) {
            Ok(text) if escaped_len(text) <= base64_len(text.len()) => {
                HeaderBytes::Text(text.to_owned())
            }
            _ => HeaderBytes::Bytes {
                base64: Base64(value.as_bytes().to_vec()),
            },
        }
    }

    fn as_bytes(&self) -> &[u8] {
        match self {
            HeaderBytes::Text(text) => text.as_bytes(),
            HeaderBytes::Bytes { base64 } => &base64.0,
        }
    }
}

/// Bytes recorded as a base64 string (standard alphabet, padded).
#[derive(Debug, PartialEq)]
pub(super) struct Base64(Vec<u8>);

impl Serialize for Base64 {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&BASE64.encode(&self.0))
    }
}

impl<'de> Deserialize<'de> for Base64 {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        BASE64
            .decode(text)
            .map(Base64)
            .map_err(serde::de::Error::custom)
    }
}

/// The length of `text` as a JSON string's contents, at most (serde_json escapes `"`,
/// `\` and control characters, and nothing else).
fn escaped_len(text: &str) -> usize {
    text.bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 2,
            0..0x20 => 6,
            _ => 1,
        })
        .sum()
}

/// The length of `n` bytes in padded base64.
fn base64_len(n: usize) -> usize {
    n.div_ceil(3) * 4
}

/// Reads a record of schema version 1: bodies as text or hex, header values as text.
pub(super) fn upgrade(
    name: &str,
    from: u32,
    value: serde_json::Value,
) -> Result<Recorded, IdemError> {
    #[derive(Deserialize)]
    struct V1 {
        status: u16,
        headers: Vec<(String, String)>,
        body: V1Body,
    }
    #[derive(Deserialize)]
    enum V1Body {
        Text(String),
        Hex(String),
    }
    let codec = |message: String| IdemError::Codec {
        name: name.to_owned(),
        message,
    };
    if from != 1 {
        return Err(codec(format!(
            "a response recorded under schema version {from} cannot be read by this build \
             (version {RECORD_VERSION}); deploy the newer build everywhere, or wait for the \
             record to expire"
        )));
    }
    let v1: V1 = serde_json::from_value(value)
        .map_err(|e| codec(format!("cannot read a version-1 recorded response: {e}")))?;
    let body = match v1.body {
        V1Body::Text(text) => text.into_bytes(),
        V1Body::Hex(hex) => unhex(&hex),
    };
    Ok(Recorded {
        status: v1.status,
        headers: v1
            .headers
            .into_iter()
            .map(|(name, value)| (name, HeaderBytes::Text(value)))
            .collect(),
        body: RecordedBody::new(&body),
    })
}

fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len() / 2)
        .filter_map(|i| u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok())
        .collect()
}

impl IntoResponse for Recorded {
    fn into_response(self) -> Response {
        let mut res = Response::new(Body::from(self.body.into_bytes()));
        *res.status_mut() = StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK);
        for (name, value) in self.headers {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_bytes(value.as_bytes()),
            ) {
                res.headers_mut().append(name, value);
            }
        }
        res
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_record_compactly_and_exactly() {
        let json = br#"{"b": [1, 2.50, "\u00e9"], "a":null}"#;
        let body = RecordedBody::new(json);
        assert!(matches!(body, RecordedBody::Json(_)));
        let record = serde_json::to_string(&body).unwrap();
        assert_eq!(record.len(), json.len() + r#"{"json":}"#.len());
        let back: RecordedBody = serde_json::from_str(&record).unwrap();
        assert_eq!(back.into_bytes(), json);
        // Whitespace around a document is kept, as text.
        assert!(matches!(RecordedBody::new(b"[1]\n"), RecordedBody::Text(_)));
        assert!(matches!(RecordedBody::new(b"done"), RecordedBody::Text(_)));
        assert!(matches!(
            RecordedBody::new(&[b'"'; 30]),
            RecordedBody::Base64(_)
        ));
        assert!(matches!(
            RecordedBody::new(b"\xff\x00"),
            RecordedBody::Base64(_)
        ));
    }

    #[test]
    fn escaped_len_matches_serde_json() {
        let all: String = (0u8..0x80).map(char::from).chain("é€".chars()).collect();
        for text in [all.as_str(), "", "plain", "\"q\"\\"] {
            let quoted = serde_json::to_string(text).unwrap();
            assert_eq!(escaped_len(text), quoted.len() - 2, "{text:?}");
        }
    }

    #[test]
    fn version_one_records_are_read() {
        let v1 = serde_json::json!({
            "status": 201,
            "headers": [["content-type", "application/json"]],
            "body": {"Text": "{\"id\":7}"},
        });
        let r = upgrade("http", 1, v1).unwrap();
        assert_eq!(r.status, 201);
        assert_eq!(
            r.headers,
            [(
                "content-type".to_owned(),
                HeaderBytes::Text("application/json".into())
            )]
        );
        assert_eq!(r.body.into_bytes(), b"{\"id\":7}");
        let hex = serde_json::json!({"status": 200, "headers": [], "body": {"Hex": "ff00"}});
        assert_eq!(
            upgrade("http", 1, hex).unwrap().body.into_bytes(),
            [0xff, 0x00]
        );
        assert!(matches!(
            upgrade("http", 3, serde_json::Value::Null),
            Err(IdemError::Codec { .. })
        ));
    }
}
