//! The `checkout` example as a binary, so cargo builds it for tests/suite/checkout_example.rs
//! (`CARGO_BIN_EXE_idem-checkout`) and the test always runs the current example.

#[path = "../../examples/checkout.rs"]
mod checkout;

fn main() -> Result<(), idem_runtime::BoxError> {
    checkout::main()
}
