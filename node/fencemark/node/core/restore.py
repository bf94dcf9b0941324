"""Restoring a whole cluster from a backup, without reissuing a fencing token.

A backup remembers the fences as they were when it was taken. Grants made after
it are forgotten by a cluster restored from it, so the restored homes would
grant again tokens that workers of the lost timeline may still hold. This is the
disk-loss problem on every node at once, and it takes the same cure
(docs/replication.md, catch-up after disk loss): a durable ``recovered_hlc`` in
the meta table, after which the first grant a home makes on each record whose
holder it did not grant since jumps ``RECOVERY_GAP`` above the fence
(``admission.next_token``); peers accept the jump within ``--max-token-jump``
(``integrity``).

``mark_restored`` is offline: the node must be stopped (the file is opened with
an exclusive lock, so a running node is noticed and refused). It is idempotent
in effect — marking twice only moves the mark later, and every grant of the
restored file stays below it — and a restarted node reads the mark as it is, so
restarting never jumps again. docs/operations.md has the procedure.
"""

from __future__ import annotations

import contextlib
import datetime
import secrets
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from fencemark.node.crdt import codec
from fencemark.node.store.storage import DB_FILE

COMPANIONS = ("-wal", "-shm", "-journal")


class RestoreError(Exception):
    """The restore cannot be done; the message says what to fix."""


@dataclass(frozen=True)
class Restored:
    path: Path
    records: int
    recovered_hlc: int  # every grant in the file is below it; every new one above
    node_id: str  # a new identity: the restored copies of one backup are new nodes


def copy_backup(backup: Path, db: Path) -> None:
    """Copy ``backup`` to ``db`` with SQLite's backup API (a consistent copy).

    Refuses to overwrite: a file already at ``db`` (or its WAL) is another
    timeline, and mixing its WAL into the backup would corrupt both.
    """
    if not backup.is_file():
        raise RestoreError(f"--from: no backup file at {backup}")
    present = [p for p in (db, *(Path(f"{db}{s}") for s in COMPANIONS)) if p.exists()]
    if present:
        names = ", ".join(str(p) for p in present)
        raise RestoreError(f"{names} already exist: move them away first (or restore without"
                           " --from to mark the file already there)")  # fmt: skip
    db.parent.mkdir(parents=True, exist_ok=True)
    source = sqlite3.connect(f"file:{backup}?mode=ro", uri=True)
    try:
        target = sqlite3.connect(db)
        try:
            source.backup(target)
        finally:
            target.close()
    except sqlite3.DatabaseError as exc:
        with contextlib.suppress(OSError):
            db.unlink()
        raise RestoreError(f"--from: cannot copy {backup} as a SQLite database: {exc}") from exc
    finally:
        source.close()


def mark_restored(data_dir: Path, *, backup: Path | None = None) -> Restored:
    """Mark the node database in ``data_dir`` as restored from a backup.

    With ``backup``, first copy it into place. Then, in one transaction: the
    node gets a new ``node_id``, and ``recovered_hlc`` and ``hlc_high`` are set
    just above every timestamp in the file, so every grant the file holds is
    "before the recovery" and the node's clock starts past the mark.
    """
    db = data_dir / DB_FILE
    if backup is not None:
        copy_backup(backup, db)
    if not db.is_file():
        raise RestoreError(f"--data: no database at {db}; copy the backup there, or use --from")
    conn = sqlite3.connect(db, isolation_level=None, timeout=0.5)
    try:
        # Exclusive: a running node holds the file open, and would neither see the
        # mark nor keep it (it rewrites the meta table on every commit).
        conn.execute("PRAGMA locking_mode=EXCLUSIVE")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("BEGIN EXCLUSIVE")
        try:
            restored = _mark(conn, db, backup)
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc):
            raise RestoreError(f"{db} is in use ({exc}): stop its node first") from exc
        raise RestoreError(f"{db}: {exc}") from exc
    except sqlite3.DatabaseError as exc:
        raise RestoreError(f"{db} is not a Fencemark database: {exc}") from exc
    finally:
        conn.close()
    return restored


def _mark(conn: sqlite3.Connection, db: Path, backup: Path | None) -> Restored:
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if not {"records", "meta"} <= tables:
        raise RestoreError(f"{db} is not a Fencemark database (no records and meta tables)")
    meta = {str(k): str(v) for k, v in conn.execute("SELECT name, value FROM meta")}
    high = int(meta.get("hlc_high") or 0)
    records = 0
    for (state,) in conn.execute("SELECT state FROM records"):
        try:
            record = codec.decode(bytes(state))
        except codec.DecodeError as exc:
            raise RestoreError(f"{db}: a record state does not decode ({exc})") from exc
        high = max(high, record.max_hlc())
        records += 1
    mark = high + 1
    node_id = secrets.token_hex(6)
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    settings = {
        "recovered_hlc": str(mark),
        "hlc_high": str(mark),
        # A restored file is behind whatever its peers learnt since the backup.
        "catch_up": "owed",
        "node_id": node_id,
        "restored_at": now,
        "restored_from": str(backup or ""),
    }
    conn.executemany(
        "INSERT INTO meta VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET value = excluded.value",
        list(settings.items()),
    )
    return Restored(db, records, mark, node_id)
