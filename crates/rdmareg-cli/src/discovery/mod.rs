//! `rdmareg serve` and `rdmareg fetch`: owners and consumers that find each
//! other through etcd instead of the demo's one-consumer TCP bootstrap.
//!
//! An owner (`serve`) registers `count` pool buffers, fills each with the
//! byte pattern seeded by its name (`NODE.INDEX`), and publishes its worker
//! address and one descriptor per buffer under a lease. A consumer (`fetch`)
//! resolves names, adds each owner as a peer, GETs every range and checks it
//! against the pattern its name implies — no checksum has to travel. It
//! watches the cluster while it runs: an owner whose lease vanishes is
//! removed from the engine at once, so GETs to it fail with a typed error
//! instead of waiting out their deadline.

pub mod fetch;
pub mod serve;

use std::time::{SystemTime, UNIX_EPOCH};

use rdmareg_discovery::EtcdConfig;

use crate::cli::EtcdArgs;
use crate::pattern;

/// The etcd configuration the arguments ask for.
pub fn etcd_config(args: &EtcdArgs) -> EtcdConfig {
    let mut endpoints = args.etcd.iter();
    let first = endpoints.next().cloned().unwrap_or_default();
    let mut config = EtcdConfig::new(first)
        .with_prefix(args.prefix.clone())
        .with_ttl(args.ttl);
    for endpoint in endpoints {
        config = config.with_endpoint(endpoint.clone());
    }
    config
}

/// The published name of an owner's `index`th range.
pub fn range_name(node: &str, index: u32) -> String {
    format!("{node}.{index}")
}

/// The pattern seed of a published name (so the consumer can verify
/// without the owner sending checksums).
pub fn seed_for(name: &str) -> u64 {
    u64::from(pattern::checksum(name.as_bytes())) << 16 | name.len() as u64
}

/// The checksum of the `len` bytes an owner publishes under `name`.
pub fn expected_checksum(name: &str, len: usize) -> u32 {
    let mut bytes = vec![0u8; len];
    pattern::fill(&mut bytes, seed_for(name));
    pattern::checksum(&bytes)
}

/// Wall-clock seconds since the Unix epoch, for event lines that scripts
/// compare with their own clock (`[t=1764612345.678]`).
pub fn stamp() -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    format!("[t={}.{:03}]", now.as_secs(), now.subsec_millis())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_of_different_names_have_different_checksums() {
        assert_ne!(
            expected_checksum("a.0", 4096),
            expected_checksum("a.1", 4096)
        );
        assert_ne!(
            expected_checksum("a.0", 4096),
            expected_checksum("b.0", 4096)
        );
    }

    #[test]
    fn what_the_owner_fills_is_what_the_consumer_expects() {
        let mut bytes = vec![0u8; 1000];
        pattern::fill(&mut bytes, seed_for("node.3"));
        assert_eq!(pattern::checksum(&bytes), expected_checksum("node.3", 1000));
    }

    #[test]
    fn the_etcd_arguments_carry_every_endpoint() {
        let args = EtcdArgs {
            etcd: vec!["h:1".into(), "h:2".into()],
            prefix: "/p".into(),
            ttl: std::time::Duration::from_secs(3),
        };
        let config = etcd_config(&args);
        assert_eq!(config.prefix(), "/p");
        assert_eq!(config.ttl_secs(), 3);
        assert_eq!(format!("{config:?}").matches("h:").count(), 2);
    }
}
