//! zdisk-core: the engine of zdisk, a compressing log-structured block store.

pub mod device;
pub mod error;

pub use device::{BlockDevice, Extent, ExtentState};
pub use error::{Error, Result};
