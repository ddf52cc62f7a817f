"""CI's check of `make demo`'s table (.ci/check_demo.py) reads the table the CLI prints, and fails
when a round, its method, its plan or its held-out interval is missing."""

import importlib.util
import io
from pathlib import Path

from rich.console import Console

from cli.main import demo_table
from flows.demo import RoundRow

CHECK = Path(__file__).resolve().parent.parent / ".ci" / "check_demo.py"
spec = importlib.util.spec_from_file_location("check_demo", CHECK)
check_demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_demo)


def _printed(rows: list[RoundRow]) -> str:
    out = io.StringIO()
    Console(file=out, width=200).print(demo_table(rows, 0.95))
    return out.getvalue()


def _rows(plan: str = "sequential (fixed)") -> list[RoundRow]:
    boot = RoundRow("bootstrap", 4, 80, 0.95, "80.6% [76.8, 84.0]", 480, True, 1, "bc", plan, "12 vs 14 seq", 0)
    rounds = [RoundRow(f"round {r}", 8, 77, 0.86, "85.6% [82.2, 88.5]", 480, r == 1, 2, "fert", plan, "30", 412)
              for r in (1, 2)]
    return [boot, *rounds]


def test_a_whole_table_passes():
    assert check_demo.problems(_printed(_rows()), rounds=2) == []


def test_a_missing_round_plan_or_interval_fails():
    assert check_demo.problems(_printed(_rows()[:2]), rounds=2) == ["round 2: no row in the demo table"]
    assert "round 1: no plan" in check_demo.problems(_printed(_rows(plan="-")), rounds=2)
    broken = _rows()
    broken[1] = RoundRow("round 1", 8, 77, 0.86, "n/a", 480, False, 1, "fert", "sequential", "30", 0)
    assert check_demo.problems(_printed(broken), rounds=2) == ["round 1: held-out success 'n/a' is not 'rate% [low, high]'"]
