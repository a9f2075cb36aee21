//! Handshake behaviour over a real TCP socket, against the fixed newstyle
//! rules of the NBD specification: greeting, client flags, each supported
//! option and its error cases, and the two ways into transmission
//! (EXPORT_NAME with and without NO_ZEROES, GO with and without a block
//! size request). Every refused option is followed by a successful one to
//! prove negotiation carries on.

mod common;

use common::{be32, Client, Setup, TestServer};
use zdisk_nbd::wire::*;
use zdisk_nbd::ServerConfig;

const SIZE: u64 = 4 << 20;

fn expect_one(replies: &[common::OptReply], reply_type: u32) {
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].reply_type, reply_type, "{replies:?}");
}

#[test]
fn greeting_advertises_fixed_newstyle_and_no_zeroes() {
    let server = TestServer::start(SIZE);
    let mut c = server.connect();
    assert_eq!(c.greeting(), NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES);
}

#[test]
fn unknown_client_flags_drop_the_connection() {
    let server = TestServer::start(SIZE);
    let mut c = server.connect();
    c.greeting();
    c.send_client_flags(NBD_FLAG_C_FIXED_NEWSTYLE | 1 << 5);
    assert!(c.is_closed());
}

#[test]
fn export_name_with_no_zeroes_sends_ten_bytes() {
    let server = TestServer::start(SIZE);
    let mut c = server.connect();
    c.start_handshake();
    c.send_option(NBD_OPT_EXPORT_NAME, b"zdisk");
    let reply = c.read_bytes(10);
    assert_eq!(common::be64(&reply[0..8]), SIZE);
    let flags = common::be16(&reply[8..10]);
    assert_ne!(flags & NBD_FLAG_HAS_FLAGS, 0);
    assert_eq!(
        flags & NBD_FLAG_SEND_DF,
        0,
        "no DF without structured replies"
    );
    // Transmission starts at once: the next bytes are a reply, not padding.
    c.assert_works();
}

#[test]
fn export_name_without_no_zeroes_pads_with_124_zeros() {
    let server = TestServer::start(SIZE);
    let mut c = server.connect();
    c.greeting();
    c.send_client_flags(NBD_FLAG_C_FIXED_NEWSTYLE);
    // The empty name selects the default export.
    c.send_option(NBD_OPT_EXPORT_NAME, b"");
    let reply = c.read_bytes(10 + 124);
    assert_eq!(common::be64(&reply[0..8]), SIZE);
    assert!(reply[10..].iter().all(|&b| b == 0));
    c.assert_works();
}

#[test]
fn export_name_for_an_unknown_export_hangs_up() {
    let server = TestServer::start(SIZE);
    let mut c = server.connect();
    c.start_handshake();
    c.send_option(NBD_OPT_EXPORT_NAME, b"other");
    assert!(c.is_closed());
}

#[test]
fn go_reports_export_and_block_sizes() {
    let server = TestServer::start(SIZE);
    let mut c = server.connect();
    c.start_handshake();
    let replies = c.option(
        NBD_OPT_GO,
        &Client::go_data(
            "zdisk",
            &[NBD_INFO_BLOCK_SIZE, NBD_INFO_NAME, NBD_INFO_DESCRIPTION],
        ),
    );
    let info = Client::parse_info(&replies);
    assert_eq!(info.size_bytes, SIZE);
    assert_eq!(info.block_sizes, Some((512, 4096, 64 << 20)));
    assert_eq!(info.name.as_deref(), Some("zdisk"));
    // No description configured: none sent.
    assert_eq!(info.description, None);
    let expected = NBD_FLAG_HAS_FLAGS
        | NBD_FLAG_SEND_FLUSH
        | NBD_FLAG_SEND_FUA
        | NBD_FLAG_SEND_TRIM
        | NBD_FLAG_SEND_WRITE_ZEROES
        | NBD_FLAG_SEND_FAST_ZERO
        | NBD_FLAG_CAN_MULTI_CONN
        | NBD_FLAG_SEND_CACHE;
    assert_eq!(info.flags, expected);
    c.assert_works();
}

#[test]
fn go_without_block_size_request_still_reports_it_and_allows_any_alignment() {
    let server = TestServer::start(SIZE);
    let (mut c, info) = Client::connect_with(
        &server.addr,
        Setup {
            block_size: false,
            ..Setup::SIMPLE
        },
    );
    assert_eq!(info.block_sizes, Some((512, 4096, 64 << 20)));
    let w = c.write(1001, b"abc");
    assert_eq!(w.error, 0, "unaligned write without a block size agreement");
    let r = c.read(1000, 5);
    assert_eq!(r.error, 0);
    assert_eq!(r.data, b"\0abc\0");
}

#[test]
fn go_with_block_size_request_enforces_alignment() {
    let server = TestServer::start(SIZE);
    let (mut c, _) = Client::connect_with(&server.addr, Setup::SIMPLE);
    assert_eq!(c.write(1001, b"abc").error, NBD_EINVAL);
    c.assert_works();
}

#[test]
fn go_describes_the_export_when_configured_and_structured_adds_df() {
    let config = ServerConfig {
        export_name: "disk0".into(),
        description: Some("a test disk".into()),
        ..ServerConfig::default()
    };
    let server = TestServer::start_with(SIZE, config);
    let mut c = server.connect();
    c.start_handshake();
    c.structured_reply();
    // The default name "" resolves to the canonical name.
    let replies = c.option(
        NBD_OPT_GO,
        &Client::go_data("", &[NBD_INFO_NAME, NBD_INFO_DESCRIPTION]),
    );
    let info = Client::parse_info(&replies);
    assert_eq!(info.name.as_deref(), Some("disk0"));
    assert_eq!(info.description.as_deref(), Some("a test disk"));
    assert_ne!(info.flags & NBD_FLAG_SEND_DF, 0);
    c.assert_works();
}

#[test]
fn unknown_export_and_malformed_go_are_errors_then_go_works() {
    let server = TestServer::start(SIZE);
    let mut c = server.connect();
    c.start_handshake();
    expect_one(
        &c.option(NBD_OPT_GO, &Client::go_data("nope", &[])),
        NBD_REP_ERR_UNKNOWN,
    );
    expect_one(
        &c.option(NBD_OPT_INFO, &Client::go_data("nope", &[])),
        NBD_REP_ERR_UNKNOWN,
    );
    // Name length pointing past the data; a truncated info list; trailing bytes.
    expect_one(
        &c.option(NBD_OPT_GO, &[0, 0, 0, 9, b'a']),
        NBD_REP_ERR_INVALID,
    );
    let mut short = Client::go_data("zdisk", &[1, 2]);
    short.pop();
    expect_one(&c.option(NBD_OPT_GO, &short), NBD_REP_ERR_INVALID);
    let mut long = Client::go_data("zdisk", &[]);
    long.push(0);
    expect_one(&c.option(NBD_OPT_GO, &long), NBD_REP_ERR_INVALID);
    let info = Client::parse_info(&c.option(NBD_OPT_GO, &Client::go_data("zdisk", &[])));
    assert_eq!(info.size_bytes, SIZE);
    c.assert_works();
}

#[test]
fn info_then_go() {
    let server = TestServer::start(SIZE);
    let mut c = server.connect();
    c.start_handshake();
    let data = Client::go_data("zdisk", &[NBD_INFO_BLOCK_SIZE]);
    let info = Client::parse_info(&c.option(NBD_OPT_INFO, &data));
    let go = Client::parse_info(&c.option(NBD_OPT_GO, &data));
    assert_eq!(info.size_bytes, go.size_bytes);
    assert_eq!(info.flags, go.flags, "same parameters, same information");
    c.assert_works();
}

#[test]
fn list_names_the_export_and_refuses_data() {
    let config = ServerConfig {
        description: Some("described".into()),
        ..ServerConfig::default()
    };
    let server = TestServer::start_with(SIZE, config);
    let mut c = server.connect();
    c.start_handshake();
    let replies = c.option(NBD_OPT_LIST, &[]);
    assert_eq!(replies.len(), 2);
    assert_eq!(replies[0].reply_type, NBD_REP_SERVER);
    let name_length = be32(&replies[0].data[0..4]) as usize;
    assert_eq!(&replies[0].data[4..4 + name_length], b"zdisk");
    assert_eq!(&replies[0].data[4 + name_length..], b"described");
    assert_eq!(replies[1].reply_type, NBD_REP_ACK);
    expect_one(&c.option(NBD_OPT_LIST, b"x"), NBD_REP_ERR_INVALID);
    Client::parse_info(&c.option(NBD_OPT_GO, &Client::go_data("zdisk", &[])));
}

#[test]
fn unsupported_options_get_err_unsup_and_negotiation_continues() {
    let server = TestServer::start(SIZE);
    let mut c = server.connect();
    c.start_handshake();
    // As nbdkit does when TLS is off: a policy refusal, and carry on.
    expect_one(&c.option(NBD_OPT_STARTTLS, &[]), NBD_REP_ERR_POLICY);
    for option in [
        NBD_OPT_EXTENDED_HEADERS,
        NBD_OPT_PEEK_EXPORT,
        99,
        0xffff_ffff,
    ] {
        expect_one(&c.option(option, &[]), NBD_REP_ERR_UNSUP);
    }
    expect_one(&c.option(1234, &[7; 100]), NBD_REP_ERR_UNSUP);
    Client::parse_info(&c.option(NBD_OPT_GO, &Client::go_data("zdisk", &[])));
    c.assert_works();
}

#[test]
fn abort_is_acknowledged_then_closed() {
    let server = TestServer::start(SIZE);
    let mut c = server.connect();
    c.start_handshake();
    // Data on ABORT is ignored, not rejected.
    expect_one(&c.option(NBD_OPT_ABORT, b"ignored"), NBD_REP_ACK);
    assert!(c.is_closed());
}

#[test]
fn structured_reply_with_data_is_invalid() {
    let server = TestServer::start(SIZE);
    let mut c = server.connect();
    c.start_handshake();
    expect_one(
        &c.option(NBD_OPT_STRUCTURED_REPLY, b"x"),
        NBD_REP_ERR_INVALID,
    );
    c.structured_reply();
}

#[test]
fn meta_contexts_list_and_set() {
    let server = TestServer::start(SIZE);
    let mut c = server.connect();
    c.start_handshake();

    // SET before structured replies is refused.
    assert_eq!(
        c.set_meta_context("", &[BASE_ALLOCATION]),
        Err(NBD_REP_ERR_INVALID)
    );
    c.structured_reply();

    // LIST: no queries lists everything; `base:` and `zdisk:` are
    // wildcards; unknown queries are ignored.
    for (queries, listed) in [
        (&[][..], &[BASE_ALLOCATION, ZDISK_COMPRESSION][..]),
        (&["base:"][..], &[BASE_ALLOCATION][..]),
        (
            &["base:allocation", "qemu:dirty-bitmap:x"][..],
            &[BASE_ALLOCATION][..],
        ),
        (&["zdisk:"][..], &[ZDISK_COMPRESSION][..]),
        (
            &["zdisk:compression", "base:"][..],
            &[BASE_ALLOCATION, ZDISK_COMPRESSION][..],
        ),
    ] {
        let replies = c.option(
            NBD_OPT_LIST_META_CONTEXT,
            &Client::meta_data("zdisk", queries),
        );
        assert_eq!(replies.len(), listed.len() + 1, "{queries:?}: {replies:?}");
        for (reply, name) in replies.iter().zip(listed) {
            assert_eq!(reply.reply_type, NBD_REP_META_CONTEXT);
            assert_eq!(&reply.data[4..], name.as_bytes());
        }
    }
    let none = c.option(
        NBD_OPT_LIST_META_CONTEXT,
        &Client::meta_data("", &["x-foo:bar"]),
    );
    expect_one(&none, NBD_REP_ACK);
    expect_one(
        &c.option(NBD_OPT_LIST_META_CONTEXT, &Client::meta_data("nope", &[])),
        NBD_REP_ERR_UNKNOWN,
    );
    expect_one(
        &c.option(NBD_OPT_LIST_META_CONTEXT, &[0, 0, 0, 0, 0, 0, 0, 1]),
        NBD_REP_ERR_INVALID,
    );

    // SET: `base:` alone selects nothing; base:allocation gets a nonzero id.
    assert_eq!(
        c.set_meta_context("zdisk", &["base:", "x-foo:bar"]),
        Ok(vec![])
    );
    let selected = c.set_meta_context("zdisk", &["base:allocation"]).unwrap();
    assert_eq!(selected.len(), 1);
    assert_ne!(selected[0].0, 0);
    assert_eq!(selected[0].1, BASE_ALLOCATION);
    assert_eq!(
        c.set_meta_context("nope", &[BASE_ALLOCATION]),
        Err(NBD_REP_ERR_UNKNOWN)
    );
    // Both contexts, with distinct ids; `zdisk:` alone selects nothing.
    assert_eq!(c.set_meta_context("", &["zdisk:"]), Ok(vec![]));
    let both = c
        .set_meta_context("", &[ZDISK_COMPRESSION, BASE_ALLOCATION])
        .unwrap();
    let names: Vec<&str> = both.iter().map(|(_, name)| name.as_str()).collect();
    assert_eq!(names, vec![BASE_ALLOCATION, ZDISK_COMPRESSION]);
    assert_ne!(both[0].0, both[1].0);
    assert!(both.iter().all(|(id, _)| *id != 0));
}

#[test]
fn set_meta_context_replaces_the_previous_selection() {
    let server = TestServer::start(SIZE);
    let mut c = server.connect();
    c.start_handshake();
    c.structured_reply();
    c.set_meta_context("", &[BASE_ALLOCATION]).unwrap();
    assert_eq!(c.set_meta_context("", &[]), Ok(vec![]));
    Client::parse_info(&c.option(NBD_OPT_GO, &Client::go_data("", &[NBD_INFO_BLOCK_SIZE])));
    let r = c.request(0, NBD_CMD_BLOCK_STATUS, 0, 4096, &[]);
    assert_eq!(r.error, NBD_EINVAL, "no context selected any more");
    c.assert_works();
}

#[test]
fn oversized_option_is_discarded_and_refused() {
    let server = TestServer::start(SIZE);
    let mut c = server.connect();
    c.start_handshake();
    let big = vec![0u8; MAX_OPTION_BYTES as usize + 1];
    expect_one(&c.option(NBD_OPT_GO, &big), NBD_REP_ERR_TOO_BIG);
    Client::parse_info(&c.option(NBD_OPT_GO, &Client::go_data("zdisk", &[])));
    c.assert_works();
}

#[test]
fn bad_option_magic_hangs_up() {
    let server = TestServer::start(SIZE);
    let mut c = server.connect();
    c.start_handshake();
    c.send(&[0u8; 16]);
    assert!(c.is_closed());
}

#[test]
fn read_only_export_advertises_read_only() {
    let config = ServerConfig {
        read_only: true,
        ..ServerConfig::default()
    };
    let server = TestServer::start_with(SIZE, config);
    let (_, info) = Client::connect_with(&server.addr, Setup::SIMPLE);
    assert_ne!(info.flags & NBD_FLAG_READ_ONLY, 0);
    assert_eq!(info.flags & NBD_FLAG_SEND_TRIM, 0);
    assert_eq!(info.flags & NBD_FLAG_SEND_WRITE_ZEROES, 0);

    // A device that reports read-only is served read-only regardless.
    let server = TestServer::start(SIZE);
    server.device.set_read_only(true);
    let (_, info) = Client::connect_with(&server.addr, Setup::SIMPLE);
    assert_ne!(info.flags & NBD_FLAG_READ_ONLY, 0);
}
