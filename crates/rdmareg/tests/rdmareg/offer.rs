//! Offers over byte streams: the round trip, every refusal a reader makes
//! of a frame it cannot trust (typed, never a panic, never an allocation
//! sized by the peer's length field alone), and `accept` between two real
//! engines over a TCP connection.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use rdmareg::offer::{MAX_FRAME_LEN, MAX_LABEL_LEN, MAX_REGIONS, read_frame, write_frame};
use rdmareg::registry::RdmaConfig;
use rdmareg::{
    Config, Descriptor, DescriptorError, Offer, OfferError, OfferedRegion, PeerId, Rdma, Transport,
};
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

fn descriptor(addr: u64) -> Descriptor {
    Descriptor::new("ucx", addr, 4096, 1, Bytes::from_static(&[9; 9])).unwrap()
}

fn sample() -> Offer {
    Offer::new(
        Bytes::from_static(b"an owner's worker address"),
        [
            OfferedRegion::new("weights/layer-0", descriptor(0x10_000)),
            OfferedRegion::new(0xdead_beef_u32.to_le_bytes().to_vec(), descriptor(0x20_000)),
            OfferedRegion::from(descriptor(0x30_000)),
        ],
    )
}

/// An offer body by hand: tag, version, address, count, then `regions`
/// already encoded.
fn body(version: u8, address: &[u8], count: u32, regions: &[u8]) -> Vec<u8> {
    let mut body = vec![0x01, version];
    body.extend_from_slice(&(address.len() as u32).to_le_bytes());
    body.extend_from_slice(address);
    body.extend_from_slice(&count.to_le_bytes());
    body.extend_from_slice(regions);
    body
}

/// One region as the offer encodes it.
fn region(label: &[u8], descriptor: &Descriptor) -> Vec<u8> {
    let mut out = (label.len() as u16).to_le_bytes().to_vec();
    out.extend_from_slice(label);
    out.extend_from_slice(&descriptor.encode());
    out
}

/// The writer sends an offer and then a frame of its own on the same
/// stream; the reader gets both back, labels and all.
#[tokio::test]
async fn an_offer_and_a_later_frame_survive_a_duplex_round_trip() {
    let (mut owner, mut consumer) = tokio::io::duplex(64);
    let sent = sample();
    let writer = tokio::spawn(async move {
        sent.write_to(&mut owner).await.unwrap();
        write_frame(&mut owner, b"done?").await.unwrap();
        owner
    });
    let received = Offer::read_from(&mut consumer).await.unwrap();
    assert_eq!(received, sample());
    assert_eq!(
        received.worker_address(),
        &Bytes::from_static(b"an owner's worker address")
    );
    assert_eq!(
        received.descriptor("weights/layer-0"),
        Some(&descriptor(0x10_000))
    );
    assert_eq!(
        received.regions()[1].label(),
        &0xdead_beef_u32.to_le_bytes()[..]
    );
    assert_eq!(received.regions()[2].label(), b"");
    assert_eq!(&read_frame(&mut consumer).await.unwrap()[..], b"done?");
    drop(writer.await.unwrap());
    assert!(matches!(
        read_frame(&mut consumer).await,
        Err(OfferError::Closed)
    ));
}

#[tokio::test]
async fn an_oversize_frame_is_refused_before_its_body_is_read() {
    let (mut peer, mut reader) = tokio::io::duplex(64);
    // The declared length only: a reader that waited for the body would
    // hang here, since the writer stays open.
    peer.write_all(&(MAX_FRAME_LEN + 1).to_le_bytes())
        .await
        .unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(5), Offer::read_from(&mut reader))
        .await
        .expect("refused without waiting for the body");
    assert!(
        matches!(refused, Err(OfferError::Oversize { len }) if len == u64::from(MAX_FRAME_LEN) + 1),
        "{refused:?}"
    );
    peer.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
    assert!(matches!(
        read_frame(&mut reader).await,
        Err(OfferError::Oversize { .. })
    ));
}

/// A reader that hands out a frame declaring the largest body allowed,
/// then a few bytes one at a time, then the end of the stream; it records
/// the largest buffer a read offered it.
struct Stingy {
    sent: usize,
    largest_read: usize,
}

impl AsyncRead for Stingy {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.largest_read = self.largest_read.max(buf.remaining());
        let prefix = MAX_FRAME_LEN.to_le_bytes();
        if self.sent < 4 {
            buf.put_slice(&prefix[self.sent..self.sent + 1]);
        } else if self.sent < 4 + 100 {
            buf.put_slice(&[0]);
        } else {
            return Poll::Ready(Ok(()));
        }
        self.sent += 1;
        Poll::Ready(Ok(()))
    }
}

#[tokio::test]
async fn a_declared_length_alone_does_not_make_the_reader_allocate() {
    let mut stingy = Stingy {
        sent: 0,
        largest_read: 0,
    };
    let refused = read_frame(&mut stingy).await;
    assert!(
        matches!(
            refused,
            Err(OfferError::Truncated { read: 104, expected }) if expected == 4 + MAX_FRAME_LEN as usize
        ),
        "{refused:?}"
    );
    // 100 bytes arrived of 16 MiB declared: the buffer grew with them.
    assert!(
        stingy.largest_read < 64 << 10,
        "a read was offered {} bytes",
        stingy.largest_read
    );
}

#[tokio::test]
async fn a_stream_cut_inside_a_frame_is_truncated() {
    let frame = sample().encode().unwrap();
    for cut in [1, 3, 4, 5, frame.len() / 2, frame.len() - 1] {
        let (mut peer, mut reader) = tokio::io::duplex(frame.len());
        peer.write_all(&frame[..cut]).await.unwrap();
        drop(peer);
        let refused = Offer::read_from(&mut reader).await;
        let expected = if cut < 4 { 4 } else { frame.len() };
        assert!(
            matches!(refused, Err(OfferError::Truncated { read, expected: e }) if read == cut && e == expected),
            "cut at {cut}: {refused:?}"
        );
    }
}

#[tokio::test]
async fn a_stream_closed_before_any_frame_is_closed() {
    let (peer, mut reader) = tokio::io::duplex(64);
    drop(peer);
    assert!(matches!(
        Offer::read_from(&mut reader).await,
        Err(OfferError::Closed)
    ));
}

/// Over a real connection: the peer writes half an offer and closes its
/// socket; the reader reports the cut instead of waiting.
#[tokio::test]
async fn a_peer_that_closes_mid_frame_is_reported_truncated() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let frame = sample().encode().unwrap();
    let half = frame.slice(..frame.len() / 2);
    let peer = tokio::spawn(async move {
        let mut stream = TcpStream::connect(address).await.unwrap();
        stream.write_all(&half).await.unwrap();
        stream.shutdown().await.unwrap();
    });
    let (mut stream, _) = listener.accept().await.unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(10), Offer::read_from(&mut stream))
        .await
        .expect("answers once the peer closed");
    assert!(
        matches!(refused, Err(OfferError::Truncated { read, expected }) if read == frame.len() / 2 && expected == frame.len()),
        "{refused:?}"
    );
    peer.await.unwrap();
}

/// Whether a refusal is the one a case expects.
type Expect = fn(&OfferError) -> bool;

#[test]
fn malformed_offers_are_refused_with_typed_errors() {
    let good = region(b"a", &descriptor(0x1000));
    let mut bad_descriptor = region(b"a", &descriptor(0x1000));
    bad_descriptor[3] = b'X'; // the descriptor's magic
    let mut long_label = ((MAX_LABEL_LEN + 1) as u16).to_le_bytes().to_vec();
    long_label.extend(vec![b'x'; MAX_LABEL_LEN + 1]);
    let mut trailing = body(1, b"addr", 1, &good);
    trailing.push(0);
    let mut not_an_offer = body(1, b"addr", 1, &good);
    not_an_offer[0] = 0x02;

    let cases: Vec<(&str, Vec<u8>, Expect)> = vec![
        ("empty frame", vec![], |e| {
            matches!(e, OfferError::Malformed { .. })
        }),
        ("another message", not_an_offer, |e| {
            matches!(e, OfferError::Malformed { .. })
        }),
        ("version 2", body(2, b"addr", 1, &good), |e| {
            matches!(e, OfferError::Version { got: 2 })
        }),
        ("version 0", body(0, b"addr", 0, &[]), |e| {
            matches!(e, OfferError::Version { got: 0 })
        }),
        ("empty address", body(1, b"", 0, &[]), |e| {
            matches!(e, OfferError::Malformed { .. })
        }),
        (
            "address longer than the frame",
            {
                let mut b = body(1, b"addr", 0, &[]);
                b[2..6].copy_from_slice(&u32::MAX.to_le_bytes());
                b
            },
            |e| matches!(e, OfferError::Malformed { .. }),
        ),
        (
            "too many regions",
            body(1, b"addr", MAX_REGIONS + 1, &[]),
            |e| matches!(e, OfferError::TooManyRegions { count } if *count == u64::from(MAX_REGIONS) + 1),
        ),
        (
            "count larger than the regions sent",
            body(1, b"addr", 3, &good),
            |e| matches!(e, OfferError::Malformed { .. }),
        ),
        (
            "a bad descriptor",
            body(1, b"addr", 2, &[good.clone(), bad_descriptor].concat()),
            |e| {
                matches!(
                    e,
                    OfferError::Descriptor {
                        index: 1,
                        source: DescriptorError::BadMagic
                    }
                )
            },
        ),
        (
            "a label over the limit",
            body(1, b"addr", 1, &long_label),
            |e| matches!(e, OfferError::LabelTooLong { len } if *len == MAX_LABEL_LEN + 1),
        ),
        ("trailing bytes", trailing, |e| {
            matches!(e, OfferError::Malformed { .. })
        }),
    ];
    for (what, bytes, expected) in cases {
        match Offer::decode(&bytes) {
            Err(e) if expected(&e) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
    assert!(Offer::decode(&body(1, b"addr", 1, &good)).is_ok());
}

#[tokio::test]
async fn an_offer_a_reader_would_refuse_is_not_written() {
    let address = Bytes::from_static(b"addr");
    let too_many = Offer::new(
        address.clone(),
        std::iter::repeat_n(descriptor(0x1000), MAX_REGIONS as usize + 1),
    );
    let long_label = Offer::new(
        address.clone(),
        [(vec![b'x'; MAX_LABEL_LEN + 1], descriptor(0x1000))],
    );
    // 65,536 regions with the longest labels: about 70 MiB.
    let oversize = Offer::new(
        address.clone(),
        std::iter::repeat_n(
            (Bytes::from(vec![b'x'; MAX_LABEL_LEN]), descriptor(0x1000)),
            MAX_REGIONS as usize,
        ),
    );
    let nowhere = Offer::new(Bytes::new(), [descriptor(0x1000)]);
    let mut sink = Vec::new();
    assert!(matches!(
        too_many.write_to(&mut sink).await,
        Err(OfferError::TooManyRegions { .. })
    ));
    assert!(matches!(
        long_label.write_to(&mut sink).await,
        Err(OfferError::LabelTooLong { .. })
    ));
    assert!(matches!(
        oversize.write_to(&mut sink).await,
        Err(OfferError::Oversize { .. })
    ));
    assert!(matches!(
        nowhere.write_to(&mut sink).await,
        Err(OfferError::Malformed { .. })
    ));
    assert!(matches!(
        write_frame(&mut sink, &vec![0; MAX_FRAME_LEN as usize + 1]).await,
        Err(OfferError::Oversize { .. })
    ));
    assert!(sink.is_empty(), "{} bytes written", sink.len());
    // The largest offer a reader takes is written and read back.
    let largest = Offer::new(
        address,
        std::iter::repeat_n(descriptor(0x1000), MAX_REGIONS as usize),
    );
    largest.write_to(&mut sink).await.unwrap();
    assert_eq!(Offer::read_from(&mut &sink[..]).await.unwrap(), largest);
}

fn config(transport: Transport) -> Config {
    Config::new()
        .with_transport(transport)
        .with_net_devices("lo")
        .with_registry(
            RdmaConfig::default()
                .with_budget_bytes(64 << 20)
                .with_shutdown_budget(Duration::from_secs(5)),
        )
}

/// Owner and consumer engines joined by a TCP connection on loopback.
async fn connected(transport: Transport) -> (Rdma, TcpStream, Rdma, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let consumer_side = TcpStream::connect(listener.local_addr().unwrap());
    let (owner_side, consumer_side) = tokio::join!(listener.accept(), consumer_side);
    let owner = Rdma::start(config(transport.clone())).expect("owner starts");
    let consumer = Rdma::start(config(transport)).expect("consumer starts");
    (
        owner,
        owner_side.unwrap().0,
        consumer,
        consumer_side.unwrap(),
    )
}

/// The owner offers two labelled regions over TCP; `accept` adds it as a
/// peer, and each descriptor it returned reads the owner's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_adds_the_peer_and_its_descriptors_read_over_tcp() {
    let (owner, mut owner_stream, consumer, mut consumer_stream) = connected(Transport::Tcp).await;
    let first = owner
        .register_owned(vec![0x11; 8192].into_boxed_slice())
        .await
        .unwrap();
    let second = owner
        .register_owned(b"second block".to_vec().into_boxed_slice())
        .await
        .unwrap();
    owner
        .offer(
            &mut owner_stream,
            [
                ("first", first.descriptor().unwrap()),
                ("second", second.descriptor().unwrap()),
            ],
        )
        .await
        .unwrap();

    let peer = PeerId(7);
    let offered = consumer.accept(&mut consumer_stream, peer).await.unwrap();
    assert_eq!(offered.regions().len(), 2);
    for (label, expected) in [("first", &[0x11; 8192][..]), ("second", b"second block")] {
        let descriptor = offered.descriptor(label).expect("offered");
        let mut buffer = consumer.alloc_pinned(expected.len()).await.unwrap();
        consumer.get(peer, descriptor, &mut buffer).await.unwrap();
        assert_eq!(&buffer[..], expected, "{label}");
    }
    // An offer whose address the engine refuses is read in full, then
    // refused as a peer; the stream stays usable.
    Offer::new(
        Bytes::from_static(b"not a worker address"),
        [first.descriptor().unwrap()],
    )
    .write_to(&mut owner_stream)
    .await
    .unwrap();
    let refused = consumer.accept(&mut consumer_stream, PeerId(8)).await;
    assert!(
        matches!(
            refused,
            Err(OfferError::AddPeer(
                rdmareg::RdmaError::InvalidWorkerAddress(_)
            ))
        ),
        "{refused:?}"
    );

    write_frame(&mut consumer_stream, b"done").await.unwrap();
    assert_eq!(&read_frame(&mut owner_stream).await.unwrap()[..], b"done");
    for region in [first, second] {
        region
            .unregister_owned(Duration::from_secs(5))
            .await
            .unwrap();
    }
    for side in [consumer, owner] {
        let summary = side.shutdown().await;
        assert!(summary.is_clean(), "{summary}");
    }
}

/// On one host, `accept` lets the consumer copy reads itself and
/// `accept_served_only` sends every read through the owner's engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_served_only_sends_every_read_through_the_owner() {
    for served_only in [false, true] {
        let (owner, mut owner_stream, consumer, mut consumer_stream) =
            connected(Transport::SameHost).await;
        let region = owner
            .register_owned(vec![0x5A; 4096].into_boxed_slice())
            .await
            .unwrap();
        owner
            .offer(&mut owner_stream, [region.descriptor().unwrap()])
            .await
            .unwrap();
        let peer = PeerId(1);
        let offered = if served_only {
            consumer
                .accept_served_only(&mut consumer_stream, peer)
                .await
        } else {
            consumer.accept(&mut consumer_stream, peer).await
        }
        .unwrap();
        let descriptor = offered.regions()[0].descriptor();
        let mut buffer = consumer.alloc_pinned(4096).await.unwrap();
        for _ in 0..8 {
            consumer.get(peer, descriptor, &mut buffer).await.unwrap();
            assert!(buffer.iter().all(|&b| b == 0x5A));
        }
        let copied = consumer.engine().reads_copied_on_caller_threads();
        if served_only {
            assert_eq!(copied, 0, "a served-only peer's read was copied");
        } else {
            assert!(copied > 0, "the direct lane was not used");
        }
        drop(buffer);
        region
            .unregister_owned(Duration::from_secs(5))
            .await
            .unwrap();
        for side in [consumer, owner] {
            assert!(side.shutdown().await.is_clean());
        }
    }
}
