//! The key layout under a cluster prefix and the two record encodings.
//!
//! ```text
//! {prefix}/nodes/{node}  -> node record: incarnation, backend key, worker address
//! {prefix}/names/{name}  -> name record: node, incarnation, encoded Descriptor
//! ```
//!
//! Both keys of a node are attached to the node's lease, so a node whose lease
//! expires loses its entry and every name it published in one revision.
//!
//! The *incarnation* is the etcd revision at which a publisher first wrote its
//! node key. It is unique per publisher start and grows across restarts, so a
//! consumer can tell a restarted node (whose registry counts generations from
//! the start again) from an old entry of the same process. Revisions compare
//! only within one store: a publisher that outlives an etcd which lost its
//! data takes a new incarnation, the revision of its first write there.
//!
//! Records are versioned and length-prefixed; decoding bytes read from etcd
//! never panics and allocates at most the record's own size.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use rdmareg_core::{Descriptor, MAX_BACKEND_KEY_LEN};

use crate::DiscoveryError;

const NODE_VERSION: u8 = 1;
const NAME_VERSION: u8 = 1;
/// Largest worker address accepted in a node record.
pub const MAX_WORKER_ADDRESS_LEN: usize = 64 * 1024;
/// Longest node or descriptor name.
pub const MAX_NAME_LEN: usize = 200;

/// Checks a node or descriptor name.
pub(crate) fn check_name(name: &str) -> Result<(), DiscoveryError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && !name
            .chars()
            .any(|c| c == '/' || c.is_whitespace() || c.is_control());
    if ok {
        Ok(())
    } else {
        Err(DiscoveryError::InvalidName(name.to_string()))
    }
}

/// The keys of one cluster.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    prefix: String,
}

/// What a key under the prefix names.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum KeyKind<'a> {
    Node(&'a str),
    Name(&'a str),
    Other,
}

impl Keys {
    pub(crate) fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.trim_end_matches('/').to_string(),
        }
    }

    pub(crate) fn root(&self) -> String {
        format!("{}/", self.prefix)
    }

    pub(crate) fn node(&self, node: &str) -> String {
        format!("{}/nodes/{node}", self.prefix)
    }

    pub(crate) fn name(&self, name: &str) -> String {
        format!("{}/names/{name}", self.prefix)
    }

    pub(crate) fn classify<'a>(&self, key: &'a [u8]) -> KeyKind<'a> {
        let Ok(key) = std::str::from_utf8(key) else {
            return KeyKind::Other;
        };
        let Some(rest) = key
            .strip_prefix(self.prefix.as_str())
            .and_then(|r| r.strip_prefix('/'))
        else {
            return KeyKind::Other;
        };
        if let Some(node) = rest.strip_prefix("nodes/") {
            KeyKind::Node(node)
        } else if let Some(name) = rest.strip_prefix("names/") {
            KeyKind::Name(name)
        } else {
            KeyKind::Other
        }
    }
}

/// What a node publishes about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRecord {
    /// The etcd revision of this publisher's first registration (in the
    /// current store: taken again if etcd lost its data).
    pub incarnation: i64,
    /// The backend's wire name (`"ucx"`), as in its descriptors.
    pub backend_key: String,
    /// The backend's worker address, for the consumer's `add_peer`.
    pub worker_address: Bytes,
}

impl NodeRecord {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = BytesMut::with_capacity(
            1 + 8 + 1 + self.backend_key.len() + 4 + self.worker_address.len(),
        );
        out.put_u8(NODE_VERSION);
        out.put_i64_le(self.incarnation);
        out.put_u8(self.backend_key.len() as u8);
        out.put_slice(self.backend_key.as_bytes());
        out.put_u32_le(self.worker_address.len() as u32);
        out.put_slice(&self.worker_address);
        out.to_vec()
    }

    pub(crate) fn decode(key: &str, mut input: &[u8]) -> Result<Self, DiscoveryError> {
        let bad = |reason: String| DiscoveryError::Malformed {
            key: key.to_string(),
            reason,
        };
        if input.remaining() < 1 + 8 + 1 {
            return Err(bad("node record truncated".into()));
        }
        let version = input.get_u8();
        if version != NODE_VERSION {
            return Err(bad(format!("unsupported node record version {version}")));
        }
        let incarnation = input.get_i64_le();
        let key_len = input.get_u8() as usize;
        if key_len == 0 || key_len > MAX_BACKEND_KEY_LEN || input.remaining() < key_len + 4 {
            return Err(bad("backend key length out of range or truncated".into()));
        }
        let backend_key = std::str::from_utf8(&input[..key_len])
            .map_err(|_| bad("backend key is not UTF-8".into()))?
            .to_string();
        input.advance(key_len);
        let addr_len = input.get_u32_le() as usize;
        if addr_len == 0 || addr_len > MAX_WORKER_ADDRESS_LEN || input.remaining() != addr_len {
            return Err(bad(format!(
                "worker address length {addr_len} does not match the {} bytes left (1..={MAX_WORKER_ADDRESS_LEN})",
                input.remaining()
            )));
        }
        Ok(Self {
            incarnation,
            backend_key,
            worker_address: Bytes::copy_from_slice(input),
        })
    }
}

/// What is published under a descriptor name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NameRecord {
    pub(crate) node: String,
    pub(crate) incarnation: i64,
    pub(crate) descriptor: Descriptor,
}

impl NameRecord {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = BytesMut::new();
        out.put_u8(NAME_VERSION);
        out.put_u16_le(self.node.len() as u16);
        out.put_slice(self.node.as_bytes());
        out.put_i64_le(self.incarnation);
        self.descriptor.encode_into(&mut out);
        out.to_vec()
    }

    pub(crate) fn decode(key: &str, mut input: &[u8]) -> Result<Self, DiscoveryError> {
        let bad = |reason: String| DiscoveryError::Malformed {
            key: key.to_string(),
            reason,
        };
        if input.remaining() < 1 + 2 {
            return Err(bad("name record truncated".into()));
        }
        let version = input.get_u8();
        if version != NAME_VERSION {
            return Err(bad(format!("unsupported name record version {version}")));
        }
        let node_len = input.get_u16_le() as usize;
        if node_len == 0 || node_len > MAX_NAME_LEN || input.remaining() < node_len + 8 {
            return Err(bad("node name length out of range or truncated".into()));
        }
        let node = std::str::from_utf8(&input[..node_len])
            .map_err(|_| bad("node name is not UTF-8".into()))?
            .to_string();
        check_name(&node).map_err(|_| bad(format!("invalid node name `{node}`")))?;
        input.advance(node_len);
        let incarnation = input.get_i64_le();
        let descriptor = Descriptor::decode(input).map_err(|error| DiscoveryError::Descriptor {
            key: key.to_string(),
            error,
        })?;
        Ok(Self {
            node,
            incarnation,
            descriptor,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn descriptor(generation: u64) -> Descriptor {
        Descriptor::new("ucx", 0x1000, 4096, generation, Bytes::from_static(b"key")).unwrap()
    }

    #[test]
    fn node_records_round_trip() {
        let record = NodeRecord {
            incarnation: 42,
            backend_key: "ucx".into(),
            worker_address: Bytes::from_static(b"\x01\x02\x03"),
        };
        assert_eq!(NodeRecord::decode("k", &record.encode()).unwrap(), record);
    }

    #[test]
    fn name_records_round_trip() {
        let record = NameRecord {
            node: "owner-a".into(),
            incarnation: 7,
            descriptor: descriptor(3),
        };
        assert_eq!(NameRecord::decode("k", &record.encode()).unwrap(), record);
    }

    #[test]
    fn every_truncation_of_a_record_is_a_typed_error() {
        let node = NodeRecord {
            incarnation: 1,
            backend_key: "ucx".into(),
            worker_address: Bytes::from_static(b"addr"),
        }
        .encode();
        for cut in 0..node.len() {
            assert!(NodeRecord::decode("k", &node[..cut]).is_err(), "cut {cut}");
        }
        let name = NameRecord {
            node: "n".into(),
            incarnation: 1,
            descriptor: descriptor(1),
        }
        .encode();
        for cut in 0..name.len() {
            assert!(NameRecord::decode("k", &name[..cut]).is_err(), "cut {cut}");
        }
    }

    #[test]
    fn names_with_slashes_spaces_or_nothing_are_refused() {
        for name in ["", "a/b", "a b", "tab\t", &"x".repeat(MAX_NAME_LEN + 1)] {
            assert!(check_name(name).is_err(), "{name:?}");
        }
        assert!(check_name("kv-cache.block-7").is_ok());
    }

    #[test]
    fn keys_classify_what_they_build() {
        let keys = Keys::new("/rdmareg/test/");
        assert_eq!(keys.classify(keys.node("a").as_bytes()), KeyKind::Node("a"));
        assert_eq!(keys.classify(keys.name("b").as_bytes()), KeyKind::Name("b"));
        assert_eq!(keys.classify(b"/rdmareg/other/nodes/a"), KeyKind::Other);
    }
}
