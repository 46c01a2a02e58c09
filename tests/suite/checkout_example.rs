//! The `checkout` example end to end: a run that crashes after its charge, then a run
//! that resumes, as two processes on one SQLite file.

use std::path::Path;
use std::process::{Command, Output};

/// The example, built by cargo for this test (see tests/bin/checkout.rs).
const EXE: &str = env!("CARGO_BIN_EXE_idem-checkout");

fn checkout(db: &Path, args: &[&str]) -> (Output, String) {
    let out = Command::new(EXE)
        .env("IDEM_EXAMPLE_DB", db)
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!(
        "{EXE} {args:?}:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (out, stdout)
}

fn lines(stdout: &str) -> Vec<&str> {
    stdout.lines().collect()
}

#[test]
fn a_crash_after_the_charge_resumes_at_the_receipt() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("checkout.db");

    let (crashed, stdout) = checkout(&db, &["--crash-after", "charge"]);
    assert_eq!(
        crashed.status.code(),
        Some(3),
        "the simulated crash's status"
    );
    let out = lines(&stdout);
    for line in ["ran reserve", "ran charge"] {
        assert!(out.contains(&line), "{line:?} in {out:?}");
    }
    assert!(!stdout.contains("receipt"), "{out:?}");

    let (resumed, stdout) = checkout(&db, &[]);
    assert!(resumed.status.success(), "{resumed:?}");
    let out = lines(&stdout);
    for line in [
        "replayed reserve",
        "replayed charge",
        "ran receipt",
        "counts for order-1: reservations=1 provider_charges=1 outbox=1",
    ] {
        assert!(out.contains(&line), "{line:?} in {out:?}");
    }
    for line in ["ran reserve", "ran charge", "replayed receipt"] {
        assert!(!out.contains(&line), "{line:?} in {out:?}");
    }
    let receipt = out.iter().find(|l| l.starts_with("receipt: ")).unwrap();

    // Completed: the receipt replays whole, and nothing runs.
    let (again, stdout) = checkout(&db, &[]);
    assert!(again.status.success(), "{again:?}");
    let out = lines(&stdout);
    assert!(out.contains(receipt), "{receipt:?} in {out:?}");
    assert!(
        !out.iter()
            .any(|l| l.starts_with("ran ") || l.starts_with("replayed ")),
        "{out:?}"
    );
    assert!(
        out.contains(&"counts for order-1: reservations=1 provider_charges=1 outbox=1"),
        "{out:?}"
    );
}
