//! A minimal HTTP endpoint for statistics: `GET /stats` returns the same
//! JSON as `zdisk stats --json` plus an `nbd` object (the server's
//! connection counters: handshakes, evictions, refusals), `GET /metrics`
//! all of it in the Prometheus text format (`zdisk_nbd_*` for the server's).
//! One short-lived connection at a time is plenty for scrapers and curl.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use zdisk_core::Volume;
use zdisk_nbd::ServerCounters;

pub fn spawn(
    addr: &str,
    volume: Arc<Volume>,
    server: Arc<ServerCounters>,
) -> Result<std::net::SocketAddr, String> {
    let listener =
        TcpListener::bind(addr).map_err(|e| format!("cannot listen for metrics on {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    std::thread::Builder::new()
        .name("zdisk-metrics".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else {
                    // Out of descriptors (EMFILE) fails at once: wait
                    // rather than spin on it.
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                };
                let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
                let mut reader = BufReader::new(&stream);
                let mut request_line = String::new();
                if reader.read_line(&mut request_line).is_err() {
                    continue;
                }
                // Drain the headers.
                let mut line = String::new();
                while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                    line.clear();
                }
                let path = request_line.split_whitespace().nth(1).unwrap_or("/");
                let (status, content_type, body) = match path {
                    "/stats" => (
                        "200 OK",
                        "application/json",
                        serde_json::to_string_pretty(&stats_json(&volume, &server)).unwrap_or_default() + "\n",
                    ),
                    "/metrics" => (
                        "200 OK",
                        "text/plain; version=0.0.4",
                        volume.stats().to_prometheus() + &server_prometheus(&server),
                    ),
                    _ => ("404 Not Found", "text/plain", "try /stats or /metrics\n".to_string()),
                };
                let mut stream = &stream;
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        })
        .map_err(|e| e.to_string())?;
    Ok(local)
}

/// The volume's statistics with the server's counters under `nbd`.
fn stats_json(volume: &Volume, server: &ServerCounters) -> serde_json::Value {
    let mut json = serde_json::to_value(volume.stats()).unwrap_or_default();
    let nbd: serde_json::Map<String, serde_json::Value> = server
        .snapshot()
        .into_iter()
        .map(|(name, value, _, _)| (name.to_string(), value.into()))
        .collect();
    if let Some(all) = json.as_object_mut() {
        all.insert("nbd".to_string(), nbd.into());
    }
    json
}

/// The server's counters in the Prometheus text format.
fn server_prometheus(server: &ServerCounters) -> String {
    let mut out = String::new();
    for (name, value, kind, help) in server.snapshot() {
        let name = match kind {
            "counter" => format!("zdisk_nbd_{name}_total"),
            _ => format!("zdisk_nbd_{name}"),
        };
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
        ));
    }
    out
}
