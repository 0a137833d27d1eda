//! Who may read the endpoints: off loopback only with TLS and a bearer
//! token or a client certificate (or an explicit opt-out); a real
//! Prometheus scrapes over TLS with its token, and requests without one are
//! refused with a 401.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use tests::*;

/// A CA, a server certificate for 127.0.0.1 and a client certificate, all
/// signed by that CA, made with openssl in `dir`.
struct Certificates {
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let output = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("running openssl");
    assert!(
        output.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

fn make_certificates(dir: &Path) -> Certificates {
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
    let mut ca = vec![
        "req",
        "-x509",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=test CA",
    ];
    ca.extend(ec);
    ca.extend(["-keyout", "ca.key", "-out", "ca.pem"]);
    openssl(dir, &ca);
    for (name, extensions) in [
        (
            "server",
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        ),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ] {
        std::fs::write(dir.join(format!("{name}.ext")), extensions).unwrap();
        let key = format!("{name}.key");
        let csr = format!("{name}.csr");
        let subject = format!("/CN={name}");
        let mut request = vec!["req", "-nodes", "-subj", &subject];
        request.extend(ec);
        request.extend(["-keyout", &key, "-out", &csr]);
        openssl(dir, &request);
        let (pem, ext) = (format!("{name}.pem"), format!("{name}.ext"));
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &ext,
                "-out",
                &pem,
            ],
        );
    }
    Certificates {
        ca: dir.join("ca.pem"),
        server_cert: dir.join("server.pem"),
        server_key: dir.join("server.key"),
        client_cert: dir.join("client.pem"),
        client_key: dir.join("client.key"),
    }
}

/// curl's status code for `url`, trusting `ca`, with `extra` flags; 0
/// where no HTTP answer came (a refused handshake).
fn curl_status(url: &str, ca: &Path, extra: &[&str]) -> u16 {
    let output = Command::new("curl")
        .args(["--silent", "--max-time", "10", "--output", "/dev/null"])
        .args(["--write-out", "%{http_code}", "--cacert"])
        .arg(ca)
        .args(extra)
        .arg(url)
        .output()
        .expect("running curl");
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .unwrap_or(0)
}

/// memprobe attached to `fixture`, serving on every address of the host
/// (off loopback, as a fleet serves it) over TLS, with `extra` flags.
fn serving_over_tls(
    fixture: &Fixture,
    out: &Path,
    certs: &Certificates,
    extra: &[&str],
) -> Memprobe {
    let mut flags = vec![
        "--listen",
        "0.0.0.0:0",
        "--tls-cert",
        certs.server_cert.to_str().unwrap(),
        "--tls-key",
        certs.server_key.to_str().unwrap(),
    ];
    flags.extend_from_slice(extra);
    Memprobe::attach(fixture, out, &flags)
}

#[test]
fn an_open_address_is_refused_without_tls_and_authentication() {
    let (status, stderr) =
        run_memprobe(&["--all", "--listen", "0.0.0.0:0", "--duration", "1s"], &[]);
    assert!(!status.success(), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("--listen-insecure"), "{stderr}");
    assert!(stderr.contains("--auth-token-file"), "{stderr}");
}

#[test]
fn prometheus_scrapes_over_tls_with_its_token_and_others_get_a_401() {
    let _guard = shared();
    let out = output_dir("endpoint_tls_token");
    let certs = make_certificates(&out);
    let token_file = out.join("token");
    std::fs::write(&token_file, "a-long-random-token\n").unwrap();
    let mut fixture = Fixture::start(&sites_fixture(), &[]);
    let memprobe = serving_over_tls(
        &fixture,
        &out,
        &certs,
        &[
            "--sample-interval",
            "4096",
            "--auth-token-file",
            token_file.to_str().unwrap(),
        ],
    );
    let port = memprobe
        .listening_on()
        .rsplit(':')
        .next()
        .unwrap()
        .to_owned();
    let address = format!("127.0.0.1:{port}");
    assert!(
        memprobe.stderr_text().contains("serving https://0.0.0.0:"),
        "{}",
        memprobe.stderr_text()
    );
    fixture.run_workload();
    let metrics = format!("https://{address}/metrics");
    assert_eq!(curl_status(&metrics, &certs.ca, &[]), 401);
    let wrong = ["-H", "Authorization: Bearer a-long-random-tokeN"];
    assert_eq!(curl_status(&metrics, &certs.ca, &wrong), 401);
    let right = ["-H", "Authorization: Bearer a-long-random-token"];
    assert_eq!(curl_status(&metrics, &certs.ca, &right), 200);
    // Plain HTTP gets no answer from a TLS port.
    assert_eq!(
        curl_status(&format!("http://{address}/metrics"), &certs.ca, &right),
        0
    );
    // The job docs/fleet.md shows, with this test's CA, token and address.
    let config = documented_scrape_job()
        .replace(
            "/etc/prometheus/memprobe-ca.pem",
            certs.ca.to_str().unwrap(),
        )
        .replace(
            "/etc/prometheus/memprobe-token",
            token_file.to_str().unwrap(),
        );
    let value = scraped_by_prometheus(&out, &address, fixture.pid, &config);
    let expected = 2000.0 * 4096.0 + 16.0 * MIB;
    assert_within(
        "scraped over TLS memprobe_inuse_bytes",
        value,
        expected,
        0.1,
    );
    memprobe.stop();
}

#[test]
fn client_certificates_signed_by_the_given_ca_are_let_in() {
    let _guard = shared();
    let out = output_dir("endpoint_tls_client");
    let certs = make_certificates(&out);
    let fixture = Fixture::start(&sites_fixture(), &[]);
    let memprobe = serving_over_tls(
        &fixture,
        &out,
        &certs,
        &["--tls-client-ca", certs.ca.to_str().unwrap()],
    );
    let port = memprobe
        .listening_on()
        .rsplit(':')
        .next()
        .unwrap()
        .to_owned();
    let url = format!("https://127.0.0.1:{port}/debug/pprof/?format=json");
    // Without a certificate the handshake fails: no HTTP answer at all.
    assert_eq!(curl_status(&url, &certs.ca, &[]), 0);
    let with_cert = [
        "--cert",
        certs.client_cert.to_str().unwrap(),
        "--key",
        certs.client_key.to_str().unwrap(),
    ];
    assert_eq!(curl_status(&url, &certs.ca, &with_cert), 200);
    memprobe.stop();
}

/// The Prometheus job of docs/fleet.md's `yaml` block: its lines between
/// `job_name` and `static_configs` (the test gives its own target).
fn documented_scrape_job() -> String {
    let doc = std::fs::read_to_string(workspace_root().join("docs/fleet.md")).unwrap();
    let block = doc
        .split("```yaml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("a yaml block in docs/fleet.md");
    let job: Vec<&str> = block
        .lines()
        .skip_while(|l| !l.contains("job_name: memprobe"))
        .skip(1)
        .take_while(|l| !l.contains("static_configs:"))
        .collect();
    assert!(
        job.iter().any(|l| l.contains("credentials_file")),
        "{block}"
    );
    job.join("\n") + "\n"
}
