//! The job's other processes as one rank knows them, to say which rank stopped a job when an
//! operation waits past `--comm-timeout`.
//!
//! MPI has no timeouts and no way to ask which member of a collective is missing, so each rank
//! also answers small UDP probes on a port of its own ([`Peers::start`]), and at start every
//! rank publishes its host name, process id, port and IPv4 addresses ([`Peers::record`], an
//! all-gather of fixed-size records). When the watchdog fires, [`Peers::diagnose`] looks at the
//! ranks on this host in `/proc` (stopped or gone) and probes every other rank:
//!
//! - a rank that does not answer is stopped, hangs, is gone, or its node is unreachable (a cut
//!   link, a dead machine): the one line the job ends with names it and its host;
//! - a rank that answers says which operation it waits in, if any: one that waits in none
//!   computes, or hangs outside communication.
//!
//! Probing costs nothing until the watchdog fires: the answering thread sleeps in `recv_from`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

const PROBE: &[u8] = b"autotp-probe";
const ALIVE: &[u8] = b"autotp-alive";
/// A host name's bytes kept in a record (longer ones are cut).
const HOST_BYTES: usize = 64;
/// The IPv4 addresses kept in a record.
const MAX_ADDRESSES: usize = 6;
/// One rank's record: host name, pid, port, address count, addresses.
pub(super) const RECORD_BYTES: usize = HOST_BYTES + 4 + 2 + 1 + 4 * MAX_ADDRESSES;
/// How often an unanswered probe is sent again (UDP may drop one).
const RESEND: Duration = Duration::from_millis(250);

/// One rank of the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Peer {
    pub host: String,
    pub pid: u32,
    port: u16,
    addresses: Vec<Ipv4Addr>,
}

/// What a probed rank answered.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Answer {
    /// It waits in this operation (described by that rank).
    Waiting(String),
    /// It waits on no other rank.
    Busy,
}

/// Every rank of the job, and this one's place among them.
pub(super) struct Peers {
    pub ranks: Vec<Peer>,
    rank: usize,
}

impl Peers {
    /// Starts answering probes: each is answered with what `waiting` says this rank waits in
    /// (`None`: nothing). Returns this rank's record for the all-gather.
    pub fn start(waiting: impl Fn() -> Option<String> + Send + 'static) -> std::io::Result<[u8; RECORD_BYTES]> {
        let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
        let port = socket.local_addr()?.port();
        std::thread::Builder::new().name("autotp-probes".into()).spawn(move || {
            let mut buffer = [0u8; 64];
            loop {
                let Ok((len, from)) = socket.recv_from(&mut buffer) else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                // A probe names the rank it asks, which the answer repeats.
                let Some(asked) = buffer[..len].strip_prefix(PROBE).filter(|asked| asked.len() == 4) else {
                    continue;
                };
                let mut answer = [ALIVE, asked].concat();
                if let Some(what) = waiting() {
                    answer.extend_from_slice(what.as_bytes());
                }
                let _ = socket.send_to(&answer, from);
            }
        })?;
        Ok(Self::record(&host_name(), std::process::id(), port, &ipv4_addresses()))
    }

    /// The fixed-size record of one rank.
    fn record(host: &str, pid: u32, port: u16, addresses: &[Ipv4Addr]) -> [u8; RECORD_BYTES] {
        let mut record = [0u8; RECORD_BYTES];
        let name = &host.as_bytes()[..host.len().min(HOST_BYTES)];
        record[..name.len()].copy_from_slice(name);
        let mut at = HOST_BYTES;
        record[at..at + 4].copy_from_slice(&pid.to_le_bytes());
        at += 4;
        record[at..at + 2].copy_from_slice(&port.to_le_bytes());
        at += 2;
        let kept = &addresses[..addresses.len().min(MAX_ADDRESSES)];
        record[at] = kept.len() as u8;
        at += 1;
        for address in kept {
            record[at..at + 4].copy_from_slice(&address.octets());
            at += 4;
        }
        record
    }

    /// Every rank's record, in rank order, as the all-gather returned them.
    pub fn from_records(records: &[u8], rank: usize) -> Peers {
        let ranks = records
            .chunks_exact(RECORD_BYTES)
            .map(|record| {
                let name = &record[..HOST_BYTES];
                let end = name.iter().position(|&b| b == 0).unwrap_or(HOST_BYTES);
                let mut at = HOST_BYTES;
                let pid = u32::from_le_bytes([record[at], record[at + 1], record[at + 2], record[at + 3]]);
                at += 4;
                let port = u16::from_le_bytes([record[at], record[at + 1]]);
                at += 2;
                let count = (record[at] as usize).min(MAX_ADDRESSES);
                at += 1;
                let addresses =
                    record[at..at + 4 * count].chunks_exact(4).map(|o| Ipv4Addr::new(o[0], o[1], o[2], o[3])).collect();
                Peer { host: String::from_utf8_lossy(&name[..end]).into_owned(), pid, port, addresses }
            })
            .collect();
        Peers { ranks, rank }
    }

    /// Why the job waits, as far as this rank can tell within about `wait`: the ranks on this
    /// host seen stopped or gone, the ranks that do not answer, and what those that answer wait
    /// in.
    pub fn diagnose(&self, wait: Duration) -> Diagnosis {
        let here = host_name();
        let mut findings = Vec::new();
        let mut to_probe = Vec::new();
        for (rank, peer) in self.ranks.iter().enumerate() {
            if rank == self.rank {
                continue;
            }
            match (peer.host == here).then(|| local_state(peer.pid)).flatten() {
                Some(state) => findings.push(format!("rank {rank} (host {}, pid {}) {state}", peer.host, peer.pid)),
                None => to_probe.push(rank),
            }
        }
        let answers = self.probe(&to_probe, &here, wait);
        let mut unresponsive = !findings.is_empty();
        let silent: Vec<usize> =
            to_probe.iter().copied().filter(|rank| !answers.iter().any(|(r, _)| r == rank)).collect();
        if !silent.is_empty() {
            unresponsive = true;
            let named: Vec<String> = silent
                .iter()
                .map(|&rank| format!("rank {rank} (host {}, pid {})", self.ranks[rank].host, self.ranks[rank].pid))
                .collect();
            let verb = if silent.len() == 1 { "does" } else { "do" };
            findings.push(format!("{} {verb} not answer: stopped, hung, gone, or its node unreachable", list(&named)));
        }
        let busy: Vec<String> = answers
            .iter()
            .filter(|(_, answer)| *answer == Answer::Busy)
            .map(|&(rank, _)| format!("rank {rank} (host {})", self.ranks[rank].host))
            .collect();
        if !busy.is_empty() {
            let verb = if busy.len() == 1 { "answers but waits" } else { "answer but wait" };
            findings.push(format!("{} {verb} on no rank: computing, or hung outside communication", list(&busy)));
        }
        if findings.is_empty() {
            let waiting: Vec<String> = answers
                .iter()
                .filter_map(|(rank, answer)| match answer {
                    Answer::Waiting(what) => Some(format!("rank {rank} (host {}) in {what}", self.ranks[*rank].host)),
                    Answer::Busy => None,
                })
                .take(3)
                .collect();
            if !waiting.is_empty() {
                findings.push(format!("every rank answers and waits: {}", list(&waiting)));
            }
        }
        Diagnosis { unresponsive, findings }
    }

    /// Sends probes to `ranks` until each answered or `wait` passed; the answers, in rank order.
    fn probe(&self, ranks: &[usize], here: &str, wait: Duration) -> Vec<(usize, Answer)> {
        let mut answers: Vec<(usize, Answer)> = Vec::new();
        let Ok(socket) = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)) else { return answers };
        if ranks.is_empty() || socket.set_read_timeout(Some(Duration::from_millis(20))).is_err() {
            return answers;
        }
        let targets: Vec<(usize, Vec<SocketAddr>)> = ranks
            .iter()
            .map(|&rank| {
                let peer = &self.ranks[rank];
                let mut addresses = peer.addresses.clone();
                if peer.host == here {
                    addresses.push(Ipv4Addr::LOCALHOST);
                }
                (rank, addresses.into_iter().map(|a| SocketAddr::new(IpAddr::V4(a), peer.port)).collect())
            })
            .collect();
        let start = Instant::now();
        let mut last_sent: Option<Instant> = None;
        let mut buffer = [0u8; 512];
        while start.elapsed() < wait && answers.len() < targets.len() {
            if last_sent.is_none_or(|at| at.elapsed() >= RESEND) {
                for (rank, addresses) in &targets {
                    if !answers.iter().any(|(r, _)| r == rank) {
                        let probe = [PROBE, &(*rank as u32).to_le_bytes()].concat();
                        for address in addresses {
                            let _ = socket.send_to(&probe, address);
                        }
                    }
                }
                last_sent = Some(Instant::now());
            }
            let Ok(len) = socket.recv(&mut buffer) else { continue };
            let Some(answer) = buffer[..len].strip_prefix(ALIVE).filter(|answer| answer.len() >= 4) else {
                continue;
            };
            let (asked, what) = answer.split_at(4);
            let rank = u32::from_le_bytes([asked[0], asked[1], asked[2], asked[3]]) as usize;
            if ranks.contains(&rank) && !answers.iter().any(|(r, _)| *r == rank) {
                let answer = match what {
                    [] => Answer::Busy,
                    what => Answer::Waiting(String::from_utf8_lossy(what).into_owned()),
                };
                answers.push((rank, answer));
            }
        }
        answers.sort_by_key(|(rank, _)| *rank);
        answers
    }
}

/// What [`Peers::diagnose`] found.
pub(super) struct Diagnosis {
    /// Some rank is stopped, gone or does not answer.
    pub unresponsive: bool,
    findings: Vec<String>,
}

impl Diagnosis {
    /// The findings in one line; `None` when every other rank answers and waits on none.
    pub fn describe(&self) -> Option<String> {
        (!self.findings.is_empty()).then(|| self.findings.join("; "))
    }
}

/// "a", "a and b", "a, b and c".
fn list(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

/// What `/proc` says of a process on this host, when it is not running: stopped or gone.
fn local_state(pid: u32) -> Option<&'static str> {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => Some("is gone"),
        Ok(stat) => {
            // The state follows the command name, which is in parentheses.
            match stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()) {
                Some('T') | Some('t') => Some("is stopped"),
                Some('Z') | Some('X') => Some("is gone"),
                _ => None,
            }
        }
    }
}

/// This host's name.
pub(super) fn host_name() -> String {
    let mut name = [0u8; 256];
    // SAFETY: gethostname writes at most `name.len()` bytes into it.
    unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) };
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    String::from_utf8_lossy(&name[..end]).into_owned()
}

/// The host's IPv4 addresses other than loopback, in the order the system lists them.
fn ipv4_addresses() -> Vec<Ipv4Addr> {
    let mut addresses = Vec::new();
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a linked list freed below by freeifaddrs; each entry's
    // address, when not null, is a sockaddr of the family it names.
    unsafe {
        if libc::getifaddrs(&mut list) != 0 {
            return addresses;
        }
        let mut entry = list;
        while !entry.is_null() {
            let address = (*entry).ifa_addr;
            if !address.is_null() && (*address).sa_family as i32 == libc::AF_INET {
                let inet = &*(address as *const libc::sockaddr_in);
                let ip = Ipv4Addr::from(u32::from_be(inet.sin_addr.s_addr));
                if !ip.is_loopback() && !addresses.contains(&ip) {
                    addresses.push(ip);
                }
            }
            entry = (*entry).ifa_next;
        }
        libc::freeifaddrs(list);
    }
    addresses
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let addresses = [Ipv4Addr::new(10, 0, 0, 7), Ipv4Addr::new(192, 168, 1, 2)];
        let mut records = Peers::record("node-7", 4242, 5000, &addresses).to_vec();
        records.extend(Peers::record(&"x".repeat(100), 1, 2, &[Ipv4Addr::new(1, 2, 3, 4); 9]));
        let peers = Peers::from_records(&records, 0);
        assert_eq!(
            peers.ranks[0],
            Peer { host: "node-7".into(), pid: 4242, port: 5000, addresses: addresses.to_vec() }
        );
        assert_eq!(peers.ranks[1].host.len(), HOST_BYTES);
        assert_eq!(peers.ranks[1].addresses.len(), MAX_ADDRESSES);
    }

    /// Three "ranks" in this process: one answers waiting, one answers busy, one is silent.
    #[test]
    fn a_probe_tells_silent_busy_and_waiting_ranks_apart() {
        let waiting = Peers::start(|| Some("rank 1's all_reduce #3 on mesh axis 0".into())).unwrap();
        let busy = Peers::start(|| None).unwrap();
        // A socket no one answers on.
        let silent = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let pid = std::process::id();
        let silent = Peers::record(&host_name(), pid, silent.local_addr().unwrap().port(), &[]);
        let own = Peers::start(|| None).unwrap();
        let peers = Peers::from_records(&[own, waiting, busy, silent].concat(), 0);
        let diagnosis = peers.diagnose(Duration::from_millis(600));
        assert!(diagnosis.unresponsive);
        let found = diagnosis.describe().unwrap();
        let host = host_name();
        assert_eq!(
            found,
            format!(
                "rank 3 (host {host}, pid {pid}) does not answer: stopped, hung, gone, or its node unreachable; \
                 rank 2 (host {host}) answers but waits on no rank: computing, or hung outside communication"
            )
        );
    }

    /// Ranks that all answer and wait are no one's fault: the line says where each waits.
    #[test]
    fn ranks_that_all_wait_are_described() {
        let own = Peers::start(|| None).unwrap();
        let other = Peers::start(|| Some("rank 1's all_gather #9 on mesh axis 1 for 6.0 s".into())).unwrap();
        let diagnosis = Peers::from_records(&[own, other].concat(), 0).diagnose(Duration::from_millis(600));
        assert!(!diagnosis.unresponsive);
        assert_eq!(
            diagnosis.describe().unwrap(),
            format!(
                "every rank answers and waits: rank 1 (host {}) in rank 1's all_gather #9 on mesh axis 1 for 6.0 s",
                host_name()
            )
        );
    }

    #[test]
    fn a_process_that_is_gone_is_seen_in_proc() {
        assert_eq!(local_state(std::process::id()), None);
        assert_eq!(local_state(u32::MAX), Some("is gone"));
    }
}
