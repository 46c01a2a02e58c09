//! The `agent_tools` example as a binary: cargo builds a package's binaries before its
//! integration tests and tells them where (`CARGO_BIN_EXE_idem-agent-tools`), so
//! tests/suite/mcp.rs always runs the current example, never a stale build of it.

#[path = "../../examples/agent_tools.rs"]
mod agent_tools;

fn main() -> Result<(), idem_runtime::BoxError> {
    agent_tools::main()
}
