//! The notice message as it travels from a reader to an owner.
//!
//! Little-endian: `version = 1`, `kind: u8`, two zero bytes,
//! `length: u32`, `sender: u64`, `sequence: u64`, then the message's
//! `length` bytes — [`HEADER_LEN`] + `length` in all, with `length` at
//! most [`MAX_NOTICE_BYTES`]. `sender` is a number the reading engine
//! draws at random when it starts; it numbers the messages it sends one
//! owner from 1 upwards in `sequence`. See [`inbox`](super::inbox) for
//! what the owner does with both.
//!
//! `kind` 0 is a notice for the application ([`encode`], [`decode`]);
//! kind 1 is the release of a descriptor lease ([`encode_release`],
//! [`decode_release`]), whose 24 bytes are the lease's `region: u64` and
//! `capability: [u8; 16]` as the lease's key carries them. The owner's
//! engine consumes releases itself; [`decode`] refuses one, so a release
//! never reaches an application's notice stream. Kind 1 was a reserved
//! zero byte before releases existed, so an owner of that time drops a
//! release as malformed.
//!
//! Decoding never panics and refuses an unknown version or kind, non-zero
//! reserved bytes, a length over the bound and missing or trailing bytes:
//! these bytes come from peers.

pub use rdmareg_core::MAX_NOTICE_BYTES;
use rdmareg_core::RdmaError;

/// Length of the fixed part that precedes a notice's bytes.
pub const HEADER_LEN: usize = 24;

const VERSION: u8 = 1;
const KIND_NOTICE: u8 = 0;
const KIND_RELEASE: u8 = 1;
/// Length of a release's bytes: region id and capability.
pub const RELEASE_LEN: usize = 24;

/// A decoded lease release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReleaseMessage {
    /// The reading engine's random number.
    pub sender: u64,
    /// The sender's number for it, in the same series as its notices.
    pub sequence: u64,
    /// The owner's region id, from the lease's key.
    pub region: u64,
    /// The lease's capability, from its key.
    pub capability: [u8; 16],
}

/// A decoded notice message, borrowing the bytes it arrived in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoticeMessage<'a> {
    /// The reading engine's random number.
    pub sender: u64,
    /// The sender's number for it, from 1 upwards.
    pub sequence: u64,
    /// The notice itself.
    pub bytes: &'a [u8],
}

/// What is wrong with bytes received as a notice message (a notice to send
/// that is too long is [`RdmaError::NoticeTooLarge`] instead).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NoticeFormatError {
    /// Fewer bytes than the fixed part.
    #[error("a notice message needs at least {HEADER_LEN} bytes, got {actual}")]
    Truncated {
        /// What arrived.
        actual: usize,
    },
    /// A version this build does not know.
    #[error("unknown notice version {0}")]
    Version(u8),
    /// A reserved byte is not zero.
    #[error("reserved bytes of a notice are not zero")]
    Reserved,
    /// The notice claims more than [`MAX_NOTICE_BYTES`].
    #[error("a notice of {length} bytes is over the bound of {MAX_NOTICE_BYTES}")]
    TooLong {
        /// The length it claims.
        length: u64,
    },
    /// The bytes after the fixed part are not the length it claims.
    #[error("a notice claims {claimed} bytes but carries {carried}")]
    LengthMismatch {
        /// The length in the fixed part.
        claimed: usize,
        /// The bytes that follow it.
        carried: usize,
    },
}

/// The message carrying `bytes` as notice number `sequence` of `sender`.
///
/// # Errors
/// [`RdmaError::NoticeTooLarge`] past [`MAX_NOTICE_BYTES`], the error a
/// caller of `send_notice` gets, so every backend reports it alike.
pub fn encode(sender: u64, sequence: u64, bytes: &[u8]) -> Result<Vec<u8>, RdmaError> {
    if bytes.len() > MAX_NOTICE_BYTES {
        return Err(RdmaError::NoticeTooLarge {
            length: bytes.len() as u64,
        });
    }
    Ok(encode_kind(KIND_NOTICE, sender, sequence, bytes))
}

/// The message releasing the lease `capability` of `region`, as message
/// number `sequence` of `sender`.
pub fn encode_release(sender: u64, sequence: u64, region: u64, capability: &[u8; 16]) -> Vec<u8> {
    let mut bytes = [0u8; RELEASE_LEN];
    bytes[..8].copy_from_slice(&region.to_le_bytes());
    bytes[8..].copy_from_slice(capability);
    encode_kind(KIND_RELEASE, sender, sequence, &bytes)
}

/// Whether `message` claims to be a lease release (its version and kind
/// bytes); [`decode_release`] checks the rest.
pub fn is_release(message: &[u8]) -> bool {
    message.len() >= 2 && message[0] == VERSION && message[1] == KIND_RELEASE
}

/// Decodes an untrusted lease release.
///
/// # Errors
/// The [`NoticeFormatError`] naming the first thing wrong; a notice is
/// [`NoticeFormatError::Reserved`] here, as a release is to [`decode`].
pub fn decode_release(message: &[u8]) -> Result<ReleaseMessage, NoticeFormatError> {
    let (header, bytes) = decode_kind(message, KIND_RELEASE)?;
    if bytes.len() != RELEASE_LEN {
        return Err(NoticeFormatError::LengthMismatch {
            claimed: RELEASE_LEN,
            carried: bytes.len(),
        });
    }
    let mut region = [0u8; 8];
    region.copy_from_slice(&bytes[..8]);
    let mut capability = [0u8; 16];
    capability.copy_from_slice(&bytes[8..]);
    Ok(ReleaseMessage {
        sender: u64_at(header, 8),
        sequence: u64_at(header, 16),
        region: u64::from_le_bytes(region),
        capability,
    })
}

fn encode_kind(kind: u8, sender: u64, sequence: u64, bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + bytes.len());
    out.extend_from_slice(&[VERSION, kind, 0, 0]);
    // In range of u32: at most MAX_NOTICE_BYTES.
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(&sender.to_le_bytes());
    out.extend_from_slice(&sequence.to_le_bytes());
    out.extend_from_slice(bytes);
    out
}

/// Decodes an untrusted notice message.
///
/// # Errors
/// The [`NoticeFormatError`] naming the first thing wrong.
pub fn decode(message: &[u8]) -> Result<NoticeMessage<'_>, NoticeFormatError> {
    let (header, bytes) = decode_kind(message, KIND_NOTICE)?;
    Ok(NoticeMessage {
        sender: u64_at(header, 8),
        sequence: u64_at(header, 16),
        bytes,
    })
}

/// The header and bytes of a message of `kind`, checked.
fn decode_kind(message: &[u8], kind: u8) -> Result<(&[u8; HEADER_LEN], &[u8]), NoticeFormatError> {
    let (header, bytes) =
        message
            .split_first_chunk::<HEADER_LEN>()
            .ok_or(NoticeFormatError::Truncated {
                actual: message.len(),
            })?;
    if header[0] != VERSION {
        return Err(NoticeFormatError::Version(header[0]));
    }
    if header[1] != kind || header[2..4] != [0, 0] {
        return Err(NoticeFormatError::Reserved);
    }
    let mut length = [0u8; 4];
    length.copy_from_slice(&header[4..8]);
    let claimed = u32::from_le_bytes(length);
    if claimed as usize > MAX_NOTICE_BYTES {
        return Err(NoticeFormatError::TooLong {
            length: u64::from(claimed),
        });
    }
    if bytes.len() != claimed as usize {
        return Err(NoticeFormatError::LengthMismatch {
            claimed: claimed as usize,
            carried: bytes.len(),
        });
    }
    Ok((header, bytes))
}

fn u64_at(header: &[u8; HEADER_LEN], at: usize) -> u64 {
    let mut field = [0u8; 8];
    field.copy_from_slice(&header[at..at + 8]);
    u64::from_le_bytes(field)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn the_layout_is_the_documented_one() {
        let message = encode(0x1112_1314_1516_1718, 0x0102_0304_0506_0708, b"done").unwrap();
        assert_eq!(
            message,
            [
                1, 0, 0, 0, // version, reserved
                4, 0, 0, 0, // length
                0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11, // sender
                8, 7, 6, 5, 4, 3, 2, 1, // sequence
                b'd', b'o', b'n', b'e',
            ]
        );
    }

    #[test]
    fn an_empty_notice_and_a_full_one_round_trip() {
        for len in [0, 1, MAX_NOTICE_BYTES] {
            let bytes = vec![0xA5; len];
            let message = encode(5, 9, &bytes).unwrap();
            assert_eq!(
                decode(&message).unwrap(),
                NoticeMessage {
                    sender: 5,
                    sequence: 9,
                    bytes: &bytes
                }
            );
        }
    }

    #[test]
    fn a_notice_over_the_bound_is_not_encoded() {
        let too_long = vec![0; MAX_NOTICE_BYTES + 1];
        assert_eq!(
            encode(5, 1, &too_long),
            Err(RdmaError::NoticeTooLarge {
                length: MAX_NOTICE_BYTES as u64 + 1
            })
        );
    }

    #[test]
    fn malformed_messages_are_refused_by_name() {
        let good = encode(5, 3, b"abc").unwrap();
        assert_eq!(
            decode(&good[..HEADER_LEN - 1]),
            Err(NoticeFormatError::Truncated {
                actual: HEADER_LEN - 1
            })
        );
        let mut version = good.clone();
        version[0] = 2;
        assert_eq!(decode(&version), Err(NoticeFormatError::Version(2)));
        let mut reserved = good.clone();
        reserved[2] = 1;
        assert_eq!(decode(&reserved), Err(NoticeFormatError::Reserved));
        let mut huge = good.clone();
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            decode(&huge),
            Err(NoticeFormatError::TooLong {
                length: u64::from(u32::MAX)
            })
        );
        assert_eq!(
            decode(&good[..good.len() - 1]),
            Err(NoticeFormatError::LengthMismatch {
                claimed: 3,
                carried: 2
            })
        );
        let mut trailing = good.clone();
        trailing.push(0);
        assert_eq!(
            decode(&trailing),
            Err(NoticeFormatError::LengthMismatch {
                claimed: 3,
                carried: 4
            })
        );
    }

    #[test]
    fn a_release_has_the_documented_layout_and_round_trips() {
        let message = encode_release(5, 9, 0x0102_0304_0506_0708, &[0xAB; 16]);
        assert_eq!(&message[..4], &[1, 1, 0, 0], "version, kind 1, reserved");
        assert_eq!(&message[4..8], &24u32.to_le_bytes());
        assert_eq!(&message[24..32], &0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(&message[32..], &[0xAB; 16]);
        assert!(is_release(&message));
        assert_eq!(
            decode_release(&message),
            Ok(ReleaseMessage {
                sender: 5,
                sequence: 9,
                region: 0x0102_0304_0506_0708,
                capability: [0xAB; 16],
            })
        );
    }

    /// A release never reaches an application's stream as a notice, and
    /// a notice never counts as a release.
    #[test]
    fn notices_and_releases_do_not_pass_for_each_other() {
        let release = encode_release(5, 9, 1, &[7; 16]);
        assert_eq!(decode(&release), Err(NoticeFormatError::Reserved));
        let notice = encode(5, 9, &[0; RELEASE_LEN]).unwrap();
        assert!(!is_release(&notice));
        assert_eq!(decode_release(&notice), Err(NoticeFormatError::Reserved));
        let mut short = release.clone();
        short.pop();
        short[4] = 23;
        assert_eq!(
            decode_release(&short),
            Err(NoticeFormatError::LengthMismatch {
                claimed: RELEASE_LEN,
                carried: 23
            })
        );
        let mut kind_two = release;
        kind_two[1] = 2;
        assert_eq!(decode_release(&kind_two), Err(NoticeFormatError::Reserved));
    }

    proptest! {
        #[test]
        fn any_notice_round_trips(
            sender: u64,
            sequence: u64,
            bytes in proptest::collection::vec(any::<u8>(), 0..=MAX_NOTICE_BYTES),
        ) {
            let message = encode(sender, sequence, &bytes).unwrap();
            prop_assert_eq!(message.len(), HEADER_LEN + bytes.len());
            prop_assert_eq!(
                decode(&message).unwrap(),
                NoticeMessage { sender, sequence, bytes: &bytes }
            );
        }

        #[test]
        fn decoding_any_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(notice) = decode(&bytes) {
                prop_assert_eq!(encode(notice.sender, notice.sequence, notice.bytes).unwrap(), bytes.clone());
            }
            if let Ok(release) = decode_release(&bytes) {
                prop_assert_eq!(
                    encode_release(release.sender, release.sequence, release.region, &release.capability),
                    bytes
                );
            }
        }
    }
}
