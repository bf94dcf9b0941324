"""The chaos checker catches what it claims to catch: each invariant, fed a violation.

No containers here: hand-made histories and final states, so that a green chaos
run means something (a checker that cannot fail would pass any run).
"""

from __future__ import annotations

import random

import pytest

from fencemark.client import Record
from fencemark.node.workload import Event, History
from tests.chaos.checker import (
    CONVERGE_ROUNDS,
    DISK_LOSS_GRACE_S,
    Convergence,
    Verdict,
    check,
)
from tests.chaos.nemesis import KINDS, Played, cut_pairs, schedule

KEY = "repo/r/mem/t/item"
NOTES = "repo/r/mem/notes/us"
HOMES = {KEY: "us", NOTES: "us"}
REGIONS = ("us", "eu", "ap")
AGENTS = ("us-agent-0", "eu-agent-0")
# Events carry monotonic clock readings; faults, seconds since the run started.
START = 5000.0
PARTITION = Played("isolate", ("ap",), 10.0, 20.0, cut=(("ap", "us"), ("ap", "eu")))


def event(agent: str, op: str, at: float, *, token: int = 0, outcome: str = "ok",
          detail: str = "", value: str = "", took: float = 0.1, key: str = KEY,
          ) -> Event:  # fmt: skip
    return Event(agent, op, key, token, outcome, START + at, START + at + took, detail, value)


def history(*events: Event) -> History:
    made = History(started=START)
    for each in events:
        made.add(each)
    return made


def record(key: str = KEY, **fields: str) -> Record:
    return Record(key=key, repo="r", topic="t", id="item", fields=fields, home_region="us")


def finals(**fields: str) -> dict[str, dict[str, Record]]:
    return {region: {KEY: record(**fields), NOTES: record(NOTES)} for region in REGIONS}


CONVERGED = Convergence(seconds=1.0, interval=1.0, records=2)
# Probes that show every region served while the partition lasted.
SERVED = [event(f"probe-{r}", "probe-read", 12.0, key=NOTES) for r in REGIONS]


def verdicts(h: History, played: list[Played] | None = None,
             states: dict[str, dict[str, Record]] | None = None,
             convergence: Convergence | None = CONVERGED) -> dict[str, Verdict]:  # fmt: skip
    judged = check(h, played if played is not None else [PARTITION], states or finals(),
                   HOMES, convergence)  # fmt: skip
    return {v.name.split(". ")[1]: v for v in judged}


def test_a_clean_history_passes_every_invariant() -> None:
    h = history(
        event("us-agent-0", "grant", 1.0, token=1),
        event("us-agent-0", "write", 2.0, token=1, detail="p.a", value="1"),
        event("eu-agent-0", "grant", 5.0, token=2),
        *SERVED,
    )
    judged = verdicts(h, states=finals(**{"p.a": "1"}))
    assert all(v.ok for v in judged.values()), judged


def test_a_write_with_a_superseded_token_violates_fencing_safety() -> None:
    h = history(
        event("us-agent-0", "grant", 1.0, token=1),
        event("eu-agent-0", "grant", 3.0, token=2),
        event("us-agent-0", "write", 4.0, token=1, detail="p.a", value="1"),
        *SERVED,
    )
    judged = verdicts(h, states=finals(**{"p.a": "1"}))
    assert not judged["fencing safety"].ok
    assert "after token 2 was granted" in judged["fencing safety"].detail


def test_a_stalled_workers_accepted_write_violates_fencing_safety() -> None:
    h = history(event("us-agent-0", "grant", 1.0, token=1),
                event("us-agent-0", "stale-write", 9.0, token=1), *SERVED)  # fmt: skip
    assert not verdicts(h)["fencing safety"].ok


def test_tokens_granted_out_of_order_or_twice_are_caught() -> None:
    backwards = history(event("us-agent-0", "grant", 1.0, token=5),
                        event("eu-agent-0", "grant", 3.0, token=4), *SERVED)  # fmt: skip
    assert not verdicts(backwards)["tokens strictly increase"].ok
    twice = history(event("us-agent-0", "grant", 1.0, token=5),
                    event("eu-agent-0", "grant", 9.0, token=5), *SERVED)  # fmt: skip
    assert (
        "granted to us-agent-0 and eu-agent-0" in verdicts(twice)["tokens strictly increase"].detail
    )


def test_grants_across_a_wipe_of_the_home_are_counted() -> None:
    wipe = Played("wipe", ("us",), 20.0, 25.0)
    h = history(event("us-agent-0", "grant", 1.0, token=3),
                event("eu-agent-0", "grant", 30.0, token=3 + 2**20), *SERVED)  # fmt: skip
    verdict = verdicts(h, [PARTITION, wipe])["tokens strictly increase"]
    assert verdict.ok and verdict.numbers["records granted across a disk loss"] == 1
    assert verdict.numbers["records granted across a kill -9"] == 0


def test_overlapping_claims_may_complete_in_either_order() -> None:
    """Token 6's reply arrived first, but the calls overlapped: no order to break."""
    h = history(event("us-agent-0", "grant", 1.0, token=5, took=2.0),
                event("eu-agent-0", "grant", 1.5, token=6, took=0.1), *SERVED)  # fmt: skip
    assert verdicts(h)["tokens strictly increase"].ok


def test_an_acknowledged_write_missing_anywhere_is_lost() -> None:
    write = event("us-agent-0", "write", 2.0, token=1, detail="p.a", value="1")
    h = history(event("us-agent-0", "grant", 1.0, token=1), write, *SERVED)
    states = finals(**{"p.a": "1"})
    states["eu"][KEY] = record()  # eu never got it
    verdict = verdicts(h, states=states)["no acknowledged write lost"]
    assert not verdict.ok and "missing at eu" in verdict.detail


def test_a_write_lost_with_its_nodes_disk_right_after_the_ack_is_counted_not_failed() -> None:
    note = event("probe-us", "note", 30.0, detail="note.us.1", value="us:1", key=NOTES)
    wipe = Played("wipe", ("us",), 31.0, 35.0)
    states = finals()
    verdict = verdicts(history(note, *SERVED), [PARTITION, wipe], states)[
        "no acknowledged write lost"
    ]
    assert verdict.ok and verdict.numbers["lost with a disk"] == 1


def test_a_write_acknowledged_while_the_kill_was_landing_is_lost_with_the_disk() -> None:
    """The long run's case: acknowledged 30 ms after the wipe began, before the node died."""
    note = event("probe-us", "note", 30.0, detail="note.us.1", value="us:1", key=NOTES)
    wipe = Played("wipe", ("us",), 29.9, 40.0, down_at=30.3)
    verdict = verdicts(history(note, *SERVED), [PARTITION, wipe])["no acknowledged write lost"]
    assert verdict.ok and verdict.numbers["lost with a disk"] == 1
    after = event("probe-us", "note", 31.0, detail="note.us.2", value="us:2", key=NOTES)
    verdict = verdicts(history(after, *SERVED), [PARTITION, wipe])["no acknowledged write lost"]
    assert not verdict.ok  # acknowledged by the new, empty node: no excuse


def test_a_write_its_node_had_time_to_pass_on_is_not_excused_by_a_later_wipe() -> None:
    note = event("probe-us", "note", 30.0, detail="note.us.1", value="us:1", key=NOTES)
    wipe = Played("wipe", ("us",), 30.2 + DISK_LOSS_GRACE_S + 1, 50.0)
    verdict = verdicts(history(note, *SERVED), [PARTITION, wipe])["no acknowledged write lost"]
    assert not verdict.ok


def test_a_fault_on_the_node_restarts_the_grace_it_had_to_pass_a_write_on() -> None:
    """Cut off right after the ack, then wiped soon after the heal: the write may be gone."""
    note = event("probe-ap", "note", 11.0, detail="note.ap.1", value="ap:1", key=NOTES)
    wipe = Played("wipe", ("ap",), 20.0 + DISK_LOSS_GRACE_S / 2, 40.0)
    verdict = verdicts(history(note, *SERVED), [PARTITION, wipe])["no acknowledged write lost"]
    assert verdict.ok and verdict.numbers["lost with a disk"] == 1


def test_convergence_fails_when_it_never_happened_or_took_too_many_rounds() -> None:
    h = history(*SERVED)
    assert not verdicts(h, convergence=None)["convergence"].ok
    slow = Convergence(seconds=CONVERGE_ROUNDS + 1.0, interval=1.0, records=2)
    assert not verdicts(h, convergence=slow)["convergence"].ok


def test_a_region_that_stopped_serving_reads_during_a_partition_is_unavailable() -> None:
    h = history(*SERVED, event("probe-ap", "probe-read", 15.0, outcome="unknown",
                               detail="DEADLINE_EXCEEDED", key=NOTES))  # fmt: skip
    verdict = verdicts(h)["availability"]
    assert not verdict.ok and "probe-ap probe-read unknown" in verdict.detail


def test_a_home_only_call_that_hangs_during_a_partition_is_unavailable() -> None:
    hung = event("ap-agent-0", "claim", 12.0, outcome="unknown", detail="DEADLINE_EXCEEDED",
                 took=9.0)  # fmt: skip
    assert not verdicts(history(*SERVED, hung))["availability"].ok
    slow_refusal = event("probe-ap", "probe-home-only", 12.0, outcome="fail",
                         detail="wrong_region", took=3.0)  # fmt: skip
    assert not verdicts(history(*SERVED, slow_refusal))["availability"].ok
    fast = event("ap-agent-0", "claim", 12.0, outcome="unknown", detail="UNAVAILABLE", took=0.05)
    assert verdicts(history(*SERVED, fast))["availability"].ok


def test_availability_cannot_pass_without_a_network_fault_to_judge() -> None:
    assert not verdicts(history(*SERVED), played=[])["availability"].ok


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_schedule_plays_every_kind_and_replays_from_its_seed(seed: int) -> None:
    faults = schedule(random.Random(seed), REGIONS, AGENTS, 0.0, 2.0)
    assert sorted(f.kind for f in faults) == sorted(KINDS)
    assert faults == schedule(random.Random(seed), REGIONS, AGENTS, 0.0, 2.0)
    longer = schedule(random.Random(seed), REGIONS, AGENTS, 120.0, 2.0)
    assert len(longer) > len(faults)
    assert sum(f.gap + f.seconds for f in longer) >= 120.0
    for fault in longer:
        allowed = AGENTS if fault.kind == "agent-pause" else REGIONS
        assert set(fault.targets) <= set(allowed)


def test_partitions_cut_the_pairs_they_name() -> None:
    faults = schedule(random.Random(7), REGIONS, AGENTS, 0.0, 2.0)
    by_kind = {f.kind: f for f in faults}
    isolated = by_kind["isolate"].targets[0]
    assert sorted(map(sorted, cut_pairs(by_kind["isolate"]))) == sorted(
        sorted((isolated, other)) for other in REGIONS if other != isolated
    )
    bridge = by_kind["bridge"]
    assert cut_pairs(bridge) == [(bridge.targets[0], bridge.targets[1])]
    halves = by_kind["halves"]
    assert len(cut_pairs(halves)) == 2  # 3 regions: one on one side, two on the other
