//! Whether an engine can end a read that a stalled owner's reply holds:
//! only over `tcp;ofi_rxm`, and only in a process whose environment told
//! libfabric to close a connection when its address is removed
//! (`FI_AV_REMOVE_CLEANUP`, read once when libfabric initialises, so each
//! case runs in a child process of its own).

use crate::common;

use rdmareg_ofi::{OfiEngine, Provider};

/// Set in a child: what it must find, `true` or `false`.
const EXPECTED: &str = "RDMAREG_TEST_RESETS_STALLED_CONNECTIONS";

#[test]
fn a_tcp_engine_resets_stalled_connections_exactly_where_libfabric_was_told_to() {
    if let Some(expected) = std::env::var_os(EXPECTED) {
        let expected = expected == "true";
        let tcp = OfiEngine::start(common::config(Provider::Tcp)).expect("a tcp engine starts");
        assert_eq!(tcp.resets_stalled_connections(), expected, "tcp");
        let shm = OfiEngine::start(common::config(Provider::Shm)).expect("a shm engine starts");
        assert!(!shm.resets_stalled_connections(), "shm never resets");
        return;
    }
    // libfabric's own reading of a boolean parameter: "y" and a padded "1"
    // are not true to it, so the engine must not count on them either.
    for (value, expected) in [
        (Some("1"), true),
        (Some("On"), true),
        (Some("y"), false),
        (Some(" 1"), false),
        (Some("0"), false),
        (None, false),
    ] {
        let mut child =
            std::process::Command::new(std::env::current_exe().expect("the test binary"));
        child
            .args([
                "--exact",
                // Its full name in the test binary: `--exact` compares with that.
                "stalled_connection_reset::a_tcp_engine_resets_stalled_connections_exactly_where_libfabric_was_told_to",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(EXPECTED, expected.to_string());
        match value {
            Some(value) => child.env("FI_AV_REMOVE_CLEANUP", value),
            None => child.env_remove("FI_AV_REMOVE_CLEANUP"),
        };
        let status = child.status().expect("the child test runs");
        assert!(
            status.success(),
            "FI_AV_REMOVE_CLEANUP={value:?}: the child found otherwise ({status})"
        );
    }
}
