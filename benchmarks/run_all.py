"""`make bench`: the quick benchmarks in turn (full sizes, a few minutes each on 2 cores), each writing
benchmarks/results/NAME.json (+ NAME.png but pack_difficulty, whose figures are two rates).

    python -m benchmarks.run_all            # the quick ones: QUICK below (~8 min on 2 cores)
    python -m benchmarks.run_all --all      # every benchmark of BENCHMARKS (hours on 2 cores)
    python -m benchmarks.run_all --quick    # smoke sizes (of the quick ones; with --all, of all)
    python -m benchmarks.run_all ingest shuffle
    python -m benchmarks.run_all --remote   # ingest + retrain on remote stores (loopback servers) vs local

benchmarks/README.md lists every benchmark, its command, its JSON and how long it takes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

BENCHMARKS = ("ingest", "ingest_shapes", "index_build", "training_set", "shuffle", "scheduler", "fleet_load", "fleet_scaling", "pack_difficulty", "pack_ceiling", "pack_initial_variance", "pack_fert_cap",
              "fleet_scaling_pack", "fleet_chaos", "remote_stores")
# what `make bench` runs: the benchmarks whose full run takes a few minutes on 2 cores (the recorded
# runs: ingest_shapes 38 s, fleet_load 2 x 15 s of load + start-up, pack_difficulty 109 s, pack_ceiling
# 118 s, pack_initial_variance 128 s); the rest take 7 minutes (scheduler) to over an hour (fleet_scaling)
QUICK = ("ingest_shapes", "fleet_load", "pack_difficulty", "pack_ceiling", "pack_initial_variance")
COMMANDS = {"fleet_scaling_pack": ("fleet_scaling", "--sim", "pack")}  # a name that is another module's run
REMOTE = ("remote_stores",)  # what --remote runs: the flows' timings with every store on a server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: the quick ones, {', '.join(QUICK)}; "
                        f"choose from {', '.join(BENCHMARKS)})")
    parser.add_argument("--all", action="store_true", help="every benchmark, the long ones too (hours on 2 cores)")
    parser.add_argument("--quick", action="store_true", help="smoke-sized runs")
    parser.add_argument("--remote", action="store_true", help=f"only {', '.join(REMOTE)}: the ingest and retrain "
                        "flows on remote stores (Postgres + MLflow server + S3 on loopback) vs the local root")
    args = parser.parse_args()
    unknown = sorted(set(args.names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    failed = []
    for name in args.names or (REMOTE if args.remote else BENCHMARKS if args.all else QUICK):
        module, *extra = COMMANDS.get(name, (name,))
        cmd = [sys.executable, "-m", f"benchmarks.{module}", *extra, *(["--quick"] if args.quick else [])]
        print(f"== {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        code = subprocess.call(cmd)
        print(f"== {name}: exit {code} after {time.perf_counter() - start:.0f}s", flush=True)
        if code:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
