//! The handle table of a multi-process symmetric heap: each rank exports its slice and publishes
//! one fixed-size record; an all-gather gives every rank every record; each rank imports its
//! peers' slices from them.
//!
//! Record layout (little-endian, [`RECORD_BYTES`] bytes): magic `b"MOKH"`, version u16, kind u16
//! (1 POSIX fd, 2 fabric), rank u32, pid u32, fd i32, process space u32, slice bytes u64, fabric
//! handle 64 bytes (zero for POSIX), requested bytes u64, layout digest u64.

use crate::driver::vmm::{ExportedHandle, ShareableKind};
use crate::error::{MokError, Result};

/// Bytes of one record.
pub const RECORD_BYTES: usize = 112;
const MAGIC: [u8; 4] = *b"MOKH";
const VERSION: u16 = 4;
const KIND_POSIX_FD: u16 = 1;
const KIND_FABRIC: u16 = 2;

/// One rank's exported slice (made by the heap, read from a table: its fields may grow).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HandleRecord {
    /// The exporting rank.
    pub rank: u32,
    /// The exporting process (a POSIX fd is only meaningful together with it).
    pub pid: u32,
    /// The exporter's [`process_space`]: a POSIX fd is only meaningful to processes of the same.
    pub space: u32,
    /// Bytes of the slice as mapped by the exporter.
    pub bytes: u64,
    /// Bytes per rank the exporter's heap was asked for, before rounding to the mapping
    /// granularity: `Exchange::heap_request` of its layer's config and options, so ranks
    /// built with different ones are told apart (their rounded slices may still be equal).
    pub requested: u64,
    /// The layout the exporter's layer will give the heap ([`super::HeapRequest::layout`]; 0 where
    /// its heap was asked for bytes alone), so that ranks whose layers differ are told apart
    /// even when their heaps were asked for the same bytes.
    pub layout: u64,
    /// The handle as the exporter named it.
    pub handle: ExportedHandle,
}

fn bad(problem: String) -> MokError {
    MokError::InvalidInput { tensor: "symmetric heap handle table", problem }
}

/// Which processes this one can reach by process id: a digest of the host's boot (its
/// `boot_id`) and of this process's PID namespace. Two ranks with different values are on
/// different hosts or in different containers, where a peer's POSIX fd cannot be duplicated by
/// its process id (or would name an unrelated process). 0 where the system does not say (then
/// every rank's is 0 and nothing is told apart).
pub fn process_space() -> u32 {
    #[cfg(target_os = "linux")]
    {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        let namespace = std::fs::read_link("/proc/self/ns/pid").map(|p| p.display().to_string()).unwrap_or_default();
        if boot.is_empty() && namespace.is_empty() {
            return 0;
        }
        let digest = super::id_file::digest(&format!("{}|{namespace}", boot.trim()));
        (digest ^ (digest >> 32)) as u32
    }
    #[cfg(not(target_os = "linux"))]
    0
}

impl HandleRecord {
    /// The record's bytes.
    pub fn to_bytes(&self) -> [u8; RECORD_BYTES] {
        let mut out = [0u8; RECORD_BYTES];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        let (kind, fd, fabric) = match self.handle {
            ExportedHandle::PosixFd(fd) => (KIND_POSIX_FD, fd, [0u8; 64]),
            ExportedHandle::Fabric(data) => (KIND_FABRIC, -1, data),
        };
        out[6..8].copy_from_slice(&kind.to_le_bytes());
        out[8..12].copy_from_slice(&self.rank.to_le_bytes());
        out[12..16].copy_from_slice(&self.pid.to_le_bytes());
        out[16..20].copy_from_slice(&fd.to_le_bytes());
        out[20..24].copy_from_slice(&self.space.to_le_bytes());
        out[24..32].copy_from_slice(&self.bytes.to_le_bytes());
        out[32..96].copy_from_slice(&fabric);
        out[96..104].copy_from_slice(&self.requested.to_le_bytes());
        out[104..112].copy_from_slice(&self.layout.to_le_bytes());
        out
    }

    /// Parses one record, checking magic, version and kind.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.len() != RECORD_BYTES {
            return Err(bad(format!("a record has {} bytes, expected {RECORD_BYTES}", bytes.len())));
        }
        if bytes[0..4] != MAGIC {
            return Err(bad("a record does not start with MOKH (not written by mok, or corrupted)".into()));
        }
        let u16_at = |i: usize| u16::from_le_bytes([bytes[i], bytes[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        let version = u16_at(4);
        if version != VERSION {
            return Err(bad(format!("record version {version}, this build reads {VERSION}: mixed mok versions?")));
        }
        let handle = match u16_at(6) {
            KIND_POSIX_FD => ExportedHandle::PosixFd(u32_at(16) as i32),
            KIND_FABRIC => ExportedHandle::Fabric(bytes[32..96].try_into().expect("64 bytes")),
            kind => return Err(bad(format!("unknown handle kind {kind}"))),
        };
        Ok(Self {
            rank: u32_at(8),
            pid: u32_at(12),
            space: u32_at(20),
            bytes: u64::from_le_bytes(bytes[24..32].try_into().expect("8 bytes")),
            requested: u64::from_le_bytes(bytes[96..104].try_into().expect("8 bytes")),
            layout: u64::from_le_bytes(bytes[104..112].try_into().expect("8 bytes")),
            handle,
        })
    }

    /// Parses an all-gathered table (`world` records in rank order) and checks that record r
    /// came from rank r, that every slice has the same size, requested size, layout and handle
    /// kind, and that POSIX fds come from processes of one [`process_space`].
    pub fn decode_table(table: &[u8], world: usize) -> Result<Vec<Self>> {
        match world.checked_mul(RECORD_BYTES) {
            Some(expected) if world > 0 && table.len() == expected => {}
            expected => {
                let expected = expected.map_or("more than the address space holds".to_string(), |e| e.to_string());
                return Err(bad(format!("{} bytes for {world} ranks, expected {expected}", table.len())));
            }
        }
        let records: Vec<Self> = table.chunks_exact(RECORD_BYTES).map(Self::from_bytes).collect::<Result<_>>()?;
        for (rank, record) in records.iter().enumerate() {
            if record.rank as usize != rank {
                return Err(bad(format!("entry {rank} was written by rank {}", record.rank)));
            }
            if record.bytes != records[0].bytes {
                return Err(bad(format!(
                    "rank {rank}'s slice has {} bytes, rank 0's {}: every rank must lay out the same heap",
                    record.bytes, records[0].bytes
                )));
            }
            if record.requested != records[0].requested {
                return Err(bad(format!(
                    "rank {rank}'s heap was asked for {} bytes per rank, rank 0's for {}: the ranks' layers have \
                     different configs or exchange options (build every rank's heap with \
                     Exchange::heap_request of the same ones)",
                    record.requested, records[0].requested
                )));
            }
            if record.layout != records[0].layout {
                return Err(bad(format!(
                    "rank {rank}'s heap was asked for layout {:#018x}, rank 0's for {:#018x}: the ranks' layers have \
                     different configs or exchange options (build every rank's heap with Exchange::heap_request of \
                     the same ones)",
                    record.layout, records[0].layout
                )));
            }
            let kind = record.handle.kind();
            if kind != records[0].handle.kind() {
                return Err(bad(format!(
                    "rank {rank} exported a {kind:?} handle, rank 0 a {:?} one: every rank must use the same kind \
                     (MOK_HEAP_HANDLE)",
                    records[0].handle.kind()
                )));
            }
            if kind == ShareableKind::PosixFd && record.space != records[0].space {
                return Err(bad(format!(
                    "rank {rank} runs on another host or in another PID namespace than rank 0: POSIX-fd \
                     handles reach only the processes of one node's namespace (across nodes set \
                     MOK_HEAP_HANDLE=fabric)"
                )));
            }
        }
        Ok(records)
    }
}

/// Lowercase hex of `bytes` (an NCCL unique id in a file or an environment variable).
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses [`to_hex`]'s output.
pub fn from_hex(text: &str) -> Result<Vec<u8>> {
    let text = text.trim();
    // Hex digits only: `from_str_radix` would take a sign ("+f"), and a multi-byte character
    // would split the slices below mid-character.
    if let Some(at) = text.find(|c: char| !c.is_ascii_hexdigit()) {
        return Err(bad(format!("not hex at byte {at}")));
    }
    if !text.len().is_multiple_of(2) {
        return Err(bad(format!("hex text of odd length {}", text.len())));
    }
    (0..text.len())
        .step_by(2)
        .map(|i| {
            u8::from_str_radix(&text[i..i + 2], 16).map_err(|_| bad(format!("not hex at {i}: {:?}", &text[i..i + 2])))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_hex_and_tables_are_errors_not_panics() {
        assert!(from_hex("0é0").is_err());
        assert!(from_hex("0g").is_err());
        assert!(from_hex("+f").is_err());
        assert!(from_hex("abc").is_err());
        assert_eq!(from_hex(" 0aff\n").unwrap(), [0x0a, 0xff]);
        assert!(HandleRecord::decode_table(&[], usize::MAX).is_err());
        assert!(HandleRecord::decode_table(&[], 1 << 60).is_err());
        assert!(HandleRecord::decode_table(&[], 0).is_err());
    }

    #[test]
    fn records_round_trip() {
        let mut fabric = [0u8; 64];
        fabric.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8 ^ 0xa5);
        for handle in [ExportedHandle::PosixFd(17), ExportedHandle::Fabric(fabric)] {
            let record = HandleRecord {
                rank: 3,
                pid: 4242,
                space: 0x9e37_79b9,
                bytes: 1 << 33,
                requested: (1 << 33) - 5,
                layout: 0x0123_4567_89ab_cdef,
                handle,
            };
            assert_eq!(HandleRecord::from_bytes(&record.to_bytes()).unwrap(), record);
        }
    }

    #[test]
    fn tables_check_order_and_sizes() {
        let posix = |rank, bytes, requested, layout| {
            HandleRecord { rank, pid: 1, space: 7, bytes, requested, layout, handle: ExportedHandle::PosixFd(3) }
                .to_bytes()
        };
        let record = |rank, bytes| posix(rank, bytes, 4000, 9);
        let table: Vec<u8> = [record(0, 4096), record(1, 4096)].concat();
        assert_eq!(HandleRecord::decode_table(&table, 2).unwrap().len(), 2);
        let swapped: Vec<u8> = [record(1, 4096), record(0, 4096)].concat();
        assert!(HandleRecord::decode_table(&swapped, 2).unwrap_err().to_string().contains("written by rank 1"));
        let sizes: Vec<u8> = [record(0, 4096), record(1, 8192)].concat();
        assert!(HandleRecord::decode_table(&sizes, 2).unwrap_err().to_string().contains("same heap"));
        // Equal slices asked for by layers of different configs (rounded up to the same size).
        let configs: Vec<u8> = [posix(0, 4096, 4000, 9), posix(1, 4096, 4040, 9)].concat();
        assert!(HandleRecord::decode_table(&configs, 2).unwrap_err().to_string().contains("different configs"));
        // The same bytes asked for by layers that lay them out differently.
        let layouts: Vec<u8> = [posix(0, 4096, 4000, 9), posix(1, 4096, 4000, 10)].concat();
        let refusal = HandleRecord::decode_table(&layouts, 2).unwrap_err().to_string();
        assert!(
            refusal.contains("rank 1's heap was asked for layout") && refusal.contains("different configs"),
            "{refusal}"
        );
        assert!(HandleRecord::decode_table(&table, 3).is_err());
        let mut corrupt = record(0, 16);
        corrupt[0] = b'X';
        assert!(HandleRecord::from_bytes(&corrupt).unwrap_err().to_string().contains("MOKH"));
        let mut kind = record(0, 16);
        kind[6] = 9;
        assert!(HandleRecord::from_bytes(&kind).unwrap_err().to_string().contains("kind 9"));
        // POSIX fds from another host or namespace, and mixed kinds, are refused; fabric
        // handles cross hosts.
        let with = |rank, space, handle| {
            HandleRecord { rank, pid: 1, space, bytes: 4096, requested: 4096, layout: 0, handle }.to_bytes()
        };
        let (fd, fabric) = (ExportedHandle::PosixFd(3), ExportedHandle::Fabric([1; 64]));
        let elsewhere: Vec<u8> = [with(0, 7, fd), with(1, 8, fd)].concat();
        assert!(HandleRecord::decode_table(&elsewhere, 2).unwrap_err().to_string().contains("another host"));
        let mixed: Vec<u8> = [with(0, 7, fd), with(1, 7, fabric)].concat();
        assert!(HandleRecord::decode_table(&mixed, 2).unwrap_err().to_string().contains("same kind"));
        let across_hosts: Vec<u8> = [with(0, 7, fabric), with(1, 8, fabric)].concat();
        assert_eq!(HandleRecord::decode_table(&across_hosts, 2).unwrap().len(), 2);
        // An older record version is refused by name.
        let mut old = record(0, 16);
        old[4] = 3;
        assert!(HandleRecord::from_bytes(&old).unwrap_err().to_string().contains("version 3"));
        // This process's space is the same each time it is asked.
        assert_eq!(process_space(), process_space());
    }

    #[test]
    fn hex_round_trips_and_rejects_junk() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(from_hex(&to_hex(&bytes)).unwrap(), bytes);
        assert!(from_hex("abc").is_err());
        assert!(from_hex("zz").is_err());
    }
}
