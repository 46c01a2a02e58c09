//! A TCP proxy between idem and a store, for network faults: latency, a black hole
//! (every byte held, nothing closed), a reset of the next reply, the next reply
//! dropped with its connection held open, or the connections open now silenced while
//! new ones pass. Listens on 127.0.0.1 only.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does to the traffic it carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Bytes pass as they come.
    Pass,
    /// Each chunk waits this long, both ways.
    Delay(Duration),
    /// Every byte is held until the mode changes; no connection is closed.
    BlackHole,
    /// The next reply from the server resets its connection (the request was served).
    ResetNextReply,
    /// The next reply from the server is dropped and its connection held open, silent,
    /// for good (the request was served); the proxy then passes traffic again.
    DropNextReply,
    /// Set, every connection open now goes silent for good, both ways, and none is
    /// closed: a client holding them sees no error, only no answer. Connections opened
    /// later are carried under the mode as it was, which setting this leaves unchanged.
    SilenceOpen,
}

/// A running proxy; stops when dropped.
pub struct Proxy {
    pub port: u16,
    mode: Arc<watch::Sender<Mode>>,
    /// Connections numbered below this are silent (`Mode::SilenceOpen`).
    silenced: Arc<Silence>,
    task: tokio::task::JoinHandle<()>,
}

/// Which connections `Mode::SilenceOpen` silenced: those numbered below `below`, out of
/// `opened` so far.
#[derive(Default)]
struct Silence {
    opened: AtomicU64,
    below: AtomicU64,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    /// Proxies 127.0.0.1:`self.port` to `upstream` (a `host:port` on 127.0.0.1).
    pub async fn start(upstream: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (tx, _) = watch::channel(Mode::Pass);
        let mode = Arc::new(tx);
        let silenced = Arc::new(Silence::default());
        let upstream = upstream.to_owned();
        let task = {
            let (mode, silenced) = (mode.clone(), silenced.clone());
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        continue;
                    };
                    let conn = Conn {
                        number: silenced.opened.fetch_add(1, Ordering::SeqCst),
                        silenced: silenced.clone(),
                    };
                    tokio::spawn(carry(client, server, mode.clone(), conn));
                }
            })
        };
        Proxy {
            port,
            mode,
            silenced,
            task,
        }
    }

    /// Changes what the proxy does from now on.
    pub fn set(&self, mode: Mode) {
        if mode == Mode::SilenceOpen {
            let opened = self.silenced.opened.load(Ordering::SeqCst);
            self.silenced.below.store(opened, Ordering::SeqCst);
            return;
        }
        self.mode.send_replace(mode);
    }

    /// The mode now (a one-shot mode returns to `Pass` once it has acted).
    pub fn mode(&self) -> Mode {
        *self.mode.borrow()
    }
}

/// One carried connection: its number in opening order, and which are silenced.
struct Conn {
    number: u64,
    silenced: Arc<Silence>,
}

impl Conn {
    fn silenced(&self) -> bool {
        self.number < self.silenced.below.load(Ordering::SeqCst)
    }
}

/// Carries one connection both ways under the proxy's mode.
async fn carry(client: TcpStream, server: TcpStream, mode: Arc<watch::Sender<Mode>>, conn: Conn) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_rx, client_tx) = client.into_split();
    let (server_rx, server_tx) = server.into_split();
    tokio::select! {
        _ = pump(client_rx, server_tx, &mode, &conn, false) => {}
        _ = pump(server_rx, client_tx, &mode, &conn, true) => {}
    }
}

/// Copies `from` to `to` under the mode; `replies` (server to client) is where the
/// one-shot faults act.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mode: &watch::Sender<Mode>,
    conn: &Conn,
    replies: bool,
) {
    let mut watch = mode.subscribe();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if conn.silenced() {
            // What it read goes nowhere, and both sockets stay open.
            std::future::pending::<()>().await;
        }
        let now = *watch.borrow_and_update();
        match now {
            Mode::ResetNextReply if replies => {
                mode.send_replace(Mode::Pass);
                // Closed with zero linger and no FIN first: the client sees a reset.
                let _ = to.as_ref().set_zero_linger();
                to.forget();
                return;
            }
            Mode::DropNextReply if replies => {
                mode.send_replace(Mode::Pass);
                // Nothing more reaches the client; its socket stays open.
                std::future::pending::<()>().await;
            }
            _ => {}
        }
        if !pass(&mut watch).await || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Waits while the mode holds traffic; `false` once the proxy is gone.
async fn pass(mode: &mut watch::Receiver<Mode>) -> bool {
    loop {
        let now = *mode.borrow_and_update();
        match now {
            Mode::Pass | Mode::ResetNextReply | Mode::DropNextReply | Mode::SilenceOpen => {
                return true;
            }
            Mode::Delay(d) => {
                tokio::time::sleep(d).await;
                return true;
            }
            Mode::BlackHole => {
                if mode.changed().await.is_err() {
                    return false;
                }
            }
        }
    }
}
