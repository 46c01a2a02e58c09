//! Servers a test runs for itself, on a spare port of 127.0.0.1 with its data in a
//! temporary folder, stopped when dropped: for states a test must not put the shared
//! servers in (read-only, every connection slot taken, a failover). A machine without
//! the server's binaries skips the test with a line saying so, unless `IDEM_REQUIRE_DB=1`.
#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{have, listens};
// A port nothing listens on now, and the skip (or failure) when a binary is missing.
pub use crate::common::{need, spare_port};

pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Waits until `port` accepts connections, up to 60 seconds.
fn wait_listening(port: u16, what: &str) {
    let start = Instant::now();
    while !listens("127.0.0.1", port) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{what} did not listen on 127.0.0.1:{port} within 60s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Hands `path` to `user`, for servers that refuse to run as root.
pub fn chown(user: &str, path: &Path) {
    let ok = Command::new("chown")
        .args(["-R", &format!("{user}:{user}")])
        .arg(path)
        .status()
        .unwrap();
    assert!(ok.success(), "chown {user} {}", path.display());
}

/// A PostgreSQL server of the test's own (`initdb`, `pg_ctl`).
pub struct OwnPostgres {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    settings: Vec<String>,
    _dir: tempfile::TempDir,
}

impl OwnPostgres {
    /// Starts a server with `settings` (`name=value`, as `-c` options).
    pub fn start(test: &str, settings: &[&str]) -> Option<OwnPostgres> {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .ok()
            .and_then(|dirs| {
                let mut bins: Vec<PathBuf> = dirs
                    .filter_map(|e| Some(e.ok()?.path().join("bin")))
                    .filter(|p| p.join("pg_ctl").exists())
                    .collect();
                bins.sort();
                bins.pop()
            });
        need(test, bin.is_some(), "PostgreSQL (initdb, pg_ctl)")?;
        let bin = bin.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        if is_root() {
            chown("postgres", dir.path());
        }
        let out = Self::as_postgres(&bin, "initdb")
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let server = OwnPostgres {
            bin,
            data,
            port: spare_port(),
            settings: settings.iter().map(|s| s.to_string()).collect(),
            _dir: dir,
        };
        server.pg_ctl(&["start", "-w"]);
        Some(server)
    }

    fn as_postgres(bin: &Path, program: &str) -> Command {
        let path = bin.join(program);
        // initdb and postgres refuse to run as root.
        if is_root() {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(path);
            cmd
        } else {
            Command::new(path)
        }
    }

    /// Runs `pg_ctl` on the server with `args` (`["-m", "immediate", "stop"]`,
    /// `["start", "-w"]`), with its settings.
    pub fn pg_ctl(&self, args: &[&str]) {
        let mut options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -k {} -c fsync=off",
            self.port,
            self.data.display()
        );
        for s in &self.settings {
            options.push_str(" -c ");
            options.push_str(s);
        }
        let out = Self::as_postgres(&self.bin, "pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .arg("-l")
            .arg(self.data.join("server.log"))
            .args(["-o", &options])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_ctl {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The URL of its `postgres` database, as the superuser `postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for OwnPostgres {
    fn drop(&mut self) {
        let _ = Self::as_postgres(&self.bin, "pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "immediate", "stop"])
            .output();
    }
}

/// A MariaDB (or MySQL) server of the test's own (`mariadb-install-db`, `mariadbd`),
/// with the user `root` (no password, every privilege).
pub struct OwnMariaDb {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl OwnMariaDb {
    pub fn start(test: &str) -> Option<OwnMariaDb> {
        Self::start_with(test, &[])
    }

    /// Starts a server with `args` (`--max-connections=3`, ...).
    pub fn start_with(test: &str, args: &[&str]) -> Option<OwnMariaDb> {
        let found = |p: &str| {
            Command::new("sh")
                .args(["-c", &format!("command -v {p}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        need(
            test,
            found("mariadb-install-db") && found("mariadbd"),
            "MariaDB (mariadb-install-db, mariadbd)",
        )?;
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let root = is_root();
        if root {
            chown("mysql", dir.path());
        }
        let user = if root { "--user=mysql" } else { "--user=" };
        let mut install = Command::new("mariadb-install-db");
        install
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"]);
        if root {
            install.arg(user);
        }
        let out = install.output().unwrap();
        assert!(
            out.status.success(),
            "mariadb-install-db: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let port = spare_port();
        let mut server = Command::new("mariadbd");
        server
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .arg(format!("--port={port}"))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--socket={}", dir.path().join("sock").display()))
            .arg(format!("--pid-file={}", dir.path().join("pid").display()))
            .arg(format!(
                "--log-error={}",
                dir.path().join("error.log").display()
            ))
            .args(["--skip-log-bin", "--innodb-buffer-pool-size=16M"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if root {
            server.arg(user);
        }
        let child = server.spawn().unwrap();
        wait_listening(port, "mariadbd");
        Some(OwnMariaDb {
            child,
            port,
            _dir: dir,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of `database` as `user` (no password).
    pub fn url(&self, user: &str, database: &str) -> String {
        format!("mysql://{user}@127.0.0.1:{}/{database}", self.port)
    }

    /// Creates, through `root`, the database `idem` and the user `idem` with every
    /// privilege on it but none beyond (no SUPER, so `read_only` and the connection
    /// limit bind it), and returns the URL of the one as the other.
    #[cfg(feature = "mysql")]
    pub async fn idem_user(&self, root: &mut sqlx::MySqlConnection) -> String {
        for sql in [
            "CREATE DATABASE idem",
            "CREATE USER 'idem'@'%'",
            "GRANT ALL ON idem.* TO 'idem'@'%'",
        ] {
            sqlx::raw_sql(sql).execute(&mut *root).await.unwrap();
        }
        self.url("idem", "idem")
    }
}

impl Drop for OwnMariaDb {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A Redis server of the test's own, without persistence.
pub struct OwnRedis {
    child: Child,
    port: u16,
    /// Its working folder: a replica writes the data it syncs there.
    _dir: tempfile::TempDir,
}

impl OwnRedis {
    /// Starts a server that speaks only TLS, with the certificate `cert` and its key.
    pub fn start_tls(test: &str, cert: &Path, key: &Path) -> Option<OwnRedis> {
        let port = spare_port();
        let (cert, key) = (cert.display().to_string(), key.display().to_string());
        let port_arg = port.to_string();
        Self::start_on(
            test,
            port,
            &[
                "--port",
                "0",
                "--tls-port",
                &port_arg,
                "--tls-cert-file",
                &cert,
                "--tls-key-file",
                &key,
                "--tls-auth-clients",
                "no",
            ],
        )
    }

    /// Starts a server with `args` (`--replicaof`, ...).
    pub fn start(test: &str, args: &[&str]) -> Option<OwnRedis> {
        Self::start_on(test, spare_port(), args)
    }

    /// Starts a server listening on `port` (unless `args` move it), with `args`.
    fn start_on(test: &str, port: u16, args: &[&str]) -> Option<OwnRedis> {
        need(test, have("redis-server"), "redis-server")?;
        let dir = tempfile::tempdir().unwrap();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_listening(port, "redis-server");
        Some(OwnRedis {
            child,
            port,
            _dir: dir,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
