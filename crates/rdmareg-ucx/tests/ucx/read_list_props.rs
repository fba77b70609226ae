//! Properties of the gathered-read formats (`read_list`): they come from
//! peers, so decoding must never panic, must accept only what re-encodes to
//! the same bytes, and must give back every list it encoded.

use proptest::prelude::*;
use rdmareg_ucx::read_list::{
    ListReply, ListReplyEntry, ListRequest, MAX_LIST_ENTRIES, REPLY_ENTRY_LEN, REQUEST_ENTRY_LEN,
};
use rdmareg_ucx::read_protocol::{ReadRequest, Refusal, ReplyStatus, ServedKey};

fn read_request() -> impl Strategy<Value = ReadRequest> {
    (
        any::<u64>(),
        any::<u64>(),
        any::<[u8; 16]>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(
            |(request_id, region_id, capability, address, length)| ReadRequest {
                request_id,
                key: ServedKey {
                    region_id,
                    capability,
                },
                address,
                length,
            },
        )
}

fn reply_entry() -> impl Strategy<Value = ListReplyEntry> {
    let status = prop_oneof![
        Just(ReplyStatus::Served),
        Just(ReplyStatus::Refused(Refusal::RegionUnknown)),
        Just(ReplyStatus::Refused(Refusal::CapabilityMismatch)),
        Just(ReplyStatus::Refused(Refusal::OutOfRange)),
        Just(ReplyStatus::Refused(Refusal::Deregistering)),
        Just(ReplyStatus::Refused(Refusal::Malformed)),
        Just(ReplyStatus::Refused(Refusal::Busy)),
        Just(ReplyStatus::Refused(Refusal::LeaseExpired)),
        // Codes a later release may assign: they decode typed and re-encode
        // unchanged.
        (10u8..=255).prop_map(|code| ReplyStatus::Refused(Refusal::Unrecognized(code))),
    ];
    (any::<u64>(), status, any::<u64>()).prop_map(|(request_id, status, length)| ListReplyEntry {
        request_id,
        status,
        length: if status == ReplyStatus::Served {
            length
        } else {
            0
        },
    })
}

proptest! {
    #[test]
    fn every_list_request_decodes_to_what_was_encoded(
        entries in prop::collection::vec(read_request(), 1..=MAX_LIST_ENTRIES)
    ) {
        let request = ListRequest { entries };
        let bytes = request.encode().expect("a list inside the bounds encodes");
        prop_assert_eq!(bytes.len(), 8 + request.entries.len() * REQUEST_ENTRY_LEN);
        prop_assert_eq!(ListRequest::decode(&bytes), Ok(request));
    }

    #[test]
    fn every_list_reply_decodes_to_what_was_encoded(
        entries in prop::collection::vec(reply_entry(), 1..=MAX_LIST_ENTRIES)
    ) {
        let reply = ListReply { entries };
        let bytes = reply.encode().expect("a list inside the bounds encodes");
        prop_assert_eq!(bytes.len(), 8 + reply.entries.len() * REPLY_ENTRY_LEN);
        prop_assert_eq!(ListReply::decode(&bytes), Ok(reply));
    }

    #[test]
    fn arbitrary_bytes_decode_only_to_what_re_encodes_to_them(
        bytes in prop::collection::vec(any::<u8>(), 0..4096)
    ) {
        if let Ok(request) = ListRequest::decode(&bytes) {
            prop_assert_eq!(request.encode(), Some(bytes.clone()));
        }
        if let Ok(reply) = ListReply::decode(&bytes) {
            prop_assert_eq!(reply.encode(), Some(bytes.clone()));
        }
    }

    #[test]
    fn one_flipped_byte_of_a_list_request_never_decodes_to_another_list_silently(
        entries in prop::collection::vec(read_request(), 1..8),
        at in any::<prop::sample::Index>(),
        flip in 1u8..=255,
    ) {
        let request = ListRequest { entries };
        let mut bytes = request.encode().unwrap();
        let at = at.index(bytes.len());
        bytes[at] ^= flip;
        match ListRequest::decode(&bytes) {
            // Entry bytes are free-form: a flip there is another request,
            // which must re-encode to the flipped bytes.
            Ok(other) => {
                prop_assert!(at >= 8, "a flip in the fixed part was accepted");
                prop_assert_eq!(other.encode(), Some(bytes));
            }
            Err(_) => prop_assert!(at < 8, "a flip inside an entry was refused"),
        }
    }
}
