//! TLS to the network stores, against servers of the tests' own that refuse plain
//! connections, each with a certificate made here by `openssl`: a verified connection
//! works, and a server whose certificate the client cannot verify (signed by another CA,
//! or naming another host) is refused with a message that says what went wrong.
use crate::own_servers;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use idem_runtime::{Idem, IdemError};

/// A CA, a server certificate it signed, and a CA that signed nothing here.
struct Certs {
    dir: tempfile::TempDir,
}

impl Certs {
    /// Makes the certificates, or `None` after a skip line when `openssl` is missing.
    /// The server's certificate names `127.0.0.1` and `localhost` unless `names` says
    /// otherwise (`DNS:db.idem.test`, for a host the client does not ask for).
    fn make(test: &str, names: &str) -> Option<Certs> {
        let found = Command::new("openssl").arg("version").output().is_ok();
        own_servers::need(test, found, "openssl")?;
        let dir = tempfile::tempdir().unwrap();
        let openssl = |args: &[&str]| {
            let out = Command::new("openssl")
                .current_dir(dir.path())
                .args(args)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        for ca in ["ca", "other-ca"] {
            let key = format!("{ca}.key");
            let pem = format!("{ca}.pem");
            let subject = format!("/CN=idem test {ca}");
            let mut args = vec!["req", "-x509", "-days", "2", "-subj", &subject];
            args.extend(ec);
            args.extend(["-keyout", &key, "-out", &pem]);
            openssl(&args);
        }
        std::fs::write(
            dir.path().join("server.ext"),
            format!("subjectAltName={names}\n"),
        )
        .unwrap();
        let mut args = vec!["req", "-subj", "/CN=idem test server"];
        args.extend(ec);
        args.extend(["-keyout", "server.key", "-out", "server.csr"]);
        openssl(&args);
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "server.ext",
            "-out",
            "server.pem",
        ]);
        Some(Certs { dir })
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    /// Hands the folder to `user` (a server that runs as that user reads its key), and
    /// makes the key private, as PostgreSQL requires.
    fn give_to(&self, user: &str) {
        if own_servers::is_root() {
            own_servers::chown(user, self.dir.path());
            set_mode(self.dir.path(), 0o755);
        }
        set_mode(&self.path("server.key"), 0o600);
    }
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// One call through `idem`, so a store that opened also answers.
async fn one_call(idem: &Idem) {
    let n = idem
        .operation("tls-call", "k-1")
        .retain(Duration::from_secs(60))
        .fingerprint_none()
        .run(|| async { Ok::<_, IdemError>(7) })
        .await
        .unwrap();
    assert_eq!(n, 7);
}

/// The message of an open that failed.
fn refused(open: Result<Idem, IdemError>, what: &str) -> String {
    match open {
        Ok(_) => panic!("{what}: the store opened"),
        Err(e) => {
            eprintln!("{what}: {e}");
            e.to_string()
        }
    }
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_over_verified_tls() {
    let test = "postgres_over_verified_tls";
    let Some(certs) = Certs::make(test, "IP:127.0.0.1,DNS:localhost") else {
        return;
    };
    // Only TLS connections from 127.0.0.1: a plain one is turned away.
    std::fs::write(
        certs.path("pg_hba.conf"),
        "local all all trust\nhostssl all all 127.0.0.1/32 trust\n\
         hostnossl all all 127.0.0.1/32 reject\n",
    )
    .unwrap();
    certs.give_to("postgres");
    let settings = [
        "ssl=on".to_owned(),
        format!("ssl_cert_file={}", certs.path("server.pem").display()),
        format!("ssl_key_file={}", certs.path("server.key").display()),
        format!("hba_file={}", certs.path("pg_hba.conf").display()),
    ];
    let settings: Vec<&str> = settings.iter().map(String::as_str).collect();
    let Some(server) = own_servers::OwnPostgres::start(test, &settings) else {
        return;
    };
    let url = server.url();
    let ca = certs.path("ca.pem");

    let verified = format!("{url}?sslmode=verify-full&sslrootcert={}", ca.display());
    let idem = Idem::postgres(&verified).await.unwrap();
    one_call(&idem).await;
    // `require` encrypts without verifying the server.
    let idem = Idem::postgres(&format!("{url}?sslmode=require"))
        .await
        .unwrap();
    one_call(&idem).await;

    let plain = refused(
        Idem::postgres(&format!("{url}?sslmode=disable")).await,
        "a plain connection to a server that requires TLS",
    );
    assert!(plain.contains("no encryption"), "{plain}");

    let other = certs.path("other-ca.pem");
    let message = refused(
        Idem::postgres(&format!(
            "{url}?sslmode=verify-full&sslrootcert={}",
            other.display()
        ))
        .await,
        "a server certificate signed by a CA the client does not trust",
    );
    assert!(
        message.contains("UnknownIssuer") && message.contains("with `sslrootcert=` in the URL"),
        "{message}"
    );
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn mysql_over_verified_tls() {
    let test = "mysql_over_verified_tls";
    let Some(certs) = Certs::make(test, "IP:127.0.0.1,DNS:localhost") else {
        return;
    };
    certs.give_to("mysql");
    let args = [
        format!("--ssl-cert={}", certs.path("server.pem").display()),
        format!("--ssl-key={}", certs.path("server.key").display()),
        format!("--ssl-ca={}", certs.path("ca.pem").display()),
        "--require-secure-transport=ON".to_owned(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let Some(server) = own_servers::OwnMariaDb::start_with(test, &args) else {
        return;
    };
    let url = server.url("root", "mysql");
    let ca = certs.path("ca.pem");

    let verified = format!("{url}?ssl-mode=verify_identity&ssl-ca={}", ca.display());
    let idem = Idem::mysql(&verified).await.unwrap();
    one_call(&idem).await;

    let plain = refused(
        Idem::mysql(&format!("{url}?ssl-mode=disabled")).await,
        "a plain connection to a server that requires TLS",
    );
    // MariaDB answers a plain login under `require_secure_transport` as a denied one.
    assert!(plain.contains("1045") || plain.contains("3159"), "{plain}");

    let other = certs.path("other-ca.pem");
    let message = refused(
        Idem::mysql(&format!(
            "{url}?ssl-mode=verify_ca&ssl-ca={}",
            other.display()
        ))
        .await,
        "a server certificate signed by a CA the client does not trust",
    );
    assert!(
        message.contains("UnknownIssuer") && message.contains("with `ssl-ca=` in the URL"),
        "{message}"
    );
}

/// A Redis of the test's own that speaks only TLS, with a certificate for `names`.
fn tls_redis(test: &str, names: &str) -> Option<(Certs, own_servers::OwnRedis)> {
    let certs = Certs::make(test, names)?;
    let server = own_servers::OwnRedis::start_tls(
        test,
        &certs.path("server.pem"),
        &certs.path("server.key"),
    )?;
    Some((certs, server))
}

#[tokio::test]
async fn redis_over_verified_tls() {
    let test = "redis_over_verified_tls";
    let Some((certs, server)) = tls_redis(test, "IP:127.0.0.1,DNS:localhost") else {
        return;
    };
    let url = format!("rediss://127.0.0.1:{}", server.port());
    let ca = std::fs::read(certs.path("ca.pem")).unwrap();
    let idem = Idem::builder()
        .tls_root_certificate(ca)
        .redis(&url)
        .await
        .unwrap();
    one_call(&idem).await;

    // The server speaks only TLS: a plain client gets no answer it can read.
    let plain = Idem::builder()
        .store_timeout(Duration::from_secs(2))
        .redis(&format!("redis://127.0.0.1:{}", server.port()))
        .await;
    assert!(
        plain.is_err(),
        "a plain connection to a TLS-only server opened"
    );

    // Signed by a CA the client was not given: refused.
    let other = std::fs::read(certs.path("other-ca.pem")).unwrap();
    let message = refused(
        Idem::builder()
            .tls_root_certificate(other)
            .redis(&url)
            .await,
        "a server certificate signed by a CA the client does not trust",
    );
    assert!(
        message.contains("UnknownIssuer") && message.contains("tls_root_certificate"),
        "{message}"
    );
}

/// A certificate that names another host than the one the client asked for is refused,
/// although its CA is trusted.
#[tokio::test]
async fn redis_refuses_a_certificate_for_another_host() {
    let test = "redis_refuses_a_certificate_for_another_host";
    let Some((certs, server)) = tls_redis(test, "DNS:db.idem.test") else {
        return;
    };
    let ca = std::fs::read(certs.path("ca.pem")).unwrap();
    let message = refused(
        Idem::builder()
            .tls_root_certificate(ca)
            .redis(&format!("rediss://127.0.0.1:{}", server.port()))
            .await,
        "a certificate for db.idem.test, asked for 127.0.0.1",
    );
    assert!(
        message.contains("not valid for name") && message.contains("tls_root_certificate"),
        "{message}"
    );
}
