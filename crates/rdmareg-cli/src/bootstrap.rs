//! The plain-TCP bootstrap between an owner and a consumer process, in the
//! frames of [`rdmareg::offer`]. The owner's first frame is an
//! [`rdmareg::Offer`] labelled with each range's CRC32; later frames are a
//! one-byte tag and its fields:
//! 1. owner → consumer: [`Message::Offer`];
//! 2. both ways, every half second: [`Message::Alive`] (see `control.rs`);
//! 3. consumer → owner: [`Message::Done`] once every GET finished, so the
//!    owner never deregisters under a read;
//! 4. owner → consumer: [`Message::OwnerShutDown`] with its backend's
//!    remaining registration count.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use rdmareg::offer::{self, Offer, OfferError, OfferedRegion};
use rdmareg_core::Descriptor;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

/// First body byte of an offer (written by [`rdmareg::Offer`]).
const TAG_OFFER: u8 = 1;
const TAG_DONE: u8 = 2;
const TAG_OWNER_SHUT_DOWN: u8 = 3;
const TAG_ALIVE: u8 = 4;

/// How far a consumer got: ranges whose GET finished, and of those, ranges
/// whose bytes matched the owner's checksum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Ranges read (GET returned `Ok`).
    pub read: u32,
    /// Ranges read and verified.
    pub verified: u32,
}

impl Tally {
    fn put(self, body: &mut BytesMut) {
        body.put_u32_le(self.read);
        body.put_u32_le(self.verified);
    }

    fn get(body: &mut &[u8]) -> Tally {
        Tally {
            read: body.get_u32_le(),
            verified: body.get_u32_le(),
        }
    }
}

/// One described range and the checksum of its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OfferedRange {
    /// Where to read.
    pub descriptor: Descriptor,
    /// CRC32 of the bytes the descriptor names, computed by the owner.
    pub crc32: u32,
}

/// A bootstrap message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// The owner's worker address and what it offers.
    Offer {
        /// Packed UCX worker address of the owner.
        worker_address: Bytes,
        /// The ranges the consumer may read.
        ranges: Vec<OfferedRange>,
    },
    /// The consumer finished all its GETs.
    Done {
        /// Whether every range verified.
        verified: bool,
        /// How far it got.
        tally: Tally,
    },
    /// A heartbeat: the sender is alive. The consumer's carries its tally
    /// (the owner's is zero).
    Alive {
        /// How far the consumer got.
        tally: Tally,
    },
    /// The owner shut down; its backend's remaining registration count
    /// (`None` if the backend cannot say).
    OwnerShutDown {
        /// `live_registrations()` after teardown.
        live_registrations: Option<u64>,
    },
}

/// Why a bootstrap exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    /// The connection failed or closed early, or a frame or the offer was
    /// refused.
    #[error("bootstrap: {0}")]
    Frame(#[from] OfferError),
    /// The peer sent a frame that is not a valid message.
    #[error("bootstrap protocol violation: {0}")]
    Protocol(String),
}

impl Message {
    /// Encode as one frame (length prefix included).
    ///
    /// # Errors
    /// An offer over the limits of [`rdmareg::offer`].
    pub fn encode(&self) -> Result<Bytes, BootstrapError> {
        let mut body = BytesMut::new();
        match self {
            Message::Offer {
                worker_address,
                ranges,
            } => {
                let regions = ranges.iter().map(|range| {
                    OfferedRegion::new(range.crc32.to_le_bytes().to_vec(), range.descriptor.clone())
                });
                return Ok(Offer::new(worker_address.clone(), regions).encode()?);
            }
            Message::Done { verified, tally } => {
                body.put_u8(TAG_DONE);
                body.put_u8(u8::from(*verified));
                tally.put(&mut body);
            }
            Message::Alive { tally } => {
                body.put_u8(TAG_ALIVE);
                tally.put(&mut body);
            }
            Message::OwnerShutDown { live_registrations } => {
                body.put_u8(TAG_OWNER_SHUT_DOWN);
                body.put_u64_le(live_registrations.unwrap_or(u64::MAX));
            }
        }
        let mut frame = BytesMut::with_capacity(4 + body.len());
        // At most 10 bytes.
        frame.put_u32_le(body.len() as u32);
        frame.put_slice(&body);
        Ok(frame.freeze())
    }

    /// Decode one frame body (without the length prefix).
    pub fn decode(body: &[u8]) -> Result<Message, BootstrapError> {
        let bad = |what: &str| BootstrapError::Protocol(what.to_owned());
        let whole = body;
        let mut body = body;
        if body.is_empty() {
            return Err(bad("empty frame"));
        }
        let tag = body.get_u8();
        let message = match tag {
            TAG_OFFER => {
                let offer = Offer::decode(whole)?;
                let worker_address = offer.worker_address().clone();
                let ranges = offer
                    .into_regions()
                    .into_iter()
                    .map(|region| {
                        let crc32 = <[u8; 4]>::try_from(region.label())
                            .map(u32::from_le_bytes)
                            .map_err(|_| bad("an offered range's label is not a CRC32"))?;
                        Ok(OfferedRange {
                            descriptor: region.into_descriptor(),
                            crc32,
                        })
                    })
                    .collect::<Result<_, BootstrapError>>()?;
                return Ok(Message::Offer {
                    worker_address,
                    ranges,
                });
            }
            TAG_DONE if body.remaining() == 9 => Message::Done {
                verified: body.get_u8() != 0,
                tally: Tally::get(&mut body),
            },
            TAG_ALIVE if body.remaining() == 8 => Message::Alive {
                tally: Tally::get(&mut body),
            },
            TAG_OWNER_SHUT_DOWN if body.remaining() == 8 => {
                let live = body.get_u64_le();
                Message::OwnerShutDown {
                    live_registrations: (live != u64::MAX).then_some(live),
                }
            }
            _ => return Err(bad("unknown or malformed message")),
        };
        if body.has_remaining() {
            return Err(bad("trailing bytes in frame"));
        }
        Ok(message)
    }
}

/// Write one message.
pub async fn send<W: AsyncWrite + Unpin>(
    writer: &mut W,
    message: &Message,
) -> Result<(), BootstrapError> {
    let frame = message.encode()?;
    writer.write_all(&frame).await.map_err(OfferError::from)?;
    writer.flush().await.map_err(OfferError::from)?;
    Ok(())
}

/// Read one message.
pub async fn receive<R: AsyncRead + Unpin>(reader: &mut R) -> Result<Message, BootstrapError> {
    let body = offer::read_frame(reader).await?;
    Message::decode(&body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer() -> Message {
        let descriptor =
            Descriptor::new("ucx", 0x1000, 4096, 3, Bytes::from_static(&[0; 9])).unwrap();
        Message::Offer {
            worker_address: Bytes::from_static(b"worker-address"),
            ranges: vec![
                OfferedRange {
                    descriptor: descriptor.clone(),
                    crc32: 0xdead_beef,
                },
                OfferedRange {
                    descriptor: descriptor.slice(1, 10).unwrap(),
                    crc32: 7,
                },
            ],
        }
    }

    #[tokio::test]
    async fn every_message_survives_a_round_trip_through_a_stream() {
        let messages = [
            offer(),
            Message::Done {
                verified: true,
                tally: Tally {
                    read: 7,
                    verified: 6,
                },
            },
            Message::Alive {
                tally: Tally::default(),
            },
            Message::Alive {
                tally: Tally {
                    read: u32::MAX,
                    verified: 1,
                },
            },
            Message::OwnerShutDown {
                live_registrations: Some(0),
            },
            Message::OwnerShutDown {
                live_registrations: None,
            },
        ];
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        for m in &messages {
            send(&mut a, m).await.unwrap();
        }
        for m in &messages {
            assert_eq!(&receive(&mut b).await.unwrap(), m);
        }
    }

    #[test]
    fn every_truncation_of_an_offer_is_a_protocol_error() {
        let frame = offer().encode().unwrap();
        let body = &frame[4..];
        for cut in 0..body.len() {
            assert!(Message::decode(&body[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[tokio::test]
    async fn an_oversized_frame_is_refused_before_allocation() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&(offer::MAX_FRAME_LEN + 1).to_le_bytes())
            .await
            .unwrap();
        assert!(matches!(
            receive(&mut b).await,
            Err(BootstrapError::Frame(OfferError::Oversize { .. }))
        ));
    }

    #[test]
    fn an_offer_whose_labels_are_not_checksums_is_refused() {
        let descriptor =
            Descriptor::new("ucx", 0x1000, 4096, 3, Bytes::from_static(&[0; 9])).unwrap();
        let frame = Offer::new(Bytes::from_static(b"addr"), [("block-0", descriptor)])
            .encode()
            .unwrap();
        assert!(matches!(
            Message::decode(&frame[4..]),
            Err(BootstrapError::Protocol(_))
        ));
    }
}
