//! Emulated NAND drives in the CLI: a profile's parameters with the command
//! line's overrides, for `create --nand` and `bench --profile`.

use zdisk_core::units::format_size;
use zdisk_nand::{NandConfig, NandParams};

/// Parameters for a named profile with the command line's overrides.
pub fn params(
    profile: &str,
    physical: Option<u64>,
    plp: bool,
    recycle_cap_mb_s: Option<f64>,
) -> Result<NandParams, String> {
    let mut params = NandParams::named(profile).map_err(|e| e.to_string())?;
    if let Some(bytes) = physical {
        let scaled = params.profile.clone().with_physical_bytes(bytes);
        let smallest = params
            .profile
            .clone()
            .with_physical_bytes(0)
            .physical_bytes();
        if bytes < smallest {
            return Err(format!(
                "--physical {} is smaller than the smallest {profile} drive, which has {} of NAND \
                 (at least {} erase blocks per plane)",
                format_size(bytes),
                format_size(smallest),
                zdisk_nand::MIN_BLOCKS_PER_PLANE,
            ));
        }
        params.profile = scaled;
    }
    params.config = NandConfig {
        power_loss_protection: plp || params.config.power_loss_protection,
        recycle_cap_bytes_per_sec: match recycle_cap_mb_s {
            Some(0.0) => None,
            Some(cap) if !(cap > 0.0 && cap.is_finite()) => {
                return Err(format!(
                    "--recycle-cap-mb-s {cap}: give a rate in MB/s, or 0 for no cap"
                ))
            }
            Some(cap) => Some(((cap * 1e6) as u64).max(1)),
            None => params.config.recycle_cap_bytes_per_sec,
        },
    };
    params.validate().map_err(|e| e.to_string())?;
    Ok(params)
}
