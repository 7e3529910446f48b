//! NCCL between GPUs: which path each mesh axis's collectives and each pipeline link's messages
//! take, decided by the ranks involved together when a program loads, and the communicators of
//! those that take NCCL. The collectives' device steps are [`super::collectives`]; the calls,
//! the [`Gpu`]'s.
//!
//! A pipeline link is one direction between two stages (a rank and its mesh position on the
//! other stage), with a communicator of two ranks of its own, the sender rank 0: a rank's
//! sends and receives never share a communicator, so its NCCL sends (on a stream of their own)
//! and receives (on the compute stream) need no order between them. The two ranks of a link
//! share their records and the id with pipeline messages through the host communicator, and
//! every rank takes its links in one order (by the stages' pair, then the direction), so that
//! two ranks never wait on each other's different communicators.

use super::{Gpu, NcclId, NcclReach};
use crate::comm::Communicator;
use crate::RuntimeError;

/// How a rank's collectives on one mesh axis, or its messages over one pipeline link, travel,
/// decided with the other ranks of its group when the program loads ([`bootstrap`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CommPath {
    /// On the device, NCCL communicator `comm` (a handle of the [`Gpu`]).
    Nccl { comm: usize },
    /// Through host memory and the rank's communicator, for this reason.
    Host { why: &'static str },
}

/// Bytes of the record each rank shares to decide its groups' [`CommPath`]s: its NCCL reach, its
/// process (pid and host) and its device's identity.
const RECORD_BYTES: usize = 32;

/// This rank's record (see [`RECORD_BYTES`]).
fn bootstrap_record(gpu: &mut dyn Gpu) -> Result<[u8; RECORD_BYTES], RuntimeError> {
    let mut record = [0u8; RECORD_BYTES];
    record[0] = match gpu.nccl_reach() {
        NcclReach::Unavailable => 0,
        NcclReach::Process => 1,
        NcclReach::Anywhere => 2,
    };
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host_hash = host.trim().bytes().fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32));
    record[1..5].copy_from_slice(&std::process::id().to_le_bytes());
    record[5..9].copy_from_slice(&host_hash.to_le_bytes());
    record[9..25].copy_from_slice(&gpu.device_uuid()?);
    Ok(record)
}

/// Whether a group whose ranks shared `records` communicates through NCCL: every rank has it,
/// no two share a device (NCCL refuses them), and, for an NCCL of one process, all are in it.
fn nccl_decision(records: &[u8]) -> Result<(), &'static str> {
    let records: Vec<&[u8]> = records.chunks(RECORD_BYTES).collect();
    if records.iter().any(|r| r[0] == 0) {
        return Err("a rank's GPU has no NCCL library");
    }
    let devices: std::collections::BTreeSet<&[u8]> = records.iter().map(|r| &r[9..25]).collect();
    if devices.len() < records.len() {
        return Err("its ranks share a GPU, which NCCL refuses");
    }
    let processes: std::collections::BTreeSet<&[u8]> = records.iter().map(|r| &r[1..9]).collect();
    if records.iter().any(|r| r[0] == 1) && processes.len() > 1 {
        return Err("the emulated NCCL joins threads of one process only");
    }
    Ok(())
}

/// How a rank's collectives on each mesh axis, and its messages over each pipeline link, travel
/// ([`bootstrap`]).
pub struct Paths {
    pub axes: Vec<CommPath>,
    pub links: Vec<(Link, CommPath)>,
}

/// Decides the [`CommPath`] of each of `mesh`'s axes and of each of `links` (the pipeline links
/// `rank`'s program sends or receives over) with the ranks at their other ends, through the
/// host communicator, and joins the NCCL communicators of those that take NCCL. Every rank of
/// the job calls this at once; `issued` counts the host collectives it makes on each axis
/// (their sequence numbers).
pub fn bootstrap(
    gpu: &mut dyn Gpu,
    mesh: &[autotp_program::mesh::MeshAxis],
    links: &[Link],
    rank: usize,
    comm: &dyn Communicator,
    issued: &mut [u64],
) -> Result<Paths, RuntimeError> {
    let record = bootstrap_record(gpu)?;
    let axes = axis_paths(gpu, &record, mesh, rank, comm, issued)?;
    let links = link_paths(gpu, &record, links, rank, comm)?;
    Ok(Paths { axes, links })
}

/// Each mesh axis's [`CommPath`], decided with the other ranks of the axis's group (an
/// all-gather of their records), and an NCCL communicator joined for each group that takes
/// NCCL: its first rank makes the id, shared with an all-gather of 128 bytes.
fn axis_paths(
    gpu: &mut dyn Gpu,
    record: &[u8; RECORD_BYTES],
    mesh: &[autotp_program::mesh::MeshAxis],
    rank: usize,
    comm: &dyn Communicator,
    issued: &mut [u64],
) -> Result<Vec<CommPath>, RuntimeError> {
    use autotp_program::mesh::{Collective, CollectiveOp};
    let coordinates = comm.topology().coordinates(rank);
    let gather = |axis: usize, bytes: &[u8], issued: &mut [u64]| -> Result<Vec<u8>, RuntimeError> {
        let op = CollectiveOp {
            kind: Collective::AllGather { dim: 0 },
            axis,
            dtype: autotp_kernels::DType::U8,
            shape: vec![bytes.len()],
        };
        let seq = crate::executor::next_seq(issued, &op);
        let mut all = vec![0u8; bytes.len() * mesh[axis].size];
        comm.collective(rank, &op, seq, bytes, &mut all)?;
        Ok(all)
    };
    let mut paths = Vec::with_capacity(mesh.len());
    for (axis, mesh_axis) in mesh.iter().enumerate() {
        let records = gather(axis, record, issued)?;
        paths.push(match nccl_decision(&records) {
            Ok(()) => {
                let coordinate = coordinates[axis];
                let id = if coordinate == 0 { gpu.nccl_id()? } else { [0; 128] };
                let ids = gather(axis, &id, issued)?;
                let id: NcclId = ids[..128].try_into().expect("128 bytes");
                CommPath::Nccl { comm: gpu.nccl_join(&id, mesh_axis.size, coordinate)? }
            }
            Err(why) => CommPath::Host { why },
        });
    }
    Ok(paths)
}

/// The tags of the pipeline messages that set up a link (a program's tags are below them).
pub const LINK_RECORD_TAG: u64 = u64::MAX - 1;
pub const LINK_ID_TAG: u64 = u64::MAX;

/// A pipeline link: messages from stage `from` to stage `to` (of one mesh position).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Link {
    pub from: usize,
    pub to: usize,
}

impl Link {
    /// The order every rank takes its links in: by the pair of stages, then the direction.
    fn order(&self) -> (usize, usize, usize) {
        (self.from.min(self.to), self.from.max(self.to), self.from)
    }
}

/// Each pipeline link's [`CommPath`], decided with the rank at its other end, and the NCCL
/// communicator of each that takes NCCL joined (see the module doc).
fn link_paths(
    gpu: &mut dyn Gpu,
    record: &[u8; RECORD_BYTES],
    links: &[Link],
    rank: usize,
    comm: &dyn Communicator,
) -> Result<Vec<(Link, CommPath)>, RuntimeError> {
    let stage = comm.topology().stage(rank);
    let mut ordered = links.to_vec();
    ordered.sort_by_key(Link::order);
    ordered.dedup();
    let mut paths = Vec::with_capacity(ordered.len());
    for link in ordered {
        let sends = link.from == stage;
        let peer = if sends { link.to } else { link.from };
        comm.send(rank, peer, LINK_RECORD_TAG, record, std::time::Duration::ZERO)?;
        let mut theirs = [0u8; RECORD_BYTES];
        comm.recv(rank, peer, LINK_RECORD_TAG, &mut theirs)?;
        let records = match sends {
            true => [*record, theirs].concat(),
            false => [theirs, *record].concat(),
        };
        let path = match nccl_decision(&records) {
            Ok(()) => {
                let mut id: NcclId = [0; 128];
                match sends {
                    true => {
                        id = gpu.nccl_id()?;
                        comm.send(rank, peer, LINK_ID_TAG, &id, std::time::Duration::ZERO)?;
                    }
                    false => {
                        comm.recv(rank, peer, LINK_ID_TAG, &mut id)?;
                    }
                }
                CommPath::Nccl { comm: gpu.nccl_join(&id, 2, usize::from(!sends))? }
            }
            Err(why) => CommPath::Host { why },
        };
        paths.push((link, path));
    }
    Ok(paths)
}
