//! The control channel: the bootstrap connection once the offer is made,
//! with heartbeats both ways and a bound on every wait.
//!
//! A killed peer closes the connection; a cut link or a stopped process
//! sends nothing, and TCP retries for minutes. So each side sends
//! [`Message::Alive`] every [`HEARTBEAT_INTERVAL`] (the consumer's with its
//! [`Tally`]), and silence past [`Bounds::silence`] (a GET deadline plus
//! [`SLACK`]) means the peer is lost, about when a GET to it would time out.
//! Every wait is bounded; the figures are in `docs/operations.md`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdmareg::OfferError;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::bootstrap::{self, BootstrapError, Message, Tally};
use crate::cli::LimitArgs;

/// How often each side says it is alive.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(500);

/// Headroom added to every bound: scheduling on a loaded machine, a
/// heartbeat's own interval, connection setup.
pub const SLACK: Duration = Duration::from_secs(3);

/// The bounds of every wait on the control channel, derived from the GET
/// deadline and the teardown bound the run was started with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Longest one GET may take.
    pub get_deadline: Duration,
    /// Longest each shutdown step may take.
    pub teardown: Duration,
}

impl Bounds {
    /// The bounds the command line asked for.
    pub fn new(limits: &LimitArgs) -> Self {
        Bounds {
            get_deadline: limits.get_deadline,
            teardown: limits.teardown_timeout,
        }
    }

    /// Longest a live peer stays silent: one GET deadline plus [`SLACK`].
    pub fn silence(&self) -> Duration {
        self.get_deadline + SLACK
    }

    /// Longest a side's ordered shutdown takes: unregistering what it
    /// offered, the registry's drain and its unmaps, and the engine's
    /// teardown, each bounded by the teardown bound, plus [`SLACK`].
    pub fn shutdown(&self) -> Duration {
        self.teardown * 4 + SLACK
    }
}

/// Why the control channel gave up on the peer.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The peer closed the connection (a process that exited or was killed).
    #[error("its connection closed")]
    Closed,
    /// The connection failed (reset, unreachable).
    #[error("its connection failed ({0})")]
    Broken(std::io::Error),
    /// Nothing came from the peer for this long: a cut link or a stopped
    /// process.
    #[error("no word from it for {:.1} s", .0.as_secs_f64())]
    Silent(Duration),
    /// The peer kept saying it is alive but did not send what was awaited
    /// within this long.
    #[error("it sent no {what} within {:.1} s", .waited.as_secs_f64())]
    Overdue {
        /// What was awaited.
        what: &'static str,
        /// How long.
        waited: Duration,
    },
    /// The peer sent something that is not the protocol.
    #[error("it broke the protocol ({0})")]
    Protocol(String),
}

impl From<BootstrapError> for ControlError {
    fn from(error: BootstrapError) -> Self {
        match error {
            BootstrapError::Frame(OfferError::Closed | OfferError::Truncated { .. }) => {
                ControlError::Closed
            }
            BootstrapError::Frame(OfferError::Io(e))
                if e.kind() == std::io::ErrorKind::UnexpectedEof =>
            {
                ControlError::Closed
            }
            BootstrapError::Frame(OfferError::Io(e)) => ControlError::Broken(e),
            BootstrapError::Frame(refused) => ControlError::Protocol(refused.to_string()),
            BootstrapError::Protocol(what) => ControlError::Protocol(what),
        }
    }
}

/// Read one message, giving up after `bound`. For the exchange before the
/// channel starts (the offer).
pub async fn receive_within(
    stream: &mut TcpStream,
    bound: Duration,
) -> Result<Message, ControlError> {
    match tokio::time::timeout(bound, bootstrap::receive(stream)).await {
        Ok(received) => Ok(received?),
        Err(_) => Err(ControlError::Silent(bound)),
    }
}

/// Write one message, giving up after `bound`.
pub async fn send_within<W: AsyncWriteExt + Unpin>(
    writer: &mut W,
    message: &Message,
    bound: Duration,
) -> Result<(), ControlError> {
    match tokio::time::timeout(bound, bootstrap::send(writer, message)).await {
        Ok(sent) => Ok(sent?),
        Err(_) => Err(ControlError::Silent(bound)),
    }
}

/// What the two tasks and the side share.
#[derive(Debug)]
struct Shared {
    last_heard: Instant,
    peer_tally: Tally,
    own_tally: Tally,
}

type Outgoing = (Message, oneshot::Sender<Result<(), ControlError>>);

/// One side's end of the control channel. Dropping it stops both tasks.
pub struct Control {
    shared: Arc<Mutex<Shared>>,
    outgoing: Option<mpsc::Sender<Outgoing>>,
    incoming: mpsc::Receiver<Result<Message, ControlError>>,
    writer: JoinHandle<()>,
    reader: JoinHandle<()>,
    silence: Duration,
}

impl Control {
    /// Take over `stream` (the offer already exchanged): start the
    /// heartbeat and the reader. Call inside the runtime.
    pub fn start(stream: TcpStream, bounds: Bounds) -> Control {
        let silence = bounds.silence();
        let shared = Arc::new(Mutex::new(Shared {
            last_heard: Instant::now(),
            peer_tally: Tally::default(),
            own_tally: Tally::default(),
        }));
        let (read_half, write_half) = stream.into_split();
        let (outgoing, outgoing_rx) = mpsc::channel(4);
        let (incoming_tx, incoming) = mpsc::channel(4);
        let writer = tokio::spawn(write_loop(
            write_half,
            outgoing_rx,
            Arc::clone(&shared),
            silence,
        ));
        let reader = tokio::spawn(read_loop(read_half, incoming_tx, Arc::clone(&shared)));
        Control {
            shared,
            outgoing: Some(outgoing),
            incoming,
            writer,
            reader,
            silence,
        }
    }

    /// Record how far this side got; the next heartbeat carries it.
    pub fn set_tally(&self, tally: Tally) {
        self.lock().own_tally = tally;
    }

    /// The latest tally the peer reported (zero if none).
    pub fn peer_tally(&self) -> Tally {
        self.lock().peer_tally
    }

    /// Send `message` and wait until it is written to the connection.
    pub async fn send(&self, message: Message) -> Result<(), ControlError> {
        let (ack, acked) = oneshot::channel();
        let outgoing = self.outgoing.as_ref().ok_or(ControlError::Closed)?;
        outgoing
            .send((message, ack))
            .await
            .map_err(|_| ControlError::Closed)?;
        acked.await.unwrap_or(Err(ControlError::Closed))
    }

    /// The next message other than a heartbeat. Fails once the peer has
    /// been silent for the silence bound, or after `overall` (if given)
    /// even if it kept sending heartbeats; `what` names the message in
    /// that error.
    ///
    /// # Cancel safety
    /// Cancel-safe: a message not returned stays queued.
    pub async fn receive(
        &mut self,
        what: &'static str,
        overall: Option<Duration>,
    ) -> Result<Message, ControlError> {
        let started = Instant::now();
        loop {
            let silent_at = self.lock().last_heard + self.silence;
            let give_up_at = overall.map_or(silent_at, |o| silent_at.min(started + o));
            match tokio::time::timeout_at(give_up_at.into(), self.incoming.recv()).await {
                Ok(Some(received)) => return received,
                Ok(None) => return Err(ControlError::Closed),
                Err(_) => {
                    if let Some(waited) = overall.filter(|&o| started.elapsed() >= o) {
                        return Err(ControlError::Overdue { what, waited });
                    }
                    let quiet = self.lock().last_heard.elapsed();
                    if quiet >= self.silence {
                        return Err(ControlError::Silent(quiet));
                    }
                    // Heard from it meanwhile: wait again from then.
                }
            }
        }
    }

    /// Stop the heartbeat and close this side's direction of the
    /// connection, within `bound`.
    pub async fn close(mut self, bound: Duration) {
        drop(self.outgoing.take());
        let _ = tokio::time::timeout(bound, &mut self.writer).await;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        // The critical sections cannot panic; a poisoned lock still holds
        // consistent data.
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        self.writer.abort();
        self.reader.abort();
    }
}

async fn write_loop(
    mut half: OwnedWriteHalf,
    mut outgoing: mpsc::Receiver<Outgoing>,
    shared: Arc<Mutex<Shared>>,
    bound: Duration,
) {
    let mut heartbeat = tokio::time::interval(HEARTBEAT_INTERVAL);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            next = outgoing.recv() => match next {
                Some((message, ack)) => {
                    let sent = send_within(&mut half, &message, bound).await;
                    let failed = sent.is_err();
                    let _ = ack.send(sent);
                    if failed {
                        return;
                    }
                }
                None => {
                    let _ = tokio::time::timeout(bound, half.shutdown()).await;
                    return;
                }
            },
            _ = heartbeat.tick() => {
                let tally = shared.lock().unwrap_or_else(|p| p.into_inner()).own_tally;
                if send_within(&mut half, &Message::Alive { tally }, bound).await.is_err() {
                    return;
                }
            }
        }
    }
}

async fn read_loop(
    mut half: OwnedReadHalf,
    incoming: mpsc::Sender<Result<Message, ControlError>>,
    shared: Arc<Mutex<Shared>>,
) {
    loop {
        let received = bootstrap::receive(&mut half).await;
        let forward = {
            let mut state = shared.lock().unwrap_or_else(|p| p.into_inner());
            match received {
                Ok(Message::Alive { tally }) => {
                    state.last_heard = Instant::now();
                    state.peer_tally = tally;
                    continue;
                }
                Ok(message) => {
                    state.last_heard = Instant::now();
                    if let Message::Done { tally, .. } = message {
                        state.peer_tally = tally;
                    }
                    Ok(message)
                }
                Err(e) => Err(ControlError::from(e)),
            }
        };
        let failed = forward.is_err();
        if incoming.send(forward).await.is_err() || failed {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    fn bounds(deadline_ms: u64) -> Bounds {
        Bounds {
            get_deadline: Duration::from_millis(deadline_ms),
            teardown: Duration::from_millis(100),
        }
    }

    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (connected, accepted) = tokio::join!(TcpStream::connect(address), listener.accept());
        (connected.unwrap(), accepted.unwrap().0)
    }

    #[test]
    fn the_silence_bound_is_one_deadline_plus_slack_and_shutdown_four_teardowns() {
        let b = Bounds {
            get_deadline: Duration::from_secs(2),
            teardown: Duration::from_secs(1),
        };
        assert_eq!(b.silence(), Duration::from_secs(2) + SLACK);
        assert_eq!(b.shutdown(), Duration::from_secs(4) + SLACK);
    }

    #[tokio::test]
    async fn heartbeats_carry_the_tally_and_are_not_returned_as_messages() {
        let (a, b) = pair().await;
        let sender = Control::start(a, bounds(1000));
        let mut receiver = Control::start(b, bounds(1000));
        let tally = Tally {
            read: 3,
            verified: 2,
        };
        sender.set_tally(tally);
        tokio::time::sleep(HEARTBEAT_INTERVAL * 3).await;
        assert_eq!(receiver.peer_tally(), tally);
        sender
            .send(Message::Done {
                verified: false,
                tally,
            })
            .await
            .unwrap();
        let next = receiver.receive("report", None).await.unwrap();
        assert!(matches!(next, Message::Done { .. }), "{next:?}");
    }

    #[tokio::test]
    async fn a_peer_that_closes_is_reported_as_closed() {
        let (a, b) = pair().await;
        let mut receiver = Control::start(b, bounds(5000));
        drop(a);
        let error = receiver.receive("report", None).await.unwrap_err();
        assert!(matches!(error, ControlError::Closed), "{error:?}");
    }

    #[tokio::test]
    async fn a_silent_peer_is_reported_once_the_silence_bound_passes() {
        // A raw stream that never sends a heartbeat stands for a cut link.
        let (_quiet, b) = pair().await;
        let mut receiver = Control::start(b, bounds(1));
        let error = receiver.receive("report", None).await.unwrap_err();
        let ControlError::Silent(quiet) = error else {
            panic!("{error:?}");
        };
        assert!(quiet >= bounds(1).silence());
    }

    #[tokio::test]
    async fn a_peer_that_only_sends_heartbeats_is_overdue_after_the_overall_bound() {
        let (a, b) = pair().await;
        let _alive = Control::start(a, bounds(60_000));
        let mut receiver = Control::start(b, bounds(60_000));
        let error = receiver
            .receive("shutdown report", Some(Duration::from_millis(1200)))
            .await
            .unwrap_err();
        assert!(
            matches!(
                error,
                ControlError::Overdue {
                    what: "shutdown report",
                    ..
                }
            ),
            "{error:?}"
        );
    }
}
