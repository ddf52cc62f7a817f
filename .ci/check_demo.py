"""CI: the demo's table shows every round, each with its method, plan and held-out success.

Reads the output of `make demo` (the README's first command) and fails, naming what is missing,
unless the per-round table has the bootstrap and every fleet round of params.yaml's ``demo.rounds``
with a method, a plan and a held-out success with its interval.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("round", "robots", "episodes", "fleet success", "held-out success [CI]", "trials", "promoted", "champion",
           "method", "plan", "ms/iteration", "retrieved")
HELDOUT = re.compile(r"^\d{1,3}\.\d% \[\d{1,3}\.\d, \d{1,3}\.\d\]$")


def table_rows(text: str) -> dict[str, dict[str, str]]:
    """The demo table's body rows by round label (rich draws cells between │ characters)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == len(COLUMNS) and re.fullmatch(r"bootstrap|round \d+", cells[0]):
            rows[cells[0]] = dict(zip(COLUMNS, cells, strict=True))
    return rows


def problems(text: str, rounds: int) -> list[str]:
    rows = table_rows(text)
    out = []
    for label in ["bootstrap", *(f"round {r}" for r in range(1, rounds + 1))]:
        row = rows.get(label)
        if row is None:
            out.append(f"{label}: no row in the demo table")
            continue
        if not HELDOUT.match(row["held-out success [CI]"]):
            out.append(f"{label}: held-out success {row['held-out success [CI]']!r} is not 'rate% [low, high]'")
        out += [f"{label}: no {col}" for col in ("method", "plan") if row[col] in ("", "-")]
    return out


def main(log: str) -> int:
    rounds = yaml.safe_load((ROOT / "params.yaml").read_text())["demo"]["rounds"]
    found = problems(Path(log).read_text(), rounds)
    for line in found:
        print(f"demo check: {line}", file=sys.stderr)
    print(f"demo check: {'FAILED' if found else 'ok'}: bootstrap + {rounds} rounds, each with method, plan, held-out success")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
