//! The ZMTP 3 reader (LMCache's notifications, the KV event subscriptions), as a PULL socket
//! reads a peer: the input is everything the peer sends (greeting, READY, frames), over loopback.
#![no_main]

use std::sync::OnceLock;

use baton_dataplane::compat::zmtp::{Connection, SocketType};
use libfuzzer_sys::fuzz_target;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

/// A message larger than this is refused by the reader (a notification is tens of bytes).
const MAX_MESSAGE: usize = 4096;

fn runtime() -> &'static (tokio::runtime::Runtime, std::net::SocketAddr, TcpListener) {
    static RT: OnceLock<(tokio::runtime::Runtime, std::net::SocketAddr, TcpListener)> = OnceLock::new();
    RT.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        (rt, addr, listener)
    })
}

fuzz_target!(|data: &[u8]| {
    let (rt, addr, listener) = runtime();
    rt.block_on(async {
        let mut peer = TcpStream::connect(addr).await.unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        peer.write_all(data).await.unwrap();
        peer.shutdown().await.unwrap();
        let Ok(mut c) = Connection::handshake(stream, SocketType::Pull, MAX_MESSAGE).await else { return };
        while let Ok(Some(frames)) = c.recv().await {
            let size: usize = frames.iter().map(Vec::len).sum();
            assert!(size <= MAX_MESSAGE, "a message of {size} bytes passed the limit");
        }
    });
});
