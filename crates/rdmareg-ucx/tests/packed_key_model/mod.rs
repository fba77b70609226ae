//! Shared by the `packed_key_*` tests: the real keys packed by UCX 1.22.0, a
//! builder for well-formed keys of that layout, and a model of how UCX's
//! unpacker walks a key, which reports any read outside the key.
//!
//! The model is written from UCX's reading behaviour, not from the validator:
//! it consumes whatever the bytes say, the way `ucp_ep_rkey_unpack` does, and
//! knows nothing about which keys are acceptable.

#![allow(dead_code)] // each test crate uses a different part of this module

use rdmareg_ucx::packed_key::PackedKeyFormat;

/// The layout under test.
pub fn format() -> PackedKeyFormat {
    PackedKeyFormat::for_ucx_version(1, 22).expect("UCX 1.22 layout is known")
}

/// One fixture line: where the key came from and its bytes.
#[derive(Debug, Clone)]
pub struct RealKey {
    pub label: String,
    pub bytes: Vec<u8>,
}

/// Keys produced by `ucp_rkey_pack` of UCX 1.22.0 (see `fixtures/gen_keys.c`).
pub fn real_keys() -> Vec<RealKey> {
    include_str!("../fixtures/real_keys_ucx_1_22.txt")
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| {
            let (label, hex) = line
                .split_once(' ')
                .expect("fixture line is '<label> <hex>'");
            RealKey {
                label: label.to_owned(),
                bytes: decode_hex(hex),
            }
        })
        .collect()
}

fn decode_hex(hex: &str) -> Vec<u8> {
    assert!(hex.len() % 2 == 0, "odd hex length: {hex}");
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex digit"))
        .collect()
}

/// A real key whose `md_map` is non-zero (a transport key for UCX-allocated
/// shared memory), so it has entries and a system-device byte.
pub fn real_key_with_entries() -> RealKey {
    real_keys()
        .into_iter()
        .find(|key| key.bytes[..8] != [0; 8])
        .expect("fixtures hold a key with md_map != 0")
}

/// The system-device section of a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSection {
    /// Device index (below 0x7F for a real device); with `flush` the
    /// written byte has bit 7 set.
    pub device: u8,
    pub flush: bool,
    /// `(device, latency, bandwidth)` records, in the order written.
    pub distances: Vec<(u8, u8, u8)>,
}

/// What a well-formed key contains, in the terms of the 1.22 layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpec {
    pub mem_type: u8,
    /// `(md_index, transport key bytes)`, with distinct indices below 64.
    pub entries: Vec<(u32, Vec<u8>)>,
    /// `None` writes the unknown-device byte `0xFF` (when there are entries).
    pub device: Option<DeviceSection>,
}

impl KeySpec {
    pub fn md_map(&self) -> u64 {
        self.entries
            .iter()
            .fold(0, |map, (md_index, _)| map | (1u64 << md_index))
    }

    /// Serialises the spec the way UCX 1.22's packer lays a key out.
    pub fn build(&self) -> Vec<u8> {
        let mut key = self.md_map().to_le_bytes().to_vec();
        key.push(self.mem_type);
        if self.entries.is_empty() {
            return key;
        }
        let mut entries = self.entries.clone();
        entries.sort_by_key(|(md_index, _)| *md_index);
        for (_, bytes) in &entries {
            key.push(u8::try_from(bytes.len()).expect("entry fits a u8 length"));
            key.extend_from_slice(bytes);
        }
        match &self.device {
            None => key.push(0xFF),
            Some(section) => {
                key.push(section.device | if section.flush { 0x80 } else { 0 });
                for &(device, latency, bandwidth) in &section.distances {
                    key.extend_from_slice(&[device, latency, bandwidth]);
                }
                key.push(0xFF);
            }
        }
        key
    }
}

/// A multi-entry key with a known device and two distance records: every
/// section of the layout present.
pub fn full_key() -> Vec<u8> {
    KeySpec {
        mem_type: 0,
        entries: vec![
            (0, vec![0x11; 12]),
            (3, vec![]),
            (5, vec![0x22; 24]),
            (63, vec![0x33; 4]),
        ],
        device: Some(DeviceSection {
            device: 2,
            flush: true,
            distances: vec![(1, 0x40, 0x50), (7, 0x41, 0x51)],
        }),
    }
    .build()
}

/// What UCX's unpacker made of a key it read without leaving it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelParse {
    /// Bytes the walk consumed from the start of the key.
    pub consumed: usize,
    pub md_map: u64,
    pub mem_type: u8,
    /// The raw system-device byte, when the walk read one.
    pub device_byte: Option<u8>,
    /// Device indices of the distance records walked.
    pub distance_devices: Vec<u8>,
}

/// UCX's walk needed byte `at`, which the key does not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadPastEnd {
    pub at: usize,
}

/// Walks `key` as UCX 1.22's `ucp_ep_rkey_unpack` does on an endpoint to a
/// 1.22 peer that reaches every memory domain of the key, with the worst case
/// of its cache (the distance list is always walked):
///
/// * `md_map`, `mem_type`;
/// * per set bit, a length byte and that many entry bytes (all handed to the
///   transport);
/// * if `md_map != 0`, the system-device byte; if it is not `0xFF`, 3-byte
///   records with no end bound, until a record position holds `0xFF`.
pub fn model_unpack(key: &[u8]) -> Result<ModelParse, ReadPastEnd> {
    let read = |at: usize| key.get(at).copied().ok_or(ReadPastEnd { at });

    let mut md_bytes = [0u8; 8];
    for (i, byte) in md_bytes.iter_mut().enumerate() {
        *byte = read(i)?;
    }
    let md_map = u64::from_le_bytes(md_bytes);
    let mem_type = read(8)?;
    let mut at = 9;

    for bit in 0..64 {
        if md_map & (1 << bit) == 0 {
            continue;
        }
        let len = usize::from(read(at)?);
        at += 1;
        for offset in 0..len {
            read(at + offset)?;
        }
        at += len;
    }

    let mut device_byte = None;
    let mut distance_devices = Vec::new();
    if md_map != 0 {
        let raw = read(at)?;
        at += 1;
        device_byte = Some(raw);
        let device = if (0x80..=0xFE).contains(&raw) {
            raw & 0x7F
        } else {
            raw
        };
        if device != 0xFF {
            loop {
                let record_device = read(at)?;
                if record_device == 0xFF {
                    at += 1;
                    break;
                }
                read(at + 1)?;
                read(at + 2)?;
                distance_devices.push(record_device);
                at += 3;
            }
        }
    }

    Ok(ModelParse {
        consumed: at,
        md_map,
        mem_type,
        device_byte,
        distance_devices,
    })
}

/// Whether a parse describes a key UCX 1.22's packer could have written:
/// the whole key consumed, a defined memory type, distance devices below 64
/// in strictly ascending order.
pub fn is_packer_shaped(key: &[u8], parse: &ModelParse) -> bool {
    parse.consumed == key.len()
        && parse.mem_type < format().memory_type_count()
        && parse.distance_devices.iter().all(|&device| device < 64)
        && parse
            .distance_devices
            .windows(2)
            .all(|pair| pair[0] < pair[1])
}
