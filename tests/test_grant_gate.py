"""The grant gate (fencemark.node.core.grant_gate) on a real data file, without peers.

The node-level sequences (kill -9, wiped directories, stopped peers) are in
tests/test_catch_up.py, which spawns processes; these pin the gate's own rules
quickly: a new file owes a catch-up, the obligation and the recovery gap are
durable before they count, and only ``caught_up`` ends them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fencemark.node.core.grant_gate import GrantGate
from fencemark.node.crdt import HybridClock
from fencemark.node.rules.errors import NotServing
from fencemark.node.store.storage import DB_FILE, Storage


async def reopened(db: Path) -> GrantGate:
    """The gate of a node restarted on ``db`` (what it owes is read back from the file)."""
    storage = await Storage.open(db)
    gate = GrantGate(storage, HybridClock())
    await storage.close()
    return gate


async def test_a_new_file_owes_a_catch_up_across_restarts_until_it_is_done(
    tmp_path: Path,
) -> None:
    """SPEC §4: a node on a new (or lost) disk decides nothing until it has caught up,
    however often it restarts first; afterwards it decides, and keeps deciding."""
    db = tmp_path / DB_FILE
    storage = await Storage.open(db)
    gate = GrantGate(storage, HybridClock())
    assert not gate.deciding
    with pytest.raises(NotServing, match="catching up"):
        gate.check()
    await storage.close()
    for _ in range(2):
        assert not (await reopened(db)).deciding

    storage = await Storage.open(db)
    gate = GrantGate(storage, HybridClock())
    await gate.caught_up()
    assert gate.deciding
    gate.check()
    assert gate.recovered_hlc == 0, "nobody held anything: no recovery gap"
    await storage.close()
    again = await reopened(db)
    assert again.deciding and again.recovered_hlc == 0


async def test_a_state_merged_while_catching_up_makes_the_recovery_gap_owed_durably(
    tmp_path: Path,
) -> None:
    """A peer that held records while this node caught up means the cluster is not
    new: the gap is owed, durably, before the state itself is merged. Catching up
    then marks, durably, the HLC below which grants are of the earlier life."""
    db = tmp_path / DB_FILE
    storage = await Storage.open(db)
    clock = HybridClock()
    gate = GrantGate(storage, clock)
    await gate.merging()
    assert gate.gap_owed
    await storage.close()
    assert (await reopened(db)).gap_owed, "the gap is owed across a restart"

    storage = await Storage.open(db)
    clock = HybridClock()
    gate = GrantGate(storage, clock)
    before = clock.now()
    await gate.caught_up()
    assert gate.deciding and gate.recovered_hlc > before
    mark = gate.recovered_hlc
    await gate.caught_up()  # a second complete pass changes nothing
    assert gate.recovered_hlc == mark
    await storage.close()
    again = await reopened(db)
    assert again.deciding and again.recovered_hlc == mark


async def test_a_deciding_node_owes_no_gap_for_what_it_merges(tmp_path: Path) -> None:
    """Merging is every day's work once caught up: it owes nothing."""
    db = tmp_path / DB_FILE
    storage = await Storage.open(db)
    gate = GrantGate(storage, HybridClock())
    await gate.caught_up()
    await gate.merging()
    assert not gate.gap_owed
    await storage.close()
    assert not (await reopened(db)).gap_owed
