"""How every command prints a report: for scripts (``--json``: the report's keys as they are,
stable) or for people (rich tables whose long values, paths included, wrap instead of being cut,
then one summary line).

The people view flattens a report: nested mappings become ``parent.child`` rows, lists of
mappings become their own table (one column per key), lists of scalars one line each, ``None``
a dash. Nothing is ever printed as a Python repr.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

EMPTY = "-"
FLOAT_DIGITS = 4  # significant digits of floats in the people view (--json keeps them all)


class Blocks(list):
    """Records shown one key/value block each rather than as table rows: for records whose
    values are long (paths, reasons, fixes), which a column each would squeeze."""


def to_json(report: Mapping[str, Any]) -> str:
    return json.dumps(report, indent=2, default=str)


def cell(value: Any) -> str:
    """One value as people read it."""
    if value is None:
        return EMPTY
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{FLOAT_DIGITS}g}"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={cell(v)}" for k, v in value.items()) or EMPTY
    if isinstance(value, (list, tuple)):
        return "\n".join(cell(v) for v in value) or EMPTY
    return str(value)


def _rows(report: Mapping[str, Any], prefix: str = "") -> tuple[list[tuple[str, str]], dict[str, list[Mapping]]]:
    """Key/value rows (nested mappings flattened) and the lists of mappings, by key."""
    rows: list[tuple[str, str]] = []
    tables: dict[str, list[Mapping]] = {}
    for key, value in report.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            sub_rows, sub_tables = _rows(value, f"{name}.")
            rows += sub_rows
            tables.update(sub_tables)
        elif isinstance(value, Sequence) and not isinstance(value, str) and value and all(isinstance(v, Mapping) for v in value):
            tables[name] = value if isinstance(value, Blocks) else list(value)
        else:
            rows.append((name, cell(value)))
    return rows, tables


def records_table(records: Sequence[Mapping[str, Any]], title: str | None = None) -> Table:
    """A table with one column per key (in first-seen order); every column wraps (``fold``
    breaks a long path or id that has no spaces instead of cutting it)."""
    columns = list(dict.fromkeys(k for r in records for k in r))
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    for record in records:
        table.add_row(*(cell(record.get(c)) for c in columns))
    return table


def blocks_table(records: Sequence[Mapping[str, Any]], title: str | None = None) -> Table:
    """One key/value block per record, a blank line between: every value gets the full width."""
    table = _key_value_table(title)
    for i, record in enumerate(records):
        if i:
            table.add_row("", "")
        for key, value in record.items():
            table.add_row(str(key), cell(value))
    return table


def _key_value_table(title: str | None = None) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column("key", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    return table


def report_table(report: Mapping[str, Any]) -> tuple[Table, list[Table]]:
    rows, tables = _rows(report)
    table = _key_value_table()
    for key, value in rows:
        table.add_row(key, value)
    extra = [(blocks_table if isinstance(records, Blocks) else records_table)(records, title=key)
             for key, records in tables.items()]
    return table, extra


def emit(
    console: Console, report: Mapping[str, Any], as_json: bool, summary: str, people: Mapping[str, Any] | None = None
) -> None:
    """``--json``: the report, nothing else, on stdout. People: the tables of ``people`` (default:
    the report; a command may show richer rows than its stable JSON keys), then ``summary``."""
    if as_json:
        print(to_json(report))
        return
    table, extra = report_table(report if people is None else people)
    console.print(table)
    for t in extra:
        console.print(t)
    console.print(summary, soft_wrap=True)


def say(console: Console, report: Mapping[str, Any], as_json: bool, line: str) -> None:
    """For a command whose whole report fits one line: ``--json`` the report, people that line
    (soft-wrapped: the terminal wraps a long path, nothing cuts it)."""
    if as_json:
        print(to_json(report))
    else:
        console.print(line, soft_wrap=True)
