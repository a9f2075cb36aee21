//! Sequential parsing of a segment's records, shared by recovery, the
//! cleaner and `zdisk check`.
//!
//! A segment holds records back to back from offset 0. A zero magic means
//! padding: the rest of that page is empty and the next record, if any,
//! starts on the next page. Bytes that fail to decode (a torn write, a
//! record of an older incarnation, bit rot) cannot be trusted for a length,
//! so the scan steps forward 16 bytes at a time until a record of this
//! incarnation decodes again, with a valid checksum. Undecodable bytes
//! followed by valid records are damage; undecodable bytes at the end are
//! normally the unwritten or torn tail.

use std::ops::Range;

use crate::record::{decode_record, RecordError, RecordHeader, RecordKey, HEADER_SIZE};

#[derive(Debug, Clone)]
pub(crate) struct Scanned {
    pub offset: u64,
    pub header: RecordHeader,
    pub payload: Range<usize>,
}

#[derive(Debug, Clone)]
pub(crate) struct ScanResult {
    pub records: Vec<Scanned>,
    /// End of the last valid record, rounded up to a page.
    pub end_offset: u64,
    /// The first undecodable bytes, if any (whether or not records follow).
    pub first_error: Option<(u64, RecordError)>,
    /// Undecodable runs that valid records follow: damage inside the
    /// written part of the segment.
    pub damaged: Vec<(u64, RecordError)>,
}

/// Parses the records of one segment incarnation (`seq32`) in `bytes`,
/// starting at `start`.
pub(crate) fn scan_segment(
    bytes: &[u8],
    start: u64,
    seq32: u32,
    page_size: u64,
    key: &RecordKey,
) -> ScanResult {
    let mut records = Vec::new();
    let mut pos = start as usize;
    let mut end = start;
    let mut first_error = None;
    let mut damaged = Vec::new();
    // The start of the undecodable run being skipped, if any.
    let mut skipping: Option<(u64, RecordError)> = None;
    while pos + HEADER_SIZE <= bytes.len() {
        let blank = bytes[pos];
        if (blank == 0 || blank == 0xFF) && bytes[pos + 1] == blank {
            // No record starts with these bytes: zeros are flush padding,
            // which runs to the end of the page (it may be shorter than a
            // header); zeros or ones to the page end are unwritten or erased
            // space.
            let page_end =
                ((pos as u64 / page_size + 1) * page_size).min(bytes.len() as u64) as usize;
            if bytes[pos..page_end].iter().all(|&b| b == blank) {
                pos = page_end;
                continue;
            }
        }
        match decode_record(&bytes[pos..], key, Some(seq32)) {
            Ok((header, _)) => {
                if let Some(run) = skipping.take() {
                    damaged.push(run);
                }
                let payload = pos + HEADER_SIZE..pos + HEADER_SIZE + header.payload_len as usize;
                records.push(Scanned {
                    offset: pos as u64,
                    header,
                    payload,
                });
                pos += header.record_len() as usize;
                end = pos as u64;
            }
            Err(error) => {
                if first_error.is_none() {
                    first_error = Some((pos as u64, error.clone()));
                }
                if skipping.is_none() {
                    skipping = Some((pos as u64, error));
                }
                pos += crate::record::RECORD_ALIGN as usize;
            }
        }
    }
    ScanResult {
        records,
        end_offset: end.div_ceil(page_size) * page_size,
        first_error,
        damaged,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{encode_record, record_len_for_payload, RecordKind};

    const KEY: RecordKey = RecordKey([4; 16]);

    fn put(bytes: &mut [u8], at: usize, seq: u32, lba: u64, payload: &[u8]) -> usize {
        let header = RecordHeader {
            kind: RecordKind::Data,
            codec: 1,
            seg_seq: seq,
            lba,
            version: lba + 100,
            payload_len: payload.len() as u32,
            crc: 0,
        };
        let len = record_len_for_payload(payload.len()) as usize;
        encode_record(
            &mut bytes[at..at + len],
            header,
            payload,
            crc32c::crc32c(payload),
            &KEY,
        );
        at + len
    }

    #[test]
    fn scans_across_padding_and_stops_at_damage() {
        let mut bytes = vec![0u8; 4 * 4096];
        let next = put(&mut bytes, 0, 5, 1, &[1; 100]);
        put(&mut bytes, next, 5, 2, &[2; 100]);
        // A flush padded the first page; the next record starts on page 1.
        let next = put(&mut bytes, 4096, 5, 3, &[3; 4000]);
        let result = scan_segment(&bytes, 0, 5, 4096, &KEY);
        assert_eq!(
            result
                .records
                .iter()
                .map(|r| r.header.lba)
                .collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        assert!(result.first_error.is_none());
        assert_eq!(result.end_offset, 2 * 4096);

        // Padding shorter than a header before the next page is skipped too.
        let mut short_gap = vec![0u8; 2 * 4096];
        let gap_start = put(&mut short_gap, 0, 5, 1, &[1; 4048]);
        assert_eq!(gap_start, 4096 - 16);
        put(&mut short_gap, 4096, 5, 2, &[2; 10]);
        let result = scan_segment(&short_gap, 0, 5, 4096, &KEY);
        assert_eq!(result.records.len(), 2);
        assert!(result.first_error.is_none());

        // A record of an older incarnation after the last one is the tail, not damage.
        put(&mut bytes, next, 4, 9, &[9; 10]);
        let result = scan_segment(&bytes, 0, 5, 4096, &KEY);
        assert_eq!(result.records.len(), 3);
        assert!(matches!(
            result.first_error,
            Some((_, RecordError::WrongSegment { .. }))
        ));
        assert!(result.damaged.is_empty());

        // Damage in the first record: the scan resynchronises on the next ones.
        bytes[40] ^= 1;
        let result = scan_segment(&bytes, 0, 5, 4096, &KEY);
        let lbas: Vec<u64> = result.records.iter().map(|r| r.header.lba).collect();
        assert_eq!(lbas, vec![2, 3]);
        assert!(matches!(
            result.first_error,
            Some((0, RecordError::Checksum { .. }))
        ));
        assert_eq!(result.damaged.len(), 1);
    }
}
