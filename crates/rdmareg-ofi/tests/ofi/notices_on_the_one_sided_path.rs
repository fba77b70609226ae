//! Notices on the one-sided read path (`fi_read`): the endpoint is opened
//! with tagged messages too, so a reader's notice reaches the owner there
//! as on the owner-served path.

use crate::common;

use std::time::Duration;

use futures::StreamExt;
use rdmareg_backend::RdmaBackend;
use rdmareg_ofi::{Provider, ReadPath};

async fn a_notice_arrives(provider: Provider) {
    let (owner, consumer) = common::engines_on(provider, ReadPath::OneSided);
    let (o, c) = (owner.backend(), consumer.backend());
    let mut notices = o.notices().expect("notices on the one-sided path");
    c.send_notice(common::OWNER, bytes::Bytes::from_static(b"read"))
        .await
        .expect("the notice is sent");
    let notice = tokio::time::timeout(Duration::from_secs(10), notices.next())
        .await
        .expect("the notice arrives")
        .expect("the stream is open");
    assert_eq!(&notice.bytes[..], b"read");
    assert_eq!(Some(notice.from), c.notice_sender());
    consumer.shutdown().await;
    owner.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tcp_a_notice_arrives() {
    a_notice_arrives(Provider::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_shm_a_notice_arrives() {
    a_notice_arrives(Provider::Shm).await;
}
