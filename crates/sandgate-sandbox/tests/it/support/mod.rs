//! Helpers shared by the integration tests.

/// The sandbox image under test. Tests fail (never skip) without it: CI always builds it.
pub fn image() -> String {
    std::env::var("SANDGATE_SANDBOX__IMAGE").expect(
        "SANDGATE_SANDBOX__IMAGE is not set; run the tests through scripts/test.sh \
         (or `source <cache>/stack.env` after scripts/stack.sh up)",
    )
}

/// A Docker client for the engine under test.
pub fn docker() -> bollard::Docker {
    bollard::Docker::connect_with_defaults().expect("a Docker client can be configured")
}
