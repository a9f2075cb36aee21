//! RocksDB through its C API, loaded at run time with `dlopen`, for the
//! comparison runs: the same driver, keys, values and threads as the
//! store. Loading at run time keeps RocksDB out of the build: only the
//! benchmark needs it (Debian: `librocksdb7.8`, pulled in by
//! `rocksdb-tools`, whose `db_bench` links the same library).
//!
//! Options, chosen to match the store's footing: no OS page cache for
//! reads (direct I/O when asked, as the benchmark does: the store reads
//! the device directly), a 32 MiB
//! block cache, a 10-bit bloom filter, a write-ahead log without a sync
//! per write (the store's puts are not flushed per write either),
//! compression LZ4 or none, background jobs sized to the cores.

use std::ffi::{c_char, c_int, c_uchar, c_void, CStr, CString};

use crate::ycsb::Engine;

/// RocksDB's compression types (the C API's enum values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None = 0,
    Lz4 = 4,
}

type Opaque = *mut c_void;

struct Api {
    options_create: unsafe extern "C" fn() -> Opaque,
    options_set_create_if_missing: unsafe extern "C" fn(Opaque, c_uchar),
    options_set_compression: unsafe extern "C" fn(Opaque, c_int),
    options_increase_parallelism: unsafe extern "C" fn(Opaque, c_int),
    options_set_use_direct_reads: unsafe extern "C" fn(Opaque, c_uchar),
    options_set_use_direct_io_for_flush_and_compaction: unsafe extern "C" fn(Opaque, c_uchar),
    options_set_block_based_table_factory: unsafe extern "C" fn(Opaque, Opaque),
    block_based_options_create: unsafe extern "C" fn() -> Opaque,
    block_based_options_set_block_cache: unsafe extern "C" fn(Opaque, Opaque),
    block_based_options_set_filter_policy: unsafe extern "C" fn(Opaque, Opaque),
    cache_create_lru: unsafe extern "C" fn(usize) -> Opaque,
    filterpolicy_create_bloom: unsafe extern "C" fn(f64) -> Opaque,
    open: unsafe extern "C" fn(Opaque, *const c_char, *mut *mut c_char) -> Opaque,
    close: unsafe extern "C" fn(Opaque),
    put: unsafe extern "C" fn(
        Opaque,
        Opaque,
        *const c_char,
        usize,
        *const c_char,
        usize,
        *mut *mut c_char,
    ),
    get: unsafe extern "C" fn(
        Opaque,
        Opaque,
        *const c_char,
        usize,
        *mut usize,
        *mut *mut c_char,
    ) -> *mut c_char,
    free: unsafe extern "C" fn(*mut c_void),
    writeoptions_create: unsafe extern "C" fn() -> Opaque,
    readoptions_create: unsafe extern "C" fn() -> Opaque,
    flushoptions_create: unsafe extern "C" fn() -> Opaque,
    flushoptions_set_wait: unsafe extern "C" fn(Opaque, c_uchar),
    flush: unsafe extern "C" fn(Opaque, Opaque, *mut *mut c_char),
}

/// Library names tried in order (ZDISK_KV_ROCKSDB_LIB first if set).
const LIBRARY_NAMES: &[&str] = &[
    "librocksdb.so",
    "librocksdb.so.9",
    "librocksdb.so.8",
    "librocksdb.so.7.8",
    "librocksdb.so.7",
    "librocksdb.so.6",
];

/// A symbol's address as the function pointer type `F`.
///
/// # Safety
/// `F` must be the symbol's true `extern "C"` function type.
unsafe fn function_from<F: Copy>(address: *mut c_void) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: same size; the caller vouches for the type.
    unsafe { std::mem::transmute_copy(&address) }
}

fn load_api() -> Result<Api, String> {
    let mut names: Vec<String> = std::env::var("ZDISK_KV_ROCKSDB_LIB").into_iter().collect();
    names.extend(LIBRARY_NAMES.iter().map(|name| name.to_string()));
    let mut handle = std::ptr::null_mut();
    for name in &names {
        let c_name =
            CString::new(name.as_str()).map_err(|_| format!("bad library name {name:?}"))?;
        // SAFETY: dlopen with a valid C string; a null return is handled.
        handle = unsafe { libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if !handle.is_null() {
            break;
        }
    }
    if handle.is_null() {
        return Err(format!(
            "RocksDB's shared library not found (tried {}; install rocksdb-tools or librocksdb, or set ZDISK_KV_ROCKSDB_LIB)",
            names.join(", ")
        ));
    }
    macro_rules! symbol {
        ($name:literal) => {{
            let c_name = CString::new($name).expect("no NUL");
            // SAFETY: dlsym on a live handle; the symbol's type is the C
            // API's declaration, transcribed in `Api`.
            let address = unsafe { libc::dlsym(handle, c_name.as_ptr()) };
            if address.is_null() {
                return Err(format!("RocksDB's library lacks {}", $name));
            }
            // SAFETY: see above; a function pointer of the declared type.
            unsafe { function_from(address) }
        }};
    }
    Ok(Api {
        options_create: symbol!("rocksdb_options_create"),
        options_set_create_if_missing: symbol!("rocksdb_options_set_create_if_missing"),
        options_set_compression: symbol!("rocksdb_options_set_compression"),
        options_increase_parallelism: symbol!("rocksdb_options_increase_parallelism"),
        options_set_use_direct_reads: symbol!("rocksdb_options_set_use_direct_reads"),
        options_set_use_direct_io_for_flush_and_compaction: symbol!(
            "rocksdb_options_set_use_direct_io_for_flush_and_compaction"
        ),
        options_set_block_based_table_factory: symbol!(
            "rocksdb_options_set_block_based_table_factory"
        ),
        block_based_options_create: symbol!("rocksdb_block_based_options_create"),
        block_based_options_set_block_cache: symbol!("rocksdb_block_based_options_set_block_cache"),
        block_based_options_set_filter_policy: symbol!(
            "rocksdb_block_based_options_set_filter_policy"
        ),
        cache_create_lru: symbol!("rocksdb_cache_create_lru"),
        filterpolicy_create_bloom: symbol!("rocksdb_filterpolicy_create_bloom"),
        open: symbol!("rocksdb_open"),
        close: symbol!("rocksdb_close"),
        put: symbol!("rocksdb_put"),
        get: symbol!("rocksdb_get"),
        free: symbol!("rocksdb_free"),
        writeoptions_create: symbol!("rocksdb_writeoptions_create"),
        readoptions_create: symbol!("rocksdb_readoptions_create"),
        flushoptions_create: symbol!("rocksdb_flushoptions_create"),
        flushoptions_set_wait: symbol!("rocksdb_flushoptions_set_wait"),
        flush: symbol!("rocksdb_flush"),
    })
}

/// An open RocksDB database.
pub struct RocksDb {
    api: Api,
    db: Opaque,
    write_options: Opaque,
    read_options: Opaque,
}

// SAFETY: rocksdb_t and its option objects are thread-safe for get/put
// (RocksDB's documented guarantee); the pointers are never freed while
// the value lives.
unsafe impl Send for RocksDb {}
unsafe impl Sync for RocksDb {}

/// Whether RocksDB's shared library can be loaded here; the reason if not.
pub fn available() -> Result<(), String> {
    load_api().map(|_| ())
}

/// Takes RocksDB's error string, if any, and frees it.
fn take_error(api: &Api, error: *mut c_char) -> Result<(), String> {
    if error.is_null() {
        return Ok(());
    }
    // SAFETY: RocksDB returns a NUL-terminated malloc'd string.
    let message = unsafe { CStr::from_ptr(error) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: freed once, with RocksDB's allocator.
    unsafe { (api.free)(error.cast()) };
    Err(format!("RocksDB: {message}"))
}

impl RocksDb {
    /// Opens (creating if missing) the database in `path`. `direct_io`
    /// bypasses the OS page cache for reads, flushes and compactions (the
    /// benchmark's setting; not every file system allows it: tmpfs does
    /// not).
    pub fn open(
        path: &str,
        compression: Compression,
        block_cache_bytes: usize,
        direct_io: bool,
    ) -> Result<RocksDb, String> {
        let api = load_api()?;
        let c_path = CString::new(path).map_err(|_| format!("bad path {path:?}"))?;
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get()) as c_int;
        // SAFETY: C API calls on objects it created; the options outlive open.
        unsafe {
            let options = (api.options_create)();
            (api.options_set_create_if_missing)(options, 1);
            (api.options_set_compression)(options, compression as c_int);
            (api.options_increase_parallelism)(options, threads);
            (api.options_set_use_direct_reads)(options, u8::from(direct_io));
            (api.options_set_use_direct_io_for_flush_and_compaction)(options, u8::from(direct_io));
            let table = (api.block_based_options_create)();
            (api.block_based_options_set_block_cache)(
                table,
                (api.cache_create_lru)(block_cache_bytes),
            );
            (api.block_based_options_set_filter_policy)(
                table,
                (api.filterpolicy_create_bloom)(10.0),
            );
            (api.options_set_block_based_table_factory)(options, table);
            let mut error = std::ptr::null_mut();
            let db = (api.open)(options, c_path.as_ptr(), &mut error);
            take_error(&api, error)?;
            if db.is_null() {
                return Err("RocksDB: open returned nothing".into());
            }
            let write_options = (api.writeoptions_create)();
            let read_options = (api.readoptions_create)();
            Ok(RocksDb {
                api,
                db,
                write_options,
                read_options,
            })
        }
    }
}

impl Engine for RocksDb {
    fn read(&self, key: &[u8]) -> Result<bool, String> {
        let mut length = 0usize;
        let mut error = std::ptr::null_mut();
        // SAFETY: a live db, key bytes valid for the call.
        let value = unsafe {
            (self.api.get)(
                self.db,
                self.read_options,
                key.as_ptr().cast(),
                key.len(),
                &mut length,
                &mut error,
            )
        };
        take_error(&self.api, error)?;
        if value.is_null() {
            return Ok(false);
        }
        // SAFETY: RocksDB's malloc'd value, freed once.
        unsafe { (self.api.free)(value.cast()) };
        Ok(true)
    }

    fn write(&self, key: &[u8], value: &[u8]) -> Result<(), String> {
        let mut error = std::ptr::null_mut();
        // SAFETY: a live db, buffers valid for the call.
        unsafe {
            (self.api.put)(
                self.db,
                self.write_options,
                key.as_ptr().cast(),
                key.len(),
                value.as_ptr().cast(),
                value.len(),
                &mut error,
            )
        };
        take_error(&self.api, error)
    }

    fn settle(&self) -> Result<(), String> {
        let mut error = std::ptr::null_mut();
        // SAFETY: a live db; the flush options are leaked (a few bytes per call).
        unsafe {
            let options = (self.api.flushoptions_create)();
            (self.api.flushoptions_set_wait)(options, 1);
            (self.api.flush)(self.db, options, &mut error);
        }
        take_error(&self.api, error)
    }
}

impl Drop for RocksDb {
    fn drop(&mut self) {
        // SAFETY: closed once; no other thread uses it by now (&mut self).
        unsafe { (self.api.close)(self.db) };
    }
}
