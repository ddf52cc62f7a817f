"""`make bench`: every benchmark in turn, each writing benchmarks/results/NAME.json (+ NAME.png but
pack_difficulty, whose figures are two rates).

    python -m benchmarks.run_all            # full sizes (tens of minutes on a 2-core laptop)
    python -m benchmarks.run_all --quick    # smoke sizes
    python -m benchmarks.run_all ingest shuffle
    python -m benchmarks.run_all --remote   # ingest + retrain on remote stores (loopback servers) vs local
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

BENCHMARKS = ("ingest", "ingest_shapes", "index_build", "training_set", "shuffle", "scheduler", "fleet_load", "fleet_scaling", "pack_difficulty", "pack_ceiling", "pack_initial_variance", "pack_fert_cap",
              "fleet_scaling_pack", "fleet_chaos", "remote_stores")
COMMANDS = {"fleet_scaling_pack": ("fleet_scaling", "--sim", "pack")}  # a name that is another module's run
REMOTE = ("remote_stores",)  # what --remote runs: the flows' timings with every store on a server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})")
    parser.add_argument("--quick", action="store_true", help="smoke-sized runs")
    parser.add_argument("--remote", action="store_true", help=f"only {', '.join(REMOTE)}: the ingest and retrain "
                        "flows on remote stores (Postgres + MLflow server + S3 on loopback) vs the local root")
    args = parser.parse_args()
    unknown = sorted(set(args.names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    failed = []
    for name in args.names or (REMOTE if args.remote else BENCHMARKS):
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
