//! A block service on rdmareg: an owner registers named blocks and serves
//! their descriptors over a small TCP control channel; a consumer asks for
//! blocks by name, GETs each into a pinned buffer and checks every byte.
//!
//! ```text
//! block-service owner --listen 127.0.0.1:0      # prints `listening on ADDR`
//! block-service consumer --connect ADDR         # fetches and verifies
//! block-service                                 # both: the owner as a child process
//! ```
//!
//! The control channel carries length-prefixed frames (u32 big-endian
//! length, then bytes). On connect the owner sends its UCX worker address;
//! then each request frame is `get <name>` (answered with the block's
//! encoded descriptor, or an empty frame for an unknown name) or `bye`
//! (the owner shuts down in order and exits).

use std::collections::HashMap;
use std::error::Error;
use std::process::Stdio;
use std::time::Duration;

use rdmareg::{
    Descriptor, PeerId, RdmaConfig, RdmaRegistry, RegionGuard, Transport, UcxConfig, UcxEngine,
};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;

type Result<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;

/// The blocks the owner serves: name and size.
const BLOCKS: &[(&str, usize)] = &[
    ("weights/layer-0", 1 << 20),
    ("weights/layer-1", 1 << 20),
    ("kv/session-7", 256 << 10),
    ("tiny", 13),
];

/// Largest control frame accepted (a descriptor or worker address is far
/// smaller).
const MAX_FRAME: usize = 64 << 10;

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

fn ucx_config() -> UcxConfig {
    UcxConfig::default()
        .with_transport(Transport::Tcp)
        .with_net_devices("lo")
}

async fn write_frame(stream: &mut (impl AsyncWrite + Unpin), bytes: &[u8]) -> Result<()> {
    let len = u32::try_from(bytes.len())?;
    stream.write_all(&len.to_be_bytes()).await?;
    stream.write_all(bytes).await?;
    stream.flush().await?;
    Ok(())
}

async fn read_frame(stream: &mut (impl AsyncRead + Unpin)) -> Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(
            format!("control frame of {len} bytes is over the {MAX_FRAME}-byte limit").into(),
        );
    }
    let mut frame = vec![0u8; len];
    stream.read_exact(&mut frame).await?;
    Ok(frame)
}

/// Registers every block, answers one consumer's requests, then shuts down.
async fn owner(listen: &str) -> Result<()> {
    let engine = UcxEngine::start(ucx_config())?;
    let registry = RdmaRegistry::new(engine.backend(), RdmaConfig::default(), Handle::current())?;
    let mut regions: HashMap<&str, RegionGuard> = HashMap::new();
    for &(name, len) in BLOCKS {
        let block = block_content(name, len).into_boxed_slice();
        let region = registry.register_owned(block).await.map_err(|e| e.error)?;
        regions.insert(name, region);
    }

    let listener = TcpListener::bind(listen).await?;
    println!("listening on {}", listener.local_addr()?);
    let (mut stream, _) = listener.accept().await?;
    write_frame(&mut stream, &engine.worker_address()).await?;
    let mut served = 0usize;
    loop {
        let request = read_frame(&mut stream).await?;
        let request = String::from_utf8_lossy(&request);
        if request == "bye" {
            break;
        }
        let Some(name) = request.strip_prefix("get ") else {
            return Err(format!("unknown request {request:?}").into());
        };
        match regions.get(name) {
            Some(region) => {
                write_frame(&mut stream, &region.descriptor()?.encode()).await?;
                served += 1;
            }
            None => write_frame(&mut stream, &[]).await?,
        }
    }

    for (_, region) in regions.drain() {
        region
            .unregister_owned(TEARDOWN)
            .await
            .map_err(|e| e.error)?;
    }
    let swept = registry.shutdown(TEARDOWN).await;
    engine.shutdown().await;
    swept.finish_after_backend_teardown();
    let left = engine.live_registrations();
    println!("owner: served {served} descriptors; registrations left: {left:?}");
    if left != Some(0) {
        return Err("the owner's engine still holds registrations".into());
    }
    Ok(())
}

/// Fetches every block (and one unknown name) from the owner at `connect`
/// and checks the bytes.
async fn consumer(connect: &str) -> Result<()> {
    let mut stream = TcpStream::connect(connect).await?;
    let address = read_frame(&mut stream).await?;

    let engine = UcxEngine::start(ucx_config())?;
    let registry = RdmaRegistry::new(engine.backend(), RdmaConfig::default(), Handle::current())?;
    let owner_peer = PeerId(1);
    engine.add_peer(owner_peer, address.into())?;

    let mut fetched = 0usize;
    for &(name, len) in BLOCKS {
        write_frame(&mut stream, format!("get {name}").as_bytes()).await?;
        let wire = read_frame(&mut stream).await?;
        let descriptor = Descriptor::decode(&wire)?;
        if descriptor.len() as usize != len {
            return Err(format!(
                "{name}: described {} bytes, expected {len}",
                descriptor.len()
            )
            .into());
        }
        let mut buffer = registry.alloc_pinned(len).await?;
        registry.get(owner_peer, &descriptor, &mut buffer).await?;
        if buffer[..] != block_content(name, len)[..] {
            return Err(format!("{name}: the fetched bytes differ from the block").into());
        }
        println!("consumer: {name}: {len} bytes verified");
        fetched += len;
    }
    write_frame(&mut stream, b"get no/such/block").await?;
    if !read_frame(&mut stream).await?.is_empty() {
        return Err("the owner described a block it does not have".into());
    }
    write_frame(&mut stream, b"bye").await?;

    let swept = registry.shutdown(TEARDOWN).await;
    engine.shutdown().await;
    swept.finish_after_backend_teardown();
    println!(
        "consumer: {} blocks, {fetched} bytes fetched and verified",
        BLOCKS.len()
    );
    Ok(())
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
