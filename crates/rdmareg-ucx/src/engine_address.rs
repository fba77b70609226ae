//! [`EngineAddress`]: what an engine hands its peers so they can reach it.
//!
//! It holds the serving worker's address and, if the engine opened one, the
//! address of its same-host direct-read lane and its process identity.
//!
//! # Wire format (version 3)
//!
//! | bytes | field |
//! |---|---|
//! | 2 | magic `"RW"` |
//! | 1 | version: `3` when a process identity with a thread follows, `2` when one without a thread follows, else `1` |
//! | 1 | flags: bit 0 — a direct-read address follows; bit 1 — a process identity follows; bit 2 — a release table follows; other bits zero |
//! | 2 | serving address length `n` (u16, little-endian), at least 1 |
//! | `n` | the serving worker's packed UCP address |
//! | 2 + `m` | only with flag bit 0: length `m` (u16, little-endian, at least 1) and the direct-read worker's packed UCP address |
//! | 56 | only with flag bit 1, which needs bit 0: the engine's process — its id (u32) and the inode of its pid namespace (u64), little-endian, its kernel's boot id (16 bytes), the address of its token (u64, little-endian), the token (16 bytes), then the id of a thread that lives as long as the engine (u32, little-endian) |
//! | 20 | only with flag bit 2, which needs bit 1 and version 3: the engine's release table — the descriptor number of its `memfd` in the engine's process (u32, little-endian) and the table's 16-byte id ([`TableLocation`], `release_table`) |
//!
//! Nothing may follow. Version 2 lacks the thread id (a 52-byte identity)
//! and its copies name the process by its id; version 1 lacks the token (a
//! 28-byte identity), which is dropped on decoding, so its reads go through
//! UCX. Each packed UCP address inside is validated against the loaded
//! UCX's layout ([`crate::worker_address`]) before UCX sees it.
//!
//! [`EngineAddress::decode`] also accepts a bare packed UCP worker address
//! (a peer that speaks the read protocol without the envelope) as a serving
//! address with no direct lane: a UCP address's first byte has the address
//! version (0 or 1) in its low nibble, and `'R'` (`0x52`) has 2 there.
//!
//! The process identity lets a same-host peer copy a list of reads out of
//! the owner with one `process_vm_readv` (`progress::vectored`). The boot id
//! and namespace inode keep a peer from reading a stranger with the same
//! number; the token tells the owner from a later process under its pid;
//! copies name the progress thread because the kernel fails copies by pid
//! once the main thread has exited. See `docs/safety.md`, "The same-host
//! direct lane".

use bytes::{BufMut, Bytes, BytesMut};

pub use crate::release_table::TableLocation;
use crate::worker_address::{WorkerAddressError, WorkerAddressFormat};

const MAGIC: [u8; 2] = *b"RW";
/// The envelope without a token in its process identity.
const VERSION_WITHOUT_TOKEN: u8 = 1;
/// The envelope whose process identity names no thread.
const VERSION_WITHOUT_THREAD: u8 = 2;
const VERSION: u8 = 3;
const FLAG_DIRECT: u8 = 0x01;
const FLAG_PROCESS: u8 = 0x02;
const FLAG_RELEASE_TABLE: u8 = 0x04;
const RELEASE_TABLE_LEN: usize = 20;
const HEADER_LEN: usize = 6;
const PROCESS_LEN: usize = 56;
const PROCESS_LEN_WITHOUT_THREAD: usize = 52;
const PROCESS_LEN_WITHOUT_TOKEN: usize = 28;

/// A process as its host's kernel names it: enough for a same-host peer to
/// copy out of it with `process_vm_readv`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProcessIdentity {
    /// The process id, in the namespace below.
    pub pid: u32,
    /// The inode of the pid namespace the id belongs to
    /// (`/proc/self/ns/pid`).
    pub pid_namespace: u64,
    /// The running kernel's boot id (`/proc/sys/kernel/random/boot_id`),
    /// different on every host and every boot.
    pub boot_id: [u8; 16],
    /// Where [`token`](Self::token) lies in the process's memory for the
    /// rest of its life.
    pub token_addr: u64,
    /// 16 random bytes the process drew once: a copy that reads them at
    /// `token_addr` read this process, not a later one under its pid.
    pub token: [u8; 16],
    /// A thread of the process, in the same pid namespace, that lives as
    /// long as the publishing engine (its progress thread); copies name the
    /// process by it (module docs). `None` from a version-2 peer: copies
    /// then name the process id.
    pub thread: Option<u32>,
}

impl ProcessIdentity {
    /// This process; `None` where the kernel does not say its pid namespace
    /// or boot, or where `/proc` belongs to another pid namespace.
    pub fn current() -> Option<ProcessIdentity> {
        use std::os::unix::fs::MetadataExt as _;
        let pid = std::process::id();
        let proc_self = std::fs::read_link("/proc/self").ok()?;
        if proc_self.to_str()? != pid.to_string() {
            return None;
        }
        let namespace = std::fs::metadata("/proc/self/ns/pid").ok()?;
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let (token_addr, token) = crate::owner_process::this_process_token()?;
        Some(ProcessIdentity {
            pid,
            pid_namespace: namespace.ino(),
            boot_id: parse_boot_id(&boot_id)?,
            token_addr,
            token,
            thread: None,
        })
    }

    /// This process, named by the calling thread, which must run as long as
    /// the identity is published (see [`thread`](Self::thread)).
    pub fn current_with_this_thread() -> Option<ProcessIdentity> {
        // SAFETY: gettid takes no arguments and cannot fail.
        let thread = unsafe { libc::gettid() };
        Some(ProcessIdentity {
            thread: Some(u32::try_from(thread).ok()?),
            ..ProcessIdentity::current()?
        })
    }

    /// Whether a process of this identity runs under the same kernel and in
    /// the same pid namespace as `other`, so that its id means the same
    /// process to both.
    pub fn shares_pid_space_with(&self, other: &ProcessIdentity) -> bool {
        self.boot_id == other.boot_id && self.pid_namespace == other.pid_namespace
    }
}

/// The 16 bytes of a boot id as the kernel prints it (a UUID: 32 hex
/// digits in five dash-separated groups, then a newline).
fn parse_boot_id(text: &str) -> Option<[u8; 16]> {
    let digits: Vec<u8> = text.trim().bytes().filter(|&b| b != b'-').collect();
    if digits.len() != 32 {
        return None;
    }
    let mut id = [0; 16];
    for (byte, pair) in id.iter_mut().zip(digits.chunks_exact(2)) {
        let pair = std::str::from_utf8(pair).ok()?;
        *byte = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(id)
}

/// The addresses an engine publishes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EngineAddress {
    /// The serving worker: requests, replies, and everything a remote peer
    /// does.
    pub serving: Bytes,
    /// The same-host direct-read worker, if the engine opened that lane.
    pub direct: Option<Bytes>,
    /// The engine's process, published beside the direct-read lane (never
    /// without it) so that same-host peers can copy lists of reads in one
    /// system call.
    pub process: Option<ProcessIdentity>,
    /// Where same-host readers find the engine's release table, published
    /// only beside a process identity that names a thread; without one,
    /// the engine is read through its owner.
    pub release_table: Option<TableLocation>,
}

/// Why bytes are not an engine address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineAddressError {
    /// The envelope is cut short.
    #[error("engine address truncated: {needed} bytes needed, {available} present")]
    Truncated {
        /// Bytes the field being read needs.
        needed: usize,
        /// Bytes that were left.
        available: usize,
    },
    /// An envelope version this build does not read.
    #[error("unknown engine address version {0}")]
    UnknownVersion(u8),
    /// Flag bits this build does not know, or a combination it refuses (a
    /// process identity without a direct-read lane, or a version-2 envelope
    /// without the process identity that version exists to carry).
    #[error("unknown engine address flags {0:#04x}")]
    UnknownFlags(u8),
    /// An address field of length zero.
    #[error("engine address has an empty {0} address")]
    EmptyAddress(&'static str),
    /// Bytes after the last field.
    #[error("{0} bytes after the end of the engine address")]
    TrailingBytes(usize),
    /// An address too long for the envelope's 16-bit length field. UCX
    /// packs addresses of a few hundred bytes; this is refused rather than
    /// cut.
    #[error(
        "engine address: the {which} address is {len} bytes, more than the 65535 the envelope can carry"
    )]
    TooLong {
        /// Which of the two addresses.
        which: &'static str,
        /// Its length.
        len: usize,
    },
    /// An inner UCP address failed validation.
    #[error("{which} address: {error}")]
    Worker {
        /// Which of the two addresses.
        which: &'static str,
        /// What is wrong with it.
        error: WorkerAddressError,
    },
}

impl EngineAddress {
    /// Encodes the envelope.
    ///
    /// # Errors
    /// [`EngineAddressError::TooLong`] for an address longer than 65535
    /// bytes (UCX packs none so long), [`EngineAddressError::EmptyAddress`]
    /// for an empty one: neither could be decoded again; and
    /// [`EngineAddressError::UnknownFlags`] for a process identity without a
    /// direct-read address.
    pub fn encode(&self) -> Result<Bytes, EngineAddressError> {
        check_field(&self.serving, "serving")?;
        if let Some(direct) = &self.direct {
            check_field(direct, "direct")?;
        }
        let mut flags = 0;
        if self.direct.is_some() {
            flags |= FLAG_DIRECT;
        }
        if self.process.is_some() {
            flags |= FLAG_PROCESS;
        }
        if self.release_table.is_some() {
            flags |= FLAG_RELEASE_TABLE;
            if self.process.is_none_or(|process| process.thread.is_none()) {
                return Err(EngineAddressError::UnknownFlags(flags));
            }
        }
        if flags == FLAG_PROCESS {
            return Err(EngineAddressError::UnknownFlags(flags));
        }
        let mut out = BytesMut::with_capacity(
            HEADER_LEN
                + self.serving.len()
                + self.direct.as_ref().map_or(0, |d| 2 + d.len())
                + self.process.map_or(0, |process| {
                    if process.thread.is_some() {
                        PROCESS_LEN
                    } else {
                        PROCESS_LEN_WITHOUT_THREAD
                    }
                })
                + self.release_table.map_or(0, |_| RELEASE_TABLE_LEN),
        );
        out.put_slice(&MAGIC);
        out.put_u8(match self.process {
            Some(ProcessIdentity {
                thread: Some(_), ..
            }) => VERSION,
            Some(_) => VERSION_WITHOUT_THREAD,
            None => VERSION_WITHOUT_TOKEN,
        });
        out.put_u8(flags);
        put_field(&mut out, &self.serving);
        if let Some(direct) = &self.direct {
            put_field(&mut out, direct);
        }
        if let Some(process) = self.process {
            out.put_u32_le(process.pid);
            out.put_u64_le(process.pid_namespace);
            out.put_slice(&process.boot_id);
            out.put_u64_le(process.token_addr);
            out.put_slice(&process.token);
            if let Some(thread) = process.thread {
                out.put_u32_le(thread);
            }
        }
        if let Some(table) = self.release_table {
            out.put_u32_le(table.fd);
            out.put_slice(&table.id);
        }
        Ok(out.freeze())
    }

    /// Decodes an envelope (or a bare UCP address, see the module docs)
    /// without validating the UCP addresses inside.
    pub fn decode(bytes: &[u8]) -> Result<EngineAddress, EngineAddressError> {
        if !bytes.starts_with(&MAGIC) {
            if bytes.is_empty() {
                return Err(EngineAddressError::EmptyAddress("serving"));
            }
            return Ok(EngineAddress {
                serving: Bytes::copy_from_slice(bytes),
                direct: None,
                process: None,
                release_table: None,
            });
        }
        let header = take(bytes, 0, HEADER_LEN)?;
        let version = header[2];
        if !(VERSION_WITHOUT_TOKEN..=VERSION).contains(&version) {
            return Err(EngineAddressError::UnknownVersion(version));
        }
        let flags = header[3];
        if flags & !(FLAG_DIRECT | FLAG_PROCESS | FLAG_RELEASE_TABLE) != 0
            || flags & (FLAG_DIRECT | FLAG_PROCESS) == FLAG_PROCESS
        {
            return Err(EngineAddressError::UnknownFlags(flags));
        }
        // A release table is published only beside a process identity
        // that names a thread: readers open it through that thread.
        if flags & FLAG_RELEASE_TABLE != 0 && (flags & FLAG_PROCESS == 0 || version != VERSION) {
            return Err(EngineAddressError::UnknownFlags(flags));
        }
        // Versions 2 and 3 exist only to carry a token, and are written
        // only then: one envelope, one encoding.
        if version != VERSION_WITHOUT_TOKEN && flags & FLAG_PROCESS == 0 {
            return Err(EngineAddressError::UnknownFlags(flags));
        }
        let (serving, mut at) = field(bytes, 4, "serving")?;
        let direct = if flags & FLAG_DIRECT != 0 {
            let (direct, end) = field(bytes, at, "direct")?;
            at = end;
            Some(direct)
        } else {
            None
        };
        let process = if flags & FLAG_PROCESS == 0 {
            None
        } else if version == VERSION_WITHOUT_TOKEN {
            // Read past and dropped: see the module docs.
            take(bytes, at, PROCESS_LEN_WITHOUT_TOKEN)?;
            at += PROCESS_LEN_WITHOUT_TOKEN;
            None
        } else {
            let len = if version == VERSION {
                PROCESS_LEN
            } else {
                PROCESS_LEN_WITHOUT_THREAD
            };
            let raw = take(bytes, at, len)?;
            at += len;
            let mut pid = [0; 4];
            pid.copy_from_slice(&raw[..4]);
            let mut namespace = [0; 8];
            namespace.copy_from_slice(&raw[4..12]);
            let mut boot_id = [0; 16];
            boot_id.copy_from_slice(&raw[12..28]);
            let mut token_addr = [0; 8];
            token_addr.copy_from_slice(&raw[28..36]);
            let mut token = [0; 16];
            token.copy_from_slice(&raw[36..52]);
            let thread = (len == PROCESS_LEN).then(|| {
                let mut thread = [0; 4];
                thread.copy_from_slice(&raw[52..]);
                u32::from_le_bytes(thread)
            });
            Some(ProcessIdentity {
                pid: u32::from_le_bytes(pid),
                pid_namespace: u64::from_le_bytes(namespace),
                boot_id,
                token_addr: u64::from_le_bytes(token_addr),
                token,
                thread,
            })
        };
        let release_table = if flags & FLAG_RELEASE_TABLE == 0 {
            None
        } else {
            let raw = take(bytes, at, RELEASE_TABLE_LEN)?;
            at += RELEASE_TABLE_LEN;
            let mut fd = [0; 4];
            fd.copy_from_slice(&raw[..4]);
            let mut id = [0; 16];
            id.copy_from_slice(&raw[4..]);
            Some(TableLocation {
                fd: u32::from_le_bytes(fd),
                id,
            })
        };
        if at != bytes.len() {
            return Err(EngineAddressError::TrailingBytes(bytes.len() - at));
        }
        Ok(EngineAddress {
            serving,
            direct,
            process,
            release_table,
        })
    }

    /// Decodes and validates both UCP addresses against `format`, returning
    /// them padded as `ucp_ep_create` needs them
    /// ([`WorkerAddressFormat::copy_for_endpoint`]).
    pub fn decode_for_endpoints(
        bytes: &[u8],
        format: &WorkerAddressFormat,
    ) -> Result<EngineAddress, EngineAddressError> {
        let decoded = EngineAddress::decode(bytes)?;
        let check = |which: &'static str, address: &Bytes| {
            format
                .copy_for_endpoint(address)
                .map(Bytes::from)
                .map_err(|error| EngineAddressError::Worker { which, error })
        };
        Ok(EngineAddress {
            serving: check("serving", &decoded.serving)?,
            direct: decoded
                .direct
                .as_ref()
                .map(|d| check("direct", d))
                .transpose()?,
            process: decoded.process,
            release_table: decoded.release_table,
        })
    }
}

/// Whether `address` fits a length-prefixed field that decodes again.
fn check_field(address: &[u8], which: &'static str) -> Result<(), EngineAddressError> {
    match address.len() {
        0 => Err(EngineAddressError::EmptyAddress(which)),
        len if len > usize::from(u16::MAX) => Err(EngineAddressError::TooLong { which, len }),
        _ => Ok(()),
    }
}

/// Writes a field [`check_field`] accepted.
fn put_field(out: &mut BytesMut, address: &[u8]) {
    // Checked by `check_field`: the length fits 16 bits.
    out.put_u16_le(address.len() as u16);
    out.put_slice(address);
}

fn take(bytes: &[u8], at: usize, len: usize) -> Result<&[u8], EngineAddressError> {
    let available = bytes.len().saturating_sub(at);
    bytes
        .get(at..at.saturating_add(len))
        .ok_or(EngineAddressError::Truncated {
            needed: len,
            available,
        })
}

/// A length-prefixed address at `at`; returns it and the offset after it.
fn field(
    bytes: &[u8],
    at: usize,
    which: &'static str,
) -> Result<(Bytes, usize), EngineAddressError> {
    let len = take(bytes, at, 2)?;
    let len = usize::from(u16::from_le_bytes([len[0], len[1]]));
    if len == 0 {
        return Err(EngineAddressError::EmptyAddress(which));
    }
    let address = take(bytes, at + 2, len)?;
    Ok((Bytes::copy_from_slice(address), at + 2 + len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> EngineAddress {
        EngineAddress {
            serving: Bytes::from_static(&[0x10, 1, 2, 3]),
            direct: Some(Bytes::from_static(&[0x00, 9, 9])),
            process: None,
            release_table: None,
        }
    }

    #[test]
    fn an_envelope_round_trips_with_and_without_a_direct_lane() {
        let both = sample();
        assert_eq!(
            EngineAddress::decode(&both.encode().unwrap()),
            Ok(both.clone())
        );
        let serving_only = EngineAddress {
            direct: None,
            process: None,
            ..both
        };
        assert_eq!(
            EngineAddress::decode(&serving_only.encode().unwrap()),
            Ok(serving_only)
        );
    }

    #[test]
    fn an_address_the_envelope_cannot_carry_is_refused_not_cut_or_panicked_on() {
        let long = Bytes::from(vec![0x10; usize::from(u16::MAX) + 1]);
        let too_long = EngineAddress {
            serving: long.clone(),
            direct: None,
            process: None,
            release_table: None,
        };
        assert_eq!(
            too_long.encode(),
            Err(EngineAddressError::TooLong {
                which: "serving",
                len: long.len()
            })
        );
        let long_direct = EngineAddress {
            direct: Some(long.clone()),
            ..sample()
        };
        assert_eq!(
            long_direct.encode(),
            Err(EngineAddressError::TooLong {
                which: "direct",
                len: long.len()
            })
        );
        let empty = EngineAddress {
            serving: Bytes::new(),
            direct: None,
            process: None,
            release_table: None,
        };
        assert_eq!(
            empty.encode(),
            Err(EngineAddressError::EmptyAddress("serving"))
        );
        let longest = EngineAddress {
            serving: long.slice(1..),
            direct: None,
            process: None,
            release_table: None,
        };
        let encoded = longest.encode().expect("65535 bytes fit");
        assert_eq!(EngineAddress::decode(&encoded), Ok(longest));
    }

    #[test]
    fn a_bare_ucp_address_is_a_serving_address_without_direct_lane() {
        let decoded = EngineAddress::decode(&[0x10, 0xAA, 0xBB]).unwrap();
        assert_eq!(&decoded.serving[..], &[0x10, 0xAA, 0xBB]);
        assert_eq!(decoded.direct, None);
        assert_eq!(
            EngineAddress::decode(&[]),
            Err(EngineAddressError::EmptyAddress("serving"))
        );
    }

    #[test]
    fn malformed_envelopes_get_typed_errors() {
        let good = sample().encode().unwrap();
        let mut v = good.to_vec();
        v[2] = 4;
        assert_eq!(
            EngineAddress::decode(&v),
            Err(EngineAddressError::UnknownVersion(4))
        );
        let mut v = good.to_vec();
        v[3] = 0x81;
        assert_eq!(
            EngineAddress::decode(&v),
            Err(EngineAddressError::UnknownFlags(0x81))
        );
        let mut v = good.to_vec();
        v.push(0);
        assert_eq!(
            EngineAddress::decode(&v),
            Err(EngineAddressError::TrailingBytes(1))
        );
        assert!(matches!(
            EngineAddress::decode(&good[..good.len() - 1]),
            Err(EngineAddressError::Truncated { .. })
        ));
        assert_eq!(
            EngineAddress::decode(b"RW\x01\x00\x00\x00"),
            Err(EngineAddressError::EmptyAddress("serving"))
        );
    }

    fn identity(thread: Option<u32>) -> ProcessIdentity {
        ProcessIdentity {
            pid: 4242,
            pid_namespace: 0x1122_3344_5566_7788,
            boot_id: [7; 16],
            token_addr: 0x0102_0304_0506_0708,
            token: [9; 16],
            thread,
        }
    }

    #[test]
    fn a_process_identity_round_trips_beside_a_direct_lane() {
        let with_process = EngineAddress {
            process: Some(identity(Some(0x0A0B_0C0D))),
            ..sample()
        };
        let encoded = with_process.encode().unwrap();
        assert_eq!(encoded[2], VERSION);
        assert_eq!(encoded[3], FLAG_DIRECT | FLAG_PROCESS);
        assert_eq!(&encoded[encoded.len() - 4..], &[0x0D, 0x0C, 0x0B, 0x0A]);
        assert_eq!(EngineAddress::decode(&encoded), Ok(with_process));
        assert_eq!(
            EngineAddress::decode(&encoded[..encoded.len() - 1]),
            Err(EngineAddressError::Truncated {
                needed: PROCESS_LEN,
                available: PROCESS_LEN - 1
            })
        );
    }

    #[test]
    fn a_release_table_round_trips_only_beside_a_process_that_names_a_thread() {
        let table = TableLocation {
            fd: 0x0102_0304,
            id: [5; 16],
        };
        let with_table = EngineAddress {
            process: Some(identity(Some(77))),
            release_table: Some(table),
            ..sample()
        };
        let encoded = with_table.encode().unwrap();
        let all = FLAG_DIRECT | FLAG_PROCESS | FLAG_RELEASE_TABLE;
        assert_eq!(encoded[3], all);
        assert_eq!(EngineAddress::decode(&encoded), Ok(with_table.clone()));
        assert!(matches!(
            EngineAddress::decode(&encoded[..encoded.len() - 1]),
            Err(EngineAddressError::Truncated { .. })
        ));
        let without_thread = EngineAddress {
            process: Some(identity(None)),
            ..with_table.clone()
        };
        assert_eq!(
            without_thread.encode(),
            Err(EngineAddressError::UnknownFlags(all))
        );
        let without_process = EngineAddress {
            process: None,
            ..with_table
        };
        assert_eq!(
            without_process.encode(),
            Err(EngineAddressError::UnknownFlags(
                FLAG_DIRECT | FLAG_RELEASE_TABLE
            ))
        );
        // A version-2 envelope (no thread) claiming a table is refused.
        let mut old = encoded.to_vec();
        old[2] = VERSION_WITHOUT_THREAD;
        assert_eq!(
            EngineAddress::decode(&old),
            Err(EngineAddressError::UnknownFlags(all))
        );
    }

    #[test]
    fn a_version_two_identity_names_no_thread_and_is_written_as_version_two() {
        let with_thread = EngineAddress {
            process: Some(identity(Some(77))),
            ..sample()
        };
        let without_thread = EngineAddress {
            process: Some(identity(None)),
            ..sample()
        };
        let encoded = without_thread.encode().unwrap();
        assert_eq!(encoded[2], VERSION_WITHOUT_THREAD);
        let newer = with_thread.encode().unwrap();
        assert_eq!(
            &newer[..encoded.len()],
            &{
                let mut same = encoded.to_vec();
                same[2] = VERSION;
                same
            }[..]
        );
        assert_eq!(EngineAddress::decode(&encoded), Ok(without_thread));
        // A version-3 envelope without the thread id is cut short, and a
        // version-2 one with it has bytes left over.
        let mut cut = encoded.to_vec();
        cut[2] = VERSION;
        assert!(matches!(
            EngineAddress::decode(&cut),
            Err(EngineAddressError::Truncated { .. })
        ));
        let mut long = newer.to_vec();
        long[2] = VERSION_WITHOUT_THREAD;
        assert_eq!(
            EngineAddress::decode(&long),
            Err(EngineAddressError::TrailingBytes(4))
        );
    }

    #[test]
    fn an_engine_names_its_process_by_the_thread_that_asked() {
        let me = ProcessIdentity::current_with_this_thread().expect("procfs is mounted");
        // SAFETY: gettid takes no arguments.
        let this_thread = unsafe { libc::gettid() } as u32;
        assert_eq!(me.thread, Some(this_thread));
        let other = std::thread::spawn(|| {
            ProcessIdentity::current_with_this_thread()
                .expect("procfs is mounted")
                .thread
        })
        .join()
        .unwrap();
        assert_ne!(other, Some(this_thread));
        assert_eq!(
            ProcessIdentity { thread: None, ..me },
            ProcessIdentity::current().unwrap()
        );
    }

    #[test]
    fn a_version_one_identity_without_a_token_is_read_past_and_dropped() {
        let with_process = EngineAddress {
            process: ProcessIdentity::current_with_this_thread(),
            ..sample()
        };
        let encoded = with_process.encode().unwrap();
        assert_eq!(encoded[2], VERSION);
        // The same envelope as version 1 wrote it: no token, no thread.
        let mut old = encoded[..encoded.len() - (PROCESS_LEN - PROCESS_LEN_WITHOUT_TOKEN)].to_vec();
        old[2] = VERSION_WITHOUT_TOKEN;
        assert_eq!(
            EngineAddress::decode(&old),
            Ok(EngineAddress {
                process: None,
                ..with_process
            })
        );
        // A version-2 or -3 envelope without the token is cut short.
        for version in [VERSION_WITHOUT_THREAD, VERSION] {
            old[2] = version;
            assert!(matches!(
                EngineAddress::decode(&old),
                Err(EngineAddressError::Truncated { .. })
            ));
        }
        // An envelope without an identity is still written as version 1.
        assert_eq!(sample().encode().unwrap()[2], VERSION_WITHOUT_TOKEN);
    }

    #[test]
    fn a_version_two_or_three_envelope_without_a_process_identity_is_refused() {
        let mut encoded = sample().encode().unwrap().to_vec();
        assert_eq!(encoded[2], VERSION_WITHOUT_TOKEN);
        for version in [VERSION_WITHOUT_THREAD, VERSION] {
            encoded[2] = version;
            assert_eq!(
                EngineAddress::decode(&encoded),
                Err(EngineAddressError::UnknownFlags(encoded[3]))
            );
        }
        encoded[2] = VERSION + 1;
        assert_eq!(
            EngineAddress::decode(&encoded),
            Err(EngineAddressError::UnknownVersion(VERSION + 1))
        );
    }

    #[test]
    fn a_process_identity_without_a_direct_lane_is_refused_both_ways() {
        let lone = EngineAddress {
            direct: None,
            process: ProcessIdentity::current(),
            ..sample()
        };
        assert!(lone.process.is_some(), "this host names its pid namespace");
        assert_eq!(
            lone.encode(),
            Err(EngineAddressError::UnknownFlags(FLAG_PROCESS))
        );
        let mut forged = b"RW\x01\x02\x01\x00\x10".to_vec();
        forged.extend_from_slice(&[0; PROCESS_LEN]);
        assert_eq!(
            EngineAddress::decode(&forged),
            Err(EngineAddressError::UnknownFlags(FLAG_PROCESS))
        );
    }

    #[test]
    fn this_process_is_named_by_its_own_id() {
        let me = ProcessIdentity::current().expect("procfs is mounted");
        assert_eq!(me.pid, std::process::id());
        assert_ne!(me.pid_namespace, 0);
        assert_ne!(me.boot_id, [0; 16]);
        assert!(me.shares_pid_space_with(&me));
        let elsewhere = ProcessIdentity {
            boot_id: [!me.boot_id[0]; 16],
            ..me
        };
        assert!(!me.shares_pid_space_with(&elsewhere));
    }

    #[test]
    fn boot_ids_parse_as_the_kernel_prints_them_and_nothing_else() {
        assert_eq!(
            parse_boot_id("0123abcd-4567-89ab-cdef-0123456789ab\n"),
            Some([
                0x01, 0x23, 0xab, 0xcd, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0x01, 0x23, 0x45, 0x67,
                0x89, 0xab
            ])
        );
        assert_eq!(parse_boot_id(""), None);
        assert_eq!(parse_boot_id("0123abcd-4567-89ab-cdef-0123456789"), None);
        assert_eq!(parse_boot_id("0123abcd-4567-89ab-cdef-0123456789zz"), None);
        assert_eq!(parse_boot_id("é123abcd-4567-89ab-cdef-0123456789a"), None);
    }

    proptest! {
        #[test]
        fn an_accepted_envelope_encodes_back_to_its_bytes_less_only_a_version_one_identity(
            version in 0u8..5,
            flags in 0u8..8,
            serving in proptest::collection::vec(any::<u8>(), 0..6),
            direct in proptest::collection::vec(any::<u8>(), 0..6),
            identity_len in proptest::sample::select(vec![
                0,
                PROCESS_LEN_WITHOUT_TOKEN - 1,
                PROCESS_LEN_WITHOUT_TOKEN,
                PROCESS_LEN_WITHOUT_THREAD - 1,
                PROCESS_LEN_WITHOUT_THREAD,
                PROCESS_LEN_WITHOUT_THREAD + 1,
                PROCESS_LEN - 1,
                PROCESS_LEN,
                PROCESS_LEN + 1,
            ]),
            identity in proptest::collection::vec(any::<u8>(), PROCESS_LEN + 1),
            cut in 0usize..3,
        ) {
            let mut bytes = MAGIC.to_vec();
            bytes.extend_from_slice(&[version, flags]);
            bytes.extend_from_slice(&(serving.len() as u16).to_le_bytes());
            bytes.extend_from_slice(&serving);
            if flags & FLAG_DIRECT != 0 {
                bytes.extend_from_slice(&(direct.len() as u16).to_le_bytes());
                bytes.extend_from_slice(&direct);
            }
            bytes.extend_from_slice(&identity[..identity_len]);
            bytes.truncate(bytes.len() - cut.min(bytes.len() - MAGIC.len()));
            if let Ok(decoded) = EngineAddress::decode(&bytes) {
                let mut expected = bytes.clone();
                if version == VERSION_WITHOUT_TOKEN && flags & FLAG_PROCESS != 0 {
                    expected[3] &= !FLAG_PROCESS;
                    expected.truncate(expected.len() - PROCESS_LEN_WITHOUT_TOKEN);
                }
                let encoded = decoded.encode();
                prop_assert_eq!(encoded.map(|e| e.to_vec()), Ok(expected));
            }
        }

        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = EngineAddress::decode(&bytes);
            let mut framed = b"RW\x01".to_vec();
            framed.extend_from_slice(&bytes);
            let _ = EngineAddress::decode(&framed);
        }
    }
}
