//! Two processes: an owner registers a buffer and offers it over TCP; a
//! consumer accepts the offer, reads the buffer with a GET and says it is
//! done; the owner unregisters. `docs/guide-two-processes.md` walks through
//! this file, and `tests/two_processes.rs` runs it.
//!
//! ```text
//! cargo run -p rdmareg --example two_processes                       # both, the owner as a child process
//! cargo run -p rdmareg --example two_processes -- owner 0.0.0.0:7471
//! cargo run -p rdmareg --example two_processes -- consumer owner-host:7471
//! ```

use std::error::Error;
use std::process::Stdio;
use std::time::Duration;

use rdmareg::offer::{read_frame, write_frame};
use rdmareg::{Config, PeerId, Rdma, Transport};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

type Result<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;

// GUIDE BEGIN config
/// UCX over TCP on the loopback interface; across hosts, leave out
/// `with_net_devices` (or name the interface that reaches the peer).
pub fn config() -> Config {
    Config::new()
        .with_transport(Transport::Tcp)
        .with_net_devices("lo")
}
// GUIDE END

// GUIDE BEGIN owner
/// Registers a buffer, offers it to the first consumer that connects,
/// and unregisters it once the consumer says it is done.
pub async fn owner(listener: TcpListener) -> Result<()> {
    let rdma = Rdma::start(config())?;
    // Shut down on every path, errors included: an `Rdma` dropped on an
    // early return leaks the memory it still has registered.
    let served = serve_greeting(&rdma, listener).await;
    let summary = rdma.shutdown().await;
    println!("owner: {summary}");
    served
}

async fn serve_greeting(rdma: &Rdma, listener: TcpListener) -> Result<()> {
    let greeting = b"hello from the owner".to_vec().into_boxed_slice();
    let region = rdma.register_owned(greeting).await?;

    let (mut stream, _) = listener.accept().await?;
    rdma.offer(&mut stream, [("greeting", region.descriptor()?)])
        .await?;

    // The consumer's word that its reads are over (or the stream's end,
    // if it went away): only then is unregistering not pulling the
    // memory from under a read.
    let _ = read_frame(&mut stream).await;
    let (greeting, _) = region.unregister_owned(Duration::from_secs(5)).await?;
    println!("owner: got back {} bytes", greeting.len());
    Ok(())
}
// GUIDE END

// GUIDE BEGIN consumer
/// Connects to the owner, accepts its offer, reads the greeting and
/// says it is done.
pub async fn consumer(owner_addr: &str) -> Result<Vec<u8>> {
    let rdma = Rdma::start(config())?;
    let read = read_greeting(&rdma, owner_addr).await;
    let summary = rdma.shutdown().await;
    println!("consumer: {summary}");
    read
}

async fn read_greeting(rdma: &Rdma, owner_addr: &str) -> Result<Vec<u8>> {
    let mut stream = TcpStream::connect(owner_addr).await?;

    let owner = PeerId(1);
    let offer = rdma.accept(&mut stream, owner).await?;
    let descriptor = offer.descriptor("greeting").ok_or("no greeting offered")?;

    let mut buffer = rdma.alloc_pinned(descriptor.len() as usize).await?;
    rdma.get(owner, descriptor, &mut buffer).await?;
    let greeting = buffer.to_vec();
    println!("consumer: {}", String::from_utf8_lossy(&greeting));
    drop(buffer);

    write_frame(&mut stream, b"done").await?;
    Ok(greeting)
}
// GUIDE END

/// Runs the owner as a child process of this binary and the consumer here.
async fn both() -> Result<()> {
    let mut child = tokio::process::Command::new(std::env::current_exe()?)
        .args(["owner", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
    let first = lines.next_line().await?.ok_or("the owner exited")?;
    let addr = first
        .strip_prefix("owner: listening on ")
        .ok_or(first.clone())?;
    let greeting = consumer(addr).await?;
    while let Some(line) = lines.next_line().await? {
        println!("{line}");
    }
    if !child.wait().await?.success() || greeting != b"hello from the owner" {
        return Err("the two processes did not complete the exchange".into());
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        [] => both().await,
        ["owner", listen] => {
            let listener = TcpListener::bind(listen).await?;
            println!("owner: listening on {}", listener.local_addr()?);
            owner(listener).await
        }
        ["consumer", connect] => consumer(connect).await.map(drop),
        _ => Err("usage: two_processes [owner LISTEN_ADDR | consumer OWNER_ADDR]".into()),
    }
}
