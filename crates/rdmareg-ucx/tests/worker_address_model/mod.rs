//! Shared by the `worker_address_*` tests: the real worker addresses packed by
//! UCX 1.22.0, a builder for well-formed addresses of that layout, and a model
//! of how UCX's parser walks an address, which reports any read outside it.
//!
//! The model is written from UCX's reading behaviour (`ucp_address_unpack`
//! with the default worker-address flags, not in unified mode), not from the
//! validator: it consumes whatever the bytes say and knows nothing about
//! which addresses are acceptable.

#![allow(dead_code)] // each test crate uses a different part of this module

use rdmareg_ucx::worker_address::WorkerAddressFormat;

/// The layout under test.
pub fn format() -> WorkerAddressFormat {
    WorkerAddressFormat::for_ucx_version(1, 22).expect("UCX 1.22 layout is known")
}

/// One fixture line: where the address came from and its bytes.
#[derive(Debug, Clone)]
pub struct RealAddress {
    pub label: String,
    pub bytes: Vec<u8>,
}

/// Addresses produced by `ucp_worker_get_address` of UCX 1.22.0 (see
/// `fixtures/gen_worker_addresses.c`).
pub fn real_addresses() -> Vec<RealAddress> {
    include_str!("../fixtures/real_worker_addresses_ucx_1_22.txt")
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| {
            let (label, hex) = line
                .split_once(' ')
                .expect("fixture line is '<label> <hex>'");
            RealAddress {
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

/// Address version, as packed in the low nibble of the first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

/// One interface record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfaceSpec {
    pub checksum: u16,
    pub iface_addr: Vec<u8>,
    /// `(endpoint address, lane below 64)`.
    pub ep_addrs: Vec<(Vec<u8>, u8)>,
}

/// One device record with at least one interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    /// Below 64.
    pub md_index: u8,
    pub dev_addr: Vec<u8>,
    /// Written only when more than 1.
    pub num_paths: u8,
    /// Written only when not `0xFF`.
    pub sys_dev: u8,
    pub ifaces: Vec<IfaceSpec>,
}

/// What a well-formed worker address contains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressSpec {
    pub version: Version,
    pub uuid: u64,
    pub name: Option<Vec<u8>>,
    pub devices: Vec<DeviceSpec>,
}

/// Writes `value` the way `ucp_address_pack_byte_extended` does: below
/// `mask` in the low bits of a byte also holding `flags`, else (v2 only) the
/// mask and then the value in the next byte.
fn push_extended(out: &mut Vec<u8>, version: Version, flags: u8, value: usize, mask: u8) {
    let value = u8::try_from(value).expect("value fits a byte");
    if version == Version::V2 && value >= mask {
        out.extend_from_slice(&[flags | mask, value]);
    } else {
        assert!(value <= mask, "v1 cannot pack {value} under mask {mask:#x}");
        out.push(flags | value);
    }
}

/// v1 interface attributes: positive finite numbers, priority 1, a few
/// capability bits.
fn v1_attributes() -> [u8; 16] {
    let mut attributes = [0u8; 16];
    attributes[0..4].copy_from_slice(&2.5e-8f32.to_le_bytes());
    attributes[4..8].copy_from_slice(&1.2e10f32.to_le_bytes());
    attributes[8..12].copy_from_slice(&1e-7f32.to_le_bytes());
    attributes[12..16].copy_from_slice(&0x0023_1301u32.to_le_bytes());
    attributes
}

/// v2 interface attributes as a tcp interface packs them.
const V2_ATTRIBUTES: [u8; 8] = [0x0c, 0x01, 0x5a, 0x01, 0x80, 0x00, 0x8b, 0x00];

impl AddressSpec {
    /// Serialises the spec the way UCX 1.22's `ucp_address_do_pack` lays a
    /// worker address out.
    pub fn build(&self) -> Vec<u8> {
        let flags = 0x2 | u8::from(self.name.is_some());
        let mut out = match self.version {
            Version::V1 => vec![flags << 4],
            Version::V2 => vec![0x61, flags],
        };
        out.extend_from_slice(&self.uuid.to_le_bytes());
        if let Some(name) = &self.name {
            out.push(u8::try_from(name.len()).expect("name fits a u8 length"));
            out.extend_from_slice(name);
        }
        if self.devices.is_empty() {
            out.push(0xFF);
            return out;
        }
        for (d, device) in self.devices.iter().enumerate() {
            assert!(!device.ifaces.is_empty(), "a real device has interfaces");
            push_extended(&mut out, self.version, 0, device.md_index.into(), 0x7F);
            let mut device_flags = 0;
            if self.version == Version::V2 && d + 1 == self.devices.len() {
                device_flags |= 0x80;
            }
            if device.num_paths > 1 {
                device_flags |= 0x40;
            }
            if device.sys_dev != 0xFF {
                device_flags |= 0x20;
            }
            push_extended(
                &mut out,
                self.version,
                device_flags,
                device.dev_addr.len(),
                0x1F,
            );
            if device.num_paths > 1 {
                out.push(device.num_paths);
            }
            if device.sys_dev != 0xFF {
                out.push(device.sys_dev);
            }
            out.extend_from_slice(&device.dev_addr);
            for (i, iface) in device.ifaces.iter().enumerate() {
                out.extend_from_slice(&iface.checksum.to_le_bytes());
                match self.version {
                    Version::V1 => out.extend_from_slice(&v1_attributes()),
                    Version::V2 => out.extend_from_slice(&V2_ATTRIBUTES),
                }
                let mut iface_flags = 0;
                if i + 1 == device.ifaces.len() {
                    iface_flags |= 0x80;
                }
                if !iface.ep_addrs.is_empty() {
                    iface_flags |= 0x40;
                }
                push_extended(
                    &mut out,
                    self.version,
                    iface_flags,
                    iface.iface_addr.len(),
                    0x3F,
                );
                out.extend_from_slice(&iface.iface_addr);
                for (e, (ep_addr, lane)) in iface.ep_addrs.iter().enumerate() {
                    out.push(u8::try_from(ep_addr.len()).expect("fits a u8 length"));
                    out.extend_from_slice(ep_addr);
                    let last = if e + 1 == iface.ep_addrs.len() {
                        0x80
                    } else {
                        0
                    };
                    out.push(lane | last);
                }
            }
        }
        if self.version == Version::V1 {
            out.extend_from_slice(&[0x86, 0x80]);
        }
        out
    }
}

/// An address with every optional section present: v2 extended lengths,
/// path count, system device, endpoint addresses, a worker name.
pub fn full_spec(version: Version) -> AddressSpec {
    let long = |len: usize, fill: u8| vec![fill; len];
    let dev_len = if version == Version::V2 { 40 } else { 31 };
    let iface_len = if version == Version::V2 { 70 } else { 63 };
    AddressSpec {
        version,
        uuid: 0x0123_4567_89ab_cdef,
        name: Some(b"host:1234".to_vec()),
        devices: vec![
            DeviceSpec {
                md_index: 3,
                dev_addr: long(dev_len, 0x11),
                num_paths: 2,
                sys_dev: 5,
                ifaces: vec![
                    IfaceSpec {
                        checksum: 0xcf19,
                        iface_addr: long(iface_len, 0x22),
                        ep_addrs: vec![(long(12, 0x33), 0), (long(0, 0), 63)],
                    },
                    IfaceSpec {
                        checksum: 0x1234,
                        iface_addr: long(2, 0x44),
                        ep_addrs: vec![],
                    },
                ],
            },
            DeviceSpec {
                md_index: 63,
                dev_addr: vec![],
                num_paths: 1,
                sys_dev: 0xFF,
                ifaces: vec![IfaceSpec {
                    checksum: 0x5678,
                    iface_addr: vec![],
                    ep_addrs: vec![],
                }],
            },
        ],
    }
}

/// What UCX's parser made of an address it read without leaving it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelParse {
    /// Bytes the walk consumed from the start of the address.
    pub consumed: usize,
    pub version: Version,
    pub interfaces: usize,
    /// Memory-domain indices of the devices with interfaces.
    pub md_indices: Vec<u8>,
    /// Lane indices of endpoint addresses.
    pub lanes: Vec<u8>,
}

/// How UCX's parse of an address ended when it did not succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFault {
    /// The walk needed byte `at`, which the address does not have.
    ReadPastEnd { at: usize },
    /// An address version other than v1/v2: `ucs_assertv_always` aborts.
    Abort,
    /// UCX's own, clean refusal (too many interfaces or endpoint addresses).
    Refused,
}

/// Walks `address` as UCX 1.22's `ucp_address_unpack` does for
/// `ucp_ep_create` (default worker-address flags, not in unified mode).
pub fn model_unpack(address: &[u8]) -> Result<ModelParse, ModelFault> {
    let read = |at: usize| {
        address
            .get(at)
            .copied()
            .ok_or(ModelFault::ReadPastEnd { at })
    };
    let need = |at: usize, len: usize| -> Result<(), ModelFault> {
        for offset in 0..len {
            read(at + offset)?;
        }
        Ok(())
    };

    let header = read(0)?;
    let (version, flags, mut at) = match header & 0x0F {
        0 => (Version::V1, header >> 4, 1),
        1 => (Version::V2, read(1)?, 2),
        _ => return Err(ModelFault::Abort),
    };
    // v1 is parsed with its UUID whatever the flags (the unpack flags ask
    // for it); v2 only with the flag.
    if version == Version::V1 || flags & 0x2 != 0 {
        need(at, 8)?;
        at += 8;
    }
    if flags & 0x4 != 0 {
        at += 8; // client id: skipped, not read
    }
    if flags & 0x1 != 0 {
        let len = usize::from(read(at)?);
        need(at + 1, len.min(255))?;
        at += 1 + len;
    }
    let mut parse = ModelParse {
        consumed: 0,
        version,
        interfaces: 0,
        md_indices: Vec::new(),
        lanes: Vec::new(),
    };
    if read(at)? == 0xFF {
        parse.consumed = at + 1;
        return Ok(parse);
    }

    let extended = |at: &mut usize, mask: u8| -> Result<u8, ModelFault> {
        let mut value = read(*at)? & mask;
        *at += 1;
        if version == Version::V2 && value == mask {
            value = read(*at)?;
            *at += 1;
        }
        Ok(value)
    };

    loop {
        let md_byte = read(at)?;
        let empty = md_byte & 0x80 != 0;
        let md_index = extended(&mut at, 0x7F)?;
        let device_byte = read(at)?;
        let last_device = device_byte & 0x80 != 0;
        let dev_len = usize::from(extended(&mut at, 0x1F)?);
        if device_byte & 0x40 != 0 {
            read(at)?;
            at += 1;
        }
        if device_byte & 0x20 != 0 {
            read(at)?;
            at += 1;
        }
        // The device address is handed on by pointer; only its bytes'
        // presence matters for the transports that read it.
        need(at, dev_len)?;
        at += dev_len;
        if !empty {
            parse.md_indices.push(md_index);
            loop {
                if parse.interfaces >= 128 {
                    return Err(ModelFault::Refused);
                }
                parse.interfaces += 1;
                need(at, 2)?;
                at += 2;
                let attr_len = if version == Version::V1 { 16 } else { 8 };
                need(at, attr_len)?;
                at += attr_len;
                let length_byte = read(at)?;
                let iface_len = usize::from(extended(&mut at, 0x3F)?);
                need(at, iface_len)?;
                at += iface_len;
                if length_byte & 0x40 != 0 {
                    let mut count = 0;
                    loop {
                        if count >= 64 {
                            return Err(ModelFault::Refused);
                        }
                        count += 1;
                        let ep_len = usize::from(read(at)?);
                        at += 1;
                        need(at, ep_len)?;
                        at += ep_len;
                        let lane = read(at)?;
                        at += 1;
                        parse.lanes.push(lane & 0x3F);
                        if lane & 0x80 != 0 {
                            break;
                        }
                    }
                }
                if length_byte & 0x80 != 0 {
                    break;
                }
            }
        }
        if last_device {
            break;
        }
    }
    parse.consumed = at;
    Ok(parse)
}
