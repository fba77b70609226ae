//! [`UcxConfig`]: which transports an engine uses, its progress loop and GET deadline.
//!
//! UCX settings go into the engine's own `ucp_config_t`, never the process
//! environment, so two engines in one process can run different transports.
//!
//! # Precedence
//!
//! 1. [`UcxConfig::extra`], applied last, wins over everything but point 5.
//! 2. The [`Transport`] and [`UcxConfig::net_devices`] win over `UCX_TLS`
//!    and `UCX_NET_DEVICES`; [`Transport::Auto`] leaves the choice to UCX.
//! 3. The memory-hook, cma invalidation, tcp segment and tcp vector
//!    defaults apply only where the environment sets no `UCX_*` value.
//! 4. `TCP_PUT_ENABLE=n` wins over the environment: tcp PUT lets a peer
//!    write anywhere in the process and the engine never uses it.
//! 5. Whatever the above says, the transport list never holds System V
//!    shared memory (`sysv`, also through the `shm`, `sm` and `mm` aliases),
//!    and posix shared memory is shared through `/proc/<pid>/fd`. A list
//!    that named `sysv` is used without it, with one warning; a list with
//!    nothing left fails [`UcxEngine::start`](crate::UcxEngine::start).
//! 6. Keepalive every second over every endpoint unless the environment
//!    sets it: it is how an owner learns a consumer closed its endpoint.
//!
//! Why each default, and the list of variables: `docs/operations.md`;
//! why no `sysv` and no tcp PUT: `docs/safety.md`.

use std::time::Duration;

/// Which UCX transports an engine may use.
///
/// Peer error handling (`UCP_ERR_HANDLING_MODE_PEER`) is on for every choice
/// but [`Transport::SharedMemoryNoErrorHandling`]: with it, a dead peer fails
/// its GETs instead of hanging them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Transport {
    /// Let UCX choose (honouring `UCX_TLS` if set). What production on RDMA
    /// hardware uses: a site UCX picks InfiniBand/RoCE by itself.
    #[default]
    Auto,
    /// `UCX_TLS=tcp`. The owner's engine serves each read, so a read
    /// completes only while that engine progresses.
    Tcp,
    /// Same-host lane: `tcp,cma` with `CMA_MEMORY_INVALIDATE=y` and peer
    /// error handling. Requests, small replies and keepalive go over tcp;
    /// the consumer's UCX pulls large replies with cma while leased.
    SameHost,
    /// Pure shared memory (`UCX_TLS=posix,cma`, never System V) with peer
    /// error handling **off**, which UCX refuses on these transports: a GET
    /// to a dead peer fails with an I/O error or at its deadline, and
    /// endpoint failures are never reported.
    SharedMemoryNoErrorHandling,
    /// An explicit `UCX_TLS` value, with peer error handling on (and
    /// without System V shared memory, see the module docs).
    Custom {
        /// The comma-separated transport list, as `UCX_TLS` spells it.
        tls: String,
    },
}

impl Transport {
    /// Whether endpoints are created with `UCP_ERR_HANDLING_MODE_PEER`.
    pub fn peer_error_handling(&self) -> bool {
        !matches!(self, Transport::SharedMemoryNoErrorHandling)
    }

    fn tls(&self) -> Option<&str> {
        match self {
            Transport::Auto => None,
            Transport::Tcp => Some("tcp"),
            Transport::SameHost => Some("tcp,cma"),
            Transport::SharedMemoryNoErrorHandling => Some("posix,cma"),
            Transport::Custom { tls } => Some(tls),
        }
    }
}

/// How to start a [`UcxEngine`](crate::UcxEngine).
///
/// Start from [`UcxConfig::default`] and adjust with the `with_*` methods (or
/// the public fields).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct UcxConfig {
    /// Transport selection; see [`Transport`].
    pub transport: Transport,
    /// `NET_DEVICES` for this engine (`"lo"` keeps loopback tests off other
    /// interfaces). `None` leaves it to UCX and the environment.
    pub net_devices: Option<String>,
    /// Extra UCX configuration keys (without the `UCX_` prefix) and values,
    /// applied after everything else.
    pub extra: Vec<(String, String)>,
    /// Capacity of the bounded command ring between submitters and the
    /// progress thread.
    pub ring_capacity: usize,
    /// How long the progress loop spins after its last work before it
    /// arms the worker and sleeps; submissions meanwhile cost no wake-up.
    pub spin_window: Duration,
    /// Longest single sleep of the progress loop, against a lost wake-up.
    pub park_timeout: Duration,
    /// Deadline of a GET that carries none (only GETs issued on the backend
    /// directly: a registry attaches `RdmaConfig::get_deadline` to each).
    pub default_get_deadline: Duration,
    /// How long teardown waits before it destroys the worker anyway (at
    /// most three quarters for reads and replies to finish, the rest for
    /// UCX to release what closing the endpoints cancelled).
    pub teardown_timeout: Duration,
    /// Whether this engine opens the same-host direct-read lane, on which
    /// same-host, same-user peers read its registrations with cma
    /// (`process_vm_readv`), unchecked by this engine, and it reads theirs.
    /// `None` opens it on [`Transport::Auto`], [`Transport::SameHost`] and
    /// [`Transport::SharedMemoryNoErrorHandling`] only. See the crate docs
    /// ("Lanes").
    pub same_host_direct_reads: Option<bool>,
    /// Whether, with the direct lane open, this engine lets same-host peers
    /// write its writable registrations one-sided (`process_vm_writev`
    /// under its release table's lock), and writes theirs so. The owner's
    /// engine never sees such writes, so its written log
    /// (`RdmaBackend::take_written`) cannot list them; an owner that needs
    /// that log complete turns this off, and every write into it is served.
    /// `true` by default.
    pub same_host_direct_writes: bool,
    /// Most served replies this engine, as an owner, keeps unfinished for
    /// one consumer connection; must be at least 1.
    ///
    /// Each holds a read lease on its region and a UCX send, so without a
    /// bound one consumer that asks and never takes would grow the owner's
    /// memory and stall its unmaps. A valid read beyond the bound is refused
    /// as busy: the caller gets [`RdmaError::Backend`] with
    /// [`BUSY_TEXT`](crate::read_protocol::BUSY_TEXT), a transient error.
    /// Refusals not yet taken are bounded by the same number, separately;
    /// past it requests get no reply and run into their deadlines. Only
    /// served reads count, each chunk of a chunked read as one (see
    /// [`UcxEngine::reads_asked_in_chunks`]). The default,
    /// [`Self::DEFAULT_MAX_SERVED_REPLIES_PER_CONNECTION`], is four times
    /// the 1024 reads `rdmareg bench` keeps outstanding.
    ///
    /// [`UcxEngine::reads_asked_in_chunks`]: crate::UcxEngine::reads_asked_in_chunks
    /// [`RdmaError::Backend`]: rdmareg_core::RdmaError::Backend
    pub max_served_replies_per_connection: u32,
    /// CPUs the progress thread runs on; `None` (the default) leaves it to
    /// the kernel (see `affinity`). Every number must be below
    /// `CPU_SETSIZE` (1024) and the set not empty; a set with no CPU online
    /// or allowed fails [`UcxEngine::start`](crate::UcxEngine::start).
    pub progress_cpus: Option<Vec<usize>>,
    /// Largest same-host direct read the caller's own thread copies.
    ///
    /// A read (or a batch, in all) of at most this many bytes from an owner
    /// this engine already copies from is one `process_vm_readv` inside
    /// [`RdmaBackend::get`](rdmareg_backend::RdmaBackend::get), with no
    /// hand-off to the progress thread. Maps, unmaps and peer changes wait
    /// for such a copy, which is why it is bounded. 0 sends every read
    /// through the thread. Default: [`Self::DEFAULT_CALLER_COPY_LIMIT`].
    pub caller_copy_limit: usize,
    /// How many notices readers sent may wait for this engine's
    /// application, overall and per reader, and how many idle readers it
    /// remembers (see `rdmareg_engine::notices::inbox`). Notices past the
    /// bound are dropped and counted. Default:
    /// [`NoticeLimits::default`](rdmareg_engine::notices::NoticeLimits).
    pub notice_limits: rdmareg_engine::notices::NoticeLimits,
}

impl Default for UcxConfig {
    fn default() -> Self {
        UcxConfig {
            transport: Transport::Auto,
            net_devices: None,
            extra: Vec::new(),
            ring_capacity: 4096,
            spin_window: Duration::from_micros(50),
            park_timeout: Duration::from_millis(100),
            default_get_deadline: Duration::from_secs(30),
            teardown_timeout: Duration::from_secs(5),
            same_host_direct_reads: None,
            same_host_direct_writes: true,
            max_served_replies_per_connection: Self::DEFAULT_MAX_SERVED_REPLIES_PER_CONNECTION,
            progress_cpus: None,
            caller_copy_limit: Self::DEFAULT_CALLER_COPY_LIMIT,
            notice_limits: Default::default(),
        }
    }
}

impl UcxConfig {
    /// The default of [`Self::max_served_replies_per_connection`].
    pub const DEFAULT_MAX_SERVED_REPLIES_PER_CONNECTION: u32 = 4096;

    /// The default of [`Self::caller_copy_limit`]: 64 KiB, so maps and
    /// unmaps waiting behind a copy wait briefly.
    pub const DEFAULT_CALLER_COPY_LIMIT: usize = 64 * 1024;

    /// The tcp send segment (`UCX_TCP_TX_SEG_SIZE`) an engine uses unless
    /// the environment sets a segment size: UCX's default receive segment.
    pub const DEFAULT_TCP_SEND_SEGMENT: &'static str = "64K";

    /// The ranges one tcp zero-copy send may carry (`UCX_TCP_MAX_IOV`),
    /// unless the environment sets it: 16 lets a list reply of fifteen 4 KiB
    /// ranges leave as one fragment straight from its registrations.
    pub const DEFAULT_TCP_MAX_IOV: usize = 16;

    /// The keepalive interval (`UCX_KEEPALIVE_INTERVAL`) unless the
    /// environment sets one; UCX's 20 s default let a closed consumer
    /// endpoint hold the owner's side for minutes.
    pub const DEFAULT_KEEPALIVE_INTERVAL: &'static str = "1s";

    /// Bound the queue of notices readers send this engine (see
    /// [`Self::notice_limits`]).
    pub fn with_notice_limits(mut self, limits: rdmareg_engine::notices::NoticeLimits) -> Self {
        self.notice_limits = limits;
        self
    }

    /// Copy same-host direct reads of at most `bytes` on the caller's
    /// thread; 0 never does (see [`Self::caller_copy_limit`]).
    pub fn with_caller_copy_limit(mut self, bytes: usize) -> Self {
        self.caller_copy_limit = bytes;
        self
    }

    /// Keep at most `bound` served replies unfinished per consumer
    /// connection (see [`Self::max_served_replies_per_connection`]).
    pub fn with_max_served_replies_per_connection(mut self, bound: u32) -> Self {
        self.max_served_replies_per_connection = bound;
        self
    }

    /// Use `transport`.
    pub fn with_transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }

    /// Restrict UCX to `devices` (its `NET_DEVICES` syntax, e.g. `"lo"`).
    pub fn with_net_devices(mut self, devices: impl Into<String>) -> Self {
        self.net_devices = Some(devices.into());
        self
    }

    /// Set one more UCX configuration key (without the `UCX_` prefix).
    pub fn with_ucx_setting(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra.push((key.into(), value.into()));
        self
    }

    /// Use `deadline` for GETs that carry none (see
    /// [`default_get_deadline`](Self::default_get_deadline)).
    pub fn with_default_get_deadline(mut self, deadline: Duration) -> Self {
        self.default_get_deadline = deadline;
        self
    }

    /// Run the progress thread on these CPUs only (see
    /// [`Self::progress_cpus`]).
    pub fn with_progress_cpus(mut self, cpus: impl IntoIterator<Item = usize>) -> Self {
        self.progress_cpus = Some(cpus.into_iter().collect());
        self
    }

    /// Spin this long after the last work before sleeping.
    pub fn with_spin_window(mut self, spin: Duration) -> Self {
        self.spin_window = spin;
        self
    }

    /// Sleep at most this long at a time.
    pub fn with_park_timeout(mut self, timeout: Duration) -> Self {
        self.park_timeout = timeout;
        self
    }

    /// Give teardown this long to let UCX release in-flight work.
    pub fn with_teardown_timeout(mut self, timeout: Duration) -> Self {
        self.teardown_timeout = timeout;
        self
    }

    /// Open (or not) the same-host direct-read lane, whatever the transport;
    /// see [`UcxConfig::same_host_direct_reads`].
    pub fn with_same_host_direct_reads(mut self, enabled: bool) -> Self {
        self.same_host_direct_reads = Some(enabled);
        self
    }

    /// Let (or not) same-host peers write this engine's writable
    /// registrations one-sided; see [`UcxConfig::same_host_direct_writes`].
    pub fn with_same_host_direct_writes(mut self, enabled: bool) -> Self {
        self.same_host_direct_writes = enabled;
        self
    }

    /// Whether the same-host direct-read lane is opened.
    pub fn direct_reads_enabled(&self) -> bool {
        self.same_host_direct_reads.unwrap_or(matches!(
            self.transport,
            Transport::Auto | Transport::SameHost | Transport::SharedMemoryNoErrorHandling
        ))
    }

    /// The UCX key/values of the direct-read context: cma for the reads and
    /// the posix lane UCX requires beside it, shared through
    /// `/proc/<pid>/fd`; no network and no System V segment, so only a
    /// same-user process of this host reaches it.
    pub(crate) fn direct_read_settings(
        &self,
        env_sets: impl Fn(&str) -> bool,
    ) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        let mut set = |k: &str, v: &str| out.push((k.to_owned(), v.to_owned()));
        set("TLS", "posix,cma");
        set("POSIX_USE_PROC_LINK", "y");
        set("CMA_MEMORY_INVALIDATE", "y");
        if !env_sets("MEM_EVENTS") {
            set("MEM_EVENTS", "n");
        }
        if !env_sets("RCACHE_ENABLE") {
            set("RCACHE_ENABLE", "n");
        }
        out
    }

    /// [`Self::direct_read_settings`] against the real process environment.
    pub(crate) fn direct_read_settings_from_env(&self) -> Vec<(String, String)> {
        self.direct_read_settings(environment_sets)
    }

    /// The UCX key/values this configuration applies, in order, given the
    /// environment's `UCX_<KEY>` values (`env("TLS")` is `UCX_TLS`).
    ///
    /// `TCP_PUT_ENABLE=n` is always among them (only [`Self::extra`] undoes
    /// it; see `docs/safety.md`). `TLS` (without `sysv`) and
    /// `POSIX_USE_PROC_LINK=y` come last: nothing undoes them.
    ///
    /// # Errors
    /// When the transport list has nothing left once `sysv` is taken out.
    pub(crate) fn ucx_settings(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<UcxSettings, String> {
        self.ucx_settings_with(env, &linked_ucx_has)
    }

    /// [`Self::ucx_settings`], with `has` saying which of the optional
    /// shared-memory transports (`xpmem`, `knem`) the UCX in use has: an
    /// alias spelled out names only those (UCX warns about a transport
    /// named outright that it lacks, never about one an alias names).
    fn ucx_settings_with(
        &self,
        env: impl Fn(&str) -> Option<String>,
        has: &dyn Fn(&str) -> bool,
    ) -> Result<UcxSettings, String> {
        let env_sets = |key: &str| env(key).is_some();
        let mut out: Vec<(String, String)> = Vec::new();
        let mut set = |k: &str, v: &str| out.push((k.to_owned(), v.to_owned()));
        let wants_invalidation = matches!(self.transport, Transport::SameHost)
            || (matches!(self.transport, Transport::Auto | Transport::Custom { .. })
                && !env_sets("CMA_MEMORY_INVALIDATE"));
        if wants_invalidation {
            set("CMA_MEMORY_INVALIDATE", "y");
        }
        if let Some(devices) = &self.net_devices {
            set("NET_DEVICES", devices);
        }
        if !env_sets("MEM_EVENTS") {
            set("MEM_EVENTS", "n");
        }
        if !env_sets("RCACHE_ENABLE") {
            set("RCACHE_ENABLE", "n");
        }
        // Sending in UCX's 64 KiB receive segment cuts a large read's
        // fragments by eight; a send segment may not exceed the receive
        // segment, so an environment that sets either keeps both.
        if !env_sets("TCP_TX_SEG_SIZE") && !env_sets("TCP_RX_SEG_SIZE") {
            set("TCP_TX_SEG_SIZE", UcxConfig::DEFAULT_TCP_SEND_SEGMENT);
        }
        if !env_sets("TCP_MAX_IOV") {
            set("TCP_MAX_IOV", &UcxConfig::DEFAULT_TCP_MAX_IOV.to_string());
        }
        if !env_sets("KEEPALIVE_INTERVAL") {
            set("KEEPALIVE_INTERVAL", UcxConfig::DEFAULT_KEEPALIVE_INTERVAL);
        }
        if !env_sets("KEEPALIVE_NUM_EPS") {
            set("KEEPALIVE_NUM_EPS", "inf");
        }
        // Off whatever the environment says (module docs, point 4).
        set("TCP_PUT_ENABLE", "n");
        let is_tls = |key: &str| key.eq_ignore_ascii_case("TLS");
        for (k, v) in self.extra.iter().filter(|(k, _)| !is_tls(k)) {
            set(k, v);
        }
        let (source, requested) = match self.extra.iter().rev().find(|(k, _)| is_tls(k)) {
            Some((_, tls)) => ("UcxConfig::extra's TLS", Some(tls.clone())),
            None => match self.transport.tls() {
                Some(tls) => ("the transport's TLS", Some(tls.to_owned())),
                None => ("UCX_TLS", env("TLS")),
            },
        };
        let tls = tls_without_sysv(requested.as_deref(), has)
            .map_err(|why| format!("{source}: {why}"))?;
        set("TLS", &tls.value);
        set("POSIX_USE_PROC_LINK", "y");
        let overridden = tls.named_sysv.then(|| {
            format!(
                "{source}={:?} names System V shared memory, whose segments every member of \
                 this process's group can open; using TLS={} instead",
                requested.unwrap_or_default(),
                tls.value
            )
        });
        Ok(UcxSettings {
            pairs: out,
            overridden,
        })
    }

    /// Whether served reads and writes may go in chunks over tcp
    /// (`progress::chunks`): the chunks are sized for UCX's rendezvous
    /// threshold and 64 KiB tcp segments, so an operator who sets either
    /// (or UCX's older protocols) gets reads whole and writes in chunks of
    /// 1 MiB.
    pub(crate) fn fragment_chunks_allowed(&self, env_sets: impl Fn(&str) -> bool) -> bool {
        const SHAPING: [&str; 4] = [
            "RNDV_THRESH",
            "TCP_TX_SEG_SIZE",
            "TCP_RX_SEG_SIZE",
            "PROTO_ENABLE",
        ];
        !SHAPING.iter().any(|key| {
            env_sets(key)
                || self
                    .extra
                    .iter()
                    .any(|(set, _)| set.eq_ignore_ascii_case(key))
        })
    }

    /// How many ranges one tcp zero-copy fragment carries: one less than
    /// the vector bound in force ([`Self::extra`]'s, else the environment's,
    /// else [`Self::DEFAULT_TCP_MAX_IOV`], a non-number counting as UCX's 6),
    /// because UCX 1.22 keeps one entry per fragment for its trailer, and
    /// at most 15 since UCP uses at most 16 entries (`UCP_MAX_IOV`).
    pub(crate) fn tcp_ranges_per_zero_copy_fragment(
        &self,
        env_value: impl Fn(&str) -> Option<String>,
    ) -> usize {
        /// UCX's own `TCP_MAX_IOV` and UCP's cap on vector entries.
        const UCX_DEFAULT_TCP_MAX_IOV: usize = 6;
        const UCP_MAX_IOV: usize = 16;
        let set_here = self
            .extra
            .iter()
            .rev()
            .find(|(key, _)| key.eq_ignore_ascii_case("TCP_MAX_IOV"))
            .map(|(_, value)| value.clone());
        let bound = match set_here.or_else(|| env_value("TCP_MAX_IOV")) {
            Some(value) => value.trim().parse().unwrap_or(UCX_DEFAULT_TCP_MAX_IOV),
            None => UcxConfig::DEFAULT_TCP_MAX_IOV,
        };
        bound.min(UCP_MAX_IOV).saturating_sub(1)
    }

    /// [`Self::tcp_ranges_per_zero_copy_fragment`] against the real process
    /// environment.
    pub(crate) fn tcp_ranges_per_zero_copy_fragment_by_env(&self) -> usize {
        self.tcp_ranges_per_zero_copy_fragment(environment_value)
    }

    /// [`Self::fragment_chunks_allowed`] against the real process
    /// environment.
    pub(crate) fn fragment_chunks_allowed_by_env(&self) -> bool {
        self.fragment_chunks_allowed(environment_sets)
    }

    /// [`Self::ucx_settings`] against the real process environment.
    pub(crate) fn ucx_settings_from_env(&self) -> Result<UcxSettings, String> {
        self.ucx_settings(|key| {
            std::env::var_os(format!("UCX_{key}")).map(|value| value.to_string_lossy().into_owned())
        })
    }

    /// Refuse settings the engine cannot run with.
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.ring_capacity == 0 {
            return Err("ring_capacity must be at least 1".into());
        }
        if self.park_timeout.is_zero() {
            return Err("park_timeout must be positive".into());
        }
        if self.default_get_deadline.is_zero() {
            return Err("default_get_deadline must be positive".into());
        }
        if self.max_served_replies_per_connection == 0 {
            return Err(
                "max_served_replies_per_connection must be at least 1 (0 would refuse every read)"
                    .into(),
            );
        }
        if let Some(cpus) = &self.progress_cpus {
            crate::affinity::validate(cpus)?;
        }
        for (k, v) in self.ucx_settings(|_| None)?.pairs {
            if k.is_empty() || k.contains('\0') || v.contains('\0') {
                return Err(format!("invalid UCX setting {k:?}={v:?}"));
            }
        }
        Ok(())
    }
}

/// What [`UcxConfig::ucx_settings`] gives the engine's UCX context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UcxSettings {
    /// Keys (without `UCX_`) and values, applied in order.
    pub(crate) pairs: Vec<(String, String)>,
    /// One line for the log when a transport list that named System V
    /// shared memory was used without it.
    pub(crate) overridden: Option<String>,
}

impl UcxSettings {
    /// Whether every lane to another process is tcp, read from the
    /// transport list alone: it allows `tcp` and nothing else but `self`
    /// (which reaches only the engine's own worker). A deny list, UCX's
    /// default or any other transport answers `false`, since which lanes a
    /// peer gets then depends on where it runs.
    ///
    /// The owner answers list requests from this rather than by asking UCX
    /// about the endpoint a request came on: UCX can hand a request handler
    /// an endpoint whose configuration is already gone (a consumer that
    /// vanished mid-list), and querying its lanes then reads freed memory.
    pub(crate) fn every_lane_is_tcp(&self) -> bool {
        let Some((_, tls)) = self.pairs.iter().rev().find(|(key, _)| key == "TLS") else {
            return false;
        };
        every_lane_is_tcp_under(tls)
    }
}

/// [`UcxSettings::every_lane_is_tcp`] for the `UCX_TLS` value `tls`.
fn every_lane_is_tcp_under(tls: &str) -> bool {
    if tls.trim_start().starts_with('^') {
        return false;
    }
    let mut names = tls
        .split(',')
        .map(|name| name.trim().trim_start_matches('\\').to_ascii_lowercase())
        .filter(|name| !name.is_empty())
        .peekable();
    let mut tcp = false;
    let only_tcp_and_self = names.peek().is_some()
        && names.all(|name| {
            tcp |= name == "tcp";
            name == "tcp" || name == "self"
        });
    only_tcp_and_self && tcp
}

/// A transport list without System V shared memory.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TlsWithoutSysv {
    /// What `UCX_TLS` is set to.
    value: String,
    /// Whether the requested list named `sysv`, itself or by an alias.
    named_sysv: bool,
}

/// UCX 1.22's transport aliases that include `sysv` (`ucp_tl_aliases` in
/// `ucp_context.c`), and what each stands for without it.
const ALIASES_WITH_SYSV: [(&str, &str); 3] = [
    ("mm", "posix,xpmem"),
    ("sm", "posix,xpmem,knem,cma"),
    ("shm", "posix,xpmem,knem,cma"),
];

/// Whether the linked UCX has the transport component `name`.
fn linked_ucx_has(name: &str) -> bool {
    static NAMES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    NAMES
        .get_or_init(|| {
            crate::build_info::components()
                .map(|components| components.into_iter().map(|c| c.name).collect())
                .unwrap_or_default()
        })
        .iter()
        .any(|have| have == name)
}

/// `requested`, a `UCX_TLS` value (`None`: UCX's default, every
/// transport), with System V shared memory taken out.
///
/// A deny list (`^a,b`) gains `sysv` unless it already denies it; `all`
/// (or nothing) becomes `^sysv`; an allow list loses `sysv` (also spelled
/// `\sysv`, UCX's "no alias" prefix) and has the aliases that include it
/// spelled out without it, naming `xpmem` and `knem` only where `has`
/// them.
fn tls_without_sysv(
    requested: Option<&str>,
    has: &dyn Fn(&str) -> bool,
) -> Result<TlsWithoutSysv, String> {
    let items: Vec<&str> = requested
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .collect();
    let all = TlsWithoutSysv {
        value: "^sysv".into(),
        named_sysv: false,
    };
    let Some(first) = items.first() else {
        return Ok(all);
    };
    // A name without UCX's `\` (no alias) prefix and `:aux` suffix, and
    // whether it had the prefix.
    let bare = |item: &str| -> (String, bool) {
        let (explicit, rest) = match item.strip_prefix('\\') {
            Some(rest) => (true, rest),
            None => (false, item),
        };
        let name = rest.split_once(':').map_or(rest, |(name, _)| name);
        (name.to_ascii_lowercase(), explicit)
    };
    let covers_sysv = |item: &str| {
        let (name, explicit) = bare(item);
        name == "sysv" || (!explicit && ALIASES_WITH_SYSV.iter().any(|(a, _)| *a == name))
    };
    if let Some(first_denied) = first.strip_prefix('^') {
        let mut denied: Vec<&str> = std::iter::once(first_denied)
            .chain(items[1..].iter().copied())
            .filter(|item| !item.is_empty())
            .collect();
        if !denied.iter().any(|item| covers_sysv(item)) {
            denied.push("sysv");
        }
        return Ok(TlsWithoutSysv {
            value: format!("^{}", denied.join(",")),
            named_sysv: false,
        });
    }
    if items.len() == 1 && first.eq_ignore_ascii_case("all") {
        return Ok(all);
    }
    let mut kept: Vec<String> = Vec::new();
    let mut named_sysv = false;
    for item in &items {
        let (name, explicit) = bare(item);
        let replacement = match ALIASES_WITH_SYSV.iter().find(|(a, _)| *a == name) {
            Some((_, without)) if !explicit => Some(*without),
            _ => None,
        };
        if name == "sysv" {
            named_sysv = true;
        } else if let Some(without) = replacement {
            named_sysv = true;
            let suffix = item.split_once(':').map_or("", |(_, aux)| aux);
            let optional = |tl: &str| matches!(tl, "xpmem" | "knem");
            for tl in without.split(',').filter(|tl| !optional(tl) || has(tl)) {
                kept.push(if suffix.is_empty() {
                    tl.to_owned()
                } else {
                    format!("{tl}:{suffix}")
                });
            }
        } else {
            kept.push((*item).to_owned());
        }
    }
    let mut seen = std::collections::HashSet::new();
    kept.retain(|item| seen.insert(item.clone()));
    if kept.is_empty() {
        return Err(format!(
            "{:?} names no transport but System V shared memory, whose segments every member \
             of this process's group can open; the engine never uses it",
            requested.unwrap_or_default()
        ));
    }
    Ok(TlsWithoutSysv {
        value: kept.join(","),
        named_sysv,
    })
}

/// Whether the process environment sets `UCX_<key>`: what every
/// `*_from_env`/`*_by_env` method of [`UcxConfig`] asks.
fn environment_sets(key: &str) -> bool {
    std::env::var_os(format!("UCX_{key}")).is_some()
}

/// The process environment's `UCX_<key>`, if set and valid UTF-8.
fn environment_value(key: &str) -> Option<String> {
    std::env::var(format!("UCX_{key}")).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    impl UcxConfig {
        /// [`UcxConfig::ucx_settings`] with the environment setting (to
        /// an empty value) the keys `env_sets` names.
        fn settings_given(&self, env_sets: impl Fn(&str) -> bool) -> Vec<(String, String)> {
            self.ucx_settings_with(|key| env_sets(key).then(String::new), &|_| true)
                .expect("valid settings")
                .pairs
        }
    }

    fn lookup<'a>(s: &'a [(String, String)], key: &str) -> Option<&'a str> {
        s.iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The owner cuts list replies to tcp fragments only where the
    /// transport list leaves a peer no lane but tcp; it never asks an
    /// endpoint (see `UcxSettings::every_lane_is_tcp`).
    #[test]
    fn only_a_tcp_list_makes_every_lane_tcp() {
        let under = |config: UcxConfig, env: Option<&str>| {
            config
                .ucx_settings_with(
                    |key| (key == "TLS").then(|| env.map(str::to_owned))?,
                    &|_| true,
                )
                .expect("valid settings")
                .every_lane_is_tcp()
        };
        let with = |transport| UcxConfig::default().with_transport(transport);
        assert!(under(with(Transport::Tcp), None));
        assert!(!under(with(Transport::SameHost), None), "cma is a lane");
        assert!(!under(with(Transport::SharedMemoryNoErrorHandling), None));
        assert!(!under(with(Transport::Auto), None), "UCX's default");
        assert!(under(with(Transport::Auto), Some("tcp")), "UCX_TLS=tcp");
        assert!(!under(with(Transport::Auto), Some("^posix")), "a deny list");
        for (tls, every_lane_tcp) in [
            ("tcp,self", true),
            (" TCP , \\self ", true),
            ("self", false),
            ("tcp,posix", false),
            ("tcp,rc", false),
            ("", false),
        ] {
            let custom = Transport::Custom { tls: tls.into() };
            assert_eq!(under(with(custom), None), every_lane_tcp, "{tls:?}");
        }
    }

    #[test]
    fn chunks_are_used_unless_the_operator_shapes_ucxs_protocols() {
        let config = UcxConfig::default();
        assert!(config.fragment_chunks_allowed(|_| false));
        for key in [
            "RNDV_THRESH",
            "TCP_TX_SEG_SIZE",
            "TCP_RX_SEG_SIZE",
            "PROTO_ENABLE",
        ] {
            assert!(
                !config.fragment_chunks_allowed(|set| set == key),
                "{key} in the environment"
            );
            let set_here = UcxConfig::default().with_ucx_setting(key, "8K");
            assert!(
                !set_here.fragment_chunks_allowed(|_| false),
                "{key} set on the config"
            );
        }
        assert!(config.fragment_chunks_allowed(|set| set == "TLS"));
    }

    #[test]
    fn same_host_selects_tcp_and_cma_with_invalidation() {
        let s = UcxConfig::default()
            .with_transport(Transport::SameHost)
            .settings_given(|_| false);
        assert_eq!(lookup(&s, "TLS"), Some("tcp,cma"));
        assert_eq!(lookup(&s, "CMA_MEMORY_INVALIDATE"), Some("y"));
        assert!(Transport::SameHost.peer_error_handling());
    }

    #[test]
    fn tcp_put_is_off_for_every_transport_even_when_the_environment_sets_it() {
        for transport in [
            Transport::Auto,
            Transport::Tcp,
            Transport::SameHost,
            Transport::SharedMemoryNoErrorHandling,
            Transport::Custom { tls: "tcp".into() },
        ] {
            let s = UcxConfig::default()
                .with_transport(transport.clone())
                .settings_given(|_| true);
            assert_eq!(lookup(&s, "TCP_PUT_ENABLE"), Some("n"), "{transport:?}");
        }
        let undone = UcxConfig::default()
            .with_ucx_setting("TCP_PUT_ENABLE", "y")
            .settings_given(|_| false);
        assert_eq!(lookup(&undone, "TCP_PUT_ENABLE"), Some("y"));
    }

    #[test]
    fn the_direct_lane_opens_by_transport_unless_chosen() {
        let on = |t: Transport| {
            UcxConfig::default()
                .with_transport(t)
                .direct_reads_enabled()
        };
        assert!(on(Transport::Auto));
        assert!(on(Transport::SameHost));
        assert!(on(Transport::SharedMemoryNoErrorHandling));
        assert!(!on(Transport::Tcp));
        assert!(!on(Transport::Custom {
            tls: "tcp,cma".into()
        }));
        let forced = UcxConfig::default()
            .with_transport(Transport::Tcp)
            .with_same_host_direct_reads(true);
        assert!(forced.direct_reads_enabled());
        let refused = UcxConfig::default()
            .with_transport(Transport::SameHost)
            .with_same_host_direct_reads(false);
        assert!(!refused.direct_reads_enabled());
    }

    #[test]
    fn the_direct_lane_reaches_no_network_and_no_group_shared_segment() {
        let s = UcxConfig::default()
            .with_ucx_setting("TLS", "tcp")
            .direct_read_settings(|_| false);
        assert_eq!(lookup(&s, "TLS"), Some("posix,cma"));
        assert_eq!(lookup(&s, "POSIX_USE_PROC_LINK"), Some("y"));
    }

    #[test]
    fn pure_shared_memory_turns_error_handling_off() {
        let t = Transport::SharedMemoryNoErrorHandling;
        assert!(!t.peer_error_handling());
        let s = UcxConfig::default()
            .with_transport(t)
            .settings_given(|_| false);
        assert_eq!(lookup(&s, "TLS"), Some("posix,cma"));
    }

    #[test]
    fn memory_hooks_are_off_unless_the_environment_sets_them() {
        let s = UcxConfig::default().settings_given(|_| false);
        assert_eq!(lookup(&s, "MEM_EVENTS"), Some("n"));
        assert_eq!(lookup(&s, "RCACHE_ENABLE"), Some("n"));
        let s = UcxConfig::default().settings_given(|k| k == "MEM_EVENTS" || k == "RCACHE_ENABLE");
        assert_eq!(lookup(&s, "MEM_EVENTS"), None);
        assert_eq!(lookup(&s, "RCACHE_ENABLE"), None);
    }

    #[test]
    fn tcp_sends_in_receive_sized_segments_unless_the_environment_sets_a_segment() {
        let s = UcxConfig::default()
            .with_transport(Transport::Tcp)
            .settings_given(|_| false);
        assert_eq!(lookup(&s, "TCP_TX_SEG_SIZE"), Some("64K"));
        for set_by_operator in ["TCP_TX_SEG_SIZE", "TCP_RX_SEG_SIZE"] {
            let s = UcxConfig::default()
                .with_transport(Transport::Tcp)
                .settings_given(|k| k == set_by_operator);
            assert_eq!(lookup(&s, "TCP_TX_SEG_SIZE"), None, "{set_by_operator}");
        }
    }

    #[test]
    fn tcp_zero_copy_fragments_carry_fifteen_ranges_unless_the_operator_sets_the_bound() {
        let config = UcxConfig::default().with_transport(Transport::Tcp);
        let s = config.settings_given(|_| false);
        assert_eq!(lookup(&s, "TCP_MAX_IOV"), Some("16"));
        assert_eq!(config.tcp_ranges_per_zero_copy_fragment(|_| None), 15);

        let s = config.settings_given(|k| k == "TCP_MAX_IOV");
        assert_eq!(lookup(&s, "TCP_MAX_IOV"), None, "the environment's stands");
        let env =
            |value: &'static str| move |key: &str| (key == "TCP_MAX_IOV").then(|| value.to_owned());
        assert_eq!(config.tcp_ranges_per_zero_copy_fragment(env("6")), 5);
        assert_eq!(config.tcp_ranges_per_zero_copy_fragment(env("1")), 0);
        assert_eq!(
            config.tcp_ranges_per_zero_copy_fragment(env("64")),
            15,
            "UCP uses at most 16 vector entries"
        );
        assert_eq!(
            config.tcp_ranges_per_zero_copy_fragment(env("lots")),
            5,
            "not a number: UCX's default"
        );

        let set_here = config.with_ucx_setting("TCP_MAX_IOV", "4");
        assert_eq!(
            lookup(&set_here.settings_given(|_| false), "TCP_MAX_IOV"),
            Some("4")
        );
        assert_eq!(set_here.tcp_ranges_per_zero_copy_fragment(env("12")), 3);
    }

    #[test]
    fn auto_leaves_transport_selection_to_ucx_but_sysv() {
        let s = UcxConfig::default().settings_given(|_| false);
        assert_eq!(lookup(&s, "TLS"), Some("^sysv"));
        assert_eq!(lookup(&s, "NET_DEVICES"), None);
    }

    /// Every way a transport list reaches the engine — the transport
    /// choice, the environment's `UCX_TLS` under `Auto`, a custom list,
    /// `extra` — ends without System V shared memory, with posix shared
    /// memory only through `/proc/<pid>/fd`, and says so when the list
    /// named `sysv`.
    #[test]
    fn no_transport_list_keeps_system_v_shared_memory() {
        let settings = |config: UcxConfig, env_tls: Option<&str>| {
            config
                .ucx_settings_with(
                    |key| (key == "TLS").then(|| env_tls.map(str::to_owned)).flatten(),
                    &|_| true,
                )
                .expect("valid settings")
        };
        let cases: [(UcxConfig, Option<&str>, &str, bool); 13] = [
            (UcxConfig::default(), None, "^sysv", false),
            (UcxConfig::default(), Some("all"), "^sysv", false),
            (UcxConfig::default(), Some(""), "^sysv", false),
            (
                UcxConfig::default(),
                Some("shm"),
                "posix,xpmem,knem,cma",
                true,
            ),
            (
                UcxConfig::default(),
                Some("tcp,sm"),
                "tcp,posix,xpmem,knem,cma",
                true,
            ),
            (
                UcxConfig::default(),
                Some("mm,cma"),
                "posix,xpmem,cma",
                true,
            ),
            (UcxConfig::default(), Some("sysv,tcp"), "tcp", true),
            (
                UcxConfig::default(),
                Some("\\sysv,\\posix"),
                "\\posix",
                true,
            ),
            (UcxConfig::default(), Some("^ib"), "^ib,sysv", false),
            (UcxConfig::default(), Some("^shm"), "^shm", false),
            (
                UcxConfig::default().with_transport(Transport::SharedMemoryNoErrorHandling),
                Some("sysv"),
                "posix,cma",
                false,
            ),
            (
                UcxConfig::default().with_transport(Transport::Custom {
                    tls: "shm,tcp".into(),
                }),
                None,
                "posix,xpmem,knem,cma,tcp",
                true,
            ),
            (
                UcxConfig::default()
                    .with_transport(Transport::Tcp)
                    .with_ucx_setting("TLS", "SYSV,tcp")
                    .with_ucx_setting("POSIX_USE_PROC_LINK", "n"),
                None,
                "tcp",
                true,
            ),
        ];
        for (config, env_tls, want, warned) in cases {
            let what = format!(
                "{:?} {:?} with UCX_TLS={env_tls:?}",
                config.transport, config.extra
            );
            let s = settings(config, env_tls);
            assert_eq!(lookup(&s.pairs, "TLS"), Some(want), "{what}");
            assert_eq!(lookup(&s.pairs, "POSIX_USE_PROC_LINK"), Some("y"), "{what}");
            let tls_entries = s
                .pairs
                .iter()
                .filter(|(k, _)| k.eq_ignore_ascii_case("TLS"))
                .count();
            assert_eq!(tls_entries, 1, "{what}: one TLS setting, the last word");
            assert_eq!(s.overridden.is_some(), warned, "{what}: {:?}", s.overridden);
            if let Some(line) = s.overridden {
                assert!(!line.contains('\n') && line.contains("System V"), "{line}");
            }
        }
    }

    #[test]
    fn a_spelled_out_alias_names_only_the_optional_transports_ucx_has() {
        let tls = |has: &dyn Fn(&str) -> bool, requested: &str| {
            tls_without_sysv(Some(requested), has)
                .expect("a list")
                .value
        };
        assert_eq!(tls(&|_| false, "shm"), "posix,cma");
        assert_eq!(tls(&|tl| tl == "knem", "sm,tcp"), "posix,knem,cma,tcp");
        assert_eq!(tls(&|_| false, "mm"), "posix");
        assert_eq!(
            tls(&|_| false, "\\xpmem"),
            "\\xpmem",
            "named outright: kept"
        );
    }

    #[test]
    fn a_transport_list_of_system_v_alone_is_refused() {
        let only_sysv = UcxConfig::default()
            .ucx_settings(|key| (key == "TLS").then(|| "sysv".to_owned()))
            .unwrap_err();
        assert!(
            only_sysv.contains("UCX_TLS") && only_sysv.contains("System V"),
            "{only_sysv}"
        );
        let custom = UcxConfig::default().with_transport(Transport::Custom {
            tls: "\\sysv".into(),
        });
        let refused = custom.validate().unwrap_err();
        assert!(refused.contains("System V"), "{refused}");
    }

    #[test]
    fn keepalive_runs_every_second_unless_the_environment_sets_it() {
        let s = UcxConfig::default().settings_given(|_| false);
        assert_eq!(lookup(&s, "KEEPALIVE_INTERVAL"), Some("1s"));
        assert_eq!(lookup(&s, "KEEPALIVE_NUM_EPS"), Some("inf"));
        let s = UcxConfig::default()
            .settings_given(|k| k == "KEEPALIVE_INTERVAL" || k == "KEEPALIVE_NUM_EPS");
        assert_eq!(lookup(&s, "KEEPALIVE_INTERVAL"), None);
        assert_eq!(lookup(&s, "KEEPALIVE_NUM_EPS"), None);
    }

    #[test]
    fn extra_settings_are_applied_last_and_win() {
        let s = UcxConfig::default()
            .with_transport(Transport::Tcp)
            .with_net_devices("lo")
            .with_ucx_setting("TLS", "tcp,self")
            .settings_given(|_| false);
        assert_eq!(lookup(&s, "TLS"), Some("tcp,self"));
        assert_eq!(lookup(&s, "NET_DEVICES"), Some("lo"));
    }

    #[test]
    fn degenerate_loop_settings_are_refused() {
        let c = UcxConfig {
            ring_capacity: 0,
            ..UcxConfig::default()
        };
        assert!(c.validate().is_err());
        let c = UcxConfig::default().with_park_timeout(Duration::ZERO);
        assert!(c.validate().is_err());
        let c = UcxConfig::default().with_ucx_setting("TLS", "tcp\0");
        assert!(c.validate().is_err());
        let c = UcxConfig::default().with_max_served_replies_per_connection(0);
        assert!(
            c.validate()
                .unwrap_err()
                .contains("max_served_replies_per_connection")
        );
        assert!(UcxConfig::default().validate().is_ok());
    }

    #[test]
    fn the_reply_bound_defaults_above_the_deepest_honest_window_and_can_be_set() {
        let c = UcxConfig::default();
        assert_eq!(
            c.max_served_replies_per_connection,
            UcxConfig::DEFAULT_MAX_SERVED_REPLIES_PER_CONNECTION
        );
        // `rdmareg bench --window` allows at most 1024 outstanding reads.
        assert!(c.max_served_replies_per_connection >= 4 * 1024);
        let c = c.with_max_served_replies_per_connection(8);
        assert_eq!(c.max_served_replies_per_connection, 8);
        assert!(c.validate().is_ok());
    }
}
