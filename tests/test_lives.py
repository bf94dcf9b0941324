"""Lives of a node id: a restart is never a twin; two processes calling at once are.

Pure tests of ``fencemark.node.replication.lives`` (the peer's bookkeeping); the
cluster-level behaviour — both twins refused and stopped, the survivor deciding
again above every token the twin granted — is tests/test_twins.py.
"""

from __future__ import annotations

from fencemark.node.crdt.hlc import pack
from fencemark.node.replication.lives import MAX_LIVES, MAX_NODE_IDS, Lives

MARGIN = 500  # ms, the default max_clock_offset
T0 = 1_800_000_000_000  # a wall-clock millisecond


def at(ms: int) -> int:
    """An origin HLC sent at wall-clock ``T0 + ms``."""
    return pack(T0 + ms, 3)


def test_one_life_calling_for_ever_is_no_twin() -> None:
    lives = Lives(MARGIN)
    assert not any(lives.heard("n1", 7, at(ms), ms / 1000) for ms in range(0, 60_000, 250))
    assert lives.twinned(60.0) == [] and lives.twins_found == 0


def test_a_restart_is_no_twin_even_with_its_old_lifes_calls_arriving_late() -> None:
    """The old life's last calls are received after the new life's first (delayed
    in the network), and the new host's clock is behind the old one's by almost
    the margin: still a restart, because the old life sent nothing after the new
    one began."""
    lives = Lives(MARGIN)
    for ms in range(0, 10_000, 200):
        assert not lives.heard("n1", 1, at(ms), ms / 1000)
    # The new life starts 1 s after the old one's last call, on a clock 450 ms behind.
    assert not lives.heard("n1", 2, at(10_800 - 450), 10.9)
    assert not lives.heard("n1", 1, at(9_800), 11.0)  # a late call of the old life
    for ms in range(11_000, 30_000, 200):
        assert not lives.heard("n1", 2, at(ms - 450), ms / 1000)
    assert lives.twins_found == 0


def test_two_lives_calling_at_once_are_twins_once_they_overlap_by_the_margin() -> None:
    lives = Lives(MARGIN)
    lives.heard("n1", 1, at(0), 0.0)
    lives.heard("n2", 5, at(0), 0.0)  # another node id, calling alone
    assert not lives.heard("n1", 2, at(100), 0.1)  # began while 1 lives ...
    assert not lives.heard("n1", 1, at(500), 0.5)  # ... not yet past the margin
    assert not lives.heard("n1", 1, at(700), 0.7)  # 1 is past it, 2 not yet heard again
    assert lives.heard("n1", 2, at(700), 0.7)  # both called 600 ms after the later began
    assert lives.heard("n1", 1, at(800), 0.8)  # every call of either is refused now
    assert not lives.heard("n2", 5, at(800), 0.8)
    assert lives.twinned(0.8) == ["n1"] and lives.twins_found == 1


def test_twins_are_refused_until_one_has_been_silent_for_forget_s() -> None:
    lives = Lives(MARGIN, forget_s=30.0)
    lives.heard("n1", 1, at(0), 0.0)
    lives.heard("n1", 2, at(0), 0.0)
    lives.heard("n1", 1, at(1_000), 1.0)
    assert lives.heard("n1", 2, at(1_000), 1.0)
    # Life 1 stops (its process was stopped); life 2 keeps calling.
    assert lives.heard("n1", 2, at(20_000), 20.0)
    assert lives.heard("n1", 2, at(31_000), 31.0)  # 1 last heard 30.0 s ago: not yet
    assert not lives.heard("n1", 2, at(31_500), 31.5)
    assert lives.twinned(31.5) == []
    # Found again if life 1 was only quiet, not stopped: counted anew.
    lives.heard("n1", 1, at(32_000), 32.0)
    assert lives.heard("n1", 1, at(33_000), 33.0) or lives.heard("n1", 2, at(33_000), 33.0)
    assert lives.twins_found == 2


def test_calls_without_a_life_or_a_node_id_are_not_tracked() -> None:
    """Nodes from before lives send 0; probes and tools send no node id."""
    lives = Lives(MARGIN)
    for ms in (0, 1_000, 2_000):
        assert not lives.heard("n1", 0, at(ms), ms / 1000)
        assert not lives.heard("", 9, at(ms), ms / 1000)
        assert not lives.heard("n1", 3, at(ms), ms / 1000)
    assert lives.twins_found == 0


def test_what_is_kept_is_bounded_whatever_callers_make_up() -> None:
    """Without TLS any caller can send any node id and life: at most MAX_LIVES lives
    per node id and MAX_NODE_IDS node ids, the least recently heard forgotten."""
    lives = Lives(MARGIN)
    for n in range(MAX_NODE_IDS + 50):
        for life in range(1, MAX_LIVES + 3):
            lives.heard(f"n{n}", life, at(n), n / 1000)
    assert len(lives._lives) == MAX_NODE_IDS
    assert all(len(per) <= MAX_LIVES for per in lives._lives.values())
    assert "n0" not in lives._lives and f"n{MAX_NODE_IDS + 49}" in lives._lives


def test_a_pair_of_twins_that_both_stopped_is_over_even_if_neither_calls_again() -> None:
    """The gauge (and its alert) follows ``twinned(now)``: once both processes are
    stopped for ``forget_s``, no later call is needed to end it."""
    lives = Lives(MARGIN, forget_s=30.0)
    lives.heard("n1", 1, at(0), 0.0)
    lives.heard("n1", 2, at(0), 0.0)
    lives.heard("n1", 1, at(1_000), 1.0)
    assert lives.heard("n1", 2, at(1_000), 1.0)
    assert lives.twinned(30.0) == ["n1"]
    assert lives.twinned(31.5) == []
