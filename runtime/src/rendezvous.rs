//! Sharing a few bytes from rank 0 with every rank before any communicator exists (NCCL's
//! 128-byte unique id), over TCP at `MASTER_ADDR:MASTER_PORT` as torchrun provides them.
//!
//! Rank 0 listens on the port; every other rank connects (retrying while rank 0 starts), says
//! which rank of which world it is, and waits. Once every rank has arrived, rank 0 sends each
//! the bytes. Whatever goes wrong is an error within the timeout, naming what: the ranks that
//! never arrived, a rank that arrived twice or from another world, rank 0 not answering.
//!
//! Messages: hello = `b"ATPR"`, rank (u32 LE), world size (u32 LE); answer = `b"ATPI"`, the
//! bytes. Tests: the unit tests below (ranks as threads, arbitrary bytes).
//!
//! [`share_from_root`] is what a communicator's bootstrap calls: MPI's broadcast in a job over
//! MPI (`autotp bench-comm` checks it across processes), else this rendezvous.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// The bytes shared: NCCL's unique id.
pub const SHARED_BYTES: usize = 128;

const HELLO: &[u8; 4] = b"ATPR";
const ANSWER: &[u8; 4] = b"ATPI";

#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error("the rendezvous needs {0} (set by torchrun; set it for other launchers)")]
    MissingVariable(&'static str),
    #[error("{variable}={value} is not a port number")]
    BadPort { variable: &'static str, value: String },
    #[error("rank 0 listening on port {port}: {source}")]
    Listen { port: u16, source: std::io::Error },
    #[error("rank 0 waited {waited:?} on port {port}; rank(s) {missing:?} of {world_size} never arrived")]
    RanksMissing { port: u16, waited: Duration, missing: Vec<usize>, world_size: usize },
    #[error("rank {rank} could not reach rank 0 at {addr} within {waited:?}: {reason}")]
    RootUnreachable { rank: usize, addr: String, waited: Duration, reason: String },
    #[error("rendezvous at {addr}: {message}")]
    Protocol { addr: String, message: String },
    #[error("sharing through MPI: {0}")]
    Mpi(String),
}

/// Every rank's copy of rank 0's `bytes` (which only rank 0 passes): through MPI's broadcast
/// when the process is a rank of a job over MPI, else through the TCP rendezvous at
/// `MASTER_ADDR:MASTER_PORT` (waiting at most `timeout`).
pub fn share_from_root(
    job: Option<&crate::comm::MpiComm>,
    place: &crate::launch::JobPlace,
    bytes: Option<&[u8; SHARED_BYTES]>,
    timeout: Duration,
) -> Result<[u8; SHARED_BYTES], RendezvousError> {
    let Some(job) = job else {
        return TcpRendezvous::from_env(timeout)?.share(place.rank, place.world_size, bytes);
    };
    let mut shared = [0u8; SHARED_BYTES];
    match (job.rank(), bytes) {
        (0, Some(bytes)) => shared = *bytes,
        (0, None) => return Err(RendezvousError::Mpi("rank 0 has no bytes to share".into())),
        _ => {}
    }
    job.broadcast(0, &mut shared).map_err(|e| RendezvousError::Mpi(e.to_string()))?;
    Ok(shared)
}

/// Where and how long ranks meet.
#[derive(Clone, Debug)]
pub struct TcpRendezvous {
    pub host: String,
    pub port: u16,
    pub timeout: Duration,
}

impl TcpRendezvous {
    /// The rendezvous torchrun's variables name (`MASTER_ADDR`, `MASTER_PORT`).
    pub fn from_env(timeout: Duration) -> Result<TcpRendezvous, RendezvousError> {
        let host = std::env::var("MASTER_ADDR").map_err(|_| RendezvousError::MissingVariable("MASTER_ADDR"))?;
        let port = std::env::var("MASTER_PORT").map_err(|_| RendezvousError::MissingVariable("MASTER_PORT"))?;
        let port =
            port.trim().parse().map_err(|_| RendezvousError::BadPort { variable: "MASTER_PORT", value: port })?;
        Ok(TcpRendezvous { host, port, timeout })
    }

    fn addr(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// Every rank's copy of rank 0's `bytes` (which only rank 0 passes).
    pub fn share(
        &self,
        rank: usize,
        world_size: usize,
        bytes: Option<&[u8; SHARED_BYTES]>,
    ) -> Result<[u8; SHARED_BYTES], RendezvousError> {
        match (rank, bytes) {
            (0, Some(bytes)) => self.serve(world_size, bytes).map(|()| *bytes),
            (0, None) => Err(self.protocol("rank 0 has no bytes to share".into())),
            (_, _) => self.fetch(rank, world_size),
        }
    }

    fn protocol(&self, message: String) -> RendezvousError {
        RendezvousError::Protocol { addr: self.addr(), message }
    }

    /// Rank 0: waits for every other rank, then answers each.
    fn serve(&self, world_size: usize, bytes: &[u8; SHARED_BYTES]) -> Result<(), RendezvousError> {
        let listen = |source| RendezvousError::Listen { port: self.port, source };
        let listener = TcpListener::bind(("0.0.0.0", self.port)).map_err(listen)?;
        listener.set_nonblocking(true).map_err(listen)?;
        let start = Instant::now();
        let mut arrived: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();
        while arrived.iter().skip(1).any(Option::is_none) {
            let waited = start.elapsed();
            if waited >= self.timeout {
                let missing = (1..world_size).filter(|&r| arrived[r].is_none()).collect();
                return Err(RendezvousError::RanksMissing { port: self.port, waited, missing, world_size });
            }
            let mut stream = match listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                Err(e) => return Err(listen(e)),
            };
            let io = |e: std::io::Error| self.protocol(format!("reading a rank's hello: {e}"));
            stream.set_nonblocking(false).map_err(io)?;
            stream
                .set_read_timeout(Some(self.timeout.saturating_sub(waited).max(Duration::from_millis(1))))
                .map_err(io)?;
            let mut hello = [0u8; 12];
            stream.read_exact(&mut hello).map_err(io)?;
            let field = |at: usize| u32::from_le_bytes(hello[at..at + 4].try_into().expect("4 bytes")) as usize;
            let (rank, theirs) = (field(4), field(8));
            if &hello[..4] != HELLO {
                return Err(self.protocol("a connection that is not an autotp rank".into()));
            }
            if theirs != world_size {
                return Err(self
                    .protocol(format!("rank {rank} is in a world of {theirs} ranks, rank 0 in one of {world_size}")));
            }
            if rank == 0 || rank >= world_size || arrived[rank].is_some() {
                return Err(self.protocol(format!("rank {rank} arrived twice or is out of the world of {world_size}")));
            }
            arrived[rank] = Some(stream);
        }
        for (rank, stream) in arrived.iter_mut().enumerate().skip(1) {
            let stream = stream.as_mut().expect("every rank arrived");
            let mut answer = ANSWER.to_vec();
            answer.extend_from_slice(bytes);
            stream.write_all(&answer).map_err(|e| self.protocol(format!("answering rank {rank}: {e}")))?;
        }
        Ok(())
    }

    /// Another rank: connects (while rank 0 starts, again and again), says hello, reads.
    fn fetch(&self, rank: usize, world_size: usize) -> Result<[u8; SHARED_BYTES], RendezvousError> {
        let start = Instant::now();
        let unreachable = |reason: String| RendezvousError::RootUnreachable {
            rank,
            addr: self.addr(),
            waited: start.elapsed(),
            reason,
        };
        let mut stream = loop {
            let remaining = self.timeout.saturating_sub(start.elapsed());
            if remaining.is_zero() {
                return Err(unreachable("no answer".into()));
            }
            let addrs = self.addr().to_socket_addrs().map_err(|e| unreachable(format!("cannot resolve: {e}")))?;
            let connected = addrs.into_iter().find_map(|a| TcpStream::connect_timeout(&a, remaining).ok());
            match connected {
                Some(stream) => break stream,
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let io = |e: std::io::Error| unreachable(e.to_string());
        let mut hello = HELLO.to_vec();
        hello.extend_from_slice(&(rank as u32).to_le_bytes());
        hello.extend_from_slice(&(world_size as u32).to_le_bytes());
        stream.write_all(&hello).map_err(io)?;
        stream
            .set_read_timeout(Some(self.timeout.saturating_sub(start.elapsed()).max(Duration::from_millis(1))))
            .map_err(io)?;
        let mut answer = [0u8; 4 + SHARED_BYTES];
        stream.read_exact(&mut answer).map_err(|e| unreachable(format!("waiting for the bytes: {e}")))?;
        if &answer[..4] != ANSWER {
            return Err(self.protocol(format!("rank {rank} got an answer that is not autotp's")));
        }
        Ok(answer[4..].try_into().expect("128 bytes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind(("127.0.0.1", 0)).unwrap().local_addr().unwrap().port()
    }

    fn rendezvous(port: u16, timeout_ms: u64) -> TcpRendezvous {
        TcpRendezvous { host: "127.0.0.1".into(), port, timeout: Duration::from_millis(timeout_ms) }
    }

    #[test]
    fn every_rank_gets_rank_zeros_bytes() {
        let port = free_port();
        let id: [u8; SHARED_BYTES] = std::array::from_fn(|i| (i * 37 + 11) as u8);
        // The other ranks start first: they retry until rank 0 listens.
        let others: Vec<_> = (1..4)
            .map(|rank| std::thread::spawn(move || rendezvous(port, 10_000).share(rank, 4, None).unwrap()))
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(rendezvous(port, 10_000).share(0, 4, Some(&id)).unwrap(), id);
        for other in others {
            assert_eq!(other.join().unwrap(), id);
        }
    }

    #[test]
    fn a_missing_rank_is_named_within_the_timeout() {
        let port = free_port();
        let one = std::thread::spawn(move || rendezvous(port, 2_000).share(1, 3, None));
        let start = Instant::now();
        let err = rendezvous(port, 500).share(0, 3, Some(&[7; SHARED_BYTES])).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(2), "{:?}", start.elapsed());
        assert!(err.to_string().contains("rank(s) [2] of 3 never arrived"), "{err}");
        // Rank 1 hears nothing back: its connection closes, or its wait ends.
        assert!(one.join().unwrap().is_err());
    }

    #[test]
    fn no_rank_zero_and_other_worlds_are_errors() {
        let port = free_port();
        let err = rendezvous(port, 200).share(2, 4, None).unwrap_err();
        assert!(err.to_string().starts_with("rank 2 could not reach rank 0 at 127.0.0.1:"), "{err}");

        let port = free_port();
        let stranger = std::thread::spawn(move || rendezvous(port, 2_000).share(1, 3, None));
        let err = rendezvous(port, 2_000).share(0, 2, Some(&[1; SHARED_BYTES])).unwrap_err();
        assert!(err.to_string().contains("rank 1 is in a world of 3 ranks, rank 0 in one of 2"), "{err}");
        assert!(stranger.join().unwrap().is_err());
    }
}
