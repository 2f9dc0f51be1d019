//! Real HAProxy (the Debian package) in front of the gateways of a test: the shipped
//! `deploy/loadbalancers/haproxy/haproxy.cfg` (or it without its stick lines, plain round
//! robin), three pods, started and waited on until every pod is UP; its stats page read back.
//! Used by tests/fleet/scale_out.rs and tests/fleet/fleet_interop.rs.

use super::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The shipped HAProxy config.
pub const CONFIG: &str = "deploy/loadbalancers/haproxy/haproxy.cfg";
/// The three pods (servers) of its backend, in order.
pub const PODS: [&str; 3] = ["pod1", "pod2", "pod3"];
/// HAProxy's health-check interval in these tests (the shipped default is 2 s).
const CHECK_INTERVAL: &str = "200ms";

/// The HAProxy executable, or None (after saying so) when it is not installed and
/// `CI_REQUIRE_HAPROXY` is not set.
pub fn haproxy_or_skip(test: &str, case: &str) -> Option<PathBuf> {
    let candidates: Vec<PathBuf> = match std::env::var_os("HAPROXY") {
        Some(p) => vec![PathBuf::from(p)],
        None => vec![PathBuf::from("haproxy"), PathBuf::from("/usr/sbin/haproxy")],
    };
    for bin in candidates {
        if Command::new(&bin)
            .arg("-v")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return Some(bin);
        }
    }
    assert!(
        std::env::var_os("CI_REQUIRE_HAPROXY").is_none(),
        "HAProxy is required (CI_REQUIRE_HAPROXY is set) but `haproxy -v` did not run: \
         install the Debian package `haproxy` (.ci/run does) or set HAPROXY=/path/to/haproxy"
    );
    eprintln!(
        "\n*** SKIPPED {test} {case}: HAProxy is not installed (apt-get install -y haproxy; \
         CI installs it and sets CI_REQUIRE_HAPROXY=1) ***\n"
    );
    None
}

/// The shipped config without its `stick` directives: plain round robin, the control.
pub fn control_config() -> PathBuf {
    let shipped = std::fs::read_to_string(repo_dir().join(CONFIG)).expect("reading the config");
    let kept: Vec<&str> = shipped
        .lines()
        .filter(|l| {
            let t = l.trim_start();
            !(t.starts_with("stick ") || t.starts_with("stick-table "))
        })
        .collect();
    assert_eq!(
        shipped.lines().count() - kept.len(),
        3,
        "the control removes exactly stick-table, stick store-response and stick match"
    );
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("haproxy-control.cfg");
    std::fs::write(&path, kept.join("\n") + "\n").expect("writing the control config");
    path
}

pub struct Haproxy {
    pub proc: ChildProc,
    pub addr: SocketAddr,
    stats: SocketAddr,
}

impl Haproxy {
    /// Runs `haproxy -db -f <config>` in front of `gateways` (pod1, pod2, pod3), and waits (at
    /// most 10 s) until its health checks see every pod UP.
    pub async fn start(bin: &Path, config: &Path, gateways: &[&Binary]) -> Haproxy {
        let (addr, stats) = (free_port(), free_port());
        let mut env: Vec<(String, String)> = vec![
            ("MCP_LB_BIND".into(), addr.to_string()),
            ("MCP_LB_STATS_BIND".into(), stats.to_string()),
            ("MCP_CHECK_INTERVAL".into(), CHECK_INTERVAL.into()),
        ];
        for (i, g) in gateways.iter().enumerate() {
            env.push((format!("MCP_POD{}", i + 1), g.addr.to_string()));
            env.push((
                format!("MCP_POD{}_ADMIN_PORT", i + 1),
                g.admin.port().to_string(),
            ));
        }
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (&**k, &**v)).collect();
        let proc = ChildProc::spawn_env(
            "haproxy",
            bin.to_str().expect("UTF-8 path"),
            &["-db", "-f", config.to_str().expect("UTF-8 path")],
            &repo_dir(),
            &env,
        );
        let mut lb = Haproxy { proc, addr, stats };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let status = lb.status().await;
            if PODS
                .iter()
                .all(|p| status.get(*p).is_some_and(|s| s == "UP"))
            {
                break;
            }
            if tokio::time::Instant::now() >= deadline
                || lb.proc.wait_exit(Duration::ZERO).await.is_some()
            {
                panic!(
                    "HAProxy did not see every pod UP (last: {status:?}); stderr:\n{}",
                    lb.proc.stderr_lines().join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        lb
    }

    /// Each pod's status in the `mcp_reattach` backend (`UP`, `DOWN`, `UP 1/2`, …), from the
    /// stats page's CSV export; empty if HAProxy does not answer yet.
    pub async fn status(&self) -> BTreeMap<String, String> {
        let Ok(resp) = http_client()
            .get(format!("http://{}/stats;csv", self.stats))
            .timeout(Duration::from_secs(2))
            .send()
            .await
        else {
            return BTreeMap::new();
        };
        let text = resp.text().await.unwrap_or_default();
        let mut lines = text.lines();
        let header: Vec<&str> = lines
            .next()
            .unwrap_or("")
            .trim_start_matches("# ")
            .split(',')
            .collect();
        let col = |name: &str| header.iter().position(|h| *h == name);
        let (Some(px), Some(sv), Some(st)) = (col("pxname"), col("svname"), col("status")) else {
            return BTreeMap::new();
        };
        lines
            .map(|l| l.split(',').collect::<Vec<_>>())
            .filter(|f| {
                f.get(px) == Some(&"mcp_reattach") && PODS.contains(f.get(sv).unwrap_or(&""))
            })
            .map(|f| (f[sv].to_string(), f[st].to_string()))
            .collect()
    }

    /// Waits (at most `limit`) until `pod`'s status starts with `want`; returns how long it took.
    pub async fn wait_status(&self, pod: &str, want: &str, limit: Duration) -> Duration {
        let t0 = tokio::time::Instant::now();
        loop {
            let status = self.status().await;
            if status.get(pod).is_some_and(|s| s.starts_with(want)) {
                return t0.elapsed();
            }
            assert!(
                t0.elapsed() < limit,
                "HAProxy did not mark {pod} {want} within {limit:?}: {status:?}"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}
