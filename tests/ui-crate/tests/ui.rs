//! Runs the `#[idempotent]` compile-fail and compile-pass cases under `tests/ui/`.
//!
//! Regenerate the expected errors with `TRYBUILD=overwrite cargo test -p idem-ui-tests`
//! and review the diff: each `.stderr` must show the intended error on the intended span.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("../ui/fail/*.rs");
    cases.pass("../ui/pass/*.rs");
}
