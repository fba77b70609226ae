//! On one host the boundary is the user, not the group: no engine creates
//! a shared-memory segment that another user can open.
//!
//! UCX creates System V segments with mode `0660`, and each element of an
//! mm receive FIFO holds a raw pointer (`desc_data`) that the receiving
//! worker follows. A member of the owner's group who could attach the
//! owner's FIFO could write an element pointing anywhere, wake the owner
//! through the signal socket named in the FIFO's header, and crash it (or
//! have it handle bytes of the attacker's choosing as a message).
//!
//! - [`a_group_member_gets_no_segment_of_the_owner`]: an owner runs as one
//!   uid and an attacker as another uid of the same group (both dropped to
//!   from root, as `setpriv --reuid --regid --clear-groups` would). The
//!   attacker attaches every System V segment whose creator is the owner
//!   and writes forged FIFO elements into any it gets, and opens every
//!   file of the owner's in `/dev/shm` and under `/proc/<owner>/fd`. It
//!   must get nothing, and the owner must serve the next read. Needs root
//!   (to run as two other users); says so and passes without it.
//! - [`every_segment_an_engine_creates_is_private`]: engines of every
//!   transport, serving reads, create no System V segment and no posix
//!   segment that group or others may read or write.

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use common::child_process::test_path;
use common::*;
use rdmareg_backend::own_process::in_own_process;
use rdmareg_core::{Descriptor, PeerId};
use rdmareg_ucx::{Transport, UcxEngine};

/// The role this process plays: `owner` or `attacker`.
const ROLE: &str = "RDMAREG_SHM_TEST_ROLE";
/// The test a child plays its role for.
const ROLE_TEST: &str = "RDMAREG_SHM_TEST_NAME";
/// The owner's transport (see [`transport_named`]).
const TRANSPORT: &str = "RDMAREG_SHM_TEST_TRANSPORT";
/// The attacker's target.
const OWNER_PID: &str = "RDMAREG_SHM_TEST_OWNER_PID";
/// The uids and the group of the two users.
const OWNER_UID: u32 = 4201;
const ATTACKER_UID: u32 = 4202;
const SHARED_GID: u32 = 4242;
/// Bytes the owner serves.
const LEN: usize = 64 * 1024;

fn transport_named(name: &str) -> Transport {
    match name {
        "auto" => Transport::Auto,
        "tcp" => Transport::Tcp,
        "same-host" => Transport::SameHost,
        "shm" => Transport::SharedMemoryNoErrorHandling,
        other => panic!("unknown transport {other:?}"),
    }
}

/// Whether this process is a child playing a role for `test`; plays it.
fn played_role(test: &str) -> bool {
    if std::env::var(ROLE_TEST).as_deref() != Ok(test) {
        return false;
    }
    match std::env::var(ROLE).as_deref() {
        Ok("owner") => owner_main(),
        Ok("attacker") => attacker_main(),
        other => panic!("unknown role {other:?}"),
    }
    true
}

/// Starts this test binary again as `role` for `test`, running as `uid`
/// in group [`SHARED_GID`] with no supplementary groups.
fn spawn_role(test: &str, role: &str, uid: u32, env: &[(&str, String)]) -> Child {
    Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            test_path(module_path!(), test).as_str(),
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(ROLE_TEST, test)
        .env(ROLE, role)
        .env("RDMAREG_SHM_TEST_UID", uid.to_string())
        .envs(env.iter().map(|(key, value)| (key, value)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the child process starts")
}

/// Becomes the user the parent named: uid from `RDMAREG_SHM_TEST_UID`,
/// group [`SHARED_GID`], no supplementary groups; stays dumpable, as a
/// process started by that user is (so the kernel judges access to its
/// `/proc` files by its uid, not by a lost dumpable flag).
fn become_the_named_user() {
    let uid: u32 = std::env::var("RDMAREG_SHM_TEST_UID")
        .expect("uid")
        .parse()
        .expect("uid");
    // SAFETY: plain system calls on this process's credentials; glibc
    // applies them to every thread.
    unsafe {
        assert_eq!(libc::setgroups(0, std::ptr::null()), 0, "setgroups");
        assert_eq!(
            libc::setresgid(SHARED_GID, SHARED_GID, SHARED_GID),
            0,
            "setresgid"
        );
        assert_eq!(libc::setresuid(uid, uid, uid), 0, "setresuid");
        assert_eq!(
            libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0),
            0,
            "dumpable"
        );
    }
}

/// The owner: serves [`LEN`] bytes of the pattern with one engine of
/// [`TRANSPORT`], says `READY <address> <descriptor>`, and serves until
/// stdin closes.
fn owner_main() {
    become_the_named_user();
    init_tracing();
    let transport = transport_named(&std::env::var(TRANSPORT).expect("transport"));
    let buf = PageBuf::filled(LEN, pattern);
    let runtime = runtime();
    let engine = UcxEngine::start(config(transport)).expect("owner engine starts");
    let region = runtime.block_on(map(&engine.backend(), &buf));
    let descriptor = describe(&buf, &region);
    println!(
        "READY {} {}",
        hex(&engine.worker_address()),
        hex(&descriptor.encode())
    );
    std::io::stdout().flush().expect("stdout");
    let mut rest = String::new();
    let _ = std::io::stdin().read_line(&mut rest);
    engine.shutdown_blocking();
    drop(buf);
}

/// What the attacker got.
#[derive(Debug, Default)]
struct Attack {
    /// System V segments of the owner it attached.
    attached: usize,
    /// FIFO elements it forged in them.
    forged: usize,
    /// Files of the owner (in `/dev/shm`, under `/proc/<owner>/fd`) it
    /// opened for reading and writing.
    opened: Vec<String>,
}

/// The attacker: attacks the owner at [`OWNER_PID`] and says
/// `ATTACK <attached> <forged> <opened...>`.
fn attacker_main() {
    become_the_named_user();
    let owner: i32 = std::env::var(OWNER_PID)
        .expect("owner pid")
        .parse()
        .expect("owner pid");
    let mut attack = Attack::default();
    for shmid in system_v_segments_created_by(owner) {
        // SAFETY: attaching maps a segment at an address the kernel
        // chooses; nothing of this process lies there.
        let base = unsafe { libc::shmat(shmid, std::ptr::null(), 0) };
        if base as isize == -1 {
            continue;
        }
        attack.attached += 1;
        // SAFETY: `base` is the attached segment, of the size the kernel
        // reported; `forge` stays within it.
        attack.forged += unsafe { forge_fifo_elements(base.cast(), shmid, owner) };
    }
    let mut candidates: Vec<String> = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/dev/shm") {
        for entry in entries.flatten() {
            if entry.metadata().is_ok_and(|m| m.uid() == OWNER_UID) {
                candidates.push(entry.path().display().to_string());
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir(format!("/proc/{owner}/fd")) {
        for entry in entries.flatten() {
            candidates.push(entry.path().display().to_string());
        }
    }
    for path in candidates {
        if std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .is_ok()
        {
            attack.opened.push(path);
        }
    }
    println!(
        "ATTACK {} {} {}",
        attack.attached,
        attack.forged,
        attack.opened.join(" ")
    );
}

/// `(shmid, perms, size, cpid)` of every System V segment on the host.
fn system_v_segments() -> Vec<(i32, u32, usize, i32)> {
    let table = std::fs::read_to_string("/proc/sysvipc/shm").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            Some((
                fields.get(1)?.parse().ok()?,
                u32::from_str_radix(fields.get(2)?, 8).ok()?,
                fields.get(3)?.parse().ok()?,
                fields.get(4)?.parse().ok()?,
            ))
        })
        .collect()
}

fn system_v_segments_created_by(pid: i32) -> Vec<i32> {
    system_v_segments()
        .into_iter()
        .filter(|&(_, _, _, cpid)| cpid == pid)
        .map(|(shmid, ..)| shmid)
        .collect()
}

/// UCX 1.22's mm FIFO on x86-64 (`mm_iface.h`, 64-byte cache lines): the
/// control block (`head` at 0, the signal socket's address length at 8
/// and address at 12, `tail` at 128, the owner's pid at 136) takes 192
/// bytes, then 256 elements of 128 bytes: `flags` (bit 0 the owner bit),
/// `am_id`, `length`, the descriptor info, and `desc_data` at 20.
const FIFO_CONTROL: usize = 192;
const FIFO_ELEMENTS: u64 = 256;
const FIFO_ELEMENT: usize = 128;
const HEAD_ARMED: u64 = 1 << 63;

/// If the segment at `base` is `owner`'s mm receive FIFO, writes eight
/// elements whose data pointer is 0x1000, for UCP's wireup handler (AM id
/// 1), and wakes the owner through its signal socket, as a sender does.
/// Returns how many it wrote.
///
/// # Safety
/// `base` is the start of attached segment `shmid`.
unsafe fn forge_fifo_elements(base: *mut u8, shmid: i32, owner: i32) -> usize {
    let size = system_v_segments()
        .into_iter()
        .find(|&(id, ..)| id == shmid)
        .map_or(0, |(_, _, size, _)| size);
    if size < FIFO_CONTROL + FIFO_ELEMENTS as usize * FIFO_ELEMENT {
        return 0;
    }
    // SAFETY: within the segment (checked above).
    let pid = unsafe { base.add(136).cast::<i32>().read_unaligned() };
    if pid != owner {
        return 0;
    }
    // SAFETY: `head` is the 8-byte-aligned first word of the page-aligned
    // segment; senders update it atomically.
    let head = unsafe { &*base.cast::<std::sync::atomic::AtomicU64>() };
    let mut forged = 0;
    for _ in 0..8 {
        let seen = head.load(std::sync::atomic::Ordering::Acquire);
        let index = seen & !HEAD_ARMED;
        if head
            .compare_exchange(
                seen,
                index + 1,
                std::sync::atomic::Ordering::AcqRel,
                std::sync::atomic::Ordering::Acquire,
            )
            .is_err()
        {
            continue;
        }
        let slot = (index % FIFO_ELEMENTS) as usize;
        // SAFETY: element `slot` lies within the segment (size checked).
        unsafe {
            let element = base.add(FIFO_CONTROL + slot * FIFO_ELEMENT);
            element.add(1).write(1); // am_id: UCP wireup
            element.add(2).cast::<u16>().write_unaligned(64);
            element.add(20).cast::<u64>().write_unaligned(0x1000);
            std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
            element.write(((index / FIFO_ELEMENTS) & 1) as u8);
        }
        forged += 1;
    }
    // SAFETY: the address length and address lie within the control
    // block; the socket is this process's own.
    unsafe {
        let length = base.add(8).cast::<u32>().read_unaligned();
        let fd = libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM, 0);
        if fd >= 0 && (length as usize) <= std::mem::size_of::<libc::sockaddr_un>() {
            let byte = 0u8;
            libc::sendto(
                fd,
                (&byte as *const u8).cast(),
                1,
                0,
                base.add(12).cast(),
                length,
            );
        }
        if fd >= 0 {
            libc::close(fd);
        }
    }
    forged
}

/// A running owner of another user: its child process and what it said.
struct Owner {
    child: Child,
    /// Kept open: the owner's harness reports on it when the owner ends.
    _stdout: BufReader<ChildStdout>,
    address: Vec<u8>,
    descriptor: Descriptor,
}

impl Owner {
    fn spawn(test: &str, transport: &str) -> Owner {
        let mut child = spawn_role(
            test,
            "owner",
            OWNER_UID,
            &[(TRANSPORT, transport.to_owned())],
        );
        // The test harness speaks first, and its `test … … ` starts the
        // owner's line.
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        let announced = loop {
            line.clear();
            let read = stdout.read_line(&mut line).expect("the owner speaks");
            assert!(read > 0, "the owner ended before it was ready");
            if let Some((_, announced)) = line.split_once("READY ") {
                break announced;
            }
        };
        let mut words = announced.split_whitespace();
        let address = unhex(words.next().expect("address"));
        let descriptor = Descriptor::decode(&unhex(words.next().expect("descriptor")))
            .expect("the owner's descriptor decodes");
        Owner {
            child,
            _stdout: stdout,
            address,
            descriptor,
        }
    }

    /// How the owner ended, if it did.
    fn ended(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().expect("waiting on the owner")
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// Runs the attacker against `owner_pid`; what it got.
fn attack(test: &str, owner_pid: u32) -> Attack {
    let child = spawn_role(
        test,
        "attacker",
        ATTACKER_UID,
        &[(OWNER_PID, owner_pid.to_string())],
    );
    let output = child.wait_with_output().expect("the attacker runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .find_map(|line| line.split_once("ATTACK ").map(|(_, said)| said))
        .unwrap_or_else(|| panic!("the attacker failed ({}): {stdout}", output.status));
    let mut words = line.split_whitespace();
    Attack {
        attached: words.next().and_then(|w| w.parse().ok()).expect("attached"),
        forged: words.next().and_then(|w| w.parse().ok()).expect("forged"),
        opened: words.map(str::to_owned).collect(),
    }
}

/// An owner of uid 4201 and an attacker of uid 4202, both in group 4242,
/// for an owner of each transport: the owner serves a read, the attacker
/// tries every segment and file of the owner's (forging FIFO elements in
/// any segment it attaches), and the owner serves the next read. The
/// attacker must get nothing.
#[test]
fn a_group_member_gets_no_segment_of_the_owner() {
    const TEST: &str = "a_group_member_gets_no_segment_of_the_owner";
    if played_role(TEST) {
        return;
    }
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        println!("not run: running an owner and an attacker as two other users needs root");
        return;
    }
    let runtime = runtime();
    let mut failures = Vec::new();
    for transport in ["auto", "shm", "same-host", "tcp"] {
        let mut owner = Owner::spawn(TEST, transport);
        let consumer =
            UcxEngine::start(config(transport_named(transport))).expect("consumer engine starts");
        let peer = PeerId(1);
        consumer
            .add_peer(peer, owner.address.clone().into())
            .expect("add_peer");
        let dst = PageBuf::zeroed(LEN);
        let backend = consumer.backend();
        let dst_region = runtime.block_on(map(&backend, &dst));
        let descriptor = owner.descriptor.clone();
        let read = |dst: &PageBuf| {
            dst.fill(0);
            let request = get_request(
                peer,
                &descriptor,
                &dst_region,
                0,
                Some(Duration::from_secs(5)),
            );
            let answer = runtime.block_on(backend.get_into_test_memory(request));
            answer.is_ok() && dst.snapshot() == PageBuf::filled(LEN, pattern).snapshot()
        };
        assert!(
            read(&dst),
            "{transport}: the owner serves a read before the attack"
        );
        let attack = attack(TEST, owner.child.id());
        std::thread::sleep(Duration::from_millis(300));
        let served_after = read(&dst);
        let ended = owner.ended();
        println!("{transport}: {attack:?}, owner ended: {ended:?}, read after: {served_after}");
        if attack.attached != 0 || !attack.opened.is_empty() || ended.is_some() || !served_after {
            failures.push(format!(
                "{transport}: the attacker attached {} segments (forged {} FIFO elements) and \
                 opened {:?}; the owner {}, and the read after the attack {}",
                attack.attached,
                attack.forged,
                attack.opened,
                ended.map_or("lives".to_owned(), |status| format!("ended ({status})")),
                if served_after { "succeeded" } else { "failed" },
            ));
        }
        consumer.shutdown_blocking();
        drop(dst);
        drop(owner);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Engines of every transport, owner and consumer, serve reads to each
/// other; then every System V segment this process created and every
/// posix segment it holds (a file of `/dev/shm`, open or unlinked) must be
/// its user's alone: no permission bit for group or others.
#[test]
fn every_segment_an_engine_creates_is_private() {
    in_own_process(|| {
        let runtime = runtime();
        let mut running = Vec::new();
        for transport in [
            Transport::Auto,
            Transport::Tcp,
            Transport::SameHost,
            Transport::SharedMemoryNoErrorHandling,
        ] {
            let (owner, consumer) = engines(transport.clone());
            let src = PageBuf::filled(LEN, pattern);
            let dst = PageBuf::zeroed(LEN);
            let src_region = runtime.block_on(map(&owner.backend(), &src));
            let dst_region = runtime.block_on(map(&consumer.backend(), &dst));
            let desc = describe(&src, &src_region);
            let request = get_request(OWNER, &desc, &dst_region, 0, None);
            assert_eq!(
                runtime.block_on(consumer.backend().get_into_test_memory(request)),
                Ok(()),
                "{transport:?}"
            );
            running.push((owner, consumer, src, dst));
        }
        let me = std::process::id() as i32;
        let mut shared = Vec::new();
        let mut checked = 0;
        for (shmid, perms, size, cpid) in system_v_segments() {
            if cpid == me {
                checked += 1;
                if perms & 0o077 != 0 {
                    shared.push(format!(
                        "System V segment {shmid} ({size} bytes) mode {perms:o}"
                    ));
                }
            }
        }
        let mut posix = Vec::new();
        for entry in std::fs::read_dir("/proc/self/fd")
            .expect("/proc/self/fd")
            .flatten()
        {
            let Ok(target) = std::fs::read_link(entry.path()) else {
                continue;
            };
            if target.starts_with("/dev/shm") {
                // Follows the descriptor to the file, unlinked or not.
                if let Ok(meta) = std::fs::metadata(entry.path()) {
                    posix.push((target.display().to_string(), meta.permissions().mode()));
                }
            }
        }
        // SAFETY: geteuid takes no arguments and cannot fail.
        let uid = unsafe { libc::geteuid() };
        let shm_files = std::fs::read_dir("/dev/shm")
            .into_iter()
            .flatten()
            .flatten();
        for entry in shm_files {
            if let Ok(meta) = entry.metadata() {
                if meta.uid() == uid && entry.file_name().to_string_lossy().starts_with("ucx") {
                    posix.push((
                        entry.path().display().to_string(),
                        meta.permissions().mode(),
                    ));
                }
            }
        }
        for (path, mode) in &posix {
            checked += 1;
            if mode & 0o077 != 0 {
                shared.push(format!("posix segment {path} mode {:o}", mode & 0o7777));
            }
        }
        println!("checked {checked} segments: {shared:?}");
        for (owner, consumer, src, dst) in running {
            consumer.shutdown_blocking();
            owner.shutdown_blocking();
            drop((src, dst));
        }
        assert!(
            checked > 0,
            "the engines created no shared-memory segment at all"
        );
        assert!(
            shared.is_empty(),
            "segments another user of the group may open:\n{}",
            shared.join("\n")
        );
    });
}
