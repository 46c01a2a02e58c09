//! The fingerprint is bound at first use and stable across processes.
use crate::common;
use crate::suite;
use common::*;
use idem_runtime::{IdemError, fingerprint};
use serde::Serialize;
use std::collections::HashMap;

suite!(fingerprint_survives_release_and_takeover_checks);

#[derive(Serialize)]
struct Order {
    id: u64,
    lines: HashMap<String, u32>,
    note: Option<String>,
}

fn order() -> Order {
    Order {
        id: 7,
        lines: (0..40).map(|i| (format!("sku-{i}"), i)).collect(),
        note: Some("leave at door".into()),
    }
}

fn hex(b: [u8; 32]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

/// Run by the parent test in a child process: prints the fingerprint.
#[test]
fn child_prints_fingerprint() {
    if std::env::var("IDEM_FP_CHILD").is_ok() {
        println!("FP={}", hex(fingerprint(&order()).unwrap()));
    }
}

#[test]
fn hashmap_fingerprint_is_the_same_in_two_processes() {
    let mine = hex(fingerprint(&order()).unwrap());
    // Each process seeds its HashMaps differently, so iteration orders differ.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            // The test's path in the suite binary.
            "fingerprint::child_prints_fingerprint",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("IDEM_FP_CHILD", "1")
        .output()
        .expect("run child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let theirs = stdout
        .lines()
        .find_map(|l| l.split_once("FP=").map(|(_, fp)| &fp[..64.min(fp.len())]))
        .unwrap_or_else(|| panic!("child printed no fingerprint: {stdout}"));
    assert_eq!(mine, theirs);
}

async fn fingerprint_survives_release_and_takeover_checks(ctx: Ctx) {
    // A struct with a HashMap fingerprints the same on every call within a process too.
    for _ in 0..3 {
        ctx.idem
            .operation("place", "order-7")
            .fingerprint(&order())
            .retain(std::time::Duration::from_secs(86_400))
            .run(|| async { Ok::<_, IdemError>(1) })
            .await
            .unwrap();
    }
    let mut changed = order();
    changed.lines.insert("sku-extra".into(), 1);
    let r = ctx
        .idem
        .operation("place", "order-7")
        .fingerprint(&changed)
        .retain(std::time::Duration::from_secs(86_400))
        .run(|| async { Ok::<_, IdemError>(2) })
        .await;
    assert!(matches!(r, Err(IdemError::Mismatch { .. })), "{r:?}");
}
