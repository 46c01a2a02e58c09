//! The `#[idempotent]` cases under `tests/ui/`.
//!
//! The compile-fail cases run through trybuild, which checks each one's errors against
//! its `.stderr`. Regenerate them with `TRYBUILD=overwrite cargo test -p idem-ui-tests`
//! and review the diff: each `.stderr` must show the intended error on the intended span.
//! trybuild builds in a target directory of its own; with only compile-fail cases it
//! checks (`cargo check`) rather than builds, so its dependencies are not compiled to
//! machine code.
//!
//! The cases that must compile are modules of this test binary: they compile with it,
//! each under its own `#![deny(warnings)]`.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("../ui/fail/*.rs");
}

#[path = "../../ui/pass/attributes-preserved.rs"]
mod attributes_preserved;
#[path = "../../ui/pass/composite-tuple-key.rs"]
mod composite_tuple_key;
#[path = "../../ui/pass/crate-path.rs"]
mod crate_path;
#[path = "../../ui/pass/every-argument.rs"]
mod every_argument;
#[path = "../../ui/pass/field-created-at.rs"]
mod field_created_at;
#[path = "../../ui/pass/format-key.rs"]
mod format_key;
#[path = "../../ui/pass/generics.rs"]
mod generics;
#[path = "../../ui/pass/global-store.rs"]
mod global_store;
#[path = "../../ui/pass/idem-skip.rs"]
mod idem_skip;
// Its `main` only names the functions, for trybuild.
#[allow(dead_code)]
#[path = "../../ui/pass/key-client-chosen-with-scope.rs"]
mod key_client_chosen_with_scope;
#[path = "../../ui/pass/method-now-serving.rs"]
mod method_now_serving;
#[path = "../../ui/pass/method-self-store.rs"]
mod method_self_store;
#[path = "../../ui/pass/mut-and-owned-params.rs"]
mod mut_and_owned_params;
#[path = "../../ui/pass/patterned-params.rs"]
mod patterned_params;
#[path = "../../ui/pass/question-mark-and-return.rs"]
mod question_mark_and_return;
#[path = "../../ui/pass/user-fn-clock-id.rs"]
mod user_fn_clock_id;
#[path = "../../ui/pass/uuid-new-v5.rs"]
mod uuid_new_v5;
// Its bodies stay on one line: what it checks is how they expand.
#[rustfmt::skip]
#[path = "../../ui/pass/warning-free-one-line-bodies.rs"]
mod warning_free_one_line_bodies;
