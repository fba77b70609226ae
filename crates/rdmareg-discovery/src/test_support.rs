//! A real etcd for tests: one server per test, on random loopback ports, with
//! a data directory of its own that is removed when the server is dropped.
//!
//! Needs the `etcd` binary on `PATH` (`cargo xtask etcd` installs Debian's
//! `etcd-server`), or its path in `RDMAREG_ETCD`. The server can be stopped
//! and started again on the same ports and data so tests can cut a client off
//! and let it reconnect, or started again on the same ports with its data
//! gone ([`EtcdServer::wipe`]), as after a lost disk.

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// How long a fresh etcd gets to accept client connections.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// An etcd server owned by a test. Dropping it kills the server and removes
/// its data directory.
#[derive(Debug)]
pub struct EtcdServer {
    child: Option<Child>,
    data: TempDir,
    client_port: u16,
    peer_port: u16,
    /// While stopped, the server's ports stay bound here, so another test
    /// looking for a free port cannot take them before the restart.
    reserved: Vec<TcpListener>,
}

/// Why a test etcd could not be started or used.
#[derive(Debug, thiserror::Error)]
pub enum EtcdStartError {
    /// The binary could not be run.
    #[error("cannot run `{program}` ({error}); install it with `cargo xtask etcd`")]
    Spawn {
        /// The program tried.
        program: String,
        /// What the OS said.
        error: std::io::Error,
    },
    /// A filesystem or socket step failed.
    #[error("cannot prepare a test etcd: {0}")]
    Io(#[from] std::io::Error),
    /// The server exited or never listened.
    #[error("test etcd did not come up: {0}")]
    NotReady(String),
    /// A request to the running server was refused.
    #[error("a request to the test etcd failed: {0}")]
    Request(String),
}

impl EtcdServer {
    /// Starts a new single-member etcd on two free loopback ports.
    pub fn start() -> Result<Self, EtcdStartError> {
        let mut last = None;
        // A free port found by binding can be taken by someone else before
        // etcd binds it: a few tries with fresh ports absorb that race.
        for _ in 0..3 {
            let data = tempfile::Builder::new().prefix("rdmareg-etcd-").tempdir()?;
            let mut server = EtcdServer {
                child: None,
                data,
                client_port: free_port()?,
                peer_port: free_port()?,
                reserved: Vec::new(),
            };
            match server.launch() {
                Ok(()) => return Ok(server),
                Err(e @ EtcdStartError::Spawn { .. }) => return Err(e),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| EtcdStartError::NotReady("no attempt made".into())))
    }

    /// The client URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// The data directory (removed on drop).
    pub fn data_dir(&self) -> &Path {
        self.data.path()
    }

    /// Kills the server (as a crash would), keeping ports and data.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            // Best effort: a port that cannot be bound again right now is
            // simply not reserved.
            self.reserved = [self.client_port, self.peer_port]
                .into_iter()
                .filter_map(|port| TcpListener::bind((Ipv4Addr::LOCALHOST, port)).ok())
                .collect();
        }
    }

    /// Starts the server again on the same ports and data after [`stop`](Self::stop).
    pub fn restart(&mut self) -> Result<(), EtcdStartError> {
        self.stop();
        self.launch()
    }

    /// Writes `revisions` times to one key outside every cluster prefix
    /// (`/aging`), through etcd's JSON gateway: afterwards the store's
    /// revision is at least that much higher, as in an etcd that has been in
    /// use for a while.
    pub fn age(&self, revisions: u32) -> Result<(), EtcdStartError> {
        use std::io::{Read, Write};
        let body = r#"{"key":"L2FnaW5n","value":"MQ=="}"#;
        let request = format!(
            "POST /v3/kv/put HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        for _ in 0..revisions {
            let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, self.client_port))?;
            stream.set_read_timeout(Some(Duration::from_secs(10)))?;
            stream.write_all(request.as_bytes())?;
            let mut response = String::new();
            stream.read_to_string(&mut response)?;
            if !response.starts_with("HTTP/1.1 200") {
                return Err(EtcdStartError::Request(format!(
                    "a put to age the store: {response}"
                )));
            }
        }
        Ok(())
    }

    /// Kills the server and starts it again on the same ports with an empty
    /// data directory, as an operator does after losing etcd's disk. The new
    /// store counts revisions from 1 again; with the same name and peer URL
    /// it has the same cluster and member ids as the old one.
    pub fn wipe(&mut self) -> Result<(), EtcdStartError> {
        self.stop();
        match std::fs::remove_dir_all(self.member_dir()) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
            _ => {}
        }
        self.launch()
    }

    fn launch(&mut self) -> Result<(), EtcdStartError> {
        // Hand the ports back to etcd.
        self.reserved.clear();
        let program = std::env::var("RDMAREG_ETCD").unwrap_or_else(|_| "etcd".to_string());
        let client = self.url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::File::create(self.data.path().join("etcd.log"))?;
        let child = Command::new(&program)
            .arg("--name=test")
            .arg(format!("--data-dir={}", self.member_dir().display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=test={peer}"))
            .arg("--initial-cluster-state=new")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|error| EtcdStartError::Spawn {
                program: program.clone(),
                error,
            })?;
        self.child = Some(child);
        self.wait_ready()
    }

    fn member_dir(&self) -> PathBuf {
        self.data.path().join("member-data")
    }

    fn wait_ready(&mut self) -> Result<(), EtcdStartError> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                self.child = None;
                return Err(EtcdStartError::NotReady(format!(
                    "etcd exited ({status}); log: {}",
                    self.log_tail()
                )));
            }
            if TcpStream::connect((Ipv4Addr::LOCALHOST, self.client_port)).is_ok() && self.healthy()
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                self.stop();
                return Err(EtcdStartError::NotReady(format!(
                    "no client port after {START_TIMEOUT:?}; log: {}",
                    self.log_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Asks `/health` over plain HTTP: etcd reports itself healthy once it
    /// has a leader.
    fn healthy(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut stream) = TcpStream::connect((Ipv4Addr::LOCALHOST, self.client_port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
        let request = "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
        if stream.write_all(request.as_bytes()).is_err() {
            return false;
        }
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response);
        response.contains("\"health\":\"true\"")
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.data.path().join("etcd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().rev().take(5).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join("\n")
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A loopback TCP port that was free a moment ago.
pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}
