//! Recording a response the routes made: buffered within the cap into a [`Recorded`],
//! or passed on unrecorded ([`NotRecorded`]).

use axum::body::Body;
use axum::response::Response;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::{Deserialize, Serialize};

use super::Config;
use super::codec::{HEADER_OVERHEAD, HeaderBytes, Recorded, RecordedBody};
use crate::error::IdemError;
use crate::op::Disposition;

/// A body's outcome that is not recorded.
#[derive(Serialize, Deserialize)]
pub(super) enum NotRecorded {
    /// A response the status policy does not record: passed on, the key released.
    #[serde(skip)]
    Released(Response),
    /// The response is over the cap, or its body failed mid-way: it ran, so the key goes
    /// to UNKNOWN.
    Unrecordable,
    #[serde(skip)]
    Idem(IdemError),
}

impl From<IdemError> for NotRecorded {
    fn from(e: IdemError) -> Self {
        NotRecorded::Idem(e)
    }
}

pub(super) fn disposition(e: &NotRecorded) -> Disposition {
    match e {
        NotRecorded::Unrecordable => Disposition::Unknown,
        NotRecorded::Released(_) | NotRecorded::Idem(_) => Disposition::Release,
    }
}

/// Buffers a response the policy records, returning its record and the response as it
/// was made (its body buffered); passes on one it does not record.
pub(super) async fn record(
    cfg: &Config,
    res: Response,
) -> Result<(Recorded, Response), NotRecorded> {
    if !cfg.records(res.status()) {
        return Err(NotRecorded::Released(res));
    }
    let (parts, body) = res.into_parts();
    let mut headers = Vec::new();
    let mut size = 0usize;
    for name in &cfg.recorded_headers {
        for value in parts.headers.get_all(name) {
            size = size.saturating_add(name.as_str().len() + value.len() + HEADER_OVERHEAD);
            headers.push((name.as_str().to_owned(), HeaderBytes::new(value)));
        }
    }
    let unrecordable = |why: &str| {
        tracing::error!(
            max = cfg.max_response_bytes,
            "IdempotencyLayer: {why}; the request ran, so its key is now UNKNOWN (raise \
             `max_response_bytes`, with the store's outcome cap, to record such responses)"
        );
        NotRecorded::Unrecordable
    };
    let Some(body_max) = cfg.max_response_bytes.checked_sub(size) else {
        return Err(unrecordable(
            "a response's recorded headers are over the cap",
        ));
    };
    let bytes = match Limited::new(body, body_max).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => {
            return Err(unrecordable("a response is over the cap"));
        }
        Err(_) => return Err(unrecordable("a response body failed mid-way")),
    };
    let recorded = Recorded {
        status: parts.status.as_u16(),
        headers,
        body: RecordedBody::new(&bytes),
    };
    Ok((recorded, Response::from_parts(parts, Body::from(bytes))))
}

#[cfg(test)]
mod tests {
    use http::header::{HeaderName, HeaderValue};

    use super::super::IdempotencyLayer;
    use super::super::codec::{ENVELOPE_BYTES, largest_recordable};
    use super::*;

    /// Records `res` as the layer does, to the bytes the store would get.
    fn stored(recorded: &Recorded) -> Vec<u8> {
        serde_json::to_vec(recorded).expect("a record serializes")
    }

    fn response(headers: &[(&str, &[u8])], body: Vec<u8>) -> Response {
        let mut res = Response::new(Body::from(body));
        for (name, value) in headers {
            res.headers_mut().append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_bytes(value).unwrap(),
            );
        }
        res
    }

    fn config(cap: usize, headers: &[&str]) -> Config {
        let idem = crate::Idem::builder().max_outcome_bytes(cap).memory();
        let mut layer = IdempotencyLayer::new(idem);
        for name in headers {
            layer = layer.record_header(HeaderName::from_bytes(name.as_bytes()).unwrap());
        }
        layer.cfg
    }

    /// The worst cases for the record's size: every response at the layer's limit, in
    /// the encodings that grow most, fits the store's cap.
    #[tokio::test]
    async fn every_response_within_the_limit_fits_the_cap() {
        for cap in [ENVELOPE_BYTES, 100, 1000, 4097, 64 * 1024] {
            let cfg = config(cap, &["a", "b"]);
            let limit = cfg.max_response_bytes;
            assert_eq!(limit, largest_recordable(cap));
            let header = |value: &'static [u8]| ("a", value);
            let bodies = |n: usize| -> Vec<Vec<u8>> {
                vec![
                    vec![0xff; n],
                    vec![b'"'; n],
                    vec![0x01; n],
                    (0..n).map(|i| (i * 7 % 256) as u8).collect(),
                ]
            };
            let header_sets: Vec<Vec<(&str, &[u8])>> = vec![
                vec![],
                vec![header(b"\xff")],
                vec![header(b"\""), ("b", b"\\\\\\")],
                vec![header(b"\xe9\xe9\xe9\xe9"); 3],
            ];
            for headers in &header_sets {
                let size: usize = headers
                    .iter()
                    .map(|(n, v)| n.len() + v.len() + HEADER_OVERHEAD)
                    .sum();
                let Some(room) = limit.checked_sub(size) else {
                    continue;
                };
                for body in bodies(room) {
                    let res = response(headers, body.clone());
                    let Ok((recorded, _)) = record(&cfg, res).await else {
                        panic!("cap {cap}: a response of {limit} bytes was refused");
                    };
                    let bytes = stored(&recorded);
                    assert!(
                        bytes.len() <= cap,
                        "cap {cap}: a response of {limit} bytes records in {}",
                        bytes.len()
                    );
                    let back: Recorded = serde_json::from_slice(&bytes).unwrap();
                    assert_eq!(back, recorded);
                    assert_eq!(back.body.into_bytes(), body);
                }
            }
        }
    }

    #[tokio::test]
    async fn a_response_over_the_limit_is_unrecordable() {
        let cfg = config(1000, &[]);
        let res = response(&[], vec![b'x'; cfg.max_response_bytes + 1]);
        assert!(matches!(
            record(&cfg, res).await,
            Err(NotRecorded::Unrecordable)
        ));
    }
}
