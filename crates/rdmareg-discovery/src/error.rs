//! The one error type of discovery.

use rdmareg_core::DescriptorError;

/// What went wrong talking to etcd or reading what is published there.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// The etcd URL cannot be used (wrong scheme, no host, bad port).
    #[error("invalid etcd endpoint `{endpoint}`: {reason} (expected http://HOST:PORT)")]
    InvalidEndpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// No etcd responded at the configured endpoints within the connect timeout.
    #[error("etcd unreachable at {endpoints}: {detail}")]
    Unreachable {
        /// The endpoints tried, comma-separated.
        endpoints: String,
        /// The client's or the timeout's message.
        detail: String,
    },
    /// An etcd request failed after connecting (connection lost, server error).
    #[error("etcd request failed while {action}: {detail}")]
    Etcd {
        /// What was being done.
        action: &'static str,
        /// The client's message.
        detail: String,
    },
    /// A node or descriptor name is empty, too long, or holds `/` or control characters.
    #[error("invalid name `{0}`: 1 to 200 bytes, no `/`, no whitespace or control characters")]
    InvalidName(String),
    /// Nothing is published under the name.
    #[error("no descriptor is published under `{0}`")]
    NotFound(String),
    /// The descriptor's node has no live lease any more (crashed, cut off or
    /// shut down): its memory must not be read.
    #[error("node `{0}` is gone (its etcd lease expired or was revoked)")]
    PeerGone(String),
    /// The entry is older than one this consumer has already seen for the name.
    #[error(
        "stale descriptor for `{name}`: revision {got_revision} generation {got_generation} is \
         older than the revision {seen_revision} generation {seen_generation} already seen"
    )]
    Stale {
        /// The descriptor's name.
        name: String,
        /// The revision already seen.
        seen_revision: i64,
        /// The generation already seen.
        seen_generation: u64,
        /// The refused entry's revision.
        got_revision: i64,
        /// The refused entry's generation.
        got_generation: u64,
    },
    /// A value under the cluster prefix is not a record this crate wrote.
    #[error("malformed discovery record at `{key}`: {reason}")]
    Malformed {
        /// The etcd key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A published descriptor does not decode.
    #[error("published descriptor at `{key}` does not decode: {error}")]
    Descriptor {
        /// The etcd key.
        key: String,
        /// The decoder's error.
        error: DescriptorError,
    },
    /// The publisher was shut down.
    #[error("the publisher is shut down")]
    Closed,
}

impl DiscoveryError {
    /// Whether retrying later may succeed (etcd down or cut off), as opposed
    /// to a mistake in the input or a decision made by the data.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Unreachable { .. } | Self::Etcd { .. })
    }

    pub(crate) fn etcd(action: &'static str, error: impl std::fmt::Display) -> Self {
        Self::Etcd {
            action,
            detail: error.to_string(),
        }
    }
}
