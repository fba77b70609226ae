//! Two OS processes: this test binary re-executes itself as an *owner*
//! (selected by an environment variable) that registers memory and prints
//! its worker address and a descriptor on stdout; the test process is the
//! consumer. Covers GETs across processes, a peer killed mid-transfer, a
//! peer stopped with SIGSTOP, consumers (another re-execution, role
//! `consumer`) SIGKILLed while the owner serves them, and who may use the
//! same-host direct-read lane: a reader (role `prober`) of the owner's user
//! reads one-sided, one of another user only through the owner; and that
//! an owner's pid, once it died, is not trusted again when another process
//! takes it. Copies name an owner by the thread its engine address
//! publishes: an owner whose main thread exited is still read, an engine
//! shut down in a living process is not, nor is another process under a
//! forged or recycled thread id.
//!
//! The binary has its own `main` (no libtest harness) because it is also
//! the owner. Arguments that do not start with `-` filter tests by substring.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use rdmareg_backend::RdmaBackend;
use rdmareg_core::{Access, BackendPut, Descriptor, PeerId, RdmaError};
use rdmareg_ucx::{Transport, UcxEngine};

const ROLE: &str = "RDMAREG_UCX_TEST_ROLE";
const TRANSPORT: &str = "RDMAREG_UCX_TEST_TRANSPORT";
const SIZE: &str = "RDMAREG_UCX_TEST_SIZE";
const OWNER_ADDRESS: &str = "RDMAREG_UCX_TEST_OWNER_ADDRESS";
const OWNER_DESCRIPTOR: &str = "RDMAREG_UCX_TEST_OWNER_DESCRIPTOR";
/// An owner fills its memory with the pattern XORed with this byte (0 if
/// unset), so two owners' bytes differ wherever their buffers lie.
const FILL_XOR: &str = "RDMAREG_UCX_TEST_FILL_XOR";
/// Set for an owner that, told `exec` on stdin, replaces its program with
/// this binary again, filling with this XOR instead.
const EXEC_XOR: &str = "RDMAREG_UCX_TEST_EXEC_XOR";
/// `1` for an owner that, from before it announces itself, switches
/// itself between not dumpable (the kernel then refuses copies to a
/// process without `CAP_SYS_PTRACE`) and dumpable, over and over; `0`
/// for one that does not (and lays out its memory as the other does).
const REFUSE_COPIES: &str = "RDMAREG_UCX_TEST_REFUSE_COPIES";
/// How many engines an owner starts (1 if unset), each serving a buffer
/// of its own: the first announced first.
const OWNER_ENGINES: &str = "RDMAREG_UCX_TEST_OWNER_ENGINES";
/// When an owner's main thread exits while its other threads serve on:
/// `announced`, right after the owner announced itself; `told`, once told
/// `end-main` on stdin ([`Owner::end_main_thread`]). Unset: it does not.
const MAIN_THREAD_EXITS: &str = "RDMAREG_UCX_TEST_MAIN_THREAD_EXITS";
/// What an owner told `shutdown` XORs the pattern with in the buffer its
/// first engine served.
const SHUT_DOWN_XOR: u8 = 0x5A;
/// `1` for an owner that registers its buffers readable and writable
/// (unset: readable only).
const WRITABLE: &str = "RDMAREG_UCX_TEST_WRITABLE";
const MIB: usize = 1024 * 1024;

fn transport_named(name: &str) -> Transport {
    match name {
        "tcp" => Transport::Tcp,
        "same-host" => Transport::SameHost,
        other => panic!("unknown transport {other:?}"),
    }
}

/// The owner role: register `SIZE` bytes of the pattern with each of its
/// engines ([`OWNER_ENGINES`], one buffer each), announce them, and serve
/// until stdin closes; told `shutdown` on stdin, shut the first engine down
/// and live on ([`Owner::shut_down_first_engine`]).
fn owner_main() {
    // Logs go to stderr: stdout carries the READY line.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let transport = transport_named(&std::env::var(TRANSPORT).expect("transport"));
    let size: usize = std::env::var(SIZE).expect("size").parse().expect("size");
    let xor: u8 = std::env::var(FILL_XOR).map_or(0, |v| v.parse().expect("fill xor"));
    let engines: usize = std::env::var(OWNER_ENGINES).map_or(1, |v| v.parse().expect("engines"));
    // Allocated while this process has one thread: without address
    // randomisation every owner's buffer then lies at the same address,
    // which the pid-reuse tests rely on (the engine's threads allocate
    // concurrently, in an order that varies from run to run).
    let bufs: Vec<PageBuf> = (0..engines)
        .map(|_| PageBuf::filled(size, |i| pattern(i) ^ xor))
        .collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let writable = std::env::var(WRITABLE).as_deref() == Ok("1");
    let mut served = Vec::new();
    let mut announcement = String::from("READY");
    for buf in bufs {
        let engine = UcxEngine::start(config(transport.clone())).expect("owner engine starts");
        let (region, descriptor) = if writable {
            let backend = engine.backend();
            // SAFETY: the buffer lives until after the engine's teardown
            // (`Served`), and this process reads it only through raw
            // pointers once its registration is gone.
            let region = runtime
                .block_on(unsafe {
                    backend.map_with_access(buf.addr(), buf.len(), Access::ReadWrite)
                })
                .expect("map succeeds");
            let descriptor = describe(&buf, &region).granting(Access::ReadWrite);
            (region, descriptor)
        } else {
            let region = runtime.block_on(map(&engine.backend(), &buf));
            let descriptor = describe(&buf, &region);
            (region, descriptor)
        };
        announcement.push_str(&format!(
            " {} {}",
            hex(&engine.worker_address()),
            hex(&descriptor.encode())
        ));
        served.push(Served {
            engine,
            region,
            buf,
        });
    }
    if std::env::var(REFUSE_COPIES).as_deref() == Ok("1") {
        std::thread::spawn(|| {
            loop {
                set_dumpable(false);
                set_dumpable(true);
            }
        });
    }
    println!("{announcement}");
    std::io::stdout().flush().unwrap();
    if let Ok(when) = std::env::var(MAIN_THREAD_EXITS) {
        // Another thread serves stdin and tears down; the engines' threads
        // and it keep the process alive once this, its main thread, ends.
        let (told, told_to_end) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            serve_stdin(&runtime, served, Some(told));
            std::process::exit(0);
        });
        if when == "told" {
            let _ = told_to_end.recv();
        }
        // The thread's own exit system call: `pthread_exit` would unwind
        // through `main`'s frames, and the runtime aborts the process when
        // a forced unwind is caught.
        // SAFETY: ends this thread only; it holds no lock and nothing
        // refers to its stack (what it owned moved to the thread above).
        unsafe { libc::syscall(libc::SYS_exit, 0) };
        unreachable!("SYS_exit returned");
    }
    serve_stdin(&runtime, served, None);
}

/// What an owner serves through one engine: the engine, its registration,
/// and the buffer under it.
struct Served {
    engine: UcxEngine,
    region: rdmareg_backend::BackendRegion,
    buf: PageBuf,
}

impl Served {
    /// Unmaps the buffer and shuts the engine down; returns the buffer and
    /// whether the engine's thread ended in time.
    fn tear_down(self, runtime: &tokio::runtime::Runtime) -> (PageBuf, bool) {
        let _ = runtime.block_on(self.engine.backend().unmap(self.region.backend_region_id));
        let ended = self.engine.shutdown_blocking();
        (self.buf, ended)
    }
}

/// The owner's commands on stdin, until it closes: `exec` (with
/// [`EXEC_XOR`] set) replaces the program; `shutdown` tears the first
/// engine down, fills its buffer with other bytes (the pattern XORed with
/// [`SHUT_DOWN_XOR`]), keeps it, and says `SHUT`; `end-main` tells the
/// main thread to end, through `end_main`. Then every engine is torn down.
fn serve_stdin(
    runtime: &tokio::runtime::Runtime,
    mut served: Vec<Served>,
    end_main: Option<std::sync::mpsc::Sender<()>>,
) {
    let mut kept = Vec::new();
    let stdin = std::io::stdin();
    let mut line = String::new();
    loop {
        line.clear();
        if stdin.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
        match line.trim() {
            "exec" => {
                let Ok(exec_xor) = std::env::var(EXEC_XOR) else {
                    continue;
                };
                // As a program replacing itself would: no teardown first.
                let error = std::os::unix::process::CommandExt::exec(
                    Command::new(std::env::current_exe().unwrap())
                        .env(FILL_XOR, exec_xor)
                        .env_remove(EXEC_XOR),
                );
                panic!("exec failed: {error}");
            }
            "end-main" => {
                if let Some(end_main) = &end_main {
                    let _ = end_main.send(());
                }
            }
            "shutdown" => {
                let (buf, ended) = served.remove(0).tear_down(runtime);
                assert!(ended, "the owner's first engine shuts down in time");
                let size = buf.len();
                // SAFETY: the buffer is no longer registered anywhere, so
                // nothing but this thread reaches its bytes.
                let bytes = unsafe { std::slice::from_raw_parts_mut(buf.addr() as *mut u8, size) };
                for (i, byte) in bytes.iter_mut().enumerate() {
                    *byte = pattern(i) ^ SHUT_DOWN_XOR;
                }
                kept.push(buf);
                println!("SHUT");
                std::io::stdout().flush().unwrap();
            }
            _ => {}
        }
    }
    for one in served {
        let _ = one.tear_down(runtime);
    }
    drop(kept);
}

/// Makes this process dumpable or not (`PR_SET_DUMPABLE`): a process that
/// is not refuses `process_vm_readv` to callers without `CAP_SYS_PTRACE`.
fn set_dumpable(dumpable: bool) {
    // SAFETY: PR_SET_DUMPABLE takes an integer and no pointers.
    let rc = unsafe {
        libc::prctl(
            libc::PR_SET_DUMPABLE,
            libc::c_ulong::from(dumpable),
            0,
            0,
            0,
        )
    };
    assert_eq!(rc, 0, "PR_SET_DUMPABLE");
}

/// Drops `CAP_SYS_PTRACE` from this thread's capability sets and from the
/// bounding set, so that this process and every thread and program it
/// starts afterwards read other processes as an ordinary same-user process
/// does: only those that are dumpable. Call before any thread starts.
fn drop_ptrace_capability() {
    const CAP_SYS_PTRACE: u32 = 19;
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    // SAFETY: PR_CAPBSET_DROP takes a capability number and no pointers.
    let rc = unsafe {
        libc::prctl(
            libc::PR_CAPBSET_DROP,
            libc::c_ulong::from(CAP_SYS_PTRACE),
            0,
            0,
            0,
        )
    };
    assert_eq!(rc, 0, "PR_CAPBSET_DROP");
    let mut header = Header {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget writes one header and two data records, which is what
    // version 3 of the interface uses and what these are.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    assert_eq!(rc, 0, "capget");
    let bit = !(1u32 << CAP_SYS_PTRACE);
    data[0].effective &= bit;
    data[0].permitted &= bit;
    data[0].inheritable &= bit;
    // SAFETY: capset reads the header and two data records filled above.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) };
    assert_eq!(rc, 0, "capset");
}

/// The consumer role: read the owner's whole descriptor over and over,
/// saying `READING` before each read, until killed.
fn consumer_main() {
    let transport = transport_named(&std::env::var(TRANSPORT).expect("transport"));
    let address = Bytes::from(unhex(&std::env::var(OWNER_ADDRESS).expect("address")));
    let descriptor = Descriptor::decode(&unhex(
        &std::env::var(OWNER_DESCRIPTOR).expect("descriptor"),
    ))
    .expect("descriptor");
    let engine = UcxEngine::start(config(transport)).expect("consumer engine starts");
    engine.add_peer(OWNER, address).expect("owner recorded");
    let backend = engine.backend();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        let dst = PageBuf::zeroed(descriptor.len() as usize);
        let region = map(&backend, &dst).await;
        loop {
            println!("READING");
            std::io::stdout().flush().unwrap();
            let request = get_request(OWNER, &descriptor, &region, 0, None);
            let _ = backend.get_into_test_memory(request).await;
        }
    });
}

/// The prober role: read the owner's descriptor once with its real key
/// and once with the tail of its capability forged (the part the release
/// table does not hold), and print both answers. Through the owner the
/// forged one is refused; a one-sided read never asks the owner.
fn prober_main() {
    let transport = transport_named(&std::env::var(TRANSPORT).expect("transport"));
    let address = Bytes::from(unhex(&std::env::var(OWNER_ADDRESS).expect("address")));
    let descriptor = Descriptor::decode(&unhex(
        &std::env::var(OWNER_DESCRIPTOR).expect("descriptor"),
    ))
    .expect("descriptor");
    let engine = UcxEngine::start(config(transport)).expect("prober engine starts");
    engine.add_peer(OWNER, address).expect("owner recorded");
    let backend = engine.backend();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (real, forged, bytes_right) = runtime.block_on(async {
        let dst = PageBuf::zeroed(descriptor.len() as usize);
        let region = map(&backend, &dst).await;
        let request = get_request(OWNER, &descriptor, &region, 0, None);
        let real = backend.get_into_test_memory(request).await;
        let bytes_right = dst.snapshot() == PageBuf::filled(dst.len(), pattern).snapshot();
        let mut request = get_request(OWNER, &descriptor, &region, 0, None);
        request.packed_key = forged_capability_tail(&request.packed_key);
        let forged = backend.get_into_test_memory(request).await;
        let _ = backend.unmap(region.backend_region_id).await;
        (real, forged, bytes_right)
    });
    engine.shutdown_blocking();
    println!("PROBED real={real:?} forged={forged:?} bytes_right={bytes_right}");
}

/// A running owner process.
struct Owner {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    address: Bytes,
    descriptor: Descriptor,
    /// The address and descriptor of each further engine
    /// ([`OWNER_ENGINES`]).
    others: Vec<(Bytes, Descriptor)>,
}

impl Owner {
    fn spawn(transport: &str, size: usize) -> Owner {
        Owner::spawn_filled(transport, size, 0)
    }

    /// An owner whose bytes are the pattern XORed with `xor`.
    fn spawn_filled(transport: &str, size: usize, xor: u8) -> Owner {
        Owner::start(
            Command::new(std::env::current_exe().unwrap()),
            transport,
            size,
            xor,
        )
    }

    /// An owner of 4 KiB on the same-host lane whose bytes are the pattern
    /// XORed with `xor`, started without address randomisation, so that two
    /// such owners place their buffers at the same address.
    fn spawn_without_aslr(xor: u8) -> Owner {
        Owner::start(Owner::without_aslr(), "same-host", 4096, xor)
    }

    /// As [`Owner::spawn_without_aslr`], an owner that replaces its program
    /// with this binary filling with `exec_xor` once told
    /// ([`Owner::exec`]).
    fn spawn_without_aslr_to_exec(xor: u8, exec_xor: u8) -> Owner {
        let mut command = Owner::without_aslr();
        command.env(EXEC_XOR, exec_xor.to_string());
        Owner::start(command, "same-host", 4096, xor)
    }

    /// This binary behind `setarch -R`; the personality holds across
    /// `exec`, so the buffer of a program started again lies where it did.
    fn without_aslr() -> Command {
        let mut command = Command::new("setarch");
        command
            .args(["x86_64", "-R"])
            .arg(std::env::current_exe().unwrap());
        command
    }

    /// Tells an owner started to exec to do so, and returns the descriptor
    /// its new program announces.
    fn exec(&mut self) -> Descriptor {
        let stdin = self.stdin.as_mut().expect("the owner's stdin is open");
        stdin.write_all(b"exec\n").unwrap();
        stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .expect("the new program announces itself");
        let mut words = line.split_whitespace();
        assert_eq!(words.next(), Some("READY"), "the new program said {line:?}");
        words.next().expect("address");
        Descriptor::decode(&unhex(words.next().expect("descriptor"))).unwrap()
    }

    /// As [`Owner::spawn_without_aslr`], an owner that refuses copies
    /// now and then if `refusing` ([`REFUSE_COPIES`]).
    fn spawn_without_aslr_refusing_copies(xor: u8, refusing: bool) -> Owner {
        let mut command = Owner::without_aslr();
        command.env(REFUSE_COPIES, if refusing { "1" } else { "0" });
        Owner::start(command, "same-host", 4096, xor)
    }

    /// Runs `command` (this binary, possibly behind a launcher) as an owner
    /// and reads its announcement.
    fn start(mut command: Command, transport: &str, size: usize, xor: u8) -> Owner {
        let mut child = command
            .env(ROLE, "owner")
            .env(FILL_XOR, xor.to_string())
            .env(TRANSPORT, transport)
            .env(SIZE, size.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("owner process starts");
        let mut line = String::new();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        stdout.read_line(&mut line).expect("owner announces itself");
        let mut words = line.split_whitespace();
        assert_eq!(words.next(), Some("READY"), "owner said {line:?}");
        let mut engines = Vec::new();
        while let Some(address) = words.next() {
            let descriptor = words.next().expect("descriptor");
            engines.push((
                Bytes::from(unhex(address)),
                Descriptor::decode(&unhex(descriptor)).unwrap(),
            ));
        }
        assert!(!engines.is_empty(), "owner said {line:?}");
        let (address, descriptor) = engines.remove(0);
        let stdin = child.stdin.take();
        Owner {
            child,
            stdin,
            stdout,
            address,
            descriptor,
            others: engines,
        }
    }

    fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill takes no pointers; the pid is our own live child.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        assert_eq!(rc, 0, "signal {signal} to the owner");
    }

    /// Stops the owner with SIGSTOP and waits until every thread of it has
    /// stopped: the signal is delivered asynchronously, so without the wait
    /// the owner may still serve a GET issued right after `kill` returns.
    fn stop(&self) {
        self.signal(libc::SIGSTOP);
        let pid = self.child.id() as libc::pid_t;
        let mut status: libc::c_int = 0;
        // SAFETY: `status` is a valid out-pointer; the pid is our own child,
        // and WUNTRACED only reports (and consumes) its stop, not its exit.
        let rc = unsafe { libc::waitpid(pid, &mut status, libc::WUNTRACED) };
        assert_eq!(rc, pid, "waiting for the owner to stop");
        assert!(
            libc::WIFSTOPPED(status),
            "the owner did not stop: {status:#x}"
        );
    }

    /// A same-host owner of 4 KiB per engine, `engines` of them, whose
    /// main thread exits when told ([`Owner::end_main_thread`]) while its
    /// other threads serve on.
    fn spawn_main_thread_exiting_when_told(engines: usize) -> Owner {
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .env(MAIN_THREAD_EXITS, "told")
            .env(OWNER_ENGINES, engines.to_string());
        // The main thread never unwinds, so what its frames own is never
        // freed, by design: under AddressSanitizer (`cargo xtask asan`) the
        // child's leak report would be about this harness, not the engine.
        if let Ok(options) = std::env::var("ASAN_OPTIONS") {
            command.env("ASAN_OPTIONS", format!("{options}:detect_leaks=0"));
        }
        Owner::start(command, "same-host", 4096, 0)
    }

    /// Tells an owner started by
    /// [`Owner::spawn_main_thread_exiting_when_told`] to end its main
    /// thread, and waits until it has, alone.
    fn end_main_thread(&mut self) {
        let stdin = self.stdin.as_mut().expect("the owner's stdin is open");
        stdin.write_all(b"end-main\n").unwrap();
        stdin.flush().unwrap();
        self.wait_main_thread_exited();
    }

    fn wait_main_thread_exited(&self) {
        let exited = (0..200).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            self.main_thread_exited()
        });
        assert!(exited, "the owner's main thread did not exit alone");
    }

    /// Whether the owner lives with its main thread exited: the leader a
    /// zombie beside live threads, and the process not reaped.
    fn main_thread_exited(&self) -> bool {
        let pid = self.child.id();
        let leader =
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/status")).unwrap_or_default();
        let state = leader
            .lines()
            .find_map(|line| line.strip_prefix("State:"))
            .map(str::trim);
        state.is_some_and(|state| state.starts_with('Z')) && !self.has_exited()
    }

    /// Whether the owner process has exited, leaving it to be reaped.
    fn has_exited(&self) -> bool {
        // SAFETY: a zeroed siginfo_t is a valid out-parameter; WNOWAIT
        // leaves our own child to be reaped later, WNOHANG makes this a
        // poll.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is a valid out-pointer; the pid is our own child.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                self.child.id(),
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        // SAFETY: waitid filled `info`, or left it zeroed (no child has
        // changed state), where the pid reads as 0.
        rc == 0 && unsafe { info.si_pid() } != 0
    }

    /// Tells the owner to shut its first engine down and waits until it
    /// has; the process lives on, and the buffer that engine served now
    /// holds the pattern XORed with [`SHUT_DOWN_XOR`].
    fn shut_down_first_engine(&mut self) {
        let stdin = self.stdin.as_mut().expect("the owner's stdin is open");
        stdin.write_all(b"shutdown\n").unwrap();
        stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .expect("the owner reports the shutdown");
        assert_eq!(line.trim(), "SHUT", "the owner said {line:?}");
    }

    /// The owner's exit status if it has exited.
    fn child_status(&self) -> Option<std::process::ExitStatus> {
        let pid = self.child.id() as libc::pid_t;
        let mut status: libc::c_int = 0;
        // SAFETY: `status` is a valid out-pointer; WNOHANG makes this a
        // poll of our own child.
        let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        (rc == pid).then(|| std::os::unix::process::ExitStatusExt::from_raw(status))
    }

    /// Closes stdin so the owner tears down, and waits for it.
    fn finish(mut self) {
        drop(self.stdin.take());
        let status = self.child.wait().unwrap();
        assert!(status.success(), "owner exited with {status}");
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        if self.stdin.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Runs a prober (as `uid`, if given) against a same-host owner; returns
/// its answer line.
fn probe_same_host_owner(uid: Option<u32>) -> String {
    use std::os::unix::process::CommandExt;
    let owner = Owner::spawn("same-host", 64 * 1024);
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .env(ROLE, "prober")
        .env(TRANSPORT, "same-host")
        .env(OWNER_ADDRESS, hex(&owner.address))
        .env(OWNER_DESCRIPTOR, hex(&owner.descriptor.encode()))
        .stderr(Stdio::inherit());
    if let Some(uid) = uid {
        command.uid(uid).gid(uid);
    }
    let output = command.output().expect("prober runs");
    assert!(
        output.status.success(),
        "prober exited with {}",
        output.status
    );
    owner.finish();
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find(|l| l.starts_with("PROBED"))
        .expect("the prober answers")
        .to_owned()
}

fn consumer(transport: &str) -> UcxEngine {
    init_tracing();
    UcxEngine::start(config(transport_named(transport))).expect("consumer engine starts")
}

fn get_across_processes_moves_the_right_bytes(transport: &str) {
    let owner = Owner::spawn(transport, 64 * MIB + 4096);
    let engine = consumer(transport);
    engine.add_peer(OWNER, owner.address.clone()).unwrap();
    let backend = engine.backend();
    runtime().block_on(async {
        let dst = PageBuf::zeroed(64 * MIB);
        let region = map(&backend, &dst).await;
        let want = PageBuf::filled(64 * MIB + 4096, pattern).snapshot();
        for (src_off, dst_off, len) in [
            (0, 0, 1),
            (4099, 13, 3001),
            (0, 0, 4096),
            (12345, 4096, MIB),
            (4096, 0, 64 * MIB),
        ] {
            let part = owner.descriptor.slice(src_off as u64, len as u64).unwrap();
            let request = get_request(OWNER, &part, &region, dst_off as u64, None);
            assert_eq!(
                backend.get_into_test_memory(request).await,
                Ok(()),
                "GET of {len} B"
            );
            let got = dst.snapshot();
            assert!(
                got[dst_off..dst_off + len] == want[src_off..src_off + len],
                "bytes of a {len} B GET across processes"
            );
        }
        assert_eq!(backend.unmap(region.backend_region_id).await, Ok(()));
    });
    engine.shutdown_blocking();
    assert_eq!(engine.live_registrations(), Some(0));
    owner.finish();
}

/// PUTs of several sizes and offsets into another process's writable
/// registration, each read back: on the same host each is one
/// `process_vm_writev` under the owner's release-table lock, over tcp each
/// is served by the owner.
fn a_put_across_processes_lands_and_reads_back(transport: &str) {
    let size = 8 * MIB + 4096;
    let mut command = Command::new(std::env::current_exe().unwrap());
    command.env(WRITABLE, "1");
    let owner = Owner::start(command, transport, size, 0);
    assert_eq!(owner.descriptor.access(), Access::ReadWrite);
    let engine = consumer(transport);
    engine.add_peer(OWNER, owner.address.clone()).unwrap();
    let backend = engine.backend();
    runtime().block_on(async {
        let src = PageBuf::filled(8 * MIB, |i| pattern(i) ^ 0x33);
        let back = PageBuf::zeroed(8 * MIB);
        let src_region = map(&backend, &src).await;
        let back_region = map(&backend, &back).await;
        for (dst_off, src_off, len) in [
            (0, 0, 1),
            (4099, 13, 3001),
            (12345, 4096, MIB),
            (4096, 0, 8 * MIB),
        ] {
            let part = owner.descriptor.slice(dst_off as u64, len as u64).unwrap();
            let put = BackendPut {
                peer: OWNER,
                remote_addr: part.addr(),
                packed_key: part.packed_key().clone(),
                local_region_id: src_region.backend_region_id,
                local_offset: src_off as u64,
                len: len as u64,
                deadline: Some(Duration::from_secs(30)),
            };
            // SAFETY: the source is a `PageBuf` mapped on this engine, alive
            // until after the put answered; nothing writes it.
            assert_eq!(unsafe { backend.put(put) }.await, Ok(()), "PUT of {len} B");
            back.fill(0);
            let request = get_request(OWNER, &part, &back_region, 0, None);
            assert_eq!(
                backend.get_into_test_memory(request).await,
                Ok(()),
                "GET of {len} B"
            );
            assert!(
                back.snapshot()[..len] == src.snapshot()[src_off..src_off + len],
                "bytes of a {len} B PUT across processes, read back"
            );
        }
        assert_eq!(backend.unmap(src_region.backend_region_id).await, Ok(()));
        assert_eq!(backend.unmap(back_region.backend_region_id).await, Ok(()));
    });
    engine.shutdown_blocking();
    assert_eq!(engine.live_registrations(), Some(0));
    owner.finish();
}

/// A scatter list as a KV-cache transfer makes it: a thousand 4 KiB blocks
/// read out of order in one batch (on the same host, one vectored kernel
/// copy), each landing where its entry says; an entry outside the owner's
/// registration fails alone.
fn a_thousand_reads_in_one_batch_land_where_each_entry_says(transport: &str) {
    const BLOCKS: usize = 1000;
    const BLOCK: usize = 4096;
    let owner = Owner::spawn(transport, BLOCKS * BLOCK);
    let engine = consumer(transport);
    engine.add_peer(OWNER, owner.address.clone()).unwrap();
    let backend = engine.backend();
    runtime().block_on(async {
        let dst = PageBuf::zeroed(BLOCKS * BLOCK + BLOCK);
        let region = map(&backend, &dst).await;
        let source_block = |i: usize| i * 7919 % BLOCKS;
        let mut requests: Vec<_> = (0..BLOCKS)
            .map(|i| {
                let part = owner
                    .descriptor
                    .slice((source_block(i) * BLOCK) as u64, BLOCK as u64)
                    .unwrap();
                get_request(OWNER, &part, &region, (i * BLOCK) as u64, None)
            })
            .collect();
        // One block past the end of the owner's registration.
        let mut outside = get_request(OWNER, &owner.descriptor, &region, 0, None);
        outside.remote_addr = owner.descriptor.addr() + (BLOCKS * BLOCK) as u64;
        outside.len = BLOCK as u64;
        outside.local_offset = (BLOCKS * BLOCK) as u64;
        requests.insert(BLOCKS / 2, outside);
        let answers = backend.get_batch_into_test_memory(requests).await;
        assert_eq!(answers.len(), BLOCKS + 1);
        for (index, answer) in answers.iter().enumerate() {
            if index == BLOCKS / 2 {
                assert!(
                    answer.is_err(),
                    "the read outside the registration answered {answer:?}"
                );
            } else {
                assert_eq!(answer, &Ok(()), "entry {index}");
            }
        }
        let want = PageBuf::filled(BLOCKS * BLOCK, pattern).snapshot();
        let got = dst.snapshot();
        for i in 0..BLOCKS {
            let from = source_block(i) * BLOCK;
            assert!(
                got[i * BLOCK..(i + 1) * BLOCK] == want[from..from + BLOCK],
                "block {i} holds the owner's block {}",
                source_block(i)
            );
        }
        assert!(
            got[BLOCKS * BLOCK..].iter().all(|&b| b == 0),
            "the refused entry wrote nothing"
        );
        assert_eq!(backend.unmap(region.backend_region_id).await, Ok(()));
    });
    engine.shutdown_blocking();
    assert_eq!(engine.live_registrations(), Some(0));
    owner.finish();
}

fn a_killed_peer_fails_gets_promptly_and_the_engine_serves_another_peer(transport: &str) {
    let owner = Owner::spawn(transport, 64 * MIB);
    let engine = consumer(transport);
    engine.add_peer(OWNER, owner.address.clone()).unwrap();
    let backend = engine.backend();
    let rt = runtime();
    let dsts: Vec<PageBuf> = (0..4).map(|_| PageBuf::zeroed(64 * MIB)).collect();
    let regions: Vec<_> = dsts.iter().map(|d| rt.block_on(map(&backend, d))).collect();

    // Keep four 64 MiB GETs in flight until one fails.
    let readers: Vec<_> = regions
        .iter()
        .map(|region| {
            let backend = backend.clone();
            let request = get_request(OWNER, &owner.descriptor, region, 0, None);
            rt.spawn(async move {
                loop {
                    if let Err(err) = backend.get_into_test_memory(request.clone()).await {
                        return (err, Instant::now());
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let killed_at = Instant::now();
    owner.signal(libc::SIGKILL);
    for reader in readers {
        let (err, at) = rt.block_on(reader).unwrap();
        assert!(
            matches!(err, RdmaError::Backend(_)),
            "a GET to a killed peer answered {err:?}, not a backend error"
        );
        let after = at.saturating_duration_since(killed_at);
        assert!(
            after < Duration::from_secs(2),
            "a GET failed only {after:?} after the kill"
        );
    }

    // The same engine still serves another peer.
    let other = Owner::spawn(transport, 64 * MIB);
    engine.add_peer(PeerId(2), other.address.clone()).unwrap();
    rt.block_on(async {
        let request = get_request(PeerId(2), &other.descriptor, &regions[0], 0, None);
        assert_eq!(backend.get_into_test_memory(request).await, Ok(()));
        assert!(dsts[0].snapshot() == PageBuf::filled(64 * MIB, pattern).snapshot());
        for region in &regions {
            assert_eq!(backend.unmap(region.backend_region_id).await, Ok(()));
        }
    });
    engine.shutdown_blocking();
    assert_eq!(engine.live_registrations(), Some(0));
    other.finish();
}

/// A peer's engine address names its serving worker and its direct lane.
/// An envelope that pairs an honest owner's serving address with another
/// process's direct lane, added first, must not decide where reads from the
/// honest owner's own envelope copy from.
fn a_forged_envelope_added_first_cannot_pin_an_owners_direct_lane() {
    use rdmareg_ucx::EngineAddress;
    let honest = Owner::spawn_filled("same-host", 64 * 1024, 0);
    let other = Owner::spawn_filled("same-host", 64 * 1024, 0xFF);
    let honest_address = EngineAddress::decode(&honest.address).unwrap();
    let other_address = EngineAddress::decode(&other.address).unwrap();
    assert!(honest_address.direct.is_some() && other_address.direct.is_some());
    assert!(honest_address.process.is_some() && other_address.process.is_some());
    let forged = EngineAddress {
        serving: honest_address.serving.clone(),
        direct: other_address.direct.clone(),
        process: other_address.process,
        release_table: other_address.release_table,
    }
    .encode()
    .unwrap();
    let engine = consumer("same-host");
    engine.add_peer(PeerId(9), forged).unwrap();
    engine.add_peer(OWNER, honest.address.clone()).unwrap();
    let backend = engine.backend();
    runtime().block_on(async {
        let dst = PageBuf::zeroed(64 * 1024);
        let region = map(&backend, &dst).await;
        let request = get_request(OWNER, &honest.descriptor, &region, 0, None);
        assert_eq!(backend.get_into_test_memory(request).await, Ok(()));
        let want = PageBuf::filled(64 * 1024, pattern).snapshot();
        assert!(
            dst.snapshot() == want,
            "a read from the honest owner copies the honest owner's bytes"
        );
        assert_eq!(backend.unmap(region.backend_region_id).await, Ok(()));
    });
    engine.shutdown_blocking();
    honest.finish();
    other.finish();
}

fn a_stopped_peer_makes_a_get_time_out_at_its_deadline() {
    let owner = Owner::spawn("tcp", 4 * MIB);
    let engine = consumer("tcp");
    engine.add_peer(OWNER, owner.address.clone()).unwrap();
    let backend = engine.backend();
    let rt = runtime();
    let dst = PageBuf::zeroed(4 * MIB);
    let region = rt.block_on(map(&backend, &dst));
    // Connect first, so the stop hits an established endpoint.
    let warm = owner.descriptor.slice(0, 8).unwrap();
    assert_eq!(
        rt.block_on(backend.get_into_test_memory(get_request(OWNER, &warm, &region, 0, None))),
        Ok(())
    );

    owner.stop();
    let deadline = Duration::from_millis(500);
    let started = Instant::now();
    let answer = rt.block_on(backend.get_into_test_memory(get_request(
        OWNER,
        &owner.descriptor,
        &region,
        0,
        Some(deadline),
    )));
    let took = started.elapsed();
    assert_eq!(answer, Err(RdmaError::Timeout));
    assert!(took >= deadline, "timed out early, after {took:?}");
    assert!(
        took < deadline + Duration::from_secs(1),
        "timed out late, after {took:?}"
    );

    // UCX released the request, so the destination can be unmapped.
    let started = Instant::now();
    assert_eq!(rt.block_on(backend.unmap(region.backend_region_id)), Ok(()));
    assert!(started.elapsed() < Duration::from_secs(2));
    // The owner still holds the abandoned request unread and answers it as
    // soon as it resumes; UCX aborts an owner whose consumer's connection
    // closes under such an answer, so teardown must keep the connection up
    // while the late reply arrives.
    owner.signal(libc::SIGCONT);
    engine.shutdown_blocking();
    assert_eq!(engine.live_registrations(), Some(0));
    owner.finish();
}

/// One test of this binary.
type TestFn = Box<dyn Fn()>;

/// Consumers SIGKILLed while the owner streams them a 64 MiB reply, one
/// after another: the owner must never abort (UCX's emulated GET aborted it
/// in about one kill in sixteen when the consumer's connection reset
/// mid-reply) and must go on serving.
fn killed_consumers_never_take_the_owner_down(transport: &str, rounds: u64) {
    let owner = Owner::spawn(transport, 64 * MIB);
    for round in 0..rounds {
        let mut consumer = Command::new(std::env::current_exe().unwrap())
            .env(ROLE, "consumer")
            .env(TRANSPORT, transport)
            .env(OWNER_ADDRESS, hex(&owner.address))
            .env(OWNER_DESCRIPTOR, hex(&owner.descriptor.encode()))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("consumer process starts");
        let mut stdout = BufReader::new(consumer.stdout.take().unwrap());
        let mut line = String::new();
        // Kill at spread-out moments of the stream: before the first read
        // has been answered, and in the middle of later ones.
        let reads_before_kill = 1 + round % 3;
        for _ in 0..reads_before_kill {
            line.clear();
            stdout.read_line(&mut line).expect("consumer reports");
            assert_eq!(line.trim(), "READING", "round {round}");
        }
        std::thread::sleep(Duration::from_millis(round * 7 % 23));
        consumer.kill().expect("SIGKILL the consumer");
        let _ = consumer.wait();
        std::thread::sleep(Duration::from_millis(20));
        let exited = owner.child_status();
        assert!(
            exited.is_none(),
            "the owner died after consumer {round} was killed: {exited:?}"
        );
    }
    // It still serves.
    let engine = consumer(transport);
    engine.add_peer(OWNER, owner.address.clone()).unwrap();
    let backend = engine.backend();
    runtime().block_on(async {
        let dst = PageBuf::zeroed(64 * MIB);
        let region = map(&backend, &dst).await;
        let request = get_request(OWNER, &owner.descriptor, &region, 0, None);
        assert_eq!(backend.get_into_test_memory(request).await, Ok(()));
        assert!(dst.snapshot() == PageBuf::filled(64 * MIB, pattern).snapshot());
        assert_eq!(backend.unmap(region.backend_region_id).await, Ok(()));
    });
    engine.shutdown_blocking();
    owner.finish();
}

/// A same-host consumer of a 4 KiB owner started without address
/// randomisation, reading its whole descriptor into one buffer.
struct SameHostReader {
    engine: UcxEngine,
    backend: std::sync::Arc<rdmareg_ucx::UcxBackend>,
    rt: tokio::runtime::Runtime,
    dst: PageBuf,
    region: rdmareg_backend::BackendRegion,
    request: rdmareg_core::BackendGet,
}

impl SameHostReader {
    /// A consumer copying reads on the caller's thread up to `limit`
    /// bytes, which has read `owner`'s bytes twice.
    fn reading(owner: &Owner, limit: usize) -> SameHostReader {
        let reader = SameHostReader::new(owner.address.clone(), &owner.descriptor, limit);
        for _ in 0..2 {
            assert_eq!(reader.read(), Ok(()));
        }
        assert!(reader.dst.snapshot() == PageBuf::filled(4096, pattern).snapshot());
        reader
    }

    /// A consumer copying reads on the caller's thread up to `limit`
    /// bytes, that knows the peer at `address` as [`OWNER`] and has read
    /// nothing yet; its request reads all of `descriptor`.
    fn new(address: Bytes, descriptor: &Descriptor, limit: usize) -> SameHostReader {
        let engine = UcxEngine::start(config(Transport::SameHost).with_caller_copy_limit(limit))
            .expect("consumer engine starts");
        engine.add_peer(OWNER, address).unwrap();
        let backend = engine.backend();
        let rt = runtime();
        let dst = PageBuf::zeroed(4096);
        let region = rt.block_on(map(&backend, &dst));
        let request = get_request(OWNER, descriptor, &region, 0, None);
        SameHostReader {
            engine,
            backend,
            rt,
            dst,
            region,
            request,
        }
    }

    fn read(&self) -> Result<(), RdmaError> {
        self.rt
            .block_on(self.backend.get_into_test_memory(self.request.clone()))
    }

    /// Unmaps the buffer and shuts the engine down.
    fn finish(self) {
        self.rt.block_on(async {
            assert_eq!(
                self.backend.unmap(self.region.backend_region_id).await,
                Ok(())
            )
        });
        self.engine.shutdown_blocking();
    }
}

/// Starts owners with `spawn` until one runs under `pid`, and returns it.
///
/// Root sets the kernel's last handed-out pid just below `pid`, so the
/// next fork takes it. Other processes fork too (tests run side by side),
/// and one may take the pid first or still hold it: then this waits for
/// the pid to be free again and tries once more, for up to 30 s.
fn spawned_under_pid(pid: u32, spawn: impl Fn() -> Owner) -> Owner {
    let started = Instant::now();
    let mut tries = 0;
    while started.elapsed() < Duration::from_secs(30) {
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            // Another process holds the pid for now.
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        tries += 1;
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string())
            .expect("ns_last_pid is writable by root");
        let spawned = spawn();
        if spawned.child.id() == pid {
            return spawned;
        }
    }
    panic!("no process took pid {pid} in 30 s ({tries} forks tried)");
}

/// Which id of a dead owner a newcomer takes: its process id, or the id of
/// the thread its engine address names (copies name the owner by it).
#[derive(Clone, Copy)]
enum TakenId {
    Pid,
    Thread,
}

/// An owner process dies (SIGKILL, reaped), reads from it fail, and then an
/// unrelated process of the same user is started under the dead owner's
/// pid (or under the id of its engine's progress thread, which copies name
/// it by: `taken`), with other bytes at the same address. A read from the dead owner
/// must keep failing: it must not copy the newcomer's memory and answer
/// `Ok`. Reads are copied by the caller (`caller_copy_limit` above the
/// read) or by the progress thread (`0`). With `read_while_gone` false no
/// read runs between the owner's death and the newcomer's start, so no
/// copy ever finds the pid free: only the owner's identity tells the two
/// apart. Needs root, to choose the pid (`/proc/sys/kernel/ns_last_pid`).
fn a_read_from_an_owner_that_died_never_copies_from_the_process_that_took_its_id(
    limit: usize,
    read_while_gone: bool,
    taken: TakenId,
) {
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not run: choosing a pid needs root");
        return;
    }
    let owner = Owner::spawn_without_aslr(0);
    let descriptor = owner.descriptor.clone();
    let reader = SameHostReader::reading(&owner, limit);
    let pid = match taken {
        TakenId::Pid => owner.child.id(),
        TakenId::Thread => published_thread(&owner.address),
    };
    // Killed and reaped.
    drop(owner);
    for _ in 0..if read_while_gone { 3 } else { 0 } {
        let answer = reader.read();
        assert!(
            answer.is_err(),
            "a read from a dead owner answered {answer:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The next process forked takes the dead owner's pid (or thread id).
    let newcomer = spawned_under_pid(pid, || Owner::spawn_without_aslr(0x5A));
    assert_eq!(
        newcomer.descriptor.addr(),
        descriptor.addr(),
        "without randomisation the newcomer's buffer lies where the owner's did"
    );
    let mut answers = Vec::new();
    for _ in 0..5 {
        reader.dst.fill(0);
        answers.push(reader.read());
        std::thread::sleep(Duration::from_millis(100));
    }
    let landed = reader.dst.snapshot() != vec![0; 4096];
    reader.finish();
    drop(newcomer);
    assert!(
        answers.iter().all(Result::is_err) && !landed,
        "reads from the dead owner copied the newcomer's memory: {answers:?}"
    );
}

/// The role that runs
/// [`a_pid_taken_over_by_a_process_that_refuses_copies_is_never_read_once_it_allows_them`]
/// in a process of its own: it gives up `CAP_SYS_PTRACE`, which the test
/// process keeps for the other tests.
const REFUSED_READER_LIMIT: &str = "RDMAREG_UCX_TEST_REFUSED_READER_LIMIT";

fn refused_reader_main() {
    let limit: usize = std::env::var(REFUSED_READER_LIMIT)
        .expect("limit")
        .parse()
        .expect("limit");
    drop_ptrace_capability();
    init_tracing();
    a_pid_taken_over_by_a_process_that_refuses_copies_is_never_read_once_it_allows_them(limit);
    println!("REFUSED_READER ok");
}

/// An owner process dies, and the process that takes its pid is one this
/// consumer may not always read: it switches between not dumpable (as
/// `ssh-agent` makes itself, or a set-user-id program is) and dumpable,
/// and the consumer runs without `CAP_SYS_PTRACE`, as an ordinary user
/// does. A copy that meets it refused gets `EPERM`, not another token.
/// Reads from the dead owner must keep failing: a refusal must not send
/// them to a path that names the owner by pid alone (UCX's cma), which
/// reads the newcomer as soon as it is readable and answers `Ok`. Several
/// rounds, each with a new owner and newcomer, since whether a copy meets
/// the newcomer refused is a matter of timing.
fn a_pid_taken_over_by_a_process_that_refuses_copies_is_never_read_once_it_allows_them(
    limit: usize,
) {
    let mut answers = Vec::new();
    let mut landed = 0;
    let mut compared = 0;
    for _ in 0..40 {
        let owner = Owner::spawn_without_aslr_refusing_copies(0, false);
        let descriptor = owner.descriptor.clone();
        let mut reader = SameHostReader::reading(&owner, limit);
        // A dead owner's reads end at this deadline at the latest.
        reader.request.deadline = Some(Duration::from_secs(2));
        let pid = owner.child.id();
        // Killed and reaped.
        drop(owner);
        let newcomer = spawned_under_pid(pid, || {
            Owner::spawn_without_aslr_refusing_copies(0x5A, true)
        });
        if newcomer.descriptor.addr() != descriptor.addr() {
            // Threads allocating beside the main one moved the buffer:
            // this round would read other memory of the newcomer.
            reader.finish();
            continue;
        }
        compared += 1;
        for _ in 0..3 {
            reader.dst.fill(0);
            let answer = reader.read();
            if reader.dst.snapshot() != vec![0; 4096] {
                landed += 1;
            }
            answers.push(answer);
        }
        reader.finish();
        drop(newcomer);
    }
    println!("REFUSED_READER rounds={compared} answers={answers:?}");
    assert!(
        compared >= 6,
        "only {compared} newcomers laid out as their owners"
    );
    assert!(
        answers.iter().all(Result::is_err) && landed == 0,
        "reads from dead owners read newcomers ({landed} left bytes): {answers:?}"
    );
}

/// Runs [`refused_reader_main`] as a process of its own.
fn run_refused_reader(limit: usize) {
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not run: choosing a pid needs root");
        return;
    }
    let output = Command::new(std::env::current_exe().unwrap())
        .env(ROLE, "refused_reader")
        .env(REFUSED_READER_LIMIT, limit.to_string())
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .expect("the reader runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("REFUSED_READER ok"),
        "the reader failed ({}): {stdout}",
        output.status
    );
}

/// An owner process replaces its program (`exec`) with one that holds
/// other bytes at the same address, under the same pid. A read with the
/// old descriptor must not copy the new program's memory and answer `Ok`.
/// Reads are copied by the caller (`caller_copy_limit` above the read) or
/// by the progress thread (`0`).
fn a_read_from_an_owner_that_replaced_its_program_never_copies_the_new_program(limit: usize) {
    let mut owner = Owner::spawn_without_aslr_to_exec(0, 0x5A);
    let descriptor = owner.descriptor.clone();
    let reader = SameHostReader::reading(&owner, limit);
    let pid = owner.child.id();
    let replaced = owner.exec();
    assert_eq!(owner.child.id(), pid);
    assert_eq!(
        replaced.addr(),
        descriptor.addr(),
        "without randomisation the new program's buffer lies where the old one's did"
    );
    let mut answers = Vec::new();
    let mut new_bytes_read = 0;
    for _ in 0..5 {
        reader.dst.fill(0);
        let answer = reader.read();
        if answer.is_ok()
            && reader.dst.snapshot() == PageBuf::filled(4096, |i| pattern(i) ^ 0x5A).snapshot()
        {
            new_bytes_read += 1;
        }
        answers.push(answer);
    }
    reader.finish();
    drop(owner);
    assert!(
        answers.iter().all(Result::is_err),
        "reads from the replaced owner answered {answers:?}, {new_bytes_read} with the new program's bytes"
    );
}

/// The id of the thread an engine address names its process by.
fn published_thread(address: &Bytes) -> u32 {
    rdmareg_ucx::EngineAddress::decode(address)
        .expect("an engine address")
        .process
        .and_then(|process| process.thread)
        .expect("the address names a thread")
}

/// Reads of 512-byte pieces of `request`'s first 4 KiB, last piece first,
/// each landing at its own offset.
fn pieces_last_first(request: &rdmareg_core::BackendGet) -> Vec<rdmareg_core::BackendGet> {
    (0..8u64)
        .rev()
        .map(|i| {
            let mut piece = request.clone();
            piece.remote_addr += i * 512;
            piece.local_offset += i * 512;
            piece.len = 512;
            piece
        })
        .collect()
}

/// A consumer reads an owner on the same host, and then the owner's main
/// thread exits while its engine's threads run: the process is alive, and
/// same-host reads from it (copied by the caller with `limit` above the
/// read, or by the progress thread with `0`) answer `Ok` with its bytes,
/// one by one and in a batch of pieces, as long as it lives so. By pid
/// alone the kernel finds no address space for such a process, and every
/// read failed as if the owner were gone.
fn an_owner_whose_main_thread_exited_still_serves_same_host_reads(limit: usize) {
    let mut owner = Owner::spawn_main_thread_exiting_when_told(1);
    let reader = SameHostReader::reading(&owner, limit);
    let copied_before = reader.engine.reads_copied_on_caller_threads();
    owner.end_main_thread();
    let want = PageBuf::filled(4096, pattern).snapshot();
    let mut answers = Vec::new();
    let mut right = 0;
    for _ in 0..6 {
        reader.dst.fill(0);
        answers.push(reader.read());
        if reader.dst.snapshot() == want {
            right += 1;
        }
    }
    reader.dst.fill(0);
    let batch = reader.rt.block_on(
        reader
            .backend
            .get_batch_into_test_memory(pieces_last_first(&reader.request)),
    );
    let batch_right = reader.dst.snapshot() == want;
    let copied_by_callers = reader.engine.reads_copied_on_caller_threads() - copied_before;
    let still_exited = owner.main_thread_exited();
    reader.finish();
    assert!(
        answers.iter().all(Result::is_ok) && right == answers.len(),
        "reads from a live owner whose main thread exited answered {answers:?}, {right} with its bytes"
    );
    assert!(
        batch == vec![Ok(()); 8] && batch_right,
        "a batch from a live owner whose main thread exited answered {batch:?} (bytes right: {batch_right})"
    );
    assert!(still_exited, "the owner's main thread stayed exited");
    if limit > 0 {
        // The owner was checked before its main thread exited: every read
        // since, the batch's pieces included, is the caller's.
        assert_eq!(copied_by_callers, 6 + 8, "reads copied by the caller");
    } else {
        assert_eq!(copied_by_callers, 0, "reads copied by the caller");
    }
    owner.finish();
}

/// An owner shuts its engine down and lives on, and writes other bytes
/// into the buffer the engine served. Reads with the descriptor it gave
/// out (copied by the caller, or by the thread with `limit` 0) must fail
/// from then on, and never deliver the new bytes: the thread the engine
/// address names ended with the engine.
fn reads_from_an_owner_whose_engine_shut_down_fail_and_never_copy_its_new_bytes(limit: usize) {
    let mut owner = Owner::spawn("same-host", 4096);
    let mut reader = SameHostReader::reading(&owner, limit);
    reader.request.deadline = Some(Duration::from_secs(2));
    owner.shut_down_first_engine();
    let new_bytes = PageBuf::filled(4096, |i| pattern(i) ^ SHUT_DOWN_XOR).snapshot();
    let mut answers = Vec::new();
    let mut landed = 0;
    let mut new_bytes_read = 0;
    for _ in 0..4 {
        reader.dst.fill(0);
        answers.push(reader.read());
        let got = reader.dst.snapshot();
        landed += usize::from(got != vec![0; 4096]);
        new_bytes_read += usize::from(got == new_bytes);
    }
    reader.finish();
    owner.finish();
    assert!(
        answers.iter().all(Result::is_err) && landed == 0,
        "reads after the owner's engine shut down answered {answers:?}; {landed} left bytes, {new_bytes_read} the new ones"
    );
}

/// An owner process runs two engines, each serving a buffer of its own. A
/// consumer reads both, alone and in one batch that interleaves them; the
/// owner's main thread exits, the first engine shuts down, and the process
/// lives on. Then reads from the first fail (and never deliver the
/// bytes it left behind) while reads from the second, in the same batches,
/// still answer `Ok` with its bytes: each engine's reads name its own
/// thread.
fn a_second_engine_in_the_owner_process_serves_on_after_the_first_shuts_down() {
    const FIRST: PeerId = OWNER;
    const SECOND: PeerId = PeerId(2);
    let mut owner = Owner::spawn_main_thread_exiting_when_told(2);
    let (second_address, second_descriptor) = owner.others[0].clone();
    assert_ne!(
        published_thread(&owner.address),
        published_thread(&second_address),
        "each engine names its own thread"
    );
    let engine = UcxEngine::start(config(Transport::SameHost).with_caller_copy_limit(0))
        .expect("consumer engine starts");
    engine.add_peer(FIRST, owner.address.clone()).unwrap();
    engine.add_peer(SECOND, second_address).unwrap();
    let backend = engine.backend();
    let rt = runtime();
    let dst = PageBuf::zeroed(2 * 4096);
    let region = rt.block_on(map(&backend, &dst));
    let first = get_request(FIRST, &owner.descriptor, &region, 0, None);
    let second = get_request(SECOND, &second_descriptor, &region, 4096, None);
    // Pieces of both, alternating.
    let interleaved: Vec<_> = pieces_last_first(&first)
        .into_iter()
        .zip(pieces_last_first(&second))
        .flat_map(|(a, b)| [a, b])
        .collect();
    let want = PageBuf::filled(4096, pattern).snapshot();
    let halves = |dst: &PageBuf| {
        let got = dst.snapshot();
        (got[..4096] == want[..], got[4096..] == want[..])
    };

    let alone = [
        rt.block_on(backend.get_into_test_memory(first.clone())),
        rt.block_on(backend.get_into_test_memory(second.clone())),
    ];
    assert_eq!(alone, [Ok(()), Ok(())], "reads from both engines");
    dst.fill(0);
    let batch = rt.block_on(backend.get_batch_into_test_memory(interleaved.clone()));
    assert_eq!(batch, vec![Ok(()); 16], "a batch from both engines");
    assert_eq!(halves(&dst), (true, true), "both engines' bytes");

    owner.end_main_thread();
    owner.shut_down_first_engine();
    let new_bytes = PageBuf::filled(4096, |i| pattern(i) ^ SHUT_DOWN_XOR).snapshot();
    let mut first_answers = Vec::new();
    let mut second_answers = Vec::new();
    let mut first_landed = 0;
    let mut first_new_bytes = 0;
    let mut second_right = 0;
    for round in 0..3 {
        dst.fill(0);
        let answers = if round == 0 {
            vec![
                rt.block_on(backend.get_into_test_memory(first.clone())),
                rt.block_on(backend.get_into_test_memory(second.clone())),
            ]
        } else {
            rt.block_on(backend.get_batch_into_test_memory(interleaved.clone()))
        };
        for (index, answer) in answers.into_iter().enumerate() {
            if index % 2 == 0 {
                first_answers.push(answer);
            } else {
                second_answers.push(answer);
            }
        }
        let got = dst.snapshot();
        first_landed += usize::from(got[..4096] != [0; 4096][..]);
        first_new_bytes += usize::from(got[..4096] == new_bytes[..]);
        second_right += usize::from(got[4096..] == want[..]);
    }
    let still_exited = owner.main_thread_exited();
    rt.block_on(async {
        assert_eq!(backend.unmap(region.backend_region_id).await, Ok(()));
    });
    engine.shutdown_blocking();
    owner.finish();
    assert!(
        first_answers.iter().all(Result::is_err) && first_landed == 0,
        "reads from the shut-down engine answered {first_answers:?}; {first_landed} rounds left bytes, {first_new_bytes} the new ones"
    );
    assert!(
        second_answers.iter().all(Result::is_ok) && second_right == 3,
        "reads from the engine still running answered {second_answers:?}, {second_right} of 3 rounds with its bytes"
    );
    assert!(still_exited, "the owner's main thread stayed exited");
}

/// A peer's engine address names the honest owner's process (pid and
/// token) but the thread of another process of the same user, whose
/// buffer and token lie at the same addresses (both started without
/// address randomisation). Reads with the honest owner's descriptor never
/// deliver the other process's bytes: the release table the address names
/// is not found through the other's thread (its id differs), so the reads
/// go through the honest owner's engine, which serves its own bytes (and
/// a copy would have read the other's token first, and failed).
fn a_read_whose_peer_address_names_another_process_thread_never_copies_that_process() {
    use rdmareg_ucx::{EngineAddress, ProcessIdentity};
    let honest = Owner::spawn_without_aslr(0);
    let other = Owner::spawn_without_aslr(0x5A);
    assert_eq!(
        honest.descriptor.addr(),
        other.descriptor.addr(),
        "without randomisation both buffers lie at one address"
    );
    let honest_address = EngineAddress::decode(&honest.address).unwrap();
    let honest_process = honest_address.process.expect("the owner names its process");
    let other_process = EngineAddress::decode(&other.address)
        .unwrap()
        .process
        .expect("the other names its process");
    assert_eq!(
        honest_process.token_addr, other_process.token_addr,
        "without randomisation both tokens lie at one address"
    );
    let forged = EngineAddress {
        process: Some(ProcessIdentity {
            thread: other_process.thread,
            ..honest_process
        }),
        ..honest_address
    }
    .encode()
    .unwrap();
    let mut reader = SameHostReader::new(forged, &honest.descriptor, 0);
    reader.request.deadline = Some(Duration::from_secs(2));
    let other_bytes = PageBuf::filled(4096, |i| pattern(i) ^ 0x5A).snapshot();
    let honest_bytes = PageBuf::filled(4096, pattern).snapshot();
    let mut answers = Vec::new();
    let mut honest_bytes_read = 0;
    let mut other_bytes_read = 0;
    for _ in 0..3 {
        reader.dst.fill(0);
        answers.push(reader.read());
        let got = reader.dst.snapshot();
        honest_bytes_read += usize::from(got == honest_bytes);
        other_bytes_read += usize::from(got == other_bytes);
    }
    reader.finish();
    honest.finish();
    other.finish();
    assert!(
        answers.iter().all(Result::is_ok) && honest_bytes_read == 3 && other_bytes_read == 0,
        "reads through a forged thread answered {answers:?}; {honest_bytes_read} rounds read the owner's bytes, {other_bytes_read} the other process's"
    );
}

fn main() {
    match std::env::var(ROLE).as_deref() {
        Ok("owner") => return owner_main(),
        Ok("consumer") => return consumer_main(),
        Ok("prober") => return prober_main(),
        Ok("refused_reader") => return refused_reader_main(),
        _ => {}
    }
    let tests: Vec<(&str, TestFn)> = vec![
        (
            "an_owner_whose_main_thread_exited_still_serves_same_host_reads_by_the_caller",
            Box::new(|| {
                an_owner_whose_main_thread_exited_still_serves_same_host_reads(
                    rdmareg_ucx::UcxConfig::DEFAULT_CALLER_COPY_LIMIT,
                )
            }),
        ),
        (
            "an_owner_whose_main_thread_exited_still_serves_same_host_reads_by_the_thread",
            Box::new(|| an_owner_whose_main_thread_exited_still_serves_same_host_reads(0)),
        ),
        (
            "reads_from_an_owner_whose_engine_shut_down_fail_and_never_copy_its_new_bytes_by_the_caller",
            Box::new(|| {
                reads_from_an_owner_whose_engine_shut_down_fail_and_never_copy_its_new_bytes(
                    rdmareg_ucx::UcxConfig::DEFAULT_CALLER_COPY_LIMIT,
                )
            }),
        ),
        (
            "reads_from_an_owner_whose_engine_shut_down_fail_and_never_copy_its_new_bytes_by_the_thread",
            Box::new(|| {
                reads_from_an_owner_whose_engine_shut_down_fail_and_never_copy_its_new_bytes(0)
            }),
        ),
        (
            "a_second_engine_in_the_owner_process_serves_on_after_the_first_shuts_down",
            Box::new(a_second_engine_in_the_owner_process_serves_on_after_the_first_shuts_down),
        ),
        (
            "a_read_whose_peer_address_names_another_process_thread_never_copies_that_process",
            Box::new(
                a_read_whose_peer_address_names_another_process_thread_never_copies_that_process,
            ),
        ),
        (
            "a_thread_id_taken_over_before_any_read_saw_the_owner_gone_is_never_copied_from_by_the_caller",
            Box::new(|| {
                a_read_from_an_owner_that_died_never_copies_from_the_process_that_took_its_id(
                    rdmareg_ucx::UcxConfig::DEFAULT_CALLER_COPY_LIMIT,
                    false,
                    TakenId::Thread,
                )
            }),
        ),
        (
            "a_thread_id_taken_over_before_any_read_saw_the_owner_gone_is_never_copied_from_by_the_thread",
            Box::new(|| {
                a_read_from_an_owner_that_died_never_copies_from_the_process_that_took_its_id(
                    0,
                    false,
                    TakenId::Thread,
                )
            }),
        ),
        (
            "a_read_from_an_owner_that_died_never_copies_from_the_process_that_took_its_pid_by_the_caller",
            Box::new(|| {
                a_read_from_an_owner_that_died_never_copies_from_the_process_that_took_its_id(
                    rdmareg_ucx::UcxConfig::DEFAULT_CALLER_COPY_LIMIT,
                    true,
                    TakenId::Pid,
                )
            }),
        ),
        (
            "a_read_from_an_owner_that_died_never_copies_from_the_process_that_took_its_pid_by_the_thread",
            Box::new(|| {
                a_read_from_an_owner_that_died_never_copies_from_the_process_that_took_its_id(
                    0,
                    true,
                    TakenId::Pid,
                )
            }),
        ),
        (
            "a_read_from_an_owner_that_replaced_its_program_never_copies_the_new_program_by_the_caller",
            Box::new(|| {
                a_read_from_an_owner_that_replaced_its_program_never_copies_the_new_program(
                    rdmareg_ucx::UcxConfig::DEFAULT_CALLER_COPY_LIMIT,
                )
            }),
        ),
        (
            "a_read_from_an_owner_that_replaced_its_program_never_copies_the_new_program_by_the_thread",
            Box::new(|| {
                a_read_from_an_owner_that_replaced_its_program_never_copies_the_new_program(0)
            }),
        ),
        (
            "a_pid_taken_over_before_any_read_saw_the_owner_gone_is_never_copied_from_by_the_caller",
            Box::new(|| {
                a_read_from_an_owner_that_died_never_copies_from_the_process_that_took_its_id(
                    rdmareg_ucx::UcxConfig::DEFAULT_CALLER_COPY_LIMIT,
                    false,
                    TakenId::Pid,
                )
            }),
        ),
        (
            "a_pid_taken_over_before_any_read_saw_the_owner_gone_is_never_copied_from_by_the_thread",
            Box::new(|| {
                a_read_from_an_owner_that_died_never_copies_from_the_process_that_took_its_id(
                    0,
                    false,
                    TakenId::Pid,
                )
            }),
        ),
        (
            "a_pid_taken_over_by_a_process_that_refuses_copies_is_never_read_once_it_allows_them_by_the_caller",
            Box::new(|| run_refused_reader(rdmareg_ucx::UcxConfig::DEFAULT_CALLER_COPY_LIMIT)),
        ),
        (
            "a_pid_taken_over_by_a_process_that_refuses_copies_is_never_read_once_it_allows_them_by_the_thread",
            Box::new(|| run_refused_reader(0)),
        ),
        (
            "get_across_processes_moves_the_right_bytes_over_tcp",
            Box::new(|| get_across_processes_moves_the_right_bytes("tcp")),
        ),
        (
            "get_across_processes_moves_the_right_bytes_over_same_host",
            Box::new(|| get_across_processes_moves_the_right_bytes("same-host")),
        ),
        (
            "a_put_across_processes_lands_and_reads_back_over_tcp",
            Box::new(|| a_put_across_processes_lands_and_reads_back("tcp")),
        ),
        (
            "a_put_across_processes_lands_and_reads_back_over_same_host",
            Box::new(|| a_put_across_processes_lands_and_reads_back("same-host")),
        ),
        (
            "a_thousand_reads_in_one_batch_land_where_each_entry_says_over_tcp",
            Box::new(|| a_thousand_reads_in_one_batch_land_where_each_entry_says("tcp")),
        ),
        (
            "a_thousand_reads_in_one_batch_land_where_each_entry_says_over_same_host",
            Box::new(|| a_thousand_reads_in_one_batch_land_where_each_entry_says("same-host")),
        ),
        (
            "a_killed_peer_fails_gets_promptly_and_the_engine_serves_another_peer_over_tcp",
            Box::new(|| {
                a_killed_peer_fails_gets_promptly_and_the_engine_serves_another_peer("tcp")
            }),
        ),
        (
            "a_killed_peer_fails_gets_promptly_and_the_engine_serves_another_peer_over_same_host",
            Box::new(|| {
                a_killed_peer_fails_gets_promptly_and_the_engine_serves_another_peer("same-host")
            }),
        ),
        (
            "a_forged_envelope_added_first_cannot_pin_an_owners_direct_lane",
            Box::new(a_forged_envelope_added_first_cannot_pin_an_owners_direct_lane),
        ),
        (
            "a_stopped_peer_makes_a_get_time_out_at_its_deadline",
            Box::new(a_stopped_peer_makes_a_get_time_out_at_its_deadline),
        ),
        (
            "killed_consumers_never_take_the_owner_down_over_tcp",
            Box::new(|| killed_consumers_never_take_the_owner_down("tcp", 40)),
        ),
        (
            "a_reader_of_the_owners_user_reads_one_sided_on_the_same_host",
            Box::new(|| {
                let answer = probe_same_host_owner(None);
                assert_eq!(
                    answer, "PROBED real=Ok(()) forged=Ok(()) bytes_right=true",
                    "a same-user reader goes one-sided: the owner checks nothing"
                );
            }),
        ),
        (
            "a_reader_of_another_user_reads_a_same_host_owner_only_through_the_owner",
            Box::new(|| {
                // SAFETY: geteuid takes no arguments and cannot fail.
                if unsafe { libc::geteuid() } != 0 {
                    eprintln!("not run: switching to another user needs root");
                    return;
                }
                let answer = probe_same_host_owner(Some(65534));
                assert_eq!(
                    answer, "PROBED real=Ok(()) forged=Err(RegionNotFound) bytes_right=true",
                    "another user's reader is refused the direct lane and goes through the owner"
                );
            }),
        ),
        (
            "killed_consumers_never_take_the_owner_down_over_same_host",
            Box::new(|| killed_consumers_never_take_the_owner_down("same-host", 12)),
        ),
    ];
    let args = HarnessArgs::parse(std::env::args().skip(1));
    let selected: Vec<_> = tests
        .iter()
        .filter(|(name, _)| args.selects(name))
        .collect();
    if args.list {
        // The libtest listing format test runners (cargo-nextest) read:
        // "<name>: test" per line. Nothing here is ignored.
        if !args.ignored {
            for (name, _) in &selected {
                println!("{name}: test");
            }
        }
        return;
    }
    println!("\nrunning {} tests", selected.len());
    let mut failed = Vec::new();
    for (name, test) in selected {
        let started = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(test));
        let verdict = if outcome.is_ok() { "ok" } else { "FAILED" };
        println!("test {name} ... {verdict} ({:.2?})", started.elapsed());
        if outcome.is_err() {
            failed.push(*name);
        }
    }
    if failed.is_empty() {
        println!("\ntest result: ok.");
    } else {
        println!("\ntest result: FAILED. failures: {failed:?}");
        std::process::exit(101);
    }
}

/// The subset of libtest's command line this harness honours: name filters
/// (substring, or equality with `--exact`), `--list` (with `--ignored`), and
/// flags it can ignore (`--nocapture`, `--format <f>`, ...).
struct HarnessArgs {
    filters: Vec<String>,
    exact: bool,
    list: bool,
    ignored: bool,
}

impl HarnessArgs {
    fn parse(args: impl Iterator<Item = String>) -> Self {
        let mut parsed = HarnessArgs {
            filters: Vec::new(),
            exact: false,
            list: false,
            ignored: false,
        };
        let mut args = args.peekable();
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--exact" => parsed.exact = true,
                "--list" => parsed.list = true,
                "--ignored" => parsed.ignored = true,
                // Options that take a value: skip the value too.
                "--format" | "--logfile" | "--test-threads" | "--skip" | "--color" | "-Z" => {
                    args.next();
                }
                flag if flag.starts_with('-') => {}
                filter => parsed.filters.push(filter.to_owned()),
            }
        }
        parsed
    }

    fn selects(&self, name: &str) -> bool {
        self.filters.is_empty()
            || self.filters.iter().any(|f| {
                if self.exact {
                    name == f
                } else {
                    name.contains(f.as_str())
                }
            })
    }
}
