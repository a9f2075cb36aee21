//! A minimal HTTP endpoint for statistics: `GET /stats` returns the same
//! JSON as `zdisk stats --json`, `GET /metrics` the Prometheus text format.
//! One short-lived connection at a time is plenty for scrapers and curl.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use zdisk_core::Volume;

pub fn spawn(addr: &str, volume: Arc<Volume>) -> Result<std::net::SocketAddr, String> {
    let listener =
        TcpListener::bind(addr).map_err(|e| format!("cannot listen for metrics on {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    std::thread::Builder::new()
        .name("zdisk-metrics".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
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
                        serde_json::to_string_pretty(&volume.stats()).unwrap_or_default() + "\n",
                    ),
                    "/metrics" => ("200 OK", "text/plain; version=0.0.4", volume.stats().to_prometheus()),
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
