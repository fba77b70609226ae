//! A block service on rdmareg: an owner registers named blocks and offers
//! their descriptors, labelled by name, to a consumer; the consumer accepts
//! the offer, GETs each block into a pinned buffer and checks every byte.
//!
//! ```text
//! block-service owner --listen 127.0.0.1:0      # prints `listening on ADDR`
//! block-service consumer --connect ADDR         # fetches and verifies
//! block-service                                 # both: the owner as a child process
//! ```
//!
//! The control channel is one TCP connection: the owner's offer
//! (`Rdma::offer`, read by `Rdma::accept`), then one `done` frame from the
//! consumer once its reads are over, after which the owner unregisters its
//! blocks and shuts down in order.

use std::error::Error;
use std::process::Stdio;
use std::time::Duration;

use rdmareg::offer::{read_frame, write_frame};
use rdmareg::{Config, PeerId, Rdma, Transport};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

type Result<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;

/// The blocks the owner serves: name and size.
const BLOCKS: &[(&str, usize)] = &[
    ("weights/layer-0", 1 << 20),
    ("weights/layer-1", 1 << 20),
    ("kv/session-7", 256 << 10),
    ("tiny", 13),
];

const TEARDOWN: Duration = Duration::from_secs(5);

/// The content of block `name`: bytes from a small generator seeded by the
/// name, so the consumer can check what it fetched without a copy.
fn block_content(name: &str, len: usize) -> Vec<u8> {
    let mut state = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

fn config() -> Config {
    Config::new()
        .with_transport(Transport::Tcp)
        .with_net_devices("lo")
}

/// Registers every block, offers them to one consumer, and once it is done
/// unregisters them and shuts down.
async fn owner(listen: &str) -> Result<()> {
    let rdma = Rdma::start(config())?;
    // Shut down on every path: an `Rdma` dropped on an early return leaks
    // the memory it still has registered.
    let served = serve_blocks(&rdma, listen).await;
    let summary = rdma.shutdown().await;
    println!("owner: offered {} blocks; {summary}", BLOCKS.len());
    served?;
    if !summary.is_clean() {
        return Err("the owner did not shut down clean".into());
    }
    Ok(())
}

async fn serve_blocks(rdma: &Rdma, listen: &str) -> Result<()> {
    let mut regions = Vec::new();
    for &(name, len) in BLOCKS {
        let block = block_content(name, len).into_boxed_slice();
        regions.push((name, rdma.register_owned(block).await?));
    }

    let listener = TcpListener::bind(listen).await?;
    println!("listening on {}", listener.local_addr()?);
    let (mut stream, _) = listener.accept().await?;
    let mut offered = Vec::new();
    for (name, region) in &regions {
        offered.push((*name, region.descriptor()?));
    }
    rdma.offer(&mut stream, offered).await?;
    // Until the consumer's `done` or the connection's end, it may be reading.
    let _ = read_frame(&mut stream).await;

    for (_, region) in regions {
        region.unregister_owned(TEARDOWN).await?;
    }
    Ok(())
}

/// Fetches every block from the owner at `connect` and checks the bytes.
async fn consumer(connect: &str) -> Result<()> {
    let rdma = Rdma::start(config())?;
    let fetched = fetch_blocks(&rdma, connect).await;
    let summary = rdma.shutdown().await;
    let fetched = fetched?;
    let blocks = BLOCKS.len();
    println!("consumer: {blocks} blocks, {fetched} bytes fetched and verified; {summary}");
    Ok(())
}

/// The bytes fetched and verified.
async fn fetch_blocks(rdma: &Rdma, connect: &str) -> Result<usize> {
    let mut stream = TcpStream::connect(connect).await?;
    let owner = PeerId(1);
    let offer = rdma.accept(&mut stream, owner).await?;

    let mut fetched = 0usize;
    for &(name, len) in BLOCKS {
        let descriptor = offer
            .descriptor(name)
            .ok_or(format!("{name}: not offered"))?;
        if descriptor.len() as usize != len {
            let described = descriptor.len();
            return Err(format!("{name}: described {described} bytes, expected {len}").into());
        }
        let mut buffer = rdma.alloc_pinned(len).await?;
        rdma.get(owner, descriptor, &mut buffer).await?;
        if buffer[..] != block_content(name, len)[..] {
            return Err(format!("{name}: the fetched bytes differ from the block").into());
        }
        println!("consumer: {name}: {len} bytes verified");
        fetched += len;
    }
    if offer.descriptor("no/such/block").is_some() {
        return Err("the owner described a block it does not have".into());
    }
    write_frame(&mut stream, b"done").await?;
    Ok(fetched)
}

/// Runs the owner as a child process of this binary and the consumer here.
async fn both() -> Result<()> {
    let exe = std::env::current_exe()?;
    let mut child = tokio::process::Command::new(exe)
        .args(["owner", "--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let stdout = child.stdout.take().ok_or("the owner has no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .map_err(|_| "the owner did not start listening within 30 s")??
        .ok_or("the owner exited before listening")?;
    let address = first
        .strip_prefix("listening on ")
        .ok_or_else(|| format!("unexpected first line from the owner: {first:?}"))?
        .to_string();
    let echo = tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            println!("{line}");
        }
    });
    consumer(&address).await?;
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .map_err(|_| "the owner did not exit within 30 s")??;
    let _ = echo.await;
    if !status.success() {
        return Err(format!("the owner failed ({status})").into());
    }
    println!("block-service: ok");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        [] => both().await,
        ["owner", "--listen", address] => owner(address).await,
        ["consumer", "--connect", address] => consumer(address).await,
        _ => Err("usage: block-service [owner --listen ADDR | consumer --connect ADDR]".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blocks_content_depends_on_its_name_and_is_repeatable() {
        let a = block_content("weights/layer-0", 4096);
        assert_eq!(a, block_content("weights/layer-0", 4096));
        assert_ne!(a, block_content("weights/layer-1", 4096));
        assert_eq!(a.len(), 4096);
    }
}
