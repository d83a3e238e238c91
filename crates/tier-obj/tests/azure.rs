//! The object tier against Azure Blob Storage's emulator on loopback: Azurite's blob service
//! (npm `azurite`, binary `azurite-blob`), started by this test on a free port of 127.0.0.1 with a
//! temporary data directory, and a fresh container. Store (block-list uploads too), restart (a new
//! tier lists the container), load and compare bytes, a damaged object (failed, deleted, reported
//! once by `take_evicted`), then the whole conformance suite over Azure.
//!
//! The tier reaches Azurite as a real account would be reached: `Backend::Azure` with an
//! `endpoint` (`http://127.0.0.1:PORT/devstoreaccount1`, `allow_http`) and the account and key
//! from the `AZURE_STORAGE_*` environment variables object_store reads; this test sets them to
//! Azurite's published development account (`devstoreaccount1` and its well-known key).
//!
//! The server is `$KVTIER_AZURITE` if set, else `azurite-blob` on `PATH`. Without one, the single
//! test prints "Azure tests NOT RUN: <reason>" and passes, unless `KVTIER_REQUIRE_AZURE=1`, when
//! it fails.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant, SystemTime};

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use tier_obj::{AzureConfig, Backend};

const CONTAINER: &str = "kvtier-test";
/// Azurite's development account and its published key (not a secret: the same everywhere).
const ACCOUNT: &str = "devstoreaccount1";
const ACCOUNT_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";
/// How long the server may take to accept connections (node starts slowly).
const START_DEADLINE: Duration = Duration::from_secs(60);

/// Starts Azurite's blob service on a free loopback port (no telemetry: nothing leaves the
/// machine) and waits until it accepts connections.
fn start_server() -> Result<common::ServerProcess, String> {
    let binary = common::server_binary("KVTIER_AZURITE", "azurite-blob", "npm install azurite")?;
    let data = tempfile::tempdir().map_err(|e| format!("no temporary directory: {e}"))?;
    let location = data.path().to_path_buf();
    common::start_server(
        &binary,
        |command, port| {
            command
                .args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()])
                .arg("--location")
                .arg(&location)
                .args(["--silent", "--skipApiVersionCheck", "--disableTelemetry"]);
        },
        Some(data),
        START_DEADLINE,
    )
}

/// Creates the container with a plain HTTP PUT signed with the account's Shared Key (Azurite
/// checks signatures; object_store has no call that creates a container).
fn create_container(addr: SocketAddr, container: &str) {
    let date = httpdate::fmt_http_date(SystemTime::now());
    let version = "2021-08-06";
    // Shared Key: verb, eleven empty standard headers, the x-ms-* headers sorted, then the
    // account and the path (path-style: the account is the path's first part) and the query.
    let to_sign = format!(
        "PUT\n{}x-ms-date:{date}\nx-ms-version:{version}\n/{ACCOUNT}/{ACCOUNT}/{container}\nrestype:container",
        "\n".repeat(11)
    );
    let key = BASE64.decode(ACCOUNT_KEY).expect("the dev key is base64");
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(&key).expect("any key length");
    mac.update(to_sign.as_bytes());
    let signature = BASE64.encode(mac.finalize().into_bytes());
    let mut stream = TcpStream::connect(addr).expect("connect to Azurite");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let request = format!(
        "PUT /{ACCOUNT}/{container}?restype=container HTTP/1.1\r\nHost: {addr}\r\n\
         x-ms-date: {date}\r\nx-ms-version: {version}\r\n\
         Authorization: SharedKey {ACCOUNT}:{signature}\r\nContent-Length: 0\r\n\
         Connection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).expect("send");
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    assert!(
        answer.starts_with("HTTP/1.1 201"),
        "creating container {container}: {}",
        answer.lines().next().unwrap_or("no answer")
    );
}

fn backend(addr: SocketAddr) -> Backend {
    Backend::Azure(AzureConfig {
        container: Some(CONTAINER.to_owned()),
        endpoint: Some(format!("http://{addr}/{ACCOUNT}")),
        allow_http: true,
    })
}

/// Store, restart, load and compare; block-list uploads; a damaged object.
fn round_trip_and_restart(addr: SocketAddr) {
    let round_trip = common::RoundTrip {
        service: "Azure",
        slot: 3 << 20,
        multipart_threshold_bytes: 2 << 20,
        part_bytes: 1 << 20,
        big_len: (2 << 20) + 5,
        key_base: 0xA2_0000,
        group: 2,
    };
    common::round_trip_and_restart(&round_trip, &|| backend(addr).open().expect("Azure client"));
}

/// The conformance suite over Azure, each case under its own prefix of the one container.
fn conformance(addr: SocketAddr) {
    common::conformance_over(&common::config(), &|| {
        backend(addr).open().expect("Azure client")
    });
}

#[test]
fn azurite_round_trip_restart_and_conformance() {
    let required = std::env::var("KVTIER_REQUIRE_AZURE").is_ok_and(|v| v == "1");
    let server = match start_server() {
        Ok(server) => server,
        Err(reason) => {
            eprintln!("Azure tests NOT RUN: {reason}");
            println!("Azure tests NOT RUN: {reason}");
            assert!(
                !required,
                "KVTIER_REQUIRE_AZURE=1 but Azure tests NOT RUN: {reason}"
            );
            return;
        }
    };
    // The only test of this binary: no other thread reads the environment meanwhile.
    std::env::set_var("AZURE_STORAGE_ACCOUNT_NAME", ACCOUNT);
    std::env::set_var("AZURE_STORAGE_ACCOUNT_KEY", ACCOUNT_KEY);
    std::env::remove_var("AZURE_STORAGE_USE_EMULATOR");
    let started = Instant::now();
    create_container(server.addr, CONTAINER);
    round_trip_and_restart(server.addr);
    conformance(server.addr);
    eprintln!(
        "Azure tests ran against azurite-blob on {} in {:?}",
        server.addr,
        started.elapsed()
    );
}
