//! The read keys this engine decoded last, so a repeated key is not decoded.
//!
//! A transfer list's entries are slices of a few descriptors, so without
//! the memo a list of a thousand blocks decodes the same few keys a thousand
//! times. An entry is found only by the key's whole content (byte for byte),
//! and holds a pure function of those bytes and the direct lane's key
//! format, fixed for the engine's life: a hit returns exactly what decoding
//! would. Keys that fail to decode are not kept. The memo copies the bytes
//! (keeping no caller's buffer alive) and keeps a few entries, so a list
//! interleaving several descriptors still hits.

use std::rc::Rc;

use crate::read_protocol::ReadKey;

/// Keys remembered at once.
const ENTRIES: usize = 4;

/// A decoded key as the engine uses it.
#[derive(Debug, Clone)]
pub(crate) struct DecodedKey {
    pub(crate) key: Rc<ReadKey>,
    /// For a same-host key: whether its UCX key has the layout this
    /// engine's direct lane packs (always false without a direct lane).
    pub(crate) direct_well_formed: bool,
}

#[derive(Debug)]
struct Entry {
    bytes: Box<[u8]>,
    decoded: DecodedKey,
}

/// The last [`ENTRIES`] keys decoded.
#[derive(Debug, Default)]
pub(crate) struct KeyMemo {
    entries: Vec<Entry>,
    /// The entry the next new key replaces, once the memo is full.
    next: usize,
}

impl KeyMemo {
    /// The decoding of `bytes` if it is remembered.
    pub(crate) fn get(&self, bytes: &[u8]) -> Option<DecodedKey> {
        self.entries
            .iter()
            .find(|entry| *entry.bytes == *bytes)
            .map(|entry| entry.decoded.clone())
    }

    /// Remembers `decoded` as the decoding of `bytes`, in place of the
    /// oldest entry when full.
    pub(crate) fn insert(&mut self, bytes: &[u8], decoded: DecodedKey) {
        let entry = Entry {
            bytes: bytes.into(),
            decoded,
        };
        if self.entries.len() < ENTRIES {
            self.entries.push(entry);
        } else {
            self.entries[self.next] = entry;
            self.next = (self.next + 1) % ENTRIES;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::read_protocol::ServedKey;

    fn served(region_id: u64) -> (Vec<u8>, DecodedKey) {
        let key = ServedKey {
            region_id,
            capability: [7; 16],
        };
        let decoded = DecodedKey {
            key: Rc::new(ReadKey::Served(key)),
            direct_well_formed: false,
        };
        (key.encode().to_vec(), decoded)
    }

    #[test]
    fn a_key_is_found_by_its_content_and_only_by_it() {
        let mut memo = KeyMemo::default();
        let (bytes, decoded) = served(1);
        memo.insert(&bytes, decoded);
        let copy = bytes.clone();
        let found = memo.get(&copy).expect("the same bytes elsewhere hit");
        assert_eq!(found.key.served().region_id, 1);
        let mut other = bytes.clone();
        *other.last_mut().unwrap() ^= 1;
        assert!(memo.get(&other).is_none(), "one byte differs: a miss");
        assert!(memo.get(&bytes[..bytes.len() - 1]).is_none());
    }

    #[test]
    fn a_full_memo_replaces_its_oldest_key() {
        let mut memo = KeyMemo::default();
        let keys: Vec<_> = (0..=ENTRIES as u64).map(served).collect();
        for (bytes, decoded) in &keys {
            memo.insert(bytes, decoded.clone());
        }
        assert!(memo.get(&keys[0].0).is_none(), "the oldest went");
        for (id, (bytes, _)) in keys.iter().enumerate().skip(1) {
            let found = memo.get(bytes).expect("the newer ones stay");
            assert_eq!(found.key.served().region_id, id as u64);
        }
    }
}
