//! Idempotent Lambda handlers (`idem_runtime::lambda`) driven as Lambda drives them,
//! through their `tower::Service` with `LambdaEvent`s, on the local DynamoDB-compatible
//! server: duplicate invocations at once run the handler once; an invocation stopped at
//! its deadline is taken over by the retry; an event without a key is refused or run as
//! chosen; an SQS batch reports only its failed records, and its redelivery runs only
//! those.
use crate::dynamodb::{client, drop_table, reachable, table};

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_lambda_events::event::sqs::{SqsEvent, SqsMessage};
use idem_runtime::Idem;
use idem_runtime::lambda::{IdempotentLambda, MissingKey, SqsBatch};
use lambda_runtime::{Context, LambdaEvent};
use serde::{Deserialize, Serialize};
use tower::util::BoxCloneService;
use tower::{Service, ServiceExt};

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Payment {
    payment_id: Option<String>,
    cents: u64,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Receipt {
    charge: String,
    run: usize,
}

/// Runs of the handler, by payment id.
type Runs = Arc<Mutex<Vec<String>>>;

fn context(deadline_in: Duration) -> Context {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let mut ctx = Context::default();
    ctx.request_id = format!("req-{}", now.as_nanos());
    ctx.deadline = u64::try_from((now + deadline_in).as_millis()).unwrap();
    ctx
}

fn event(id: Option<&str>, cents: u64, deadline_in: Duration) -> LambdaEvent<Payment> {
    let payment = Payment {
        payment_id: id.map(str::to_owned),
        cents,
    };
    LambdaEvent::new(payment, context(deadline_in))
}

/// The function's handler: counts its runs, takes `slow` to answer.
fn charge(
    runs: Runs,
    slow: Duration,
) -> BoxCloneService<LambdaEvent<Payment>, Receipt, lambda_runtime::Error> {
    BoxCloneService::new(tower::service_fn(move |event: LambdaEvent<Payment>| {
        let runs = runs.clone();
        async move {
            let id = event.payload.payment_id.clone().unwrap_or_default();
            let run = {
                let mut runs = runs.lock().unwrap();
                runs.push(id.clone());
                runs.len()
            };
            tokio::time::sleep(slow).await;
            Ok::<_, lambda_runtime::Error>(Receipt {
                charge: format!("ch_{id}"),
                run,
            })
        }
    }))
}

async fn open(test: &str) -> Option<(Idem, String)> {
    if !reachable(test) {
        return None;
    }
    let name = table(test);
    let idem = Idem::builder()
        .replay_cache_bytes(0)
        .dynamodb(client(), &name)
        .await
        .unwrap();
    Some((idem, name))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_invocations_at_once_run_the_handler_once() {
    let Some((idem, name)) = open("lambda_duplicates").await else {
        return;
    };
    let runs = Runs::default();
    let handler = IdempotentLambda::new(idem, "charge")
        .key_path("/payment_id")
        .wrap(charge(runs.clone(), Duration::from_millis(200)));
    let mut calls = Vec::new();
    for _ in 0..8 {
        let mut handler = handler.clone();
        let ready = handler.ready().await.unwrap();
        calls.push(tokio::spawn(ready.call(event(
            Some("p-1"),
            500,
            Duration::from_secs(30),
        ))));
    }
    let mut answers = Vec::new();
    for call in futures_util::future::join_all(calls).await {
        match call.unwrap() {
            Ok(receipt) => answers.push(receipt),
            // A duplicate that found the first still running is refused, as Lambda's
            // retry would be, and its retry replays.
            Err(e) => assert!(e.to_string().contains("already running"), "{e}"),
        }
    }
    assert!(!answers.is_empty());
    assert!(
        answers.iter().all(|r| r.charge == "ch_p-1" && r.run == 1),
        "{answers:?}"
    );
    let replay = handler
        .oneshot(event(Some("p-1"), 500, Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(replay.run, 1);
    assert_eq!(runs.lock().unwrap().len(), 1);
    drop_table(&name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invocation_stopped_at_its_deadline_is_taken_over_by_the_retry() {
    let Some((idem, name)) = open("lambda_deadline").await else {
        return;
    };
    let runs = Runs::default();
    let slow = IdempotentLambda::new(idem.clone(), "charge")
        .key(|p: &Payment| p.payment_id.clone())
        .wrap(charge(runs.clone(), Duration::from_secs(60)));
    // Lambda stops the invocation at its deadline: its future is dropped mid-body.
    let deadline = Duration::from_millis(1500);
    let stopped =
        tokio::time::timeout(deadline, slow.oneshot(event(Some("p-2"), 700, deadline))).await;
    assert!(stopped.is_err(), "the body outlived the deadline");
    // The retry, once the claim bounded by that deadline has lapsed, runs it again.
    let quick = IdempotentLambda::new(idem, "charge")
        .key(|p: &Payment| p.payment_id.clone())
        .wrap(charge(runs.clone(), Duration::ZERO));
    let mut attempts = 0;
    let retried = loop {
        attempts += 1;
        // A claim left to a 15-minute lease would hold this off far longer.
        assert!(
            attempts < 300,
            "the stopped invocation's claim outlived its deadline"
        );
        match quick
            .clone()
            .oneshot(event(Some("p-2"), 700, Duration::from_secs(30)))
            .await
        {
            Ok(receipt) => break receipt,
            Err(e) if e.to_string().contains("already running") => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(retried.run, 2, "the retry ran the body again");
    assert_eq!(runs.lock().unwrap().len(), 2);
    drop_table(&name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_without_a_key_is_refused_or_run_as_chosen() {
    let Some((idem, name)) = open("lambda_no_key").await else {
        return;
    };
    let runs = Runs::default();
    let refusing = IdempotentLambda::new(idem.clone(), "charge")
        .key_path("/payment_id")
        .wrap(charge(runs.clone(), Duration::ZERO));
    let refused = refusing
        .oneshot(event(None, 1, Duration::from_secs(30)))
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("no idempotency key"),
        "{refused}"
    );
    assert_eq!(runs.lock().unwrap().len(), 0);
    let running = IdempotentLambda::new(idem, "charge")
        .key_path("/payment_id")
        .on_missing_key(MissingKey::Run)
        .wrap(charge(runs.clone(), Duration::ZERO));
    for _ in 0..2 {
        running
            .clone()
            .oneshot(event(None, 1, Duration::from_secs(30)))
            .await
            .unwrap();
    }
    assert_eq!(runs.lock().unwrap().len(), 2, "run unprotected, each time");
    drop_table(&name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_other_than_the_keys_first_is_refused() {
    let Some((idem, name)) = open("lambda_payload").await else {
        return;
    };
    let runs = Runs::default();
    let handler = IdempotentLambda::new(idem, "charge")
        .key_path("/payment_id")
        .fingerprint_path("/cents")
        .wrap(charge(runs.clone(), Duration::ZERO));
    handler
        .clone()
        .oneshot(event(Some("p-3"), 100, Duration::from_secs(30)))
        .await
        .unwrap();
    let other = handler
        .oneshot(event(Some("p-3"), 999, Duration::from_secs(30)))
        .await
        .unwrap_err();
    assert!(other.to_string().contains("different payload"), "{other}");
    assert_eq!(runs.lock().unwrap().len(), 1);
    drop_table(&name).await;
}

fn message(id: &str) -> SqsMessage {
    let mut m = SqsMessage::default();
    m.message_id = Some(format!("msg-{id}"));
    m.body = Some(id.to_owned());
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sqs_batch_reports_its_failures_and_its_redelivery_runs_only_those() {
    let Some((idem, name)) = open("lambda_sqs").await else {
        return;
    };
    // Record `b` fails on its first run only.
    let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let handler = {
        let runs = runs.clone();
        tower::service_fn(move |m: SqsMessage| {
            let runs = runs.clone();
            async move {
                let body = m.body.unwrap_or_default();
                let n = {
                    let mut runs = runs.lock().unwrap();
                    let n = runs.entry(body.clone()).or_default();
                    *n += 1;
                    *n
                };
                if body == "b" && n == 1 {
                    return Err::<(), lambda_runtime::Error>("the warehouse timed out".into());
                }
                Ok(())
            }
        })
    };
    let batch = SqsBatch::new(idem, "ship").wrap(handler);
    let mut sqs = SqsEvent::default();
    sqs.records = ["a", "b", "c"].into_iter().map(message).collect();
    let first = batch
        .clone()
        .oneshot(LambdaEvent::new(
            sqs.clone(),
            context(Duration::from_secs(30)),
        ))
        .await
        .unwrap();
    let failed: Vec<_> = first
        .batch_item_failures
        .iter()
        .map(|f| f.item_identifier.clone())
        .collect();
    assert_eq!(failed, ["msg-b"]);
    // SQS redelivers the batch's failure (here: the whole batch, as a retry of an
    // invocation would): only `b` runs again.
    let second = batch
        .oneshot(LambdaEvent::new(sqs, context(Duration::from_secs(30))))
        .await
        .unwrap();
    assert!(second.batch_item_failures.is_empty(), "{second:?}");
    let runs = runs.lock().unwrap().clone();
    assert_eq!(
        runs,
        HashMap::from([("a".into(), 1), ("b".into(), 2), ("c".into(), 1)])
    );
    drop_table(&name).await;
}
