#!/usr/bin/env python3
"""The baseline side of bench/callgrind: Ir per unit of work (request, event, resume) per arm
and workload, checked in as bench/callgrind-baseline.txt.

  callgrind-baseline.py check BASELINE MEASURED TOLERANCE_PCT
      exit 1 if any measured Ir/unit is more than TOLERANCE_PCT above its baseline row, or a
      measured run failed its checks; rows of the baseline not measured this time are skipped
  callgrind-baseline.py over BASELINE ARM WORKLOAD IR_PER_UNIT TOLERANCE_PCT
      exit 0 if IR_PER_UNIT is more than TOLERANCE_PCT above the baseline row (bench/callgrind
      then measures that row again), 1 if not or if there is no such row
  callgrind-baseline.py update BASELINE MEASURED COMMIT
      replace the baseline rows that were measured (the others are kept); refuses failed runs

Both files: one `arm workload Ir_per_unit` per line (`FAILED` for a run whose load checks
failed); `#` starts a comment.
"""
import datetime
import sys

ORDER = ["json", "call", "call-streamed", "sse-200", "sse-200-burst", "sse-16k", "storm"]
UNIT = {"json": "request", "call": "call", "call-streamed": "call", "storm": "resume"}


def read(path):
    rows = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 3:
                sys.exit(f"{path}:{n}: expected `arm workload Ir_per_unit`, got {line!r}")
            arm, work, v = parts
            if v != "FAILED":
                try:
                    v = float(v)
                except ValueError:
                    sys.exit(f"{path}:{n}: {v!r} is not a number")
            rows[(arm, work)] = v
    return rows


def key(k):
    arm, work = k
    return (arm, ORDER.index(work) if work in ORDER else len(ORDER), work)


def check(baseline, measured, tol):
    base, got = read(baseline), read(measured)
    if not got:
        sys.exit("callgrind check: nothing was measured")
    bad = 0
    print(f"\ncallgrind check against {baseline} (fail above +{tol:g} %):")
    print(f"{'arm':<13} {'work':<13} {'baseline':>12} {'now':>12} {'change':>8}")
    for k in sorted(got, key=key):
        arm, work = k
        v, b = got[k], base.get(k)
        if v == "FAILED":
            print(f"{arm:<13} {work:<13} {'':>12} {'':>12} {'':>8}  FAILED: the load client's checks failed")
            bad += 1
            continue
        if b is None or b == "FAILED":
            print(f"{arm:<13} {work:<13} {'–':>12} {v:>12.0f} {'':>8}  no baseline (add it with --update)")
            continue
        change = (v - b) / b * 100
        verdict = "REGRESSED" if change > tol else "ok"
        bad += verdict != "ok"
        print(f"{arm:<13} {work:<13} {b:>12.0f} {v:>12.0f} {change:>+7.1f}%  {verdict}")
    if bad:
        sys.exit(f"callgrind check: {bad} row(s) regressed or failed")
    print("callgrind check: ok")


def update(baseline, measured, commit):
    try:
        base = read(baseline)
    except FileNotFoundError:
        base = {}
    got = read(measured)
    failed = [k for k, v in got.items() if v == "FAILED"]
    if failed:
        sys.exit("callgrind update: refusing, these runs failed their checks: "
                 + ", ".join(" ".join(k) for k in failed))
    base.update(got)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    with open(baseline, "w") as f:
        f.write("# bench/callgrind baseline: instructions (callgrind Ir) per unit of work of the proxy\n"
                "# process (request for json, call for call, resume for storm, event otherwise; json\n"
                "# sends a fresh id per request since 2026-12-02, before it was one id, answered as\n"
                "# retransmissions). `bench/callgrind --check` fails when a row grows by more than\n"
                "# 10 %; `bench/callgrind --update` rewrites the rows it measures (last: commit\n"
                f"# {commit}, {date}).\n"
                "# arm          workload      Ir/unit\n")
        for k in sorted(base, key=key):
            arm, work = k
            unit = UNIT.get(work, "event")
            f.write(f"{arm:<14} {work:<13} {base[k]:.0f}  # per {unit}\n")
    print(f"callgrind update: wrote {len(got)} row(s) to {baseline}")


def over(baseline, arm, work, value, tol):
    b = read(baseline).get((arm, work))
    return isinstance(b, float) and (value - b) / b * 100 > tol


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "over":
        a = sys.argv
        sys.exit(0 if over(a[2], a[3], a[4], float(a[5]), float(a[6])) else 1)
    if len(sys.argv) != 5 or sys.argv[1] not in ("check", "update"):
        sys.exit(__doc__)
    if sys.argv[1] == "check":
        check(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    else:
        update(sys.argv[2], sys.argv[3], sys.argv[4])
