//! This process's sockets, read from `/proc`: for tests that find the tcp
//! ports an engine listens on.

use std::collections::{BTreeSet, HashSet};
use std::fs;

/// The inodes of this process's sockets.
pub fn own_socket_inodes() -> HashSet<u64> {
    fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|entry| fs::read_link(entry.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            target
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect()
}

/// The IPv4 tcp ports this process listens on (`/proc/net/tcp`, state
/// `0A`), in order.
pub fn own_listening_ports() -> BTreeSet<u16> {
    let inodes = own_socket_inodes();
    fs::read_to_string("/proc/net/tcp")
        .expect("/proc/net/tcp")
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (local, state, inode) = (fields.get(1)?, fields.get(3)?, fields.get(9)?);
            let port = u16::from_str_radix(local.rsplit(':').next()?, 16).ok()?;
            (*state == "0A" && inodes.contains(&inode.parse().ok()?)).then_some(port)
        })
        .collect()
}
