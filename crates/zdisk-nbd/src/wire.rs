//! The NBD wire format, which lives in `zdisk-nbd-wire` so that clients
//! need neither the server nor the engine; re-exported whole here, so the
//! server's modules and users of `zdisk_nbd::wire` read it in one place.
//!
//! Only what needs the engine's types stays here: how a
//! [`zdisk_core::Stored`] extent becomes a `zdisk:compression` status.

pub use zdisk_nbd_wire::wire::*;

/// The zdisk:compression status of an extent stored as `stored`
/// (docs/semantics.md, "zdisk:compression").
pub fn compression_status(stored: zdisk_core::Stored) -> u32 {
    use zdisk_core::Stored;
    let size = |sixteenths: u8| (u32::from(sixteenths.clamp(1, 16)) - 1) << ZDISK_SIZE_SHIFT;
    match stored {
        Stored::Hole => ZDISK_KIND_HOLE,
        Stored::Zero => ZDISK_KIND_ZERO,
        Stored::Damaged => ZDISK_KIND_DAMAGED,
        Stored::Raw {
            size_sixteenths,
            shared,
        } => ZDISK_KIND_RAW | size(size_sixteenths) | shared_bit(shared),
        Stored::Compressed {
            codec,
            unit,
            size_sixteenths,
            shared,
        } => {
            let codec = codec.map_or(ZDISK_CODEC_UNKNOWN, |id| u32::from(id as u8));
            let unit = if unit { ZDISK_UNIT } else { 0 };
            ZDISK_KIND_COMPRESSED
                | codec << ZDISK_CODEC_SHIFT
                | size(size_sixteenths)
                | unit
                | shared_bit(shared)
        }
    }
}

fn shared_bit(shared: bool) -> u32 {
    match shared {
        true => ZDISK_SHARED,
        false => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zdisk_core::codec::CodecId;
    use zdisk_core::Stored;

    #[test]
    fn compression_status_packs_kind_codec_size_unit_and_shared() {
        assert_eq!(compression_status(Stored::Hole), 0);
        assert_eq!(compression_status(Stored::Zero), 1);
        assert_eq!(compression_status(Stored::Damaged), 4);
        assert_eq!(
            compression_status(Stored::Raw {
                size_sixteenths: 16,
                shared: false
            }),
            0xf02
        );
        assert_eq!(
            compression_status(Stored::Raw {
                size_sixteenths: 16,
                shared: true
            }),
            0x2f02
        );
        assert_eq!(
            compression_status(Stored::Compressed {
                codec: Some(CodecId::Zstd),
                unit: true,
                size_sixteenths: 5,
                shared: true
            }),
            0x3423
        );
        assert_eq!(
            compression_status(Stored::Compressed {
                codec: None,
                unit: false,
                size_sixteenths: 1,
                shared: false
            }),
            0xf3
        );
    }
}
