//! Compile-time cases for `#[idempotent]`; the cases live under `tests/ui/`.
