"""Opening the segment table: a LanceDB connection to a local folder or an object store, with
the consistency a handle asked for; whether the table exists; create it when it does not."""

from __future__ import annotations

from datetime import timedelta

import lancedb

from components.store.location import StoreLocation
from components.store.schema import segment_schema


def connect(location: StoreLocation, strong: bool = True) -> lancedb.DBConnection:
    """``strong``: every call looks for the latest version; else only an explicit
    ``checkout_latest`` does (a "step" handle's writes)."""
    return lancedb.connect(location.uri, read_consistency_interval=timedelta(0) if strong else None,
                           storage_options=location.storage_options)


def table_exists(location: StoreLocation, table: str) -> bool:
    """Whether the store holds ``table`` (a local folder is looked at without opening LanceDB)."""
    folder = location.local_path
    if folder is not None:
        return (folder / f"{table}.lance").exists()
    try:
        connect(location).open_table(table)  # LanceDB's table_exists is not implemented for object stores
    except (FileNotFoundError, ValueError):  # "Table '...' was not found", as open_or_create reads it
        return False
    except (OSError, RuntimeError) as exc:
        raise location.unreachable(exc) from None
    return True


def open_or_create(location: StoreLocation, table: str, dim: int, strong: bool = True) -> lancedb.table.Table:
    db = connect(location, strong)
    try:
        return db.open_table(table)
    except (FileNotFoundError, ValueError):
        return db.create_table(table, schema=segment_schema(dim), exist_ok=True)
