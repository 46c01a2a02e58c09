//! The layers' labels and keys, on the memory store, through a stand-in client that
//! answers with the key it was sent.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{HeaderName, Method, Request};
use tower::util::BoxCloneSyncService;
use tower::{ServiceBuilder, ServiceExt, service_fn};

use super::{KeyLabel, PropagateKeyLayer};
use crate::{Current, Idem, IdemError, current, step};

type Client = BoxCloneSyncService<Request<()>, Option<String>, Infallible>;

/// A client behind `layer` that answers with the `header` it was sent.
fn client_reading(layer: PropagateKeyLayer, header: &'static str) -> Client {
    let inner = service_fn(move |req: Request<()>| async move {
        let key = req.headers().get(header);
        Ok::<_, Infallible>(key.map(|v| v.to_str().unwrap().to_owned()))
    });
    BoxCloneSyncService::new(ServiceBuilder::new().layer(layer).service(inner))
}

fn client() -> Client {
    client_reading(PropagateKeyLayer::new(), "idempotency-key")
}

fn req(method: Method, path: &str) -> Request<()> {
    Request::builder()
        .method(method)
        .uri(format!("https://svc.example{path}"))
        .body(())
        .unwrap()
}

fn labelled<L: super::LabelText>(method: Method, path: &str, label: L) -> Request<()> {
    let mut r = req(method, path);
    r.extensions_mut().insert(KeyLabel(label));
    r
}

async fn send(client: &Client, r: Request<()>) -> Option<String> {
    client.clone().oneshot(r).await.unwrap()
}

/// Runs `body` as operation `op`/`key` on `idem`, keeping nothing between runs but
/// what the store keeps.
async fn run<T, F, Fut>(idem: &Idem, key: &str, body: F) -> Result<T, IdemError>
where
    T: serde::Serialize + serde::de::DeserializeOwned + Send + 'static,
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<T, IdemError>>,
{
    idem.operation("op", key)
        .retain(Duration::from_secs(3600))
        .fingerprint_none()
        .run(body)
        .await
}

fn keys(current: &Current, labels: &[&str]) -> Vec<Option<String>> {
    labels
        .iter()
        .map(|l| Some(current.downstream_key(l)))
        .collect()
}

#[tokio::test]
async fn calls_outside_steps_are_keyed_by_endpoint_and_ordinal_alike_on_every_run() {
    let idem = Idem::memory();
    let c = client();
    let runs: Arc<Mutex<Vec<Vec<Option<String>>>>> = Arc::default();
    for fail in [true, false] {
        let (c, runs) = (c.clone(), runs.clone());
        let result = run(&idem, "k", || async move {
            let sent = vec![
                send(&c, req(Method::POST, "/charges")).await,
                send(&c, req(Method::POST, "/charges?again=1")).await,
                send(&c, req(Method::PATCH, "/refunds")).await,
                send(&c, req(Method::GET, "/charges")).await,
            ];
            let mut expected = keys(
                &current(),
                &["POST /charges#0", "POST /charges#1", "PATCH /refunds#0"],
            );
            expected.push(None); // GET is not covered
            assert_eq!(sent, expected);
            runs.lock().unwrap().push(sent);
            if fail {
                return Err(IdemError::Config {
                    message: "released: the body runs again".into(),
                });
            }
            Ok(())
        })
        .await;
        assert_eq!(result.is_err(), fail);
    }
    let runs = runs.lock().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0], runs[1], "the re-run sends the same keys");
    assert_ne!(runs[0][0], runs[0][1], "two calls, two keys");
}

#[tokio::test]
async fn a_steps_calls_are_keyed_by_its_label() {
    let idem = Idem::memory();
    let c = client();
    run(&idem, "k", || async {
        let in_step: Vec<Option<String>> = step("charge", || async {
            Ok::<_, IdemError>(vec![
                send(&c, req(Method::POST, "/charges")).await,
                send(&c, req(Method::POST, "/charges")).await,
                send(&c, labelled(Method::POST, "/fees", "fee")).await,
                send(&c, req(Method::POST, "/other")).await,
            ])
        })
        .await?;
        let op = current();
        assert_eq!(
            in_step,
            keys(&op, &["charge", "charge#1", "charge/fee", "charge#2"])
        );
        assert_eq!(in_step[0], Some(op.downstream_key("charge")));
        // The step's calls do not count among the body's.
        let after = send(&c, req(Method::POST, "/charges")).await;
        assert_eq!(after, Some(op.downstream_key("POST /charges#0")));
        Ok::<_, IdemError>(())
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_replayed_step_shifts_no_ordinal() {
    let idem = Idem::memory();
    let c = client();
    let outside: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
    for fail in [true, false] {
        let (c, outside) = (c.clone(), outside.clone());
        let _ = run(&idem, "k", || async move {
            // Runs on the first run only; replayed on the second.
            step("reserve", || async {
                send(&c, req(Method::POST, "/charges")).await;
                Ok::<_, IdemError>(())
            })
            .await?;
            let sent = send(&c, req(Method::POST, "/charges")).await;
            outside.lock().unwrap().push(sent);
            if fail {
                return Err(IdemError::Config {
                    message: "released".into(),
                });
            }
            Ok(())
        })
        .await;
    }
    let outside = outside.lock().unwrap();
    assert_eq!(outside.len(), 2);
    assert_eq!(outside[0], outside[1]);
}

#[tokio::test]
async fn a_carried_label_names_the_call_whatever_its_method() {
    let idem = Idem::memory();
    let c = client();
    run(&idem, "k", || async {
        let sent = vec![
            send(&c, labelled(Method::POST, "/refunds", "refund")).await,
            send(&c, labelled(Method::GET, "/x", "lookup".to_owned())).await,
            send(
                &c,
                labelled(Method::POST, "/refunds", format!("refund:{}", 7)),
            )
            .await,
            // Labelled calls take no ordinal.
            send(&c, req(Method::POST, "/refunds")).await,
        ];
        let expected = keys(
            &current(),
            &["refund", "lookup", "refund:7", "POST /refunds#0"],
        );
        assert_eq!(sent, expected);
        Ok::<_, IdemError>(())
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_request_with_the_header_is_left_alone() {
    let idem = Idem::memory();
    let c = client();
    run(&idem, "k", || async {
        let mut mine = req(Method::POST, "/charges");
        mine.headers_mut()
            .insert("idempotency-key", "mine".parse().unwrap());
        assert_eq!(send(&c, mine).await.as_deref(), Some("mine"));
        // It took no ordinal.
        let next = send(&c, req(Method::POST, "/charges")).await;
        assert_eq!(next, Some(current().downstream_key("POST /charges#0")));
        Ok::<_, IdemError>(())
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn outside_a_body_requests_pass_untouched_unless_a_key_per_request_is_asked() {
    let c = client();
    assert_eq!(send(&c, req(Method::POST, "/charges")).await, None);
    let c = client_reading(
        PropagateKeyLayer::new().key_per_request(true),
        "idempotency-key",
    );
    let a = send(&c, req(Method::POST, "/charges")).await.unwrap();
    let b = send(&c, req(Method::POST, "/charges")).await.unwrap();
    assert_ne!(a, b, "one key per logical request");
    for key in [&a, &b] {
        let groups: Vec<usize> = key.split('-').map(str::len).collect();
        assert_eq!(groups, [8, 4, 4, 4, 12], "a UUID: {key}");
        assert_eq!(&key[14..15], "4", "version 4: {key}");
        assert!("89ab".contains(&key[19..20]), "RFC 4122 variant: {key}");
    }
    assert_eq!(send(&c, req(Method::GET, "/charges")).await, None);
    // Inside a body the operation's key wins.
    let idem = Idem::memory();
    run(&idem, "k", || async {
        let sent = send(&c, req(Method::POST, "/charges")).await;
        assert_eq!(sent, Some(current().downstream_key("POST /charges#0")));
        Ok::<_, IdemError>(())
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn the_header_and_the_methods_are_configurable() {
    let layer = PropagateKeyLayer::new()
        .header(HeaderName::from_static("x-request-key"))
        .methods([Method::PUT]);
    let c = client_reading(layer.clone(), "x-request-key");
    let default_header = client_reading(layer, "idempotency-key");
    let idem = Idem::memory();
    run(&idem, "k", || async {
        let put = send(&c, req(Method::PUT, "/things/1")).await;
        assert_eq!(put, Some(current().downstream_key("PUT /things/1#0")));
        assert_eq!(send(&c, req(Method::POST, "/things")).await, None);
        assert_eq!(
            send(&default_header, req(Method::PUT, "/things/1")).await,
            None
        );
        Ok::<_, IdemError>(())
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_body_nested_in_a_step_is_keyed_by_its_own_operation() {
    let idem = Idem::memory();
    let c = client();
    run(&idem, "outer", || async {
        step("charge", || async {
            let inner = idem
                .operation("inner", "k")
                .retain(Duration::from_secs(3600))
                .fingerprint_none()
                .run(|| async {
                    assert_eq!(current().step(), None);
                    let sent = send(&c, req(Method::POST, "/charges")).await;
                    assert_eq!(sent, Some(current().downstream_key("POST /charges#0")));
                    Ok::<_, IdemError>(sent)
                })
                .await?;
            assert_eq!(current().step(), Some("charge"));
            Ok::<_, IdemError>(inner)
        })
        .await
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn steps_run_together_each_key_their_calls_by_their_own_label() {
    let idem = Idem::memory();
    let c = client();
    run(&idem, "k", || async {
        let one = step("one", || async {
            tokio::task::yield_now().await;
            let first = send(&c, req(Method::POST, "/a")).await;
            tokio::task::yield_now().await;
            Ok::<_, IdemError>((first, send(&c, req(Method::POST, "/a")).await))
        });
        let two = step("two", || async {
            let first = send(&c, req(Method::POST, "/a")).await;
            tokio::task::yield_now().await;
            Ok::<_, IdemError>((first, send(&c, req(Method::POST, "/a")).await))
        });
        let (one, two) = tokio::try_join!(one, two)?;
        let op = current();
        let key = |l: &str| Some(op.downstream_key(l));
        assert_eq!(one, (key("one"), key("one#1")));
        assert_eq!(two, (key("two"), key("two#1")));
        Ok::<_, IdemError>(())
    })
    .await
    .unwrap();
}

#[cfg(feature = "reqwest")]
mod reqwest_middleware_order {
    use std::collections::VecDeque;

    use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
    use reqwest_retry::RetryTransientMiddleware;
    use reqwest_retry::policies::ExponentialBackoff;

    use super::*;
    use crate::client::PropagateKey;

    /// Stands in for the network: records each attempt's key and answers the scripted
    /// statuses (then 200).
    #[derive(Clone, Default)]
    struct Server {
        seen: Arc<Mutex<Vec<Option<String>>>>,
        script: Arc<Mutex<VecDeque<u16>>>,
    }

    #[async_trait::async_trait]
    impl Middleware for Server {
        async fn handle(
            &self,
            req: reqwest::Request,
            _: &mut http::Extensions,
            _: Next<'_>,
        ) -> reqwest_middleware::Result<reqwest::Response> {
            let key = req.headers().get("idempotency-key");
            let key = key.map(|v| v.to_str().unwrap().to_owned());
            self.seen.lock().unwrap().push(key);
            let status = self.script.lock().unwrap().pop_front().unwrap_or(200);
            let answer = http::Response::builder().status(status).body("").unwrap();
            Ok(answer.into())
        }
    }

    fn retry() -> RetryTransientMiddleware<ExponentialBackoff> {
        let policy = ExponentialBackoff::builder()
            .retry_bounds(Duration::from_millis(1), Duration::from_millis(1))
            .build_with_max_retries(5);
        RetryTransientMiddleware::new_with_policy(policy)
    }

    fn client(server: &Server, key_first: bool, layer: PropagateKey) -> ClientWithMiddleware {
        let b = ClientBuilder::new(reqwest::Client::new());
        let b = if key_first {
            b.with(layer).with(retry())
        } else {
            b.with(retry()).with(layer)
        };
        b.with(server.clone()).build()
    }

    /// Two calls, the first answered 503 twice (so sent three times): the keys of the
    /// four attempts, and the two calls' own.
    async fn two_calls(key_first: bool) -> (Vec<Option<String>>, Vec<Option<String>>) {
        let server = Server::default();
        server.script.lock().unwrap().extend([503, 503]);
        let http = client(&server, key_first, PropagateKey::new());
        let idem = Idem::memory();
        let expected = run(&idem, "k", || async {
            for _ in 0..2 {
                let sent = http.post("http://127.0.0.1:9/charges").send().await;
                assert_eq!(sent.unwrap().status(), 200);
            }
            Ok::<_, IdemError>(keys(&current(), &["POST /charges#0", "POST /charges#1"]))
        })
        .await
        .unwrap();
        let seen = server.seen.lock().unwrap().clone();
        (seen, expected)
    }

    #[tokio::test]
    async fn before_the_retry_middleware_every_retry_of_a_call_carries_its_key() {
        let (seen, expected) = two_calls(true).await;
        let (first, second) = (expected[0].clone(), expected[1].clone());
        assert_eq!(seen, [first.clone(), first.clone(), first, second]);
    }

    #[tokio::test]
    async fn after_the_retry_middleware_every_retry_still_carries_the_calls_key() {
        let (seen, expected) = two_calls(false).await;
        let (first, second) = (expected[0].clone(), expected[1].clone());
        assert_eq!(seen, [first.clone(), first.clone(), first, second]);
    }

    #[tokio::test]
    async fn a_label_goes_in_as_an_extension() {
        let server = Server::default();
        let http = client(&server, true, PropagateKey::new());
        let idem = Idem::memory();
        let expected = run(&idem, "k", || async {
            let sent = http
                .post("http://127.0.0.1:9/refunds")
                .with_extension(KeyLabel("refund"))
                .send()
                .await;
            assert_eq!(sent.unwrap().status(), 200);
            Ok::<_, IdemError>(current().downstream_key("refund"))
        })
        .await
        .unwrap();
        assert_eq!(*server.seen.lock().unwrap(), [Some(expected)]);
    }

    #[tokio::test]
    async fn outside_a_body_a_key_per_request_is_kept_across_retries() {
        for key_first in [true, false] {
            let server = Server::default();
            server.script.lock().unwrap().extend([503]);
            let layer = PropagateKey::new().key_per_request(true);
            let http = client(&server, key_first, layer);
            for _ in 0..2 {
                let sent = http.post("http://127.0.0.1:9/charges").send().await;
                assert_eq!(sent.unwrap().status(), 200);
            }
            let seen = server.seen.lock().unwrap().clone();
            assert_eq!(seen.len(), 3);
            assert!(seen.iter().all(Option::is_some), "{seen:?}");
            assert_eq!(seen[0], seen[1], "the retry resends the call's key");
            assert_ne!(seen[1], seen[2], "the next call has its own");
        }
    }

    #[tokio::test]
    async fn outside_a_body_requests_pass_untouched_by_default() {
        let server = Server::default();
        let http = client(&server, true, PropagateKey::new());
        http.post("http://127.0.0.1:9/charges")
            .send()
            .await
            .unwrap();
        assert_eq!(*server.seen.lock().unwrap(), [None]);
    }
}
