//! Standard output for commands: a failed write (a closed pipe, a full
//! disk) becomes the command's error, reported on one line with a non-zero
//! exit, never a panic.

use std::fmt;
use std::io::Write;

/// Writes `args` to standard output and flushes it.
pub fn write(args: fmt::Arguments<'_>) -> Result<(), String> {
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_fmt(args)
        .and_then(|()| stdout.flush())
        .map_err(|e| format!("cannot write to standard output: {e}"))
}

/// `println!` that returns the write's error instead of panicking:
/// `say!("{x}")?`.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::output::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub(crate) use say;
