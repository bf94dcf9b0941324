"""The grant gate (fencemark.node.core.grant_gate) on a real data file, without peers.

The node-level sequences (kill -9, wiped directories, stopped peers) are in
tests/test_catch_up.py, which spawns processes; these pin the gate's own rules
quickly: a new file owes a catch-up, the obligation and the recovery gap are
durable before they count, and only ``caught_up`` ends them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fencemark.node.core.grant_gate import GrantGate
from fencemark.node.crdt import FenceState, Grant, HybridClock, Record, Stamp
from fencemark.node.crdt.hlc import pack, physical_ms
from fencemark.node.rules.admission import RECOVERY_GAP, next_token, token_ceiling
from fencemark.node.rules.errors import NotDecider, NotServing
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


# -- a file that went back in time (a reverted snapshot, a lost fsync, an old copy) ----


async def written_file(db: Path) -> tuple[str, int]:
    """A file a node wrote a record into: its node id and clock high-water mark."""
    storage = await Storage.open(db)
    clock = HybridClock()
    record = Record(KEY).create("us", Stamp(0, clock.now(), storage.node_id))
    await storage.put(record, hlc=clock.last)
    node_id, high = storage.node_id, storage.hlc_high
    await storage.close()
    return node_id, high


KEY = "repo/r/mem/t/item"


async def test_a_member_that_does_not_decide_redirects_while_it_catches_up_or_settles(
    tmp_path: Path,
) -> None:
    """A restarted member, or one on a new file, that is not the decider sends a
    deciding call on to the decider at once: its own settling or catch-up concerns
    only what it decides itself. Once it decides, its own state speaks first."""

    def redirects_first(gate: GrantGate, its_own_state: str) -> None:
        role = gate.role = Elected()
        with pytest.raises(NotDecider):
            gate.check()
        role.now = 3
        with pytest.raises(NotServing, match=its_own_state):
            gate.check()

    storage = await Storage.open(tmp_path / DB_FILE)
    gate = GrantGate(storage, HybridClock(), region="us")
    assert gate.owed
    redirects_first(gate, "catching up")
    await storage.close()
    settling, gate = await restarted(tmp_path / "restarted" / DB_FILE)
    assert gate.starting
    redirects_first(gate, "just started")
    await settling.close()


async def restarted(
    db: Path, monotonic: Callable[[], float] = time.monotonic
) -> tuple[Storage, GrantGate]:
    """A file written and caught up in its first life, opened again (left open): a
    restart's storage and gate."""
    _, high = await written_file(db)
    storage = await Storage.open(db)
    await GrantGate(storage, HybridClock(last=high)).caught_up()
    await storage.close()
    storage = await Storage.open(db)
    return storage, GrantGate(storage, HybridClock(last=high), region="us", monotonic=monotonic)


async def test_a_brand_new_file_has_no_earlier_life_to_wait_for(tmp_path: Path) -> None:
    """Tokens of a brand-new file start at 1 and it owes its catch-up, not a
    restart's wait; a file that holds writes starts a new era of tokens and waits
    for its peers (bounded: ``waited``), without owing anything durably."""
    db = tmp_path / DB_FILE
    storage = await Storage.open(db)
    new = GrantGate(storage, HybridClock(), region="us")
    assert (new.life_hlc, new.starting) == (0, False)
    await storage.close()
    _, high = await written_file(db)
    storage = await Storage.open(db)
    clock = HybridClock(last=high)
    gate = GrantGate(storage, clock, region="us")
    await gate.caught_up()  # the new file's catch-up, done
    await storage.close()

    storage = await Storage.open(db)
    gate = GrantGate(storage, HybridClock(last=storage.hlc_high), region="us")
    assert gate.life_hlc > gate.opened_hlc == storage.hlc_high > 0
    assert gate.starting and not gate.owed
    with pytest.raises(NotServing, match="just started"):
        gate.check()
    assert gate.waited()
    gate.check()  # deciding now
    assert not gate.waited(), "once"
    await storage.close()
    storage = await Storage.open(db)
    gate = GrantGate(storage, HybridClock(last=storage.hlc_high), region="us")
    await gate.caught_up()  # a round with every peer ends the wait as well
    assert gate.deciding and not gate.waited() and gate.recovered_hlc == 0
    await storage.close()


async def test_a_state_holding_writes_the_file_forgot_is_seen_as_a_rollback(
    tmp_path: Path,
) -> None:
    """``forgets``: a stamp of this node's own, or a grant of its region, after what
    the file remembers and before this life began. Nothing else: another node's
    stamps, this life's own, what the file remembers, another region's grants."""
    storage, gate = await restarted(tmp_path / DB_FILE)
    node_id, high = storage.node_id, gate.opened_hlc
    lost, life = high + 1, gate.life_hlc

    def stamped(node: str, hlc: int) -> Record:
        return Record(KEY).create("us", Stamp(0, hlc, node))

    def granted(region: str, hlc: int) -> Record:
        fence = FenceState().grant(3, Grant(hlc, "w", region), 10**13)
        return stamped("other", high).with_fence(fence)

    assert gate.forgets(stamped(node_id, lost))
    assert gate.forgets(stamped(node_id, life - 1))
    assert not gate.forgets(stamped(node_id, high)), "what the file remembers"
    assert not gate.forgets(stamped(node_id, life)), "this life's own"
    assert not gate.forgets(stamped("other", lost)), "another node's"
    assert gate.forgets(granted("us", lost))
    assert not gate.forgets(granted("eu", lost)), "another region's grant"
    assert not gate.forgets(granted("us", life))
    # At a member of a region of several, the region's other members grant too: only
    # this node's own stamps prove its file lost writes (its grants carry one).
    gate.role = Elected()
    assert not gate.forgets(granted("us", lost)), "another member's grant"
    assert gate.forgets(stamped(node_id, lost))
    await storage.close()


async def deciding_restart(db: Path) -> tuple[Storage, GrantGate, list[str]]:
    """A restart's gate once it decides (its bounded wait over), and the list its
    ``on_owed`` listener notes "owed" in."""
    storage, gate = await restarted(db)
    gate.waited()
    heard: list[str] = []
    gate.on_owed(lambda: heard.append("owed"))
    return storage, gate, heard


async def test_a_rollback_owes_a_catch_up_and_the_gap_durably(tmp_path: Path) -> None:
    """``rolled_back``: the node stops deciding, owes a complete pass with every peer
    and the recovery gap — across restarts — and tells whoever follows the gate."""
    db = tmp_path / DB_FILE
    storage, gate, heard = await deciding_restart(db)
    high = gate.opened_hlc
    await gate.rolled_back()
    assert (gate.owed, gate.gap_owed, gate.deciding, gate.rollbacks) == (True, True, False, 1)
    assert heard == ["owed"]
    assert not gate.forgets(Record(KEY).create("us", Stamp(0, high + 1, storage.node_id)))
    await gate.rolled_back()  # more proof changes nothing but the count
    assert (gate.rollbacks, heard) == (2, ["owed"])
    # Caught up again (with the gap): proofs that arrive later are only counted, or
    # each would stop the node deciding anew (a chaos run found the node not deciding
    # for 11 s after its catch-up, through a network fault).
    await gate.caught_up()
    assert gate.deciding and gate.recovered_hlc > gate.life_hlc
    await gate.rolled_back()
    assert (gate.deciding, gate.rollbacks, heard) == (True, 3, ["owed"])
    await storage.close()
    again = await reopened(db)
    assert not again.owed and again.recovered_hlc == gate.recovered_hlc  # nothing owed


async def test_a_twin_refusal_owes_a_catch_up_and_the_gap_durably_each_time(
    tmp_path: Path,
) -> None:
    """``twinned`` (a peer refused this node: another live process has its node id):
    the node stops deciding and owes a complete pass and the recovery gap across
    restarts; while owed a refusal is only counted; once caught up, a refusal that
    comes again stops it again — unlike a rollback's late proofs, a twin that still
    runs would decide beside it (docs/replication.md, *Twins*)."""
    db = tmp_path / DB_FILE
    storage, gate, heard = await deciding_restart(db)
    await gate.twinned()
    assert (gate.owed, gate.gap_owed, gate.deciding, gate.twins) == (True, True, False, 1)
    assert heard == ["owed"]
    await gate.twinned()  # refused again while owed: counted only
    assert (gate.twins, heard) == (2, ["owed"])
    await storage.close()
    again = await reopened(db)
    assert again.owed and again.gap_owed and not again.deciding  # across a restart
    storage = await Storage.open(db)
    gate = GrantGate(storage, HybridClock(), region="us")
    gate.on_owed(lambda: heard.append("owed again"))
    await gate.caught_up()
    assert gate.deciding and gate.recovered_hlc > gate.life_hlc
    await gate.twinned()
    assert (gate.deciding, gate.owed, gate.twins) == (False, True, 1)
    assert heard == ["owed", "owed again"]
    await storage.close()


# -- a member of a region of several (SPEC §10) ---------------------------------------


class Elected:
    """A member's part in its region's election as the gate sees it (``Role``): the
    etcd-backed one is ``coordination.member.Member``, run against a real etcd in
    tests/test_members.py; here the gate's own rules, with the term set by hand."""

    def __init__(self) -> None:
        self.now = 0  # the term this member decides in; 0: it does not

    def term(self) -> int:
        return self.now

    def check(self) -> None:
        if not self.now:
            raise NotDecider("us", "us-b", "127.0.0.1:7401", 7)


async def test_a_member_decides_only_in_its_term_and_acknowledges_only_in_the_same_one(
    tmp_path: Path,
) -> None:
    """A member that is not the decider refuses with a redirect, whatever else the gate
    says; a decision made in one term is not acknowledged once the member no longer
    decides in it, however briefly it stopped (SPEC §10: a decision under way when
    the decider stops is not acknowledged)."""
    storage = await Storage.open(tmp_path / DB_FILE)
    gate = GrantGate(storage, HybridClock(), region="us")
    await gate.caught_up()
    role = Elected()
    gate.role = role
    assert not gate.deciding
    with pytest.raises(NotDecider) as refused:
        gate.check()
    assert (refused.value.decider, refused.value.address, refused.value.term) == (
        "us-b", "127.0.0.1:7401", 7,
    )  # fmt: skip
    role.now = 1  # etcd's first revision: a term like any other
    assert deciding(gate)
    role.now = 8
    gate.new_term(8, max_clock_offset_ms=500)
    assert deciding(gate) and gate.term == 8
    gate.check()
    mark = gate.mark()
    gate.awake(mark)  # still deciding in term 8
    role.now = 0
    with pytest.raises(NotServing, match="stopped deciding"):
        gate.awake(mark)
    role.now = 9  # back, in a later term: still not the term the decision was made in
    with pytest.raises(NotServing, match="stopped deciding"):
        gate.awake(mark)
    await storage.close()


async def test_each_term_starts_an_era_of_tokens_above_every_earlier_terms(
    tmp_path: Path,
) -> None:
    """The first grant of a term on a record jumps to the ceiling of the term's floor:
    above every token a decider of an earlier term can have granted, seen here or
    not — it stopped before this term began, with a clock and an HLC at most
    ``max_clock_offset_ms`` ahead each, and, if it had recovered from a lost disk,
    granted at most a recovery gap above its ceiling (``term_floor``)."""
    wall = 1_800_000_000_000  # this member's clock, standing still: the floor to the ms
    storage = await Storage.open(tmp_path / DB_FILE)
    clock = HybridClock(wall_ms=lambda: wall)
    gate = GrantGate(storage, clock, region="us")
    await gate.caught_up()
    assert (gate.term, gate.term_hlc, gate.era_hlc) == (0, 0, 0)  # no member: no term floor
    offset = 500
    gate.new_term(3, max_clock_offset_ms=offset)
    # Twice the offset, and a recovery's gap (2**20 tokens: 1,024 ms of ceiling) and 1 ms.
    assert physical_ms(gate.term_hlc) == wall + 2 * offset + 1_025
    assert gate.era_hlc == gate.term_hlc  # a brand-new file: no life floor of its own
    # The worst earlier decider: its HLC 2 offsets ahead of this member's clock, one
    # millisecond before this term began, and 2**10 - 1 grants of the record since its
    # own era began (fewer than 2**10 a millisecond).
    earlier = token_ceiling(pack(wall + 2 * offset - 1)) + 2**10 - 1
    held = FenceState().grant(earlier, Grant(1, "worker-a", "us"), 10**13)
    token = next_token(held, life_hlc=gate.era_hlc, region="us")
    assert token > earlier
    assert token >= token_ceiling(gate.term_hlc)
    # ... or one that had recovered from a lost disk since the holder before it was
    # granted: the recovery's gap above that holder's token, the most it can grant.
    recovered = next_token(held, recovered_hlc=2, life_hlc=1, region="us")
    assert recovered == earlier + 1 + RECOVERY_GAP
    assert token > recovered
    # A later term's floor is above this one's; an earlier term's never lowers it.
    floor = gate.term_hlc
    gate.new_term(4, max_clock_offset_ms=offset)
    assert gate.term_hlc >= floor
    await storage.close()


# -- a process that stood still (a nap), and the settle's retry hint ------------------


class Monotonic:
    """A gate's monotonic clock, set by hand: a nap is a gap between two ticks."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def deciding(gate: GrantGate) -> bool:
    return gate.deciding


async def test_a_gap_between_ticks_above_nap_s_is_a_nap_and_the_node_settles_again(
    tmp_path: Path,
) -> None:
    """A deciding node whose loop stood still longer than ``nap_s`` stops deciding
    (``starting``, ``napped``), tells its listeners, refuses replication calls for
    ``quiet_s`` and refuses claims as having stood still; a decision made before the
    nap is not acknowledged after it. A gap of exactly ``nap_s`` is no nap, and a
    gate that does not tick (no peers) never naps."""
    clock = Monotonic()
    storage = await Storage.open(tmp_path / DB_FILE)
    gate = GrantGate(storage, HybridClock(), region="us", monotonic=clock)
    await gate.caught_up()
    heard: list[str] = []
    gate.on_nap(lambda: heard.append("nap"))
    clock.now += 60
    gate.tick()  # not ticking yet: no peer could tell it from a twin
    assert gate.naps == 0 and deciding(gate)
    gate.start_ticking(nap_s=0.5, quiet_s=1.0)
    clock.now += 0.5
    gate.tick()  # exactly nap_s: no nap
    assert gate.naps == 0 and deciding(gate) and not gate.quiet()
    mark = gate.mark()
    clock.now += 0.75
    gate.tick()
    assert (gate.naps, gate.woke_at, heard) == (1, clock.now, ["nap"])
    assert gate.starting and gate.napped and gate.settled_at == 0.0 and not deciding(gate)
    with pytest.raises(NotServing, match="stood still while it decided"):
        gate.awake(mark)
    with pytest.raises(NotServing, match="stood still") as refused:
        gate.check()
    assert refused.value.retry_after_ms == 0  # when the settle ends is not known yet
    for step in (0.1, 0.4, 0.4):  # ticks closer than nap_s: no new nap
        clock.now += step
        assert gate.quiet()
    clock.now += 0.1  # quiet_s after the nap was found: replication calls served again
    assert not gate.quiet() and gate.naps == 1
    assert gate.waited()  # the bounded wait ended
    assert (gate.napped, deciding(gate)) == (False, True)
    await storage.close()


async def test_a_nap_while_owing_a_catch_up_tells_the_listeners_only_if_a_copy_could_run(
    tmp_path: Path,
) -> None:
    """A brand-new file owing its catch-up drew its node id: no copy of it can run, so
    a nap changes nothing. One restored or restarted before its catch-up ended may be
    a copy: the replicator settles again (the listeners), the obligation stays."""
    clock = Monotonic()
    storage = await Storage.open(tmp_path / DB_FILE)
    fresh = GrantGate(storage, HybridClock(), region="us", monotonic=clock)
    assert fresh.owed and fresh.fresh
    heard: list[str] = []
    fresh.on_nap(lambda: heard.append("fresh"))
    fresh.start_ticking(nap_s=0.5, quiet_s=1.0)
    clock.now += 2
    fresh.tick()
    assert fresh.naps == 1 and heard == [] and not fresh.starting and fresh.owed
    fresh.fresh = False  # as a file restored, or restarted before its catch-up ended
    fresh.on_nap(lambda: heard.append("copy"))
    clock.now += 2
    fresh.tick()
    assert fresh.naps == 2 and heard == ["fresh", "copy"]
    assert fresh.owed and not fresh.starting, "still owes the catch-up, nothing more"
    await storage.close()


async def test_a_settling_restart_says_when_to_ask_again(
    tmp_path: Path,
) -> None:
    """While a restart settles, a refused claim carries the wait in milliseconds, 50 ms
    beyond the settle's end once it is known (gRPC's pushback, ``RetryInfo``); none
    before it is known or once it has passed."""
    clock = Monotonic()
    storage, gate = await restarted(tmp_path / DB_FILE, monotonic=clock)
    assert gate.starting and not gate.napped
    with pytest.raises(NotServing, match="just started") as refused:
        gate.check()
    assert refused.value.retry_after_ms == 0
    gate.settled_at = clock.now + 2.5
    with pytest.raises(NotServing) as refused:
        gate.check()
    assert refused.value.retry_after_ms == 2_550
    clock.now += 2.5
    with pytest.raises(NotServing) as refused:
        gate.check()  # ended, and no round yet: still settling, no wait to name
    assert refused.value.retry_after_ms == 0
    await storage.close()


async def test_before_anything_is_known_nothing_is_quiet_and_no_wait_is_named(
    tmp_path: Path,
) -> None:
    """On a monotonic clock that has just started (a host just booted): a restart
    whose settle's end is not known names no wait, and a gate that never napped is
    not quiet — the defaults say "unknown" and "never", not a moment of their own."""
    clock = Monotonic(now=0.25)
    storage, gate = await restarted(tmp_path / DB_FILE, monotonic=clock)
    with pytest.raises(NotServing) as refused:
        gate.check()
    assert refused.value.retry_after_ms == 0
    gate.start_ticking(nap_s=0.5, quiet_s=5.0)
    clock.now = 0.5
    assert not gate.quiet() and gate.naps == 0
    gate.settled_at = clock.now + 0.5  # less than a second left: still named
    with pytest.raises(NotServing) as refused:
        gate.check()
    assert refused.value.retry_after_ms == 550
    await storage.close()
