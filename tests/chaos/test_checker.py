"""The chaos checker catches what it claims to catch: each invariant, fed a violation.

No containers here: hand-made histories and final states, so that a green chaos
run means something (a checker that cannot fail would pass any run).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from fencemark.client import Record
from fencemark.node.tools.workload import Event, History
from tests.chaos.checker import (
    CONVERGE_ROUNDS,
    DISK_LOSS_GRACE_S,
    START_WAIT_S,
    TWIN_BOUND_S,
    WRONG_REGION_FAST_S,
    Convergence,
    Verdict,
    check,
)
from tests.chaos.claim_invariants import leases_recorded
from tests.chaos.claims import Ending
from tests.chaos.forger import KEPT, RULES, Pushed
from tests.chaos.nemesis import KINDS, Played, cut_pairs, schedule
from tests.chaos.queue_work import QUEUE_TOPIC
from tests.chaos.shapes import SPLIT_TOPIC

KEY = "repo/r/mem/t/item"
NOTES = "repo/r/mem/notes/us"
SPLIT = f"repo/r/mem/{SPLIT_TOPIC}/split-000-0"
QUEUED = f"repo/r/mem/{QUEUE_TOPIC}/q-us-00000"  # a work-queue item
POISONED = f"repo/r/mem/{QUEUE_TOPIC}/poison-us"  # and a poison one (maxAttempts:2)
HOMES = {KEY: "us", NOTES: "us", QUEUED: "us", POISONED: "us"}
REGIONS = ("us", "eu", "ap")
AGENTS = ("us-agent-0", "eu-agent-0")
# Events carry monotonic clock readings; faults, seconds since the run started.
START = 5000.0
PARTITION = Played("isolate", ("ap",), 10.0, 20.0, cut=(("ap", "us"), ("ap", "eu")))
# ap lost its disk and was restarted twice before catching up, cut off from us until 48 s.
CATCH_UP = Played("wipe-restart", ("ap", "us"), 40.0, 50.0, cut=(("ap", "us"),), down_at=40.2,
                  cut_healed=48.0)  # fmt: skip
# A hostile peer posing as eu pushed every forgery of a us record; us merged none and
# refused each by its rule.
# (A kept one, forger.KEPT, us merged as evidence and reported by its rule, its home kept.)
REFUSED = tuple(
    Pushed(forgery, rule, KEY, int(forgery in KEPT), rule) for forgery, rule in RULES.items()
)
FORGE = Played("forge", ("us", "eu"), 55.0, 56.0, forged=REFUSED)
# ap frozen from 57.1 s, woken at 61 s, saying it was settling when asked at 64 s.
PAUSE = Played("pause", ("ap",), 57.0, 61.0, down_at=57.1, settling_until=64.0)


def event(agent: str, op: str, at: float, *, token: int = 0, outcome: str = "ok",
          detail: str = "", value: str = "", took: float = 0.1, key: str = KEY,
          expires: float = 0.0) -> Event:  # fmt: skip
    """An event ``at`` seconds into the run; ``expires``: a lease's end, run clock too."""
    return Event(agent, op, key, token, outcome, START + at, START + at + took, detail, value,
                 START + expires if expires else 0.0)  # fmt: skip


def history(*events: Event) -> History:
    made = History(started=START)
    for each in events:
        made.add(each)
    return made


def record(key: str = KEY, home: str = "us", **fields: str) -> Record:
    return Record(key=key, repo="r", topic="t", id="item", fields=fields, home_region=home,
                  tags=(f"homeRegion:{home}",))  # fmt: skip


def finals(**fields: str) -> dict[str, dict[str, Record]]:
    """KEY with ``fields`` and NOTES, and the work queue as WORKED leaves it."""
    return {
        region: {KEY: record(**fields), NOTES: record(NOTES), **queue_states()}
        for region in REGIONS
    }


DONE_BY = "done by us-queue-0@1"


def queue_states(**changed: Record) -> dict[str, Record]:
    """The work queue's final states after WORKED (QUEUED, POISONED), but ``changed``."""
    states = {
        QUEUED: replace(record(QUEUED, result=DONE_BY), status="done", attempts=1,
                        last_outcome="done"),
        POISONED: replace(record(POISONED), last_outcome="failed",
                          tags=("homeRegion:us", "poison", "maxAttempts:2")),
    }  # fmt: skip
    return {**states, **changed}


def every(states: dict[str, dict[str, Record]], key: str, made: Record) -> None:
    """``key`` is ``made`` in every region's final state."""
    for records in states.values():
        records[key] = made


CONVERGED = Convergence(seconds=1.0, interval=1.0, records=2)
# Probes that show every region served while the partition lasted.
SERVED = [event(f"probe-{r}", "probe-read", 12.0, key=NOTES) for r in REGIONS]
# The work queue at its home, us, after the partition: QUEUED picked, worked and
# released done; POISONED failed twice (parked), then reopened by the operator.
WORKED = [
    event("us-queue-0", "claim-next", 25.0, key="", detail="granted"),
    event("us-queue-0", "grant", 25.0, token=1, key=QUEUED, detail="us", expires=27.0),
    event("us-queue-0", "done", 25.5, token=1, key=QUEUED, detail="result", value=DONE_BY),
    event("us-queue-1", "grant", 26.0, token=1, key=POISONED, detail="us", expires=28.0),
    event("us-queue-1", "fail", 26.1, token=1, key=POISONED, value="failed"),
    event("us-queue-1", "grant", 26.5, token=2, key=POISONED, detail="us", expires=28.5),
    event("us-queue-1", "fail", 26.6, token=2, key=POISONED, value="failed"),
    event("operator", "reopen", 28.0, key=POISONED, value="parked"),
]


def verdicts(h: History, played: list[Played] | None = None,
             states: dict[str, dict[str, Record]] | None = None,
             convergence: Convergence | None = CONVERGED) -> dict[str, Verdict]:  # fmt: skip
    judged = check(h, played if played is not None else [PARTITION, CATCH_UP, FORGE, PAUSE],
                   states or finals(), HOMES, convergence)  # fmt: skip
    return {v.name.split(". ")[1]: v for v in judged}


def test_a_clean_history_passes_every_invariant() -> None:
    h = history(
        event("us-agent-0", "grant", 1.0, token=1),
        event("us-agent-0", "write", 2.0, token=1, detail="p.a", value="1"),
        event("eu-agent-0", "grant", 5.0, token=2),
        *SERVED,
        *WORKED,
    )
    judged = verdicts(h, states=finals(**{"p.a": "1"}))
    assert all(v.ok for v in judged.values()), judged
    assert len(judged) == 12


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


# eu-agent-0 stalled after its grant of KEY (token 1) at 30.5 s, from 30 s; us-agent-0
# was granted token 2 once the lease had lapsed; eu-agent-0 woke at 34 s and wrote and
# renewed with token 1. Its second pause, from 40 s, stalled on token 3.
AGENT_PAUSE = Played("agent-pause", ("eu-agent-0",), 30.0, 35.0)
AGAIN = Played("agent-pause", ("eu-agent-0",), 40.0, 45.0)
PLAYED = [PARTITION, CATCH_UP, FORGE, PAUSE, AGENT_PAUSE]


def woke(outcome: str, refused: str = "", renewal: str = "superseded", *, at: float = 30.0,
         token: int = 1) -> list[Event]:  # fmt: skip
    """A stalled worker's wake ``at`` + 4 s: its write with its old ``token`` answered
    ``outcome`` (``refused``: why), its renewal refused ``renewal``."""
    return [
        event("eu-agent-0", "grant", at + 0.5, token=token, detail="us", expires=at + 2.5),
        event("us-agent-0", "grant", at + 3.0, token=token + 1, detail="us", expires=at + 5.0),
        event("eu-agent-0", "stale-write", at + 4.0, token=token, outcome=outcome,
              detail=refused, value="late"),
        event("eu-agent-0", "stale-renew", at + 4.2, token=token, outcome="fail",
              detail=renewal),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("outcome", "refused"),
    [("fail", "missing"), ("fail", "NotFound"), ("fail", "contended"), ("ok", "")],
)
def test_a_woken_stalled_worker_not_refused_superseded_or_expired_violates_fencing(
    outcome: str, refused: str
) -> None:
    """Refused for another reason (its record gone, with nothing that deleted it), or
    accepted: the fence did not turn it away as docs/chaos.md promises."""
    verdict = verdicts(history(*woke(outcome, refused), *SERVED), PLAYED)["fencing safety"]
    assert not verdict.ok, verdict
    assert verdict.numbers["agent pauses fenced"] == 0
    if refused:
        assert f"refused {refused!r}, not superseded or expired" in verdict.detail


def test_a_woken_stalled_workers_renewal_refused_otherwise_violates_fencing() -> None:
    """Its write refused as promised, its renewal with the same token refused
    ``contended``: not what the fence answers a lapsed token."""
    renewed = woke("fail", "superseded", "contended")
    verdict = verdicts(history(*renewed, *SERVED), PLAYED)["fencing safety"]
    assert not verdict.ok and "renew of" in verdict.detail, verdict
    assert verdict.numbers["agent pauses fenced"] == 0


@pytest.mark.parametrize("refused", ["superseded", "expired"])
def test_a_woken_stalled_worker_refused_superseded_or_expired_passes(refused: str) -> None:
    verdict = verdicts(history(*woke("fail", refused), *SERVED), PLAYED)["fencing safety"]
    assert verdict.ok, verdict
    assert verdict.numbers["agent pauses fenced"] == 1
    assert verdict.numbers["agent pauses that did not test fencing"] == 0
    assert f"refused as promised ({refused} 1)" in verdict.detail


def test_an_agent_pause_that_did_not_test_fencing_is_counted_apart_and_never_a_pass() -> None:
    """Its item deleted by a delete already on its way (refused ``missing``, which tests
    no fence), its write's outcome unknown, or no wake at all: counted apart. A run
    whose every agent pause is such passes nothing on it."""
    deleted = event("meddler-ap", "meddle-delete", 30.4)
    gone = [deleted, *woke("fail", "NotFound", "missing")]
    lost = woke("unknown", "DEADLINE_EXCEEDED")
    for untested, played in [(gone, PLAYED), (lost, PLAYED), ([], PLAYED)]:
        verdict = verdicts(history(*untested, *SERVED), played)["fencing safety"]
        assert not verdict.ok and "no agent pause tested fencing" in verdict.detail, verdict
        assert verdict.numbers["agent pauses that did not test fencing"] == 1
        assert verdict.numbers["agent pauses fenced"] == 0
    # Beside a pause that did test it: the run passes, and says one did not.
    fenced = woke("fail", "superseded", at=40.0, token=3)
    verdict = verdicts(history(*gone, *fenced, *SERVED), [*PLAYED, AGAIN])["fencing safety"]
    assert verdict.ok, verdict
    assert verdict.numbers["agent pauses"] == 2
    assert verdict.numbers["agent pauses fenced"] == 1
    assert verdict.numbers["agent pauses that did not test fencing"] == 1
    assert "eu-agent-0: its item was deleted by meddler-ap at 30.4 s" in verdict.detail
    # A refusal of a record nothing deleted is no excuse, beside a good pause or not.
    missing = woke("fail", "NotFound", "missing")
    judged = verdicts(history(*missing, *fenced, *SERVED), [*PLAYED, AGAIN])["fencing safety"]
    assert not judged.ok and "refused 'NotFound'" in judged.detail


def test_tokens_granted_out_of_order_are_caught() -> None:
    backwards = history(event("us-agent-0", "grant", 1.0, token=5),
                        event("eu-agent-0", "grant", 3.0, token=4), *SERVED)  # fmt: skip
    assert not verdicts(backwards)["tokens strictly increase"].ok


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
    note = event("probe-us", "note", 2.0, detail="note.us.1", value="us:1", key=NOTES)
    states = finals()
    states["us"][NOTES] = record(NOTES, **{"note.us.1": "us:1"})  # eu and ap never got it
    verdict = verdicts(history(note, *SERVED), states=states)["no acknowledged write lost"]
    assert not verdict.ok and "missing at eu,ap" in verdict.detail


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


def test_a_write_with_time_to_pass_it_on_before_a_fault_is_not_excused_by_a_later_wipe() -> None:
    """Healthy from 1 s until the partition at 10 s: long enough, whatever came after."""
    note = event("probe-ap", "note", 1.0, detail="note.ap.1", value="ap:1", key=NOTES)
    wipe = Played("wipe", ("ap",), 20.0 + DISK_LOSS_GRACE_S / 2, 40.0)
    verdict = verdicts(history(note, *SERVED), [PARTITION, wipe])["no acknowledged write lost"]
    assert not verdict.ok


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


def test_a_node_that_lost_its_disk_may_refuse_home_only_calls_not_serving() -> None:
    """Wiped until 8 s, then cut off by the partition at 10 s before it caught up: it
    decides nothing and does not hold the probe's record homed elsewhere, so it
    answers NOT_SERVING for it for up to its --start-wait after it runs again."""
    wipe = Played("wipe", ("ap",), 4.0, 8.0)
    settling = event("probe-ap", "probe-home-only", 12.0, outcome="unknown",
                     detail="UNAVAILABLE", took=0.01)  # fmt: skip
    verdict = verdicts(history(*SERVED, settling), [PARTITION, wipe])["availability"]
    assert verdict.ok and verdict.numbers["refused while settling"] == 1
    # Past the wait, or at another node, it is a home-only call not redirected.
    late = Played("wipe", ("ap",), 0.5, 12.0 - START_WAIT_S - 2.0)
    assert not verdicts(history(*SERVED, settling), [PARTITION, late])["availability"].ok
    other = Played("wipe", ("us",), 4.0, 8.0)
    assert not verdicts(history(*SERVED, settling), [PARTITION, other])["availability"].ok
    hung = event("probe-ap", "probe-home-only", 12.0, outcome="unknown", detail="UNAVAILABLE",
                 took=WRONG_REGION_FAST_S + 1)  # fmt: skip
    assert not verdicts(history(*SERVED, hung), [PARTITION, wipe])["availability"].ok


def test_a_node_settling_after_its_own_pause_still_names_the_home() -> None:
    """A paused (or killed, or rolled-back) node settles before it decides, but it
    holds the probe's record homed elsewhere, created before any fault: it answers
    ``wrong_region`` at once (docs/api.md). NOT_SERVING there is a lost redirect
    (seed 3200137469 saw one: a bridge 3 s after ap's pause, before the gate came
    after the home)."""
    pause = Played("pause", ("ap",), 4.0, 8.0)
    settling = event("probe-ap", "probe-home-only", 12.0, outcome="unknown",
                     detail="UNAVAILABLE", took=0.01)  # fmt: skip
    assert not verdicts(history(*SERVED, settling), [PARTITION, pause])["availability"].ok


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


# -- 6. one home per record -------------------------------------------------------------


def split_birth(*regions: str, at: float = 12.0) -> list[Event]:
    """SPLIT created at each of ``regions`` during PARTITION, and the births meeting."""
    born = [event(f"split-000-0-{r}", "create", at, key=SPLIT, detail=r, value="created")
            for r in regions]  # fmt: skip
    met = event("split-000-0", "split-met", 20.0, took=1.5, key=SPLIT, detail=regions[-1])
    return [*born, met]


def test_a_record_whose_replicas_name_different_homes_violates_one_home() -> None:
    """The hole: an id created on both sides of a split, each side keeping its own home."""
    states = finals()
    every(states, SPLIT, record(SPLIT, home="us"))
    states["ap"][SPLIT] = record(SPLIT, home="ap")
    verdict = verdicts(history(*split_birth("us", "ap"), *SERVED), states=states)
    assert not verdict["one home per record"].ok
    assert "different homes (us: us, eu: us, ap: ap)" in verdict["one home per record"].detail


def test_a_record_naming_two_homes_or_one_that_never_created_it_violates_one_home() -> None:
    states = finals()
    two = Record(key=SPLIT, repo="r", topic="split", id="split-000-0", home_region="us",
                 tags=("homeRegion:ap", "homeRegion:us"))  # fmt: skip
    every(states, SPLIT, two)
    assert not verdicts(history(*split_birth("us", "ap"), *SERVED), states=states)[
        "one home per record"
    ].ok
    every(states, SPLIT, record(SPLIT, home="eu"))  # eu never created it
    verdict = verdicts(history(*split_birth("us", "ap"), *SERVED), states=states)
    assert "created at ap,us but is homed at eu" in verdict["one home per record"].detail


def test_an_id_born_on_both_sides_with_one_home_everywhere_passes() -> None:
    states = finals()
    every(states, SPLIT, record(SPLIT, home="ap"))
    verdict = verdicts(history(*split_birth("us", "ap"), *SERVED), states=states)
    assert verdict["one home per record"].ok
    assert verdict["one home per record"].numbers["born on both sides"] == 1


# -- 7. one live claim at a time -----------------------------------------------------------


def test_a_claim_granted_while_another_is_live_violates_one_live_claim() -> None:
    """us-agent-0's lease runs to 5 s (renewed); eu-agent-0 is granted at 3 s."""
    h = history(
        event("us-agent-0", "grant", 1.0, token=1, expires=3.0),
        event("us-agent-0", "renew", 2.0, token=1, expires=5.0),
        event("eu-agent-0", "grant", 3.0, token=2, expires=5.0),
        *SERVED,
    )
    verdict = verdicts(h)["one live claim at a time"]
    assert not verdict.ok
    assert "us-agent-0 (token 1, from us) and eu-agent-0 (token 2, from us)" in verdict.detail
    assert "live from 3.10 s to 5.00 s" in verdict.detail


def test_a_claim_ends_at_its_lease_its_release_or_its_first_refusal() -> None:
    lapsed = history(event("us-agent-0", "grant", 1.0, token=1, expires=3.0),
                     event("eu-agent-0", "grant", 3.0, token=2, expires=5.0), *SERVED)  # fmt: skip
    assert verdicts(lapsed)["one live claim at a time"].ok
    released = history(
        event("us-agent-0", "grant", 1.0, token=1, expires=9.0),
        event("us-agent-0", "release", 2.0, token=1, took=2.0),  # its reply came late
        event("eu-agent-0", "grant", 2.5, token=2, expires=5.0),
        *SERVED,
    )
    assert verdicts(released)["one live claim at a time"].ok
    refused = history(
        event("us-agent-0", "grant", 1.0, token=1, expires=9.0),
        event("us-agent-0", "write", 2.0, token=1, outcome="fail", detail="superseded"),
        event("eu-agent-0", "grant", 2.5, token=2, expires=5.0),
        *SERVED,
    )
    assert verdicts(refused)["one live claim at a time"].ok


def split_claims(renewed_after_meeting: bool = False) -> list[Event]:
    """SPLIT claimed on both sides during PARTITION; the births meet at 21.5 s."""
    events = [
        *split_birth("us", "ap"),
        event("split-000-0-us", "grant", 12.5, token=1, key=SPLIT, detail="us", expires=14.6),
        event("split-000-0-ap", "grant", 12.5, token=1, key=SPLIT, detail="ap", expires=14.6),
        event("split-000-0-us", "renew", 14.0, token=1, key=SPLIT, expires=22.0),
        event("split-000-0-ap", "renew", 14.0, token=1, key=SPLIT, expires=22.0),
        event("split-000-0-ap", "write", 21.8, token=1, key=SPLIT, outcome="fail",
              detail="wrong_region"),
        event("split-000-0-after", "grant", 22.5, token=3, key=SPLIT, detail="ap", expires=24.6),
    ]  # fmt: skip
    if renewed_after_meeting:  # us's node kept the split-time claim: renewed, never refused
        events.append(event("split-000-0-us", "renew", 21.6, token=1, key=SPLIT, expires=23.7))
    else:
        events.append(event("split-000-0-us", "write", 21.8, token=1, key=SPLIT, outcome="fail",
                            detail="superseded"))  # fmt: skip
    return events


def test_claims_granted_on_both_sides_of_a_split_may_overlap_until_the_births_meet() -> None:
    states = finals()
    every(states, SPLIT, record(SPLIT, home="ap"))
    verdict = verdicts(history(*split_claims(), *SERVED, *WORKED), states=states)
    assert all(v.ok for v in verdict.values()), verdict
    assert verdict["one live claim at a time"].numbers["split overlaps before meeting"] == 1


def test_a_split_time_claim_renewed_after_the_births_met_violates_fencing_and_one_claim() -> None:
    states = finals()
    every(states, SPLIT, record(SPLIT, home="ap"))
    verdict = verdicts(history(*split_claims(renewed_after_meeting=True), *SERVED), states=states)
    assert "after the births met" in verdict["fencing safety"].detail
    # Its holder still believed it live when the post-heal claim was granted.
    assert "split-000-0-us (token 1, from us) and split-000-0-after" in (
        verdict["one live claim at a time"].detail
    )


def bridged_split(*, moved_first: bool, ap_grants: bool = True) -> list[Event]:
    """A bridge: the births met at us through eu before the heal. ap granted token 4,
    us token 6 (after its move to 5, when ``moved_first``: its History showed the
    move before the grant, and the workload recorded it), and us's holder renews
    long after the births met (seed 354827230, and the short run's seed 424242)."""
    events = [
        *split_birth("us", "ap"),
        event("split-000-0-us", "grant", 12.6, token=6, key=SPLIT, detail="us", expires=40.0),
        event("split-000-0-us", "renew", 35.0, token=6, key=SPLIT, expires=45.0),
        event("split-000-0-us", "write", 35.1, token=6, key=SPLIT),
    ]
    if ap_grants:
        events += [
            event("split-000-0-ap", "grant", 12.5, token=4, key=SPLIT, detail="ap", expires=14.5),
            event("split-000-0-ap", "renew", 13.0, token=4, key=SPLIT, outcome="fail",
                  detail="wrong_region"),
        ]  # fmt: skip
    else:
        events.append(event("split-000-0-ap", "claim", 12.5, key=SPLIT, outcome="fail",
                            detail="wrong_region"))  # fmt: skip
    if moved_first:
        events.append(event("split-000-0", "met-grant", 20.0, token=6, key=SPLIT, detail="us"))
    return events


@pytest.mark.parametrize("ap_grants", [True, False], ids=["both-sides", "one-side"])
def test_a_claim_the_home_granted_after_its_move_is_no_split_time_claim(ap_grants: bool) -> None:
    states = finals()
    every(states, SPLIT, record(SPLIT, home="us"))
    bridged = bridged_split(moved_first=True, ap_grants=ap_grants)
    verdict = verdicts(history(*bridged, *SERVED), states=states)
    assert verdict["fencing safety"].ok, verdict["fencing safety"]
    assert verdict["one live claim at a time"].ok, verdict["one live claim at a time"]


@pytest.mark.parametrize("ap_grants", [True, False], ids=["both-sides", "one-side"])
def test_a_home_claim_granted_before_its_move_must_end_when_the_births_meet(
    ap_grants: bool,
) -> None:
    """The same history, but the home's History did not show its grant after a move:
    the grant was made apart, and the meeting must end it."""
    states = finals()
    every(states, SPLIT, record(SPLIT, home="us"))
    bridged = bridged_split(moved_first=False, ap_grants=ap_grants)
    verdict = verdicts(history(*bridged, *SERVED), states=states)
    assert "split-000-0-us's renew of" in verdict["fencing safety"].detail
    assert "under split-time token 6 accepted" in verdict["fencing safety"].detail


# -- 8. a token is granted once --------------------------------------------------------------


def test_a_token_granted_to_two_owners_or_again_after_its_release_is_caught() -> None:
    twice = history(event("us-agent-0", "grant", 1.0, token=5),
                    event("eu-agent-0", "grant", 9.0, token=5), *SERVED)  # fmt: skip
    verdict = verdicts(twice)["a token is granted once"]
    assert not verdict.ok and "token 5 granted to us-agent-0 and eu-agent-0" in verdict.detail
    again = history(
        event("us-agent-0", "grant", 1.0, token=5, expires=9.0),
        event("us-agent-0", "release", 2.0, token=5),
        event("us-agent-0", "grant", 3.0, token=5, expires=5.0),
        *SERVED,
    )
    verdict = verdicts(again)["a token is granted once"]
    assert not verdict.ok and "again at 3.00 s, after it was released" in verdict.detail


def test_a_retry_of_a_live_claim_and_a_split_are_not_tokens_granted_twice() -> None:
    retry = history(
        event("us-agent-0", "grant", 1.0, token=5, expires=3.0),
        event("us-agent-0", "write", 1.5, token=5, outcome="unknown", detail="UNAVAILABLE"),
        event("us-agent-0", "grant", 2.0, token=5, expires=4.0),  # the same claim, extended
        *SERVED,
    )
    verdict = verdicts(retry)["a token is granted once"]
    assert verdict.ok and verdict.numbers["idempotent retries"] == 1
    lapsed = history(event("us-agent-0", "grant", 1.0, token=5, expires=3.0),
                     event("us-agent-0", "grant", 4.0, token=5, expires=6.0), *SERVED)  # fmt: skip
    assert "after its lease had lapsed" in verdicts(lapsed)["a token is granted once"].detail
    states = finals()
    every(states, SPLIT, record(SPLIT, home="ap"))
    assert verdicts(history(*split_claims(), *SERVED), states=states)[
        "a token is granted once"
    ].ok  # token 1 on both sides: allowed, until the births met


# -- 9. fenced writes survive ----------------------------------------------------------------

FIELD = "progress.us-holder-0.1.0"


def holder(*more: Event) -> History:
    """us-holder-0 holds KEY (token 1) from 1 s, renewing to 9 s, and writes FIELD at 2 s."""
    return history(
        event("us-holder-0", "grant", 1.0, token=1, expires=3.0),
        event("us-holder-0", "write", 2.0, token=1, detail=FIELD, value="us-holder-0@1"),
        event("us-holder-0", "renew", 2.5, token=1, expires=9.0),
        *more,
        *SERVED,
    )


def test_an_acknowledged_fenced_write_missing_anywhere_is_lost() -> None:
    states = finals(**{FIELD: "us-holder-0@1"})
    states["eu"][KEY] = record()  # eu never got it
    verdict = verdicts(holder(), states=states)["fenced writes survive"]
    assert not verdict.ok and "missing, at eu" in verdict.detail


def test_an_unfenced_write_at_a_non_home_region_over_a_live_claim_violates_survival() -> None:
    """The hole: eu had not heard of the renewal, took the lease for lapsed, admitted."""
    meddle = event("meddler-eu", "meddle", 4.0, detail=FIELD, value="meddle:eu:1")
    verdict = verdicts(holder(meddle), states=finals(**{FIELD: "meddle:eu:1"}))
    assert not verdict["fenced writes survive"].ok
    assert "overwritten by an unfenced write at eu (ok, 4.10 s) while token 1 was unreleased" in (
        verdict["fenced writes survive"].detail
    )


def test_an_unfenced_delete_at_a_non_home_region_over_a_live_claim_violates_survival() -> None:
    delete = event("meddler-ap", "meddle-delete", 4.0)
    states = finals()
    every(states, KEY, replace(record(), deleted=True))
    verdict = verdicts(holder(delete), states=states)["fenced writes survive"]
    assert not verdict.ok and "erased by an unfenced delete at ap" in verdict.detail


def test_a_fenced_write_overwritten_after_its_claim_ended_or_by_a_newer_token_survives() -> None:
    release = event("us-holder-0", "release", 5.0, token=1)
    meddle = event("meddler-eu", "meddle", 5.2, detail=FIELD, value="meddle:eu:1")
    verdict = verdicts(holder(release, meddle), states=finals(**{FIELD: "meddle:eu:1"}))
    assert verdict["fenced writes survive"].ok
    assert verdict["fenced writes survive"].numbers["overwritten legitimately"] == 1
    lapsed = event("meddler-eu", "meddle", 9.5, detail=FIELD, value="meddle:eu:1")
    assert verdicts(holder(lapsed), states=finals(**{FIELD: "meddle:eu:1"}))[
        "fenced writes survive"
    ].ok
    delete = event("meddler-ap", "meddle-delete", 5.2)
    states = finals()
    every(states, KEY, replace(record(), deleted=True))
    assert verdicts(holder(release, delete), states=states)["fenced writes survive"].ok


# -- 10. catching up before deciding -----------------------------------------------------------


def test_a_node_that_decides_before_it_could_catch_up_is_caught() -> None:
    """ap, wiped, restarted twice and cut off from us until 48 s, granted at 45 s."""
    grant = event("press-ap", "grant", 45.0, token=7, detail="ap", key=NOTES)
    verdict = verdicts(history(grant, *SERVED))["catching up before deciding"]
    assert not verdict.ok and "ap acknowledged press-ap's grant" in verdict.detail
    early = replace(CATCH_UP, serving_early=43.0)
    verdict = verdicts(history(*SERVED), played=[PARTITION, early])["catching up before deciding"]
    assert not verdict.ok and "ap said it served claims at 43.0 s" in verdict.detail


def test_a_node_that_refuses_until_it_caught_up_passes() -> None:
    refused = event("press-ap", "claim", 45.0, outcome="unknown", detail="UNAVAILABLE")
    later = event("press-ap", "grant", 49.0, token=7, detail="ap")  # after the heal
    # An unfenced note meanwhile is admitted by a non-home node's rule: no decision.
    note = event("probe-ap", "note", 44.0, detail="note.ap.9", value="ap:9", key=NOTES)
    verdict = verdicts(history(refused, later, note, *SERVED))["catching up before deciding"]
    assert verdict.ok, verdict
    assert not verdicts(history(*SERVED), played=[PARTITION])["catching up before deciding"].ok


def test_a_paused_node_that_grants_before_it_could_have_settled_is_caught() -> None:
    """ap, frozen at 57.1 s and woken at 61 s, settles with its peers before it
    decides; asked, it still said so at 64 s. A claim that waited in line across the
    pause and was granted as the lease before it lapsed, a second after the wake, is
    what the gate once let through (tests/test_twins.py pins the node's side)."""
    early = event("ap-queue-0", "grant", 62.0, token=3, detail="ap", expires=64.0)
    verdict = verdicts(history(early, *SERVED))["catching up before deciding"]
    assert not verdict.ok and "still settling at 64.0 s" in verdict.detail, verdict
    # A pause whose node never said it settled is not judged (the nemesis says so).
    unseen = replace(PAUSE, settling_until=0.0)
    played = [PARTITION, CATCH_UP, FORGE, unseen]
    assert not verdicts(history(early, *SERVED), played)["catching up before deciding"].ok
    # Decided before the freeze and answered after the wake (the reply waited in a
    # frozen socket), decided once it could have settled, or by another node: fine.
    before = event("ap-queue-0", "grant", 56.9, token=3, detail="ap", took=4.3, expires=58.9)
    settled = event("ap-queue-1", "grant", 64.5, token=4, detail="ap", expires=66.5)
    elsewhere = event("us-agent-0", "grant", 62.0, token=5, detail="us", expires=64.0)
    verdict = verdicts(history(before, settled, elsewhere, *SERVED))["catching up before deciding"]
    assert verdict.ok and verdict.numbers["pauses judged"] == 1, verdict


# -- 11. forgeries refused ------------------------------------------------------------------


def forged(forgery: str, *, merged: int = 0, refused: str | None = None) -> Played:
    """FORGE, with ``forgery``'s push answered otherwise."""
    rule = RULES[forgery]
    changed = Pushed(forgery, rule, KEY, merged, rule if refused is None else refused)
    return replace(FORGE, forged=tuple(changed if p.forgery == forgery else p for p in REFUSED))


def test_a_forged_state_a_node_merged_is_caught() -> None:
    merged = forged("tombstone-at-claim-epoch", merged=1, refused="")
    verdict = verdicts(history(*SERVED), played=[PARTITION, CATCH_UP, merged])
    assert not verdict["forgeries refused"].ok
    assert "tombstone-at-claim-epoch forgery" in verdict["forgeries refused"].detail
    assert verdict["forgeries refused"].numbers["merged"] == 1


def test_a_kept_forgery_passes_only_if_the_home_stayed_and_it_was_reported() -> None:
    """forger.KEPT: the back-dated birth of the posing region's own is merged as
    evidence; the run fails if it moved the record's home, or was not reported."""
    name = "back-dated-birth-of-its-own-region"
    moved = replace(forged(name, merged=1), forged=tuple(
        replace(p, home_kept=False) if p.forgery == name else p for p in REFUSED
    ))  # fmt: skip
    verdict = verdicts(history(*SERVED), played=[PARTITION, CATCH_UP, moved])["forgeries refused"]
    assert not verdict.ok and f"a {name} forgery of {KEY} was merged and moved its home" in (
        verdict.detail
    )
    quiet = forged(name, merged=1, refused="")
    verdict = verdicts(history(*SERVED), played=[PARTITION, CATCH_UP, quiet])["forgeries refused"]
    assert not verdict.ok and f"never refused by its rule: {name}" in verdict.detail


def test_a_forgery_refused_by_another_rule_did_not_test_its_own() -> None:
    # A forged grant naming the home refused as a token jump: its signature went unchecked.
    other = forged("home-grant", refused="token_jump")
    verdict = verdicts(history(*SERVED), played=[PARTITION, CATCH_UP, other])["forgeries refused"]
    assert not verdict.ok
    assert "home-grant forgery of" in verdict.detail and "token_jump, not unsigned_grant" in (
        verdict.detail
    )


def test_every_kind_of_forgery_must_be_refused_by_its_rule_once() -> None:
    # No refusal seen for one kind (Info did not say), and another never pushed.
    unseen = forged("release-then-write", refused="")
    missing = replace(unseen, forged=tuple(p for p in unseen.forged if p.forgery != "over-limit"))
    verdict = verdicts(history(*SERVED), played=[PARTITION, CATCH_UP, missing])
    judged = verdict["forgeries refused"]
    assert not judged.ok
    assert "never refused by its rule: over-limit, release-then-write" in judged.detail
    assert judged.numbers["no refusal seen"] == 1
    # Seen once is enough: a second fault that refused both makes the run pass.
    again = verdicts(history(*SERVED), played=[PARTITION, CATCH_UP, missing, FORGE])
    assert again["forgeries refused"].ok, again["forgeries refused"]


def test_forgeries_all_refused_pass_and_a_run_without_any_judges_nothing() -> None:
    verdict = verdicts(history(*SERVED))["forgeries refused"]
    assert verdict.ok, verdict
    assert verdict.numbers == {
        "pushed": len(RULES),
        "merged": 0,  # the kept one merged, its home kept: not counted as merged
        "refused by their rule": len(RULES),
        "refused by another rule": 0,
        "no refusal seen": 0,
    }
    assert "unsigned_write 4" in verdict.detail and "signer_not_home 8" in verdict.detail
    assert "seen_before_birth 1" in verdict.detail
    unjudged = verdicts(history(*SERVED), played=[PARTITION, CATCH_UP])["forgeries refused"]
    assert not unjudged.ok and "nothing to judge" in unjudged.detail


# -- 12. no item done twice ---------------------------------------------------------------


def queue_verdict(*more: Event, states: dict[str, dict[str, Record]] | None = None,
                  played: list[Played] | None = None) -> Verdict:  # fmt: skip
    """Invariant 12 on WORKED and ``more``."""
    return verdicts(history(*SERVED, *WORKED, *more), played, states)["no item done twice"]


def queue_finals(**changed: Record) -> dict[str, dict[str, Record]]:
    states = finals()
    for records in states.values():
        records.update(queue_states(**changed))
    return states


def done_by(agent: str, token: int) -> Record:
    """QUEUED's final state after ``agent``'s done of ``token``."""
    return replace(queue_states()[QUEUED], fields={"result": f"done by {agent}@{token}"})


def test_a_worked_queue_passes_and_says_what_it_judged() -> None:
    verdict = queue_verdict()
    assert verdict.ok, verdict
    assert verdict.numbers["queue items"] == 2 and verdict.numbers["dones acknowledged"] == 1
    assert "1 poison items parked and reopened" in verdict.detail


def test_an_item_done_twice_without_a_reopen_between_is_caught() -> None:
    """us-queue-1 was handed QUEUED while us-queue-0's done was still on its way."""
    second = [
        event("us-queue-1", "grant", 25.55, token=2, key=QUEUED, detail="us", expires=27.6),
        event("us-queue-1", "done", 26.0, token=2, key=QUEUED, detail="result",
              value="done by us-queue-1@2"),
    ]  # fmt: skip
    states = queue_finals(**{QUEUED: done_by("us-queue-1", 2)})
    verdict = queue_verdict(*second, states=states)
    assert not verdict.ok
    assert (
        "done twice with no reopen between: us-queue-0 (token 1, ok) and us-queue-1 (token 2, ok)"
        in verdict.detail
    )
    assert "handed out again" not in verdict.detail  # its grant was sent before the ack
    # An operator's reopen that could have come between them: done again, legitimately.
    reopen = event("operator", "reopen", 25.5, key=QUEUED, value="done", outcome="unknown")
    verdict = queue_verdict(*second, reopen, states=states)
    assert verdict.ok, verdict
    assert verdict.numbers["done again after a reopen"] == 1


def test_an_item_handed_out_after_its_done_was_acknowledged_is_caught() -> None:
    again = event("eu-queue-0", "grant", 27.0, token=2, key=QUEUED, detail="us", expires=29.0)
    verdict = queue_verdict(again)
    assert not verdict.ok
    assert (
        "handed out again to eu-queue-0 (token 2) at 27.00 s, after us-queue-0's done (token 1)"
        " was acknowledged at 25.60 s" in verdict.detail
    )
    # Refused reopens change nothing; one acknowledged after the grant was sent is too late.
    refused = event("operator", "reopen", 26.0, key=QUEUED, outcome="fail", detail="missing")
    late = event("operator", "reopen", 27.5, key=QUEUED, value="done")
    # (Handed out again, its claim lapsed: the item ends open, one attempt counted.)
    lapsed = queue_finals(**{QUEUED: replace(queue_states()[QUEUED], status="open")})
    assert not queue_verdict(again, refused, late, states=lapsed).ok
    assert queue_verdict(again, replace(late, invoked=START + 26.9), states=lapsed).ok


def test_an_unknown_done_counts_only_when_the_final_state_shows_it_took_effect() -> None:
    second = [
        event("us-queue-1", "grant", 25.55, token=2, key=QUEUED, detail="us", expires=27.6),
        event("us-queue-1", "done", 26.0, token=2, key=QUEUED, outcome="unknown",
              detail="result", value="done by us-queue-1@2"),
    ]  # fmt: skip
    # Its result is not in the final state: it may never have reached the home.
    assert queue_verdict(*second).ok
    took_effect = queue_finals(**{QUEUED: done_by("us-queue-1", 2)})
    verdict = queue_verdict(*second, states=took_effect)
    assert not verdict.ok and "us-queue-1 (token 2, unknown)" in verdict.detail


def test_an_acknowledged_done_that_is_not_done_everywhere_at_the_end_is_caught() -> None:
    states = queue_finals()
    states["eu"][QUEUED] = replace(states["eu"][QUEUED], status="open")
    del states["ap"][QUEUED]
    verdict = queue_verdict(states=states)
    assert not verdict.ok
    assert (
        "us-queue-0's done (token 1) was acknowledged, but the item is eu: open, ap: missing"
        in (verdict.detail)
    )
    reopened = event("operator", "reopen", 29.0, key=QUEUED, value="done")
    opened = queue_finals(**{QUEUED: replace(queue_states()[QUEUED], status="open", attempts=0)})
    assert queue_verdict(reopened, states=opened).ok


def test_an_item_done_at_the_end_needs_a_done_that_made_it_so() -> None:
    poison_done = replace(queue_states()[POISONED], status="done", attempts=1, last_outcome="done")
    verdict = queue_verdict(states=queue_finals(**{POISONED: poison_done}))
    assert not verdict.ok
    assert f"{POISONED} is done at us with no done release that could have made it" in (
        verdict.detail
    )
    # Reopened after its only done, yet done: nothing done it again.
    reopened = event("operator", "reopen", 29.0, key=QUEUED, value="done")
    assert "no done release" in queue_verdict(reopened).detail
    no_attempts = replace(queue_states()[QUEUED], attempts=0)
    verdict = queue_verdict(states=queue_finals(**{QUEUED: no_attempts}))
    assert not verdict.ok and "done at us with 0 attempts and last outcome 'done'" in verdict.detail


def test_a_poison_item_handed_out_while_parked_is_caught() -> None:
    third = event("eu-queue-1", "grant", 27.0, token=3, key=POISONED, detail="us", expires=29.0)
    verdict = queue_verdict(third)
    assert not verdict.ok
    assert "(maxAttempts:2) granted 3 times with no reopen between, tokens 1 to 3" in (
        verdict.detail
    )
    after_reopen = replace(third, invoked=START + 28.5, completed=START + 28.6)
    assert queue_verdict(after_reopen).ok
    counted = replace(queue_states()[POISONED], attempts=3)
    verdict = queue_verdict(states=queue_finals(**{POISONED: counted}))
    assert not verdict.ok and "counts more than 2 attempts (us: 3" in verdict.detail


def test_a_done_lost_with_its_homes_disk_is_counted_not_failed() -> None:
    """us lost its disk 0.4 s after acknowledging the done: QUEUED was worked again."""
    wipe = Played("wipe", ("us",), 26.0, 27.0, down_at=26.0)
    again = [
        event("eu-queue-0", "grant", 28.0, token=1 + 2**20, key=QUEUED, detail="us",
              expires=30.0),
        event("eu-queue-0", "done", 28.5, token=1 + 2**20, key=QUEUED, detail="result",
              value=f"done by eu-queue-0@{1 + 2**20}"),
    ]  # fmt: skip
    states = queue_finals(**{QUEUED: done_by("eu-queue-0", 1 + 2**20)})
    verdict = queue_verdict(*again, states=states, played=[PARTITION, CATCH_UP, FORGE, wipe])
    assert verdict.ok, verdict
    assert verdict.numbers["lost with a disk"] == 1
    assert "1 dones lost with a wiped or rolled-back disk" in verdict.detail
    # Five healthy seconds before the wipe: it could have passed the done on.
    later = Played("wipe", ("us",), 31.0, 32.0, down_at=31.0)
    moved = [replace(e, invoked=e.invoked + 5, completed=e.completed + 5) for e in again]
    assert not queue_verdict(*moved, states=states, played=[PARTITION, CATCH_UP, FORGE, later]).ok


def test_a_run_with_no_done_or_no_parked_item_reopened_judges_nothing() -> None:
    unqueued = {region: {KEY: record(), NOTES: record(NOTES)} for region in REGIONS}
    nothing = verdicts(history(*SERVED), states=unqueued)["no item done twice"]
    assert not nothing.ok and "nothing to judge" in nothing.detail
    unparked = [e for e in WORKED if e.op != "reopen"]
    verdict = verdicts(history(*SERVED, *unparked))["no item done twice"]
    assert not verdict.ok and "parking was never put to the test" in verdict.detail


def test_queue_claims_feed_the_claim_invariants() -> None:
    """A release done ends its claim (QUEUED is reopened and handed out again within
    token 1's lease), and a done under a superseded token breaks fencing safety."""
    reopened = [
        event("operator", "reopen", 25.7, key=QUEUED, value="done"),
        event("eu-queue-0", "grant", 25.9, token=2, key=QUEUED, detail="us", expires=28.0),
    ]
    verdict = verdicts(history(*SERVED, *WORKED, *reopened))
    assert verdict["one live claim at a time"].ok, verdict["one live claim at a time"]
    stale = event("us-queue-0", "done", 26.5, token=1, key=QUEUED, detail="result", value="x")
    verdict = verdicts(history(*SERVED, *WORKED, *reopened, stale))
    assert not verdict["fencing safety"].ok
    assert "us-queue-0 wrote" in verdict["fencing safety"].detail


def test_a_claim_next_may_take_a_deadline_per_region_and_its_wait() -> None:
    """During the partition: three regions asked, 2 s deadline each, and a 1 s wait."""
    asked = event("ap-queue-0", "claim-next", 12.0, key="", outcome="fail", detail="empty",
                  took=7.5)  # fmt: skip
    assert verdicts(history(*SERVED, asked))["availability"].ok
    hung = replace(asked, completed=asked.invoked + 8.5)
    verdict = verdicts(history(*SERVED, hung))["availability"]
    assert not verdict.ok and "ap-queue-0 claim-next took 8.50 s" in verdict.detail


# -- a disk that went back in time (rollback) -------------------------------------------------

# us's data directory was copied at 30 s (us frozen for it), the workload went on, and
# at 39 s us was killed, the copy put back in place of the directory, and us restarted:
# its file forgot everything it did from 30 s to 39 s; its peers hold what it pushed.
ROLLED_BACK = Played("rollback", ("us",), 30.0, 42.0, down_at=39.0, copied_at=30.0)
BEFORE_THE_COPY = [
    event("us-agent-0", "grant", 20.0, token=1, detail="us", expires=22.0),
    event("us-agent-0", "release", 21.0, token=1),
]


def forgotten_grant(at: float) -> list[Event]:
    """us-agent-0 granted token 2 by us at ``at`` (after the copy), writes and releases."""
    return [
        event("us-agent-0", "grant", at, token=2, detail="us", expires=at + 2.0),
        event("us-agent-0", "write", at + 0.5, token=2, detail="p.a", value="us-agent-0@2"),
        event("us-agent-0", "release", at + 1.0, token=2),
    ]


def test_a_token_granted_again_after_its_homes_disk_went_back_in_time_is_caught() -> None:
    """The hole a rollback opens: us granted token 2 to us-agent-0 after the copy, and,
    put back to it, granted token 2 again, to rollback-us (the shape's presser)."""
    again = event("rollback-us", "grant", 39.6, token=2, detail="us", expires=41.6)
    played = [PARTITION, CATCH_UP, FORGE, ROLLED_BACK]
    states = finals(**{"p.a": "us-agent-0@2"})
    h = history(*BEFORE_THE_COPY, *forgotten_grant(31.0), again, *SERVED)
    judged = verdicts(h, played, states)
    once = judged["a token is granted once"]
    assert not once.ok and "token 2 granted to us-agent-0 and rollback-us" in once.detail
    order = judged["tokens strictly increase"]
    assert not order.ok and "token 2 granted after 2" in order.detail
    # Granted 0.5 s before the kill, maybe never pushed: the grant may be forgotten by
    # every node, but its token is still never handed out twice (no excuse for 2 or 8).
    h = history(*BEFORE_THE_COPY, *forgotten_grant(37.0), again, *SERVED)
    judged = verdicts(h, played, states)
    assert not judged["a token is granted once"].ok
    assert not judged["tokens strictly increase"].ok
    # A node that starts a new era of tokens after its restart passes both.
    above = replace(again, token=2 + 2**20)
    judged = verdicts(history(*BEFORE_THE_COPY, *forgotten_grant(31.0), above, *SERVED),
                      played, states)  # fmt: skip
    assert judged["a token is granted once"].ok, judged["a token is granted once"]
    order = judged["tokens strictly increase"]
    assert order.ok and order.numbers["records granted across a rollback"] == 1
    assert "1 after its disk went back in time" in order.detail


def test_an_item_done_before_a_rollback_and_handed_out_again_after_it_is_caught() -> None:
    """us acknowledged QUEUED done at 25.6 s, after the copy of 24 s and 6.4 s before
    the kill: time enough to pass it on. Put back to the copy, us handed it out again."""
    rolled = Played("rollback", ("us",), 24.0, 35.0, down_at=32.0, copied_at=24.0)
    again = event("rollback-us", "grant", 32.5, token=2, key=QUEUED, detail="us", expires=34.5)
    played = [PARTITION, CATCH_UP, FORGE, rolled]
    verdict = queue_verdict(again, played=played)
    assert not verdict.ok
    assert (
        "handed out again to rollback-us (token 2) at 32.50 s, after us-queue-0's done (token 1)"
        " was acknowledged at 25.60 s" in verdict.detail
    )
    # Killed 4.4 s after the ack: the done may be gone with the file's tail before it
    # reached a peer (SPEC §6), counted as a wipe's would be.
    soon = replace(rolled, down_at=30.0)
    verdict = queue_verdict(replace(again, invoked=START + 30.5), played=[*played[:3], soon])
    assert verdict.ok, verdict
    assert verdict.numbers["lost with a disk"] == 1
    # Done before the copy: on the copy, never excused, however soon the kill came.
    early = replace(rolled, copied_at=26.0, started=26.0, down_at=28.0)
    verdict = queue_verdict(replace(again, invoked=START + 28.5), played=[*played[:3], early])
    assert not verdict.ok and "handed out again to rollback-us" in verdict.detail


def test_a_rollback_excuses_only_what_was_acknowledged_after_the_copy_and_not_passed_on() -> None:
    def lost(at: float, rolled: Played) -> Verdict:
        note = event("probe-us", "note", at, detail="note.us.1", value="us:1", key=NOTES)
        return verdicts(history(note, *SERVED), [PARTITION, rolled])["no acknowledged write lost"]

    # Acknowledged 0.5 s after the copy, 8.4 s before the kill: its peers had it.
    assert not lost(30.5, ROLLED_BACK).ok
    # 1.9 s before the kill: it may be gone with the file's tail.
    verdict = lost(37.0, ROLLED_BACK)
    assert verdict.ok and verdict.numbers["lost with a disk"] == 1
    assert "1 lost with a wiped or rolled-back disk" in verdict.detail
    # 0.9 s before a copy that was put back 2 s later: it is on the copy.
    assert not lost(29.0, replace(ROLLED_BACK, down_at=31.0)).ok
    # A rollback whose copy was never taken (the freezer refused) forgot nothing.
    assert not lost(37.0, replace(ROLLED_BACK, copied_at=0.0, injected=False)).ok


# -- hasty callers (hasty.py) and 14. every lapsed lease is recorded ----------------------

HASTY = "us-hasty-0"
LEFT = "DEADLINE_EXCEEDED"  # a hasty call past its deadline: outcome unknown


def hasty(*more: Event) -> History:
    """us-hasty-0 claims KEY (token 1, lease to 3 s), writes, then its renewal at 2 s is
    past its deadline and it walks away; eu-agent-0 claims token 2 at 9 s."""
    return history(
        event(HASTY, "grant", 1.0, token=1, expires=3.0, took=0.01),
        event(HASTY, "write", 1.5, token=1, detail="hasty.a", value="a", took=0.01),
        event(HASTY, "renew", 2.0, token=1, outcome="unknown", detail=LEFT, took=0.01),
        event("eu-agent-0", "grant", 9.0, token=2, expires=11.0),
        *more,
        *SERVED,
        *WORKED,
    )


def test_hasty_calls_whose_outcome_is_unknown_may_have_landed_or_not() -> None:
    """A claim and a renewal left before their answer: either may have landed, and the
    claim invariants accept both — the next holder is granted after the lease could
    have run out, and the hasty writer's acknowledged write is kept."""
    h = hasty(event("ap-hasty-0", "claim", 12.0, outcome="unknown", detail="CANCELLED"))
    judged = verdicts(h, states=finals(**{"hasty.a": "a"}))
    assert all(v.ok for v in judged.values()), judged


def test_a_hasty_token_granted_again_or_written_under_once_superseded_is_caught() -> None:
    """What no cancelled call excuses: its token granted to another caller (8), a write
    under it accepted after a newer token was granted (1), two live claims (7)."""
    twice = hasty(event("eu-agent-1", "grant", 2.5, token=1, expires=4.5))
    judged = verdicts(twice, states=finals(**{"hasty.a": "a"}))
    assert not judged["a token is granted once"].ok
    assert "granted to us-hasty-0 and eu-agent-1" in judged["a token is granted once"].detail
    assert not judged["one live claim at a time"].ok
    stale = hasty(event(HASTY, "write", 9.5, token=1, detail="hasty.b", value="b", took=0.01))
    judged = verdicts(stale, states=finals(**{"hasty.a": "a", "hasty.b": "b"}))
    assert "us-hasty-0 wrote" in judged["fencing safety"].detail
    assert not judged["fencing safety"].ok


def ending(kind: str, at: float, *, token: int = 1, read_at: float = 60.0) -> Ending:
    return Ending(KEY, "us", kind, token, HASTY, at, read_at)


def test_a_lease_left_standing_long_after_it_ran_out_violates_14() -> None:
    """The past bug's signature: a renewal that landed for a caller that left, which the
    lapse watcher never heard of, so its home never recorded the lapse."""
    verdict = leases_recorded(hasty(), [ending("renewed", 2.0)], 0, [], 2.0)
    assert not verdict.ok
    assert "token 1 of us-hasty-0, renewed by us at 2.00 s" in verdict.detail
    assert "neither lapsed nor released" in verdict.detail
    granted = leases_recorded(hasty(), [ending("granted", 40.0, token=3)], 0, [], 2.0)
    assert not granted.ok  # a grant whose caller left, too
    assert not leases_recorded(hasty(), [], 0, [], 2.0).ok  # nothing read: nothing judged


def test_leases_that_ended_or_may_still_run_pass_14() -> None:
    """Lapsed, released or taken back: ended. A lease that ran out within the grace, or
    one a reply named longer than the workload's (30 s), may still stand."""
    long = history(event("forge-holder-us", "grant", 30.0, token=4, expires=60.0))
    endings = [
        ending("lapsed", 4.0),
        ending("released", 5.0),
        ending("forced", 6.0),
        ending("", 0.0),
        ending("renewed", 55.0),
        ending("granted", 30.0, token=4),
    ]
    verdict = leases_recorded(long, endings, 1, [], 2.0)
    assert verdict.ok, verdict.detail
    assert verdict.numbers["ended"] == 3 and verdict.numbers["within lease"] == 2
    assert "1 histories unread" in verdict.detail


def test_a_lease_whose_end_a_rollback_of_its_home_forgot_is_not_judged_by_14() -> None:
    """A home put back to a copy taken after a renewal, but before its lease ran out:
    the file holds the renewal, forgot the lapse that followed, and the lapse comes
    back merged from the peers, which is no event of the home's. A lease that ran out
    well before the copy must have ended on it."""
    rollback = Played("rollback", ("us",), 10.0, 25.0, down_at=18.0, copied_at=10.5)
    verdict = leases_recorded(hasty(), [ending("renewed", 10.0)], 0, [rollback], 2.0)
    assert verdict.ok and verdict.numbers["forgotten by a rollback"] == 1, verdict.detail
    early = leases_recorded(hasty(), [ending("renewed", 2.0)], 0, [rollback], 2.0)
    assert not early.ok
    elsewhere = replace(rollback, targets=("eu",))
    assert not leases_recorded(hasty(), [ending("renewed", 10.0)], 0, [elsewhere], 2.0).ok


# -- a twin: a copy of a live node's data directory started beside it -------------------------

# us's data directory was copied at 2 s, a second process started from it answered at 4 s
# and was killed at 9 s; their peers refused both, and us decided claims again at 41 s
# (the twin's life forgotten 30 s after it was last heard, then us's catch-up).
TWINNED = Played("twin", ("us",), 2.0, 43.0, copied_at=2.0, twin_answered=4.0,
                 twin_stopped=9.0, deciding_again=41.0)  # fmt: skip
TWIN_PLAYED = [PARTITION, CATCH_UP, FORGE, PAUSE, TWINNED]


def test_a_node_refused_as_a_twin_may_refuse_home_only_calls_not_serving_until_it_decides() -> None:
    """us decides nothing from its copy until it has caught up after its twin's end
    (docs/replication.md, *Twins*), NOT_SERVING for records homed elsewhere too: a
    partition meanwhile (at 10-20 s here; faults never overlap in a run, but the wait
    for us to decide again is bounded) finds its probe refused UNAVAILABLE, not
    redirected. Excused then, at us, and nowhere else or later."""
    refused = event("probe-us", "probe-home-only", 12.0, outcome="unknown",
                    detail="UNAVAILABLE", took=0.01)  # fmt: skip
    verdict = verdicts(history(*SERVED, *WORKED, refused), TWIN_PLAYED)["availability"]
    assert verdict.ok, verdict
    assert verdict.numbers["refused while twinned"] == 1
    assert "1 at a node refused as a twin" in verdict.detail
    assert "1 nodes refused as twins decided again 32.0 s or less" in verdict.detail
    # At another region: ap has no twin, and must redirect.
    elsewhere = replace(refused, agent="probe-ap")
    verdict = verdicts(history(*SERVED, *WORKED, elsewhere), TWIN_PLAYED)["availability"]
    assert not verdict.ok and "probe-ap home-only call at a non-home node" in verdict.detail
    # Once us decided again (at 10.5 s, plus a second of slack), it redirects.
    back = replace(TWINNED, ended=12.5, deciding_again=10.5)
    verdict = verdicts(history(*SERVED, *WORKED, refused), [PARTITION, back])["availability"]
    assert not verdict.ok and "probe-us home-only call at a non-home node" in verdict.detail
    # Before the twin fault began, it was no twin's.
    later = replace(TWINNED, started=13.0, copied_at=13.0, twin_answered=14.0)
    assert not verdicts(history(*SERVED, *WORKED, refused), [PARTITION, later])["availability"].ok
    # A refusal that hangs is no answer, twin or not.
    hung = replace(refused, completed=refused.invoked + WRONG_REGION_FAST_S + 1)
    assert not verdicts(history(*SERVED, *WORKED, hung), TWIN_PLAYED)["availability"].ok


def test_a_node_refused_as_a_twin_must_decide_again_within_the_bound() -> None:
    """Past TWIN_FORGET_S and the catch-up's bound after the twin's stop, nothing is
    excused: not deciding again at all, or too late, fails availability, and so does
    its probe refused past the bound."""
    bound = TWINNED.twin_stopped + TWIN_BOUND_S
    never = replace(TWINNED, deciding_again=0.0, ended=TWINNED.twin_stopped + 60)
    verdict = verdicts(history(*SERVED, *WORKED), [PARTITION, never])["availability"]
    assert not verdict.ok
    assert "us, twinned at 2.0 s, decided claims again never" in verdict.detail
    late = replace(TWINNED, deciding_again=bound + 1, ended=bound + 3)
    verdict = verdicts(history(*SERVED, *WORKED), [PARTITION, late])["availability"]
    assert not verdict.ok and f"decided claims again at {bound + 1:.1f} s" in verdict.detail
    # A partition after the bound: us's NOT_SERVING then is no twin's cost.
    after = Played("bridge", ("us", "ap"), bound + 5, bound + 10, cut=(("us", "ap"),))
    refused = event("probe-us", "probe-home-only", bound + 6, outcome="unknown",
                    detail="UNAVAILABLE", took=0.01)  # fmt: skip
    served = [event(f"probe-{r}", "probe-read", bound + 6, key=NOTES) for r in REGIONS]
    verdict = verdicts(history(*served, *WORKED, refused), [after, late])["availability"]
    assert "probe-us home-only call at a non-home node" in verdict.detail
    # Within it: judged as served and counted.
    verdict = verdicts(history(*SERVED, *WORKED), TWIN_PLAYED)["availability"]
    assert verdict.ok and verdict.numbers["twinned nodes deciding again"] == 1


def test_a_twin_that_decides_is_caught_and_its_grants_are_judged_like_any_other() -> None:
    """The copy must never decide: a grant it acknowledged fails invariant 10, and is a
    grant of us like any other for the claim invariants — here token 3 of one record
    granted by the twin and by the original to their clients at once (2, 7, 8)."""
    copy = event("twin-us", "grant", 6.0, token=3, detail="us", key=NOTES, expires=8.0)
    original = event("misrouted-us", "grant", 6.2, token=3, detail="us", key=NOTES,
                     expires=8.2)  # fmt: skip
    judged = verdicts(history(*SERVED, *WORKED, copy, original), TWIN_PLAYED)
    caught = judged["catching up before deciding"]
    assert not caught.ok
    assert "the twin of us acknowledged twin-us's grant of" in caught.detail
    once = judged["a token is granted once"]
    assert not once.ok and "token 3 granted to twin-us and misrouted-us" in once.detail
    assert not judged["one live claim at a time"].ok
    # A twin that only said it served claims (granting nothing) is caught too.
    serving = replace(TWINNED, serving_early=7.5)
    verdict = verdicts(history(*SERVED, *WORKED), [PARTITION, CATCH_UP, FORGE, serving])[
        "catching up before deciding"
    ]  # fmt: skip
    assert not verdict.ok and "the twin of us said it served claims at 7.5 s" in verdict.detail


def test_a_twin_refused_throughout_passes_and_the_survivor_grants_above() -> None:
    """The twin answered every claim NOT_SERVING; us granted before the copy and, once
    it decided again, above (the recovery floor): counted as granted across a twin."""
    h = history(
        *SERVED,
        *WORKED,
        event("us-agent-0", "grant", 1.0, token=4, detail="us", key=NOTES, expires=1.5),
        event("us-agent-0", "release", 1.2, token=4, key=NOTES),
        event("twin-us", "claim", 6.0, outcome="unknown", detail="UNAVAILABLE", key=NOTES),
        event("misrouted-us", "grant", 42.0, token=4 + 2**20, detail="us", key=NOTES,
              expires=44.0),
    )  # fmt: skip
    judged = verdicts(h, TWIN_PLAYED)
    assert all(v.ok for v in judged.values()), judged
    assert "1 twins decided nothing (1 calls refused)" in judged[
        "catching up before deciding"
    ].detail  # fmt: skip
    order = judged["tokens strictly increase"]
    assert order.numbers["records granted across a twin"] == 1
    assert "1 after it was twinned" in order.detail
