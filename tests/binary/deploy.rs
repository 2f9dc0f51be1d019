//! The deployment material under `deploy/` validates offline: `deploy/validate.sh` renders the
//! Kustomize base and overlay and the Helm chart with the real tools, validates every object
//! strictly against Kubernetes, Istio, Gateway API, Envoy Gateway (its CRDs), Prometheus Operator
//! (ServiceMonitor, PodMonitor, PrometheusRule) and Envoy schemas, checks the Envoy Gateway
//! session pin (EnvoyPatchPolicy), checks the pod's consistency (probes, ports, grace period vs
//! drain, memory vs the sizing formula), checks that each chart option in `ci/*-values.yaml`
//! lands where it belongs (pod knobs, admin port, monitors, TLS), checks the
//! HAProxy example (`haproxy -c` and its session-pin, drain and SSE settings; it is run for real
//! by `tests/fleet/scale_out.rs`), lints the Dockerfiles and scripts. It installs its tools on first use (PyPI into `.tools/deploy-venv`,
//! npm into `deploy/tools/node_modules`), which is why the limit below is generous.

// Real processes and sockets run on the wall clock (the ban in clippy.toml is for src/).
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(20 * 60);

#[test]
fn deploy_manifests_validate_offline() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/validate.sh");
    let mut child = Command::new("bash")
        .arg(&script)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start deploy/validate.sh");
    // Drain both pipes on threads so a chatty install cannot block on a full pipe.
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("stdout")));
    let err = drain(Box::new(child.stderr.take().expect("stderr")));
    let deadline = Instant::now() + LIMIT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for deploy/validate.sh") {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let (out, err) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    // Shown with --nocapture, and on failure.
    println!("{out}");
    eprintln!("{err}");
    let status = status.unwrap_or_else(|| panic!("deploy/validate.sh ran over {LIMIT:?}"));
    assert!(
        status.success(),
        "deploy/validate.sh failed ({status}):\n{out}\n{err}"
    );
    assert!(
        out.contains("deploy/validate.sh: all checks passed"),
        "no success line:\n{out}"
    );
}
