//! Handing a peer this side's address and descriptors over a byte stream.
//!
//! [`Rdma::offer`](crate::Rdma::offer) writes the worker address and
//! labelled descriptors as one [`Offer`] frame to any Tokio [`AsyncWrite`];
//! [`Rdma::accept`](crate::Rdma::accept) reads it on the other side, adds
//! the peer and returns the descriptors, ready to GET.
//!
//! ```no_run
//! # async fn sketch(
//! #     owner: &rdmareg::Rdma,
//! #     region: &rdmareg::RegionGuard,
//! #     consumer: &rdmareg::Rdma,
//! # ) -> Result<(), Box<dyn std::error::Error>> {
//! use rdmareg::PeerId;
//! use tokio::net::{TcpListener, TcpStream};
//!
//! // Owner: offer the region, labelled, to whoever connects.
//! let listener = TcpListener::bind("127.0.0.1:7471").await?;
//! let (mut to_consumer, _) = listener.accept().await?;
//! owner.offer(&mut to_consumer, [("block-0", region.descriptor()?)]).await?;
//!
//! // Consumer (another process): accept, then GET by label.
//! let mut to_owner = TcpStream::connect("127.0.0.1:7471").await?;
//! let offer = consumer.accept(&mut to_owner, PeerId(1)).await?;
//! let descriptor = offer.descriptor("block-0").ok_or("not offered")?;
//! let mut buffer = consumer.alloc_pinned(descriptor.len() as usize).await?;
//! consumer.get(PeerId(1), descriptor, &mut buffer).await?;
//! # Ok(())
//! # }
//! ```
//!
//! The [`Offer`] itself is plain bytes, for a channel that is not a stream:
//!
//! ```
//! use rdmareg::{Bytes, Descriptor, Offer};
//!
//! let descriptor = Descriptor::new("ucx", 0x1000, 4096, 1, Bytes::from_static(&[7; 9]))?;
//! let offer = Offer::new(Bytes::from_static(b"worker address"), [("block-0", descriptor)]);
//! let frame = offer.encode()?;
//! let received = Offer::decode(&frame[4..])?; // the body, after the length
//! assert_eq!(received, offer);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Frames
//!
//! A frame is a `u32` little-endian body length, then the body. A reader
//! refuses a length over [`MAX_FRAME_LEN`] before reading the body and grows
//! its buffer only as bytes arrive. [`write_frame`] and [`read_frame`] carry
//! any other message over the same stream.
//!
//! # The offer (version 1)
//!
//! All integers little-endian.
//!
//! | bytes | field |
//! |---|---|
//! | 1 | `0x01`, an offer (other frames may use other first bytes) |
//! | 1 | version, `1` |
//! | 4 | worker address length `a`, non-zero |
//! | a | worker address |
//! | 4 | region count `n`, at most [`MAX_REGIONS`] |
//!
//! then `n` times: a `u16` label length `l` (at most [`MAX_LABEL_LEN`]),
//! `l` label bytes, and one encoded [`Descriptor`] (self-delimiting).
//! Decoding reads only inside the frame, never panics, and allocates no more
//! than the frame holds.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use rdmareg_core::{Descriptor, DescriptorError, RdmaError};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest frame body either side writes or reads, in bytes.
pub const MAX_FRAME_LEN: u32 = 16 << 20;

/// Most regions one offer carries.
pub const MAX_REGIONS: u32 = 65_536;

/// Longest label of one offered region, in bytes.
pub const MAX_LABEL_LEN: usize = 1024;

/// First byte of an offer's body.
const OFFER_TAG: u8 = 0x01;
/// The offer format this build writes and reads.
const VERSION: u8 = 1;
/// Fewest bytes one region takes (label length and smallest descriptor):
/// bounds the capacity reserved for a declared region count.
const MIN_REGION_LEN: usize = 2 + 32;

/// Why an offer could not be written, read or accepted.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum OfferError {
    /// The peer closed the stream before a frame began.
    #[error("the peer closed the stream before sending a frame")]
    Closed,
    /// The peer closed the stream inside a frame.
    #[error("the peer closed the stream {read} bytes into a {expected}-byte frame")]
    Truncated {
        /// Bytes of the frame read, its 4-byte length prefix included.
        read: usize,
        /// Bytes the frame should have had, prefix included (4 if the
        /// prefix itself was cut).
        expected: usize,
    },
    /// A frame's body is longer than [`MAX_FRAME_LEN`].
    #[error("a frame of {len} bytes is over the {MAX_FRAME_LEN}-byte limit")]
    Oversize {
        /// The body's length.
        len: u64,
    },
    /// An offer names more than [`MAX_REGIONS`] regions.
    #[error("an offer of {count} regions is over the {MAX_REGIONS}-region limit")]
    TooManyRegions {
        /// The number of regions.
        count: u64,
    },
    /// A label is longer than [`MAX_LABEL_LEN`].
    #[error("a label of {len} bytes is over the {MAX_LABEL_LEN}-byte limit")]
    LabelTooLong {
        /// The label's length.
        len: usize,
    },
    /// The offer is in a format version this build does not read.
    #[error("offer format version {got}; this build reads version {VERSION}")]
    Version {
        /// The version the peer wrote.
        got: u8,
    },
    /// The frame is not a well-formed offer.
    #[error("malformed offer: {what}")]
    Malformed {
        /// What is wrong with it.
        what: &'static str,
    },
    /// A descriptor in the offer does not decode.
    #[error("malformed offer: region {index}'s descriptor: {source}")]
    Descriptor {
        /// The region's position in the offer.
        index: usize,
        /// Why the descriptor was refused.
        #[source]
        source: DescriptorError,
    },
    /// The stream failed.
    #[error("offer stream: {0}")]
    Io(#[from] std::io::Error),
    /// The offer was read, but adding its sender as a peer failed.
    #[error("could not add the offering peer: {0}")]
    AddPeer(#[source] RdmaError),
}

/// One offered region: a descriptor and its label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OfferedRegion {
    label: Bytes,
    descriptor: Descriptor,
}

impl OfferedRegion {
    /// A region with a label (at most [`MAX_LABEL_LEN`] bytes, checked when
    /// the offer is encoded).
    pub fn new(label: impl Into<Bytes>, descriptor: Descriptor) -> Self {
        OfferedRegion {
            label: label.into(),
            descriptor,
        }
    }

    /// The label the owner gave it (empty if none).
    pub fn label(&self) -> &[u8] {
        &self.label
    }

    /// The label as text, if it is UTF-8.
    pub fn label_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.label).ok()
    }

    /// Where to read.
    pub fn descriptor(&self) -> &Descriptor {
        &self.descriptor
    }

    /// The descriptor, by value.
    pub fn into_descriptor(self) -> Descriptor {
        self.descriptor
    }
}

/// An unlabelled region.
impl From<Descriptor> for OfferedRegion {
    fn from(descriptor: Descriptor) -> Self {
        OfferedRegion::new(Bytes::new(), descriptor)
    }
}

/// A labelled region: `("block-0", descriptor)`.
impl<L: Into<Bytes>> From<(L, Descriptor)> for OfferedRegion {
    fn from((label, descriptor): (L, Descriptor)) -> Self {
        OfferedRegion::new(label, descriptor)
    }
}

/// A worker address and the regions offered with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    worker_address: Bytes,
    regions: Vec<OfferedRegion>,
}

impl Offer {
    /// An offer of `regions` by the side at `worker_address`.
    pub fn new<I>(worker_address: Bytes, regions: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<OfferedRegion>,
    {
        Offer {
            worker_address,
            regions: regions.into_iter().map(Into::into).collect(),
        }
    }

    /// The offering side's worker address.
    pub fn worker_address(&self) -> &Bytes {
        &self.worker_address
    }

    /// The regions, in the order they were offered.
    pub fn regions(&self) -> &[OfferedRegion] {
        &self.regions
    }

    /// The descriptor of the first region labelled `label`.
    pub fn descriptor(&self, label: impl AsRef<[u8]>) -> Option<&Descriptor> {
        let label = label.as_ref();
        self.regions
            .iter()
            .find(|region| region.label() == label)
            .map(OfferedRegion::descriptor)
    }

    /// The regions, by value.
    pub fn into_regions(self) -> Vec<OfferedRegion> {
        self.regions
    }

    /// Encodes the offer as one frame, length prefix included.
    ///
    /// # Errors
    /// [`OfferError::TooManyRegions`], [`OfferError::LabelTooLong`] or
    /// [`OfferError::Oversize`] past the limits a reader enforces;
    /// [`OfferError::Malformed`] for an empty worker address.
    pub fn encode(&self) -> Result<Bytes, OfferError> {
        if self.worker_address.is_empty() {
            return Err(OfferError::Malformed {
                what: "empty worker address",
            });
        }
        let count = self.regions.len();
        if count > MAX_REGIONS as usize {
            return Err(OfferError::TooManyRegions {
                count: count as u64,
            });
        }
        let mut len = 2 + 4 + self.worker_address.len() + 4;
        for region in &self.regions {
            if region.label.len() > MAX_LABEL_LEN {
                return Err(OfferError::LabelTooLong {
                    len: region.label.len(),
                });
            }
            len += 2 + region.label.len() + region.descriptor.encoded_len();
        }
        if len > MAX_FRAME_LEN as usize {
            return Err(OfferError::Oversize { len: len as u64 });
        }
        let mut frame = BytesMut::with_capacity(4 + len);
        // Each cast below is within the limits checked above.
        frame.put_u32_le(len as u32);
        frame.put_u8(OFFER_TAG);
        frame.put_u8(VERSION);
        frame.put_u32_le(self.worker_address.len() as u32);
        frame.put_slice(&self.worker_address);
        frame.put_u32_le(count as u32);
        for region in &self.regions {
            frame.put_u16_le(region.label.len() as u16);
            frame.put_slice(&region.label);
            region.descriptor.encode_into(&mut frame);
        }
        debug_assert_eq!(frame.len(), 4 + len);
        Ok(frame.freeze())
    }

    /// Decodes an offer from one frame's body (without its length prefix).
    ///
    /// # Errors
    /// [`OfferError::Version`] for another format version,
    /// [`OfferError::TooManyRegions`] over [`MAX_REGIONS`],
    /// [`OfferError::Descriptor`] for a descriptor that does not decode, and
    /// [`OfferError::Malformed`] for anything else that is not an offer.
    pub fn decode(body: &[u8]) -> Result<Offer, OfferError> {
        let malformed = |what| OfferError::Malformed { what };
        let mut body = body;
        if body.is_empty() {
            return Err(malformed("empty frame"));
        }
        if body.get_u8() != OFFER_TAG {
            return Err(malformed("the frame is not an offer"));
        }
        if body.is_empty() {
            return Err(malformed("no version"));
        }
        let version = body.get_u8();
        if version != VERSION {
            return Err(OfferError::Version { got: version });
        }
        if body.remaining() < 4 {
            return Err(malformed("ends before the worker address"));
        }
        let address_len = body.get_u32_le() as usize;
        if address_len == 0 {
            return Err(malformed("empty worker address"));
        }
        if address_len > body.remaining() {
            return Err(malformed("ends inside the worker address"));
        }
        let worker_address = Bytes::copy_from_slice(&body[..address_len]);
        body.advance(address_len);
        if body.remaining() < 4 {
            return Err(malformed("ends before the region count"));
        }
        let count = body.get_u32_le();
        if count > MAX_REGIONS {
            return Err(OfferError::TooManyRegions {
                count: u64::from(count),
            });
        }
        let count = count as usize;
        let mut regions = Vec::with_capacity(count.min(body.remaining() / MIN_REGION_LEN));
        for index in 0..count {
            if body.remaining() < 2 {
                return Err(malformed("ends before a region"));
            }
            let label_len = usize::from(body.get_u16_le());
            if label_len > MAX_LABEL_LEN {
                return Err(OfferError::LabelTooLong { len: label_len });
            }
            if label_len > body.remaining() {
                return Err(malformed("ends inside a label"));
            }
            let label = Bytes::copy_from_slice(&body[..label_len]);
            body.advance(label_len);
            let (descriptor, used) = Descriptor::decode_prefix(body)
                .map_err(|source| OfferError::Descriptor { index, source })?;
            body.advance(used);
            regions.push(OfferedRegion { label, descriptor });
        }
        if body.has_remaining() {
            return Err(malformed("bytes after the last region"));
        }
        Ok(Offer {
            worker_address,
            regions,
        })
    }

    /// Writes the offer as one frame and flushes.
    ///
    /// # Errors
    /// As [`encode`](Self::encode) (nothing is written then), or
    /// [`OfferError::Io`].
    ///
    /// # Cancel safety
    /// Dropping the future may leave part of the frame written; the stream
    /// is then no use for another offer.
    pub async fn write_to<W>(&self, stream: &mut W) -> Result<(), OfferError>
    where
        W: AsyncWrite + Unpin + ?Sized,
    {
        let frame = self.encode()?;
        stream.write_all(&frame).await?;
        stream.flush().await?;
        Ok(())
    }

    /// Reads one frame and decodes it as an offer.
    ///
    /// # Errors
    /// As [`read_frame`] and [`decode`](Self::decode).
    ///
    /// # Cancel safety
    /// Not cancel safe: dropping the future loses what it read so far.
    pub async fn read_from<R>(stream: &mut R) -> Result<Offer, OfferError>
    where
        R: AsyncRead + Unpin + ?Sized,
    {
        let body = read_frame(stream).await?;
        Offer::decode(&body)
    }
}

/// Writes `body` as one frame (its length, then the bytes) and flushes.
///
/// # Errors
/// [`OfferError::Oversize`] for a body over [`MAX_FRAME_LEN`] (nothing is
/// written then), or [`OfferError::Io`].
///
/// # Cancel safety
/// Dropping the future may leave part of the frame written.
pub async fn write_frame<W>(stream: &mut W, body: &[u8]) -> Result<(), OfferError>
where
    W: AsyncWrite + Unpin + ?Sized,
{
    let len = u32::try_from(body.len())
        .ok()
        .filter(|&len| len <= MAX_FRAME_LEN)
        .ok_or(OfferError::Oversize {
            len: body.len() as u64,
        })?;
    stream.write_all(&len.to_le_bytes()).await?;
    stream.write_all(body).await?;
    stream.flush().await?;
    Ok(())
}

/// Reads one frame and returns its body.
///
/// # Errors
/// [`OfferError::Closed`] if the stream ends before the frame begins,
/// [`OfferError::Truncated`] if it ends inside it,
/// [`OfferError::Oversize`] for a declared length over [`MAX_FRAME_LEN`]
/// (refused before the body is read), or [`OfferError::Io`].
///
/// # Cancel safety
/// Not cancel safe: dropping the future loses what it read so far.
pub async fn read_frame<R>(stream: &mut R) -> Result<Bytes, OfferError>
where
    R: AsyncRead + Unpin + ?Sized,
{
    let mut prefix = [0u8; 4];
    let mut read = 0;
    while read < prefix.len() {
        match stream.read(&mut prefix[read..]).await? {
            0 if read == 0 => return Err(OfferError::Closed),
            0 => return Err(OfferError::Truncated { read, expected: 4 }),
            n => read += n,
        }
    }
    let len = u32::from_le_bytes(prefix);
    if len > MAX_FRAME_LEN {
        return Err(OfferError::Oversize {
            len: u64::from(len),
        });
    }
    // `take` stops at the declared length and the buffer grows only with
    // what arrives.
    let mut body = Vec::new();
    stream.take(u64::from(len)).read_to_end(&mut body).await?;
    if body.len() < len as usize {
        return Err(OfferError::Truncated {
            read: 4 + body.len(),
            expected: 4 + len as usize,
        });
    }
    Ok(Bytes::from(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn descriptor(addr: u64) -> Descriptor {
        Descriptor::new("ucx", addr, 4096, 3, Bytes::from_static(&[7; 9])).unwrap()
    }

    fn offer() -> Offer {
        Offer::new(
            Bytes::from_static(b"worker-address"),
            [
                OfferedRegion::new("block-0", descriptor(0x1000)),
                OfferedRegion::from(descriptor(0x3000)),
                OfferedRegion::new(vec![0xff, 0x00], descriptor(0x5000)),
            ],
        )
    }

    #[test]
    fn an_encoded_offer_decodes_to_itself() {
        let frame = offer().encode().unwrap();
        let declared = u32::from_le_bytes(frame[..4].try_into().unwrap());
        assert_eq!(declared as usize, frame.len() - 4);
        assert_eq!(Offer::decode(&frame[4..]).unwrap(), offer());
    }

    #[test]
    fn every_truncation_of_an_offer_body_is_refused() {
        let frame = offer().encode().unwrap();
        let body = &frame[4..];
        for cut in 0..body.len() {
            assert!(
                matches!(
                    Offer::decode(&body[..cut]),
                    Err(OfferError::Malformed { .. } | OfferError::Descriptor { .. })
                ),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn a_label_is_found_by_its_bytes() {
        let offer = offer();
        assert_eq!(offer.descriptor("block-0"), Some(&descriptor(0x1000)));
        assert_eq!(offer.descriptor(""), Some(&descriptor(0x3000)));
        assert_eq!(offer.descriptor("block-1"), None);
        assert_eq!(offer.regions()[2].label_str(), None);
    }
}
