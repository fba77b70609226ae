//! Structural validation of packed UCP worker addresses received from peers.
//!
//! # Contract
//!
//! [`WorkerAddressFormat::validate`] accepts an address only if every byte
//! UCX's `ucp_address_unpack` reads lies inside it and the address is one
//! `ucp_worker_get_address` of the named UCX version could have packed:
//! known version and flag bits, no section missing, nothing after the last,
//! and every index UCX uses as a bit position or array index in range.
//! Anything else is a typed [`WorkerAddressError`]; validation never panics
//! and allocates nothing. [`WorkerAddressFormat::copy_for_endpoint`]
//! validates and returns the buffer to hand to `ucp_ep_create`.
//!
//! # Why
//!
//! `ucp_ep_create` takes the address with no length and UCX trusts every
//! byte: an unknown version trips an always-on assertion (SIGABRT), and the
//! walk has no end bound, so a forged address is an out-of-bounds read
//! inside UCX. A UCX version whose layout is not described here has no
//! format ([`WorkerAddressFormat::for_ucx_version`] returns `None`), and its
//! addresses are refused.
//!
//! # The UCX 1.22 layout
//!
//! From `src/ucp/wireup/address.c` of UCX 1.22.0 (`ucp_address_do_pack`,
//! `ucp_address_unpack`), checked against real addresses
//! (`tests/fixtures/gen_worker_addresses.c`). Multi-byte fields are
//! little-endian; both address versions (`UCX_ADDRESS_VERSION`, `v1` by
//! default) are accepted.
//!
//! Header:
//!
//! | bytes | field |
//! |---|---|
//! | 1 | low nibble: address version (0 = v1, 1 = v2); high nibble: v1 header flags, or for v2 the packer's minor version modulo 16 |
//! | v2 only: 1 | header flags |
//! | 8 | worker UUID (flag `0x2`, always set by `ucp_worker_get_address`) |
//! | 1 + `len` | worker name: `len` (u8) and that many bytes (flag `0x1`, set when the owner runs with `UCX_ADDRESS_DEBUG_INFO=y`) |
//!
//! Then either the single byte `0xFF` (no devices), or one device record
//! after another until one carries the device-level "last" flag:
//!
//! | bytes | field |
//! |---|---|
//! | 1 (+1) | bit 7: device has no transports; low 7 bits: memory-domain index (v2: `0x7F` means the index is in the next byte) |
//! | 1 (+1) | bit 7: last device; bit 6: path count follows; bit 5: system device follows; low 5 bits: device-address length (v2: `0x1F` means the length is in the next byte) |
//! | 0 or 1 | path count (more than 1) |
//! | 0 or 1 | system device (not `0xFF`) |
//! | length | device address |
//!
//! and, unless the device has no transports, one interface record after
//! another until one carries the interface-level "last" flag:
//!
//! | bytes | field |
//! |---|---|
//! | 2 | transport-name checksum |
//! | 16 (v1) or 8 (v2) | interface attributes: v1 three `f32` (overhead, bandwidth, latency) and a `u32` of priority (bits 0–7), capability flags (bits 8–21) and atomics (bits 30–31); v2 three one-byte floats, priority, `u16` segment size, `u16` flags (bits 0–9) |
//! | 1 (+1) | bit 7: last interface; bit 6: endpoint addresses follow; low 6 bits: interface-address length (v2: `0x3F` means the length is in the next byte) |
//! | length | interface address |
//! | per endpoint address | `len` (u8), that many bytes, a lane byte (bit 7: last endpoint address; low 6 bits: lane) |
//!
//! A v1 address ends with a pseudo device that carries the packer's release
//! version instead of a memory-domain index: the two bytes `0x80 | minor % 16`
//! and `0x80` (no transports, last device, empty address). A v2 address has
//! no such device: its last real device carries the "last" flag.
//!
//! Rules beyond the section bounds, each because the packer never writes
//! otherwise or UCX would misbehave on it:
//!
//! * Header flags this version does not define, and the client-id and
//!   AM-only flags (client-server wireup only), are refused; the UUID flag
//!   is required.
//! * A memory-domain index must be below 64 (it becomes a bit in a 64-bit
//!   map); the two-byte extended form of an index or length is refused
//!   where the short form would do.
//! * A path count of 1 or less and a system device of `0xFF` are refused.
//! * A device without transports is only the v1 version marker, placed
//!   last; a v1 address without it is refused.
//! * Interface attributes must be finite, with no undefined flag bits and,
//!   in v1, a positive bandwidth.
//! * Lane indices have 6 bits; at most 128 interfaces and 64 endpoint
//!   addresses per interface, as UCX parses; no trailing bytes.
//!
//! # What this does not cover
//!
//! Device, interface and endpoint addresses go to the transport whose name
//! checksum matches, which reads its own fixed structure whatever the length
//! byte says; their content cannot be checked here. No section exceeds 255
//! bytes, so the [`ENDPOINT_PADDING`] zero bytes
//! [`WorkerAddressFormat::copy_for_endpoint`] appends keep such reads inside
//! the buffer. Addresses of a local context in unified mode
//! (`UCX_UNIFIED_MODE=y`) are refused as malformed. The layout checked is
//! the local UCX's; a peer laying addresses out differently is refused, not
//! misread.

use rdmareg_core::RdmaError;

/// `ucp_address_unpack`'s marker for "no devices" (`UCP_NULL_RESOURCE`).
const NO_DEVICES: u8 = 0xFF;
/// Header flags (`UCP_ADDRESS_HEADER_FLAG_*`).
const HEADER_DEBUG_INFO: u8 = 0x1;
const HEADER_WORKER_UUID: u8 = 0x2;
const HEADER_CLIENT_ID: u8 = 0x4;
const HEADER_AM_ONLY: u8 = 0x8;
const HEADER_KNOWN_FLAGS: u8 =
    HEADER_DEBUG_INFO | HEADER_WORKER_UUID | HEADER_CLIENT_ID | HEADER_AM_ONLY;
/// Memory-domain byte: device without transports, and the index mask.
const MD_EMPTY_DEVICE: u8 = 0x80;
const MD_INDEX_MASK: u8 = 0x7F;
/// `ucp_md_map_t` is 64 bits wide.
const MD_INDEX_LIMIT: u8 = 64;
/// The v1 version marker's release version uses the low 4 bits.
const RELEASE_VERSION_MASK: u8 = 0x0F;
/// Device byte flags and length mask.
const DEVICE_LAST: u8 = 0x80;
const DEVICE_NUM_PATHS: u8 = 0x40;
const DEVICE_SYS_DEVICE: u8 = 0x20;
const DEVICE_LEN_MASK: u8 = 0x1F;
/// `UCS_SYS_DEVICE_ID_UNKNOWN` as packed.
const UNKNOWN_SYS_DEVICE: u8 = 0xFF;
/// Interface-length byte flags and mask; the same mask bounds lane indices.
const IFACE_LAST: u8 = 0x80;
const IFACE_HAS_EP_ADDR: u8 = 0x40;
const IFACE_LEN_MASK: u8 = 0x3F;
/// Lane byte of an endpoint address.
const LANE_LAST: u8 = 0x80;
/// `UCP_MAX_RESOURCES` and `UCP_MAX_LANES`.
const MAX_INTERFACES: usize = 128;
const MAX_ENDPOINT_ADDRESSES: usize = 64;
/// v1 attributes: three `f32` and the `u32` of priority and flags.
const V1_ATTR_LEN: usize = 16;
/// v1 `prio_cap_flags` bits the packer may set: priority, 13 capability
/// flags, 1 event flag, and the two atomic flags.
const V1_ATTR_KNOWN_BITS: u32 = 0x003F_FFFF | (1 << 30) | (1 << 31);
/// v2 attributes: three fp8, priority, `u16` segment size, `u16` flags.
const V2_ATTR_LEN: usize = 8;
/// v2 `UCP_ADDR_IFACE_FLAG_*` bits defined by 1.22.
const V2_ATTR_KNOWN_FLAGS: u16 = 0x03FF;

/// Longest address accepted. Real ones are a few hundred bytes at most; the
/// limit bounds the work a hostile peer can ask for.
pub const MAX_WORKER_ADDRESS_LEN: usize = 64 * 1024;

/// Zero bytes [`WorkerAddressFormat::copy_for_endpoint`] appends after a
/// validated address, so that a transport reading its fixed-size address
/// structure from a section whose length byte understates it still reads
/// inside the buffer given to UCX.
pub const ENDPOINT_PADDING: usize = 256;

/// UCX versions whose layout this module describes.
const KNOWN_LAYOUTS: &[(u32, u32)] = &[(1, 22)];

/// The two address versions of UCX 1.22 (`ucp_object_version_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AddressVersion {
    V1,
    V2,
}

/// Which worker-address layout to validate against, derived from the running
/// UCX's version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerAddressFormat {
    major: u32,
    minor: u32,
}

impl WorkerAddressFormat {
    /// The layout for UCX `major.minor`, or `None` when this validator does not
    /// know that version's layout; the caller must then refuse every address,
    /// naming the version and [`supported_versions`](Self::supported_versions).
    ///
    /// Also `None` on big-endian targets: UCX writes multi-byte fields in host
    /// order and only the little-endian encoding has been checked.
    pub fn for_ucx_version(major: u32, minor: u32) -> Option<Self> {
        if cfg!(target_endian = "big") {
            return None;
        }
        KNOWN_LAYOUTS
            .contains(&(major, minor))
            .then_some(Self { major, minor })
    }

    /// The UCX `(major, minor)` versions [`for_ucx_version`](Self::for_ucx_version)
    /// recognises.
    pub fn supported_versions() -> impl Iterator<Item = (u32, u32)> {
        KNOWN_LAYOUTS.iter().copied()
    }

    /// The UCX `(major, minor)` version this layout belongs to.
    pub fn ucx_version(&self) -> (u32, u32) {
        (self.major, self.minor)
    }

    /// Checks that `address` is a well-formed packed worker address of this
    /// format, so that UCX's parser reads only inside `address[..]`.
    ///
    /// See the [module documentation](self) for the layout and what is
    /// deliberately left to [`copy_for_endpoint`](Self::copy_for_endpoint).
    pub fn validate(&self, address: &[u8]) -> Result<(), WorkerAddressError> {
        if address.is_empty() {
            return Err(WorkerAddressError::Empty);
        }
        if address.len() > MAX_WORKER_ADDRESS_LEN {
            return Err(WorkerAddressError::Oversized { len: address.len() });
        }
        let mut cursor = Cursor {
            bytes: address,
            at: 0,
            interfaces: 0,
        };
        let version = cursor.header()?;
        if cursor.peek(AddressField::MemoryDomain)? == NO_DEVICES {
            cursor.at += 1;
            return cursor.finish();
        }
        cursor.devices(version)?;
        cursor.finish()
    }

    /// Validates `address` and returns a copy of it followed by
    /// [`ENDPOINT_PADDING`] zero bytes: the buffer to hand to `ucp_ep_create`.
    pub fn copy_for_endpoint(&self, address: &[u8]) -> Result<Vec<u8>, WorkerAddressError> {
        self.validate(address)?;
        let mut buffer = Vec::with_capacity(address.len() + ENDPOINT_PADDING);
        buffer.extend_from_slice(address);
        buffer.resize(address.len() + ENDPOINT_PADDING, 0);
        Ok(buffer)
    }
}

/// A field of a worker address, named in refusals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AddressField {
    /// The header byte (address version and, for v1, flags).
    Header,
    /// The v2 header-flags byte.
    HeaderFlags,
    /// The 8-byte worker UUID.
    WorkerUuid,
    /// The worker name and its length byte.
    WorkerName,
    /// A device's memory-domain byte (or its extension).
    MemoryDomain,
    /// A device's address-length byte (or its extension).
    DeviceAddressLength,
    /// A device's path-count byte.
    PathCount,
    /// A device's system-device byte.
    SystemDevice,
    /// A device address.
    DeviceAddress,
    /// An interface's transport-name checksum.
    TransportChecksum,
    /// An interface's attributes.
    InterfaceAttributes,
    /// An interface's address-length byte (or its extension).
    InterfaceAddressLength,
    /// An interface address.
    InterfaceAddress,
    /// An endpoint address's length byte.
    EndpointAddressLength,
    /// An endpoint address.
    EndpointAddress,
    /// An endpoint address's lane byte.
    LaneIndex,
}

impl std::fmt::Display for AddressField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AddressField::Header => "header",
            AddressField::HeaderFlags => "header flags",
            AddressField::WorkerUuid => "worker UUID",
            AddressField::WorkerName => "worker name",
            AddressField::MemoryDomain => "memory-domain index of a device",
            AddressField::DeviceAddressLength => "device-address length",
            AddressField::PathCount => "path count of a device",
            AddressField::SystemDevice => "system device of a device",
            AddressField::DeviceAddress => "device address",
            AddressField::TransportChecksum => "transport-name checksum of an interface",
            AddressField::InterfaceAttributes => "interface attributes",
            AddressField::InterfaceAddressLength => "interface-address length",
            AddressField::InterfaceAddress => "interface address",
            AddressField::EndpointAddressLength => "endpoint-address length",
            AddressField::EndpointAddress => "endpoint address",
            AddressField::LaneIndex => "lane index of an endpoint address",
        })
    }
}

/// Why a packed worker address was refused.
///
/// Each variant means the bytes are not what the peer's UCX packed: a
/// corrupted exchange, a different UCX or a forgery, fixed by the sender.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerAddressError {
    /// The address has no bytes.
    #[error("worker address is empty")]
    Empty,

    /// The address is longer than [`MAX_WORKER_ADDRESS_LEN`].
    #[error("worker address is {len} bytes, more than the {MAX_WORKER_ADDRESS_LEN}-byte limit")]
    Oversized {
        /// Length of the refused address.
        len: usize,
    },

    /// The address ends inside a field.
    #[error("worker address ends at byte {at}, inside its {field}; was it cut short in transit?")]
    Truncated {
        /// Offset of the first missing byte (the address's length).
        at: usize,
        /// The field that is cut short.
        field: AddressField,
    },

    /// The header names an address version other than v1 (0) or v2 (1); UCX
    /// would abort the process on it.
    #[error(
        "worker address version {0} is unknown (UCX packs 0 for v1 or 1 for v2): not an address from this UCX version"
    )]
    UnknownVersion(u8),

    /// The header carries flag bits this layout does not define, or flags
    /// only client-server wireup sets (client id, AM-only).
    #[error(
        "worker address header flags {flags:#04x} include bits a ucp_worker_get_address address never carries"
    )]
    UnexpectedHeaderFlags {
        /// The header flags as found.
        flags: u8,
    },

    /// The header lacks the worker-UUID flag, which every
    /// `ucp_worker_get_address` address carries.
    #[error("worker address header has no worker UUID flag")]
    MissingWorkerUuid,

    /// A section declares more bytes than the address has left.
    #[error("{field} at byte {at} declares {declared} bytes, but only {available} remain")]
    Overrun {
        /// The section.
        field: AddressField,
        /// Offset of its first byte (after its length byte).
        at: usize,
        /// The length the address declares.
        declared: usize,
        /// Bytes left in the address from `at`.
        available: usize,
    },

    /// A field's value lies outside what the packer writes (and, for indices,
    /// outside the tables UCX indexes with them).
    #[error("{field} at byte {at} has value {value}, which UCX's packer never writes there")]
    BadValue {
        /// The field.
        field: AddressField,
        /// Offset of the byte holding the value.
        at: usize,
        /// The value found.
        value: u32,
    },

    /// An interface's attributes carry undefined flag bits, a non-finite
    /// number, or a bandwidth that is not positive.
    #[error("interface attributes at byte {at} are not ones UCX packs ({reason})")]
    BadInterfaceAttributes {
        /// Offset of the attributes.
        at: usize,
        /// What is wrong with them.
        reason: &'static str,
    },

    /// A device without transports appears anywhere but as the v1 version
    /// marker at the end, or a v1 address lacks that marker.
    #[error("{0}")]
    MisplacedVersionMarker(&'static str),

    /// More interfaces, or endpoint addresses per interface, than UCX parses.
    #[error("worker address at byte {at} exceeds UCX's limit of {limit} {what}")]
    TooMany {
        /// Offset where the excess record starts.
        at: usize,
        /// The limit.
        limit: usize,
        /// What is counted.
        what: &'static str,
    },

    /// Bytes follow the last device.
    #[error("worker address has {extra} bytes after its last device, which ends at byte {at}")]
    TrailingBytes {
        /// Offset where the address should have ended.
        at: usize,
        /// How many bytes follow.
        extra: usize,
    },
}

impl From<WorkerAddressError> for RdmaError {
    fn from(err: WorkerAddressError) -> Self {
        RdmaError::InvalidWorkerAddress(err.to_string())
    }
}

/// A read position in an address; every step checks the bytes it consumes
/// exist.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
    interfaces: usize,
}

impl Cursor<'_> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn truncated(&self, field: AddressField) -> WorkerAddressError {
        WorkerAddressError::Truncated {
            at: self.bytes.len(),
            field,
        }
    }

    fn peek(&self, field: AddressField) -> Result<u8, WorkerAddressError> {
        self.bytes
            .get(self.at)
            .copied()
            .ok_or_else(|| self.truncated(field))
    }

    fn byte(&mut self, field: AddressField) -> Result<u8, WorkerAddressError> {
        let value = self.peek(field)?;
        self.at += 1;
        Ok(value)
    }

    fn take(&mut self, len: usize, field: AddressField) -> Result<&[u8], WorkerAddressError> {
        let slice = self
            .bytes
            .get(self.at..self.at + len)
            .ok_or_else(|| self.truncated(field))?;
        self.at += len;
        Ok(slice)
    }

    /// Skips a section whose length the address declared.
    fn section(&mut self, declared: usize, field: AddressField) -> Result<(), WorkerAddressError> {
        if declared > self.remaining() {
            return Err(WorkerAddressError::Overrun {
                field,
                at: self.at,
                declared,
                available: self.remaining(),
            });
        }
        self.at += declared;
        Ok(())
    }

    fn bad_value(field: AddressField, at: usize, value: u8) -> WorkerAddressError {
        WorkerAddressError::BadValue {
            field,
            at,
            value: u32::from(value),
        }
    }

    /// A value packed in the low bits of a byte whose high bits are flags; in
    /// v2 the value `mask` means "the value is in the next byte", which the
    /// packer uses only for values that do not fit below `mask`.
    fn extended(
        &mut self,
        first: u8,
        mask: u8,
        version: AddressVersion,
        field: AddressField,
    ) -> Result<u8, WorkerAddressError> {
        let value = first & mask;
        if version == AddressVersion::V2 && value == mask {
            let at = self.at;
            let extension = self.byte(field)?;
            if extension < mask {
                return Err(Self::bad_value(field, at, extension));
            }
            return Ok(extension);
        }
        Ok(value)
    }

    /// Version, flags, UUID and optional name; returns the address version.
    fn header(&mut self) -> Result<AddressVersion, WorkerAddressError> {
        let first = self.byte(AddressField::Header)?;
        let (version, flags) = match first & 0x0F {
            0 => (AddressVersion::V1, first >> 4),
            1 => (AddressVersion::V2, self.byte(AddressField::HeaderFlags)?),
            other => return Err(WorkerAddressError::UnknownVersion(other)),
        };
        if flags & !HEADER_KNOWN_FLAGS != 0 || flags & (HEADER_CLIENT_ID | HEADER_AM_ONLY) != 0 {
            return Err(WorkerAddressError::UnexpectedHeaderFlags { flags });
        }
        if flags & HEADER_WORKER_UUID == 0 {
            return Err(WorkerAddressError::MissingWorkerUuid);
        }
        self.take(8, AddressField::WorkerUuid)?;
        if flags & HEADER_DEBUG_INFO != 0 {
            let len = self.byte(AddressField::WorkerName)?;
            self.section(usize::from(len), AddressField::WorkerName)?;
        }
        Ok(version)
    }

    /// Device records up to the one flagged last.
    fn devices(&mut self, version: AddressVersion) -> Result<(), WorkerAddressError> {
        loop {
            let device_start = self.at;
            let md_byte = self.byte(AddressField::MemoryDomain)?;
            let empty = md_byte & MD_EMPTY_DEVICE != 0;
            let md_extended =
                version == AddressVersion::V2 && md_byte & MD_INDEX_MASK == MD_INDEX_MASK;
            let md_index =
                self.extended(md_byte, MD_INDEX_MASK, version, AddressField::MemoryDomain)?;

            let device_byte = self.byte(AddressField::DeviceAddressLength)?;
            let last = device_byte & DEVICE_LAST != 0;
            let device_len = self.extended(
                device_byte,
                DEVICE_LEN_MASK,
                version,
                AddressField::DeviceAddressLength,
            )?;

            if empty {
                // Only the v1 version marker: [0x80 | release, 0x80].
                let marker = version == AddressVersion::V1
                    && last
                    && device_byte == DEVICE_LAST
                    && md_index & !RELEASE_VERSION_MASK == 0;
                if !marker {
                    return Err(WorkerAddressError::MisplacedVersionMarker(
                        "a device without transports appears where only the v1 version marker (last device, no flags, empty address) may be",
                    ));
                }
                return Ok(());
            }
            if version == AddressVersion::V1 && last {
                return Err(WorkerAddressError::MisplacedVersionMarker(
                    "v1 worker address ends without the version-marker device its packer always appends",
                ));
            }
            if md_index >= MD_INDEX_LIMIT {
                return Err(Self::bad_value(
                    AddressField::MemoryDomain,
                    device_start + usize::from(md_extended),
                    md_index,
                ));
            }

            if device_byte & DEVICE_NUM_PATHS != 0 {
                let at = self.at;
                let paths = self.byte(AddressField::PathCount)?;
                if paths < 2 {
                    return Err(Self::bad_value(AddressField::PathCount, at, paths));
                }
            }
            if device_byte & DEVICE_SYS_DEVICE != 0 {
                let at = self.at;
                let sys_dev = self.byte(AddressField::SystemDevice)?;
                if sys_dev == UNKNOWN_SYS_DEVICE {
                    return Err(Self::bad_value(AddressField::SystemDevice, at, sys_dev));
                }
            }
            self.section(usize::from(device_len), AddressField::DeviceAddress)?;
            self.interfaces(version)?;
            if last {
                return Ok(());
            }
        }
    }

    /// Interface records of one device, up to the one flagged last.
    fn interfaces(&mut self, version: AddressVersion) -> Result<(), WorkerAddressError> {
        loop {
            if self.interfaces == MAX_INTERFACES {
                return Err(WorkerAddressError::TooMany {
                    at: self.at,
                    limit: MAX_INTERFACES,
                    what: "interfaces",
                });
            }
            self.interfaces += 1;
            self.take(2, AddressField::TransportChecksum)?;
            self.attributes(version)?;

            let length_byte = self.byte(AddressField::InterfaceAddressLength)?;
            let iface_len = self.extended(
                length_byte,
                IFACE_LEN_MASK,
                version,
                AddressField::InterfaceAddressLength,
            )?;
            self.section(usize::from(iface_len), AddressField::InterfaceAddress)?;
            if length_byte & IFACE_HAS_EP_ADDR != 0 {
                self.endpoint_addresses()?;
            }
            if length_byte & IFACE_LAST != 0 {
                return Ok(());
            }
        }
    }

    fn attributes(&mut self, version: AddressVersion) -> Result<(), WorkerAddressError> {
        let at = self.at;
        let bad = |reason| WorkerAddressError::BadInterfaceAttributes { at, reason };
        match version {
            AddressVersion::V1 => {
                let raw = self.take(V1_ATTR_LEN, AddressField::InterfaceAttributes)?;
                let word =
                    |i: usize| u32::from_le_bytes([raw[i], raw[i + 1], raw[i + 2], raw[i + 3]]);
                let (overhead, bandwidth, latency) = (
                    f32::from_bits(word(0)),
                    f32::from_bits(word(4)),
                    f32::from_bits(word(8)),
                );
                if !(overhead.is_finite() && bandwidth.is_finite() && latency.is_finite()) {
                    return Err(bad("a non-finite overhead, bandwidth or latency"));
                }
                if bandwidth <= 0.0 {
                    return Err(bad("a bandwidth that is not positive"));
                }
                if word(12) & !V1_ATTR_KNOWN_BITS != 0 {
                    return Err(bad("undefined capability bits"));
                }
            }
            AddressVersion::V2 => {
                let raw = self.take(V2_ATTR_LEN, AddressField::InterfaceAttributes)?;
                let flags = u16::from_le_bytes([raw[6], raw[7]]);
                if flags & !V2_ATTR_KNOWN_FLAGS != 0 {
                    return Err(bad("undefined capability flags"));
                }
            }
        }
        Ok(())
    }

    /// Endpoint addresses of one interface, up to the one flagged last.
    fn endpoint_addresses(&mut self) -> Result<(), WorkerAddressError> {
        for _ in 0..MAX_ENDPOINT_ADDRESSES {
            let len = self.byte(AddressField::EndpointAddressLength)?;
            self.section(usize::from(len), AddressField::EndpointAddress)?;
            let at = self.at;
            let lane = self.byte(AddressField::LaneIndex)?;
            if lane & !(LANE_LAST | IFACE_LEN_MASK) != 0 {
                return Err(Self::bad_value(AddressField::LaneIndex, at, lane));
            }
            if lane & LANE_LAST != 0 {
                return Ok(());
            }
        }
        Err(WorkerAddressError::TooMany {
            at: self.at,
            limit: MAX_ENDPOINT_ADDRESSES,
            what: "endpoint addresses per interface",
        })
    }

    fn finish(&self) -> Result<(), WorkerAddressError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(WorkerAddressError::TrailingBytes { at: self.at, extra }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn format() -> WorkerAddressFormat {
        WorkerAddressFormat::for_ucx_version(1, 22).expect("1.22 is a known layout")
    }

    /// A v1 header with the UUID flag and a UUID of `fill`.
    fn v1_header(fill: u8) -> Vec<u8> {
        let mut address = vec![HEADER_WORKER_UUID << 4];
        address.extend_from_slice(&[fill; 8]);
        address
    }

    /// v1 attributes with a positive bandwidth and no flags.
    fn v1_attributes() -> Vec<u8> {
        let mut attributes = Vec::new();
        for value in [1e-9f32, 1e9, 1e-6] {
            attributes.extend_from_slice(&value.to_le_bytes());
        }
        attributes.extend_from_slice(&1u32.to_le_bytes());
        attributes
    }

    /// One device with one interface, then the v1 version marker.
    fn minimal_v1() -> Vec<u8> {
        let mut address = v1_header(7);
        address.extend_from_slice(&[0x00, 0x02, 0xAA, 0xBB]); // md 0, 2-byte device address
        address.extend_from_slice(&[0x12, 0x34]); // checksum
        address.extend(v1_attributes());
        address.extend_from_slice(&[IFACE_LAST | 2, 0xCC, 0xDD]);
        address.extend_from_slice(&[0x86, 0x80]);
        address
    }

    #[test]
    fn only_ucx_1_22_has_a_known_layout() {
        assert_eq!(format().ucx_version(), (1, 22));
        for (major, minor) in [(1, 21), (1, 23), (1, 0), (2, 22), (0, 22)] {
            assert_eq!(WorkerAddressFormat::for_ucx_version(major, minor), None);
        }
        assert_eq!(
            WorkerAddressFormat::supported_versions().collect::<Vec<_>>(),
            vec![(1, 22)]
        );
    }

    #[test]
    fn a_minimal_v1_address_is_accepted() {
        assert_eq!(format().validate(&minimal_v1()), Ok(()));
    }

    #[test]
    fn an_address_without_devices_is_header_and_one_null_byte() {
        let mut address = v1_header(1);
        address.push(NO_DEVICES);
        assert_eq!(format().validate(&address), Ok(()));
        address.push(0);
        assert_eq!(
            format().validate(&address),
            Err(WorkerAddressError::TrailingBytes { at: 10, extra: 1 })
        );
    }

    #[test]
    fn an_unknown_address_version_is_refused_before_anything_else() {
        let mut address = minimal_v1();
        address[0] ^= 0x02;
        assert_eq!(
            format().validate(&address),
            Err(WorkerAddressError::UnknownVersion(2))
        );
    }

    #[test]
    fn client_id_and_am_only_flags_are_refused() {
        for flag in [HEADER_CLIENT_ID, HEADER_AM_ONLY] {
            let mut address = minimal_v1();
            address[0] |= flag << 4;
            assert!(matches!(
                format().validate(&address),
                Err(WorkerAddressError::UnexpectedHeaderFlags { .. })
            ));
        }
    }

    #[test]
    fn a_v1_address_must_end_with_the_version_marker() {
        let mut address = minimal_v1();
        address.truncate(address.len() - 2);
        address[10] |= DEVICE_LAST;
        assert!(matches!(
            format().validate(&address),
            Err(WorkerAddressError::MisplacedVersionMarker(_))
        ));
    }

    #[test]
    fn a_memory_domain_index_must_fit_the_64_bit_map() {
        let mut address = minimal_v1();
        address[9] = 64;
        assert_eq!(
            format().validate(&address),
            Err(WorkerAddressError::BadValue {
                field: AddressField::MemoryDomain,
                at: 9,
                value: 64
            })
        );
    }

    #[test]
    fn a_declared_device_address_longer_than_the_rest_is_an_overrun() {
        let mut address = v1_header(0);
        address.extend_from_slice(&[0x00, 0x1F, 1, 2, 3]);
        assert_eq!(
            format().validate(&address),
            Err(WorkerAddressError::Overrun {
                field: AddressField::DeviceAddress,
                at: 11,
                declared: 31,
                available: 3
            })
        );
    }

    #[test]
    fn refusal_converts_to_invalid_worker_address_with_the_reason() {
        let err = format().validate(&[]).unwrap_err();
        match RdmaError::from(err) {
            RdmaError::InvalidWorkerAddress(text) => assert!(text.contains("empty"), "{text}"),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn copy_for_endpoint_pads_only_valid_addresses() {
        let address = minimal_v1();
        let buffer = format().copy_for_endpoint(&address).expect("valid address");
        assert_eq!(buffer.len(), address.len() + ENDPOINT_PADDING);
        assert_eq!(&buffer[..address.len()], &address[..]);
        assert!(buffer[address.len()..].iter().all(|&b| b == 0));
        assert!(format().copy_for_endpoint(&address[..5]).is_err());
    }
}
