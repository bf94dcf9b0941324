"""Invariant 13 catches what it claims to: hand-made watchers' histories that pass, and
ones with a gap, a repeat, a reorder, a changed event, a new feed without a lost disk,
a write acknowledged but never fed, a final state never received. No containers."""

from __future__ import annotations

from dataclasses import replace

from fencemark.node.tools.workload import Event, History
from tests.chaos.checker import Verdict
from tests.chaos.nemesis import Played
from tests.chaos.queue_work import queue_key
from tests.chaos.watch_invariants import Seen, Segment, WatchLog, watched_in_order

START = 5000.0  # the monotonic clock's reading when the run started
ITEM, OTHER = queue_key("q-us-00000"), queue_key("q-eu-00000")
MARKS = (queue_key("watch-mark-1"), queue_key("watch-mark-2"))
HOMES = {ITEM: "us", OTHER: "eu"}
WIPE = Played("wipe", ("us",), 20.0, 22.0, down_at=20.1)


def seen(cursor: str, key: str = ITEM, *, kind: str = "updated", at: float = 0.0,
         fence: int = 0, **fields: str) -> Seen:  # fmt: skip
    """An event of the feed; ``at``: when its node committed it, seconds into the run
    (its watcher had it 50 ms later)."""
    digest = f"{cursor} {key} {kind}".encode()
    return Seen(cursor, kind, key, digest, fence, fields, START + at, START + at + 0.05)


def feed(name: str, at: float = 10.0) -> list[Seen]:
    """Feed ``name``'s changes of the topic: ITEM created, granted token 1 and done, OTHER
    merged from eu; then the two end marks, 1 s apart from ``at`` on."""
    return [
        seen(f"{name}.2", kind="created", at=at),
        seen(f"{name}.5", kind="claimed", at=at + 1, fence=1),
        seen(f"{name}.6", OTHER, kind="created", at=at + 2),
        seen(f"{name}.9", kind="done", at=at + 3, fence=1, result="done by us-queue-0@1"),
        seen(f"{name}.12", MARKS[0], kind="created", at=at + 4),
        seen(f"{name}.13", MARKS[1], kind="created", at=at + 5),
    ]


def ends_of(events: list[Seen]) -> dict[str, bytes]:
    """Every record's last state in ``events``: what the node lists at the end."""
    return {e.key: e.digest for e in events}


def log(*segments: Segment, reread: list[Seen] | None = None) -> WatchLog:
    """us's watcher: ``segments``; the re-read and the listing, its last one's feed."""
    events = segments[-1].events
    return WatchLog("us", list(segments), events if reread is None else reread, ends_of(events))


def history(*events: Event) -> History:
    made = History(started=START)
    for each in events:
        made.add(each)
    return made


def write(op: str, at: float, *, token: int = 0, detail: str = "", value: str = "",
          key: str = ITEM) -> Event:  # fmt: skip
    """A write of us-queue-0 acknowledged 0.2 s after it was sent, ``at`` s into the run."""
    return Event("us-queue-0", op, key, token, "ok", START + at, START + at + 0.2, detail, value)


# The queue agent's grant and done of ITEM, as its node acknowledged them.
WORKED = history(
    write("grant", 10.8, token=1, detail="us"),
    write("done", 12.8, token=1, detail="result", value="done by us-queue-0@1"),
)


def verdict(*logs: WatchLog, played: list[Played] | None = None,
            h: History = WORKED) -> Verdict:  # fmt: skip
    return watched_in_order(list(logs), h, played or [], HOMES, MARKS)


def test_a_watcher_that_received_its_nodes_whole_feed_passes() -> None:
    judged = verdict(log(Segment("f1.0", feed("f1"))))
    assert judged.ok, judged.detail
    assert judged.numbers["re-read equal"] == 6
    assert judged.numbers["writes shown"] == 2  # the grant and the done, between events
    assert judged.numbers["final states"] == 2
    assert judged.name == "13. watchers miss nothing"


def test_a_change_the_watcher_never_received_is_a_gap() -> None:
    kept = feed("f1")
    got = [e for e in kept if e.cursor != "f1.6"]
    judged = verdict(log(Segment("f1.0", got), reread=kept))
    assert not judged.ok
    assert "gap: 1 changes of the node's feed never received, first f1.6" in judged.detail


def test_a_change_received_twice_is_a_repeat() -> None:
    kept = feed("f1")
    got = [*kept[:3], kept[2], *kept[3:]]
    judged = verdict(log(Segment("f1.0", got), reread=kept))
    assert not judged.ok
    assert "us: f1.6 repeated" in judged.detail


def test_changes_received_out_of_commit_order_are_a_reorder() -> None:
    kept = feed("f1")
    got = [kept[0], kept[2], kept[1], *kept[3:]]
    judged = verdict(log(Segment("f1.0", got), reread=kept))
    assert not judged.ok
    assert "us: f1.5 out of order, after seq 6" in judged.detail


def test_an_event_received_otherwise_than_the_feed_holds_it_fails() -> None:
    kept = feed("f1")
    got = [*kept[:1], replace(kept[1], digest=b"another state"), *kept[2:]]
    judged = verdict(log(Segment("f1.0", got), reread=kept))
    assert not judged.ok
    assert "f1.5 received as" in judged.detail


def test_a_new_feed_after_a_lost_disk_starts_a_segment_judged_on_its_own() -> None:
    lost = Segment("f1.0", feed("f1")[:3], ended="expired: cursor 'f1.6' is of another feed")
    after = Segment("f2.0", feed("f2", at=30.0))
    judged = verdict(log(lost, after), played=[WIPE])
    assert judged.ok, judged.detail
    assert judged.numbers["segments"] == 2
    # A wipe the engine failed to finish (its restart refused) may have wiped it all the same.
    assert verdict(log(lost, after), played=[replace(WIPE, injected=False)]).ok
    # The same two feeds without a disk loss: the node lost its identity otherwise.
    judged = verdict(log(lost, after))
    assert not judged.ok
    assert "us: 1 new feeds after 0 disk losses" in judged.detail


def test_a_write_acknowledged_while_a_lost_feed_was_followed_must_be_in_it() -> None:
    """A feed gone with its disk cannot be read again: the history says what it held."""
    events = [e for e in feed("f1") if e.kind != "claimed"]  # the grant's change missing
    lost = Segment("f1.0", events[:4], ended="expired: cursor 'f1.9' is of another feed")
    judged = verdict(log(lost, Segment("f2.0", feed("f2", at=30.0))), played=[WIPE])
    assert not judged.ok
    assert "gap: us-queue-0's grant of" in judged.detail
    # Sent before the watcher had the segment's first event: not judged there.
    early = history(write("grant", 9.0, token=1, detail="us"))
    judged = verdict(log(lost, Segment("f2.0", feed("f2", at=30.0))), played=[WIPE], h=early)
    assert judged.ok, judged.detail
    assert judged.numbers["writes shown"] == 0


def test_a_write_lost_with_its_nodes_rolled_back_disk_may_have_no_event() -> None:
    """The chaos run's case (seed 1403819500): a creation acknowledged by us after the
    copy its disk was put back to was taken, and killed before it was fed or pushed
    on. The feed goes on under the same node id, without it; invariant 3 counts it
    lost with the disk, and so does this one."""
    created = write("create", 12.0, detail="us", key=queue_key("q-us-00007"))
    watched = log(Segment("f1.0", feed("f1")))
    rollback = Played("rollback", ("us",), 12.5, 20.0, down_at=12.6, copied_at=11.0)
    judged = verdict(watched, played=[rollback], h=history(created))
    assert judged.ok, judged.detail
    assert judged.numbers["writes lost with a disk"] == 1
    assert judged.numbers["writes shown"] == 0
    # Acknowledged before the copy was taken: the file put back holds it; it must show.
    early = replace(rollback, copied_at=12.3)
    judged = verdict(watched, played=[early], h=history(created))
    assert not judged.ok
    assert "gap: us-queue-0's create of" in judged.detail
    # Nor is a write the node had DISK_LOSS_GRACE_S healthy seconds to pass on excused.
    late = replace(rollback, started=30.0, down_at=30.1)
    assert not verdict(watched, played=[late], h=history(created)).ok


def test_a_final_state_the_watcher_never_received_fails() -> None:
    watched = log(Segment("f1.0", feed("f1")))
    watched.ends[ITEM] = b"a state no event carried"
    judged = verdict(watched)
    assert not judged.ok
    assert "its state at the node was received other states" in judged.detail
    watched = log(Segment("f1.0", feed("f1")))
    del watched.ends[OTHER]
    assert "received, not held by the node" in verdict(watched).detail


def test_a_record_changed_between_the_marks_may_be_listed_either_way() -> None:
    events = feed("f1")
    later = seen("f1.12b", kind="lapsed", at=14.5)  # between the two marks
    events = [*events[:5], replace(later, cursor="f1.13"), replace(events[5], cursor="f1.14")]
    watched = log(Segment("f1.0", events))
    for listed in (events[3].digest, events[5].digest):  # before the change, after it
        watched.ends[ITEM] = listed
        assert verdict(watched).ok, verdict(watched).detail


def test_a_cursor_expiring_in_its_own_feed_or_a_refusal_fails() -> None:
    first = Segment("f1.0", feed("f1")[:2], ended="expired: cursor 'f1.5' is older")
    judged = verdict(log(first, Segment("f1.5", feed("f1")[2:])), played=[WIPE])
    assert not judged.ok
    assert "a cursor of feed f1 expired in it" in judged.detail
    refused = Segment("f1.0", feed("f1")[:2], ended="refused: InvalidArgument: cursor")
    judged = verdict(log(refused, Segment("f1.5", feed("f1")[2:])))
    assert not judged.ok
    assert "a watch of feed f1 refused: InvalidArgument" in judged.detail


def test_a_watcher_that_never_saw_the_end_or_no_watcher_judges_nothing() -> None:
    short = feed("f1")[:4]
    judged = verdict(log(Segment("f1.0", short), reread=feed("f1")))
    assert not judged.ok
    assert "never saw both end marks" in judged.detail or "gap" in judged.detail
    assert not verdict().ok
    assert verdict().detail == "no watcher: nothing judged"


# us's disk went back in time: put back at 29 s to a copy of its data directory of 20 s.
ROLLBACK = Played("rollback", ("us",), 20.0, 30.0, down_at=29.0, copied_at=20.0)


def test_a_feed_that_went_back_in_time_is_left_for_a_new_one_never_resumed_over() -> None:
    # Told CURSOR_EXPIRED and onto a new feed, as after a lost disk: nothing skipped.
    lost = Segment("f1.0", feed("f1")[:3], ended="expired: cursor 'f1.6' is of another feed")
    judged = verdict(log(lost, Segment("f2.0", feed("f2", at=30.0))), played=[ROLLBACK])
    assert judged.ok, judged.detail
    # Resumed on the same feed: the watcher had f1.5 and f1.6 before the rollback, and
    # the node, put back to f1.2, used seqs 3 to 6 again for other changes. The re-read
    # of the feed holds them; the watcher never had them.
    kept = feed("f1")
    again = [kept[0], seen("f1.4", OTHER, kind="created", at=29.5),
             replace(kept[2], digest=b"merged after the rollback"), *kept[3:]]  # fmt: skip
    judged = verdict(log(Segment("f1.0", kept), reread=again), played=[ROLLBACK])
    assert not judged.ok
    assert "us: gap: 1 changes of the node's feed never received, first f1.4" in judged.detail


def test_a_feed_that_went_back_in_time_resumes_past_what_it_forgot_in_a_new_era() -> None:
    # The watcher had f1.5 and f1.6; the node, put back to f1.2, forgot them and
    # began a new era of seqs (store.feed.era_start) at f1.1000. Resumed from f1.6, the
    # watcher gets every change of the new era: what the file forgot is not in the
    # re-read, and is not a problem after a rollback of its node ...
    kept = feed("f1")
    era = [
        seen("f1.1000", OTHER, kind="created", at=29.5),
        seen("f1.1001", kind="done", at=29.6, fence=1, result="done by us-queue-0@1"),
        seen("f1.1002", MARKS[0], kind="created", at=30.0),
        seen("f1.1003", MARKS[1], kind="created", at=31.0),
    ]
    got = [*kept[:4], *era]
    reread = [kept[0], *era]
    judged = verdict(log(Segment("f1.0", got), reread=reread), played=[ROLLBACK])
    assert judged.ok, judged.detail
    # ... but it is without one, and so is a change of the new era never received.
    judged = verdict(log(Segment("f1.0", got), reread=reread))
    assert not judged.ok
    short = [*kept[:4], *era[1:]]
    judged = verdict(log(Segment("f1.0", short), reread=reread), played=[ROLLBACK])
    assert not judged.ok
    assert "gap: 1 changes of the node's feed never received, first f1.1000" in judged.detail


def test_a_record_a_rolled_back_file_forgot_whole_is_not_required_at_the_end() -> None:
    """An item created and claimed a moment before a rollback's kill, pushed to no
    peer (chaos seed 84059738): its watcher had both events, the file forgot them,
    and no node holds the item at the end — invariant 3 counts the creation lost
    with the rolled-back disk. Without a rollback it is a record the node lost."""
    gone = queue_key("q-us-00052")
    kept = feed("f1")
    forgot = [seen("f1.10", gone, kind="created", at=13.5),
              seen("f1.11", gone, kind="claimed", at=13.6, fence=1)]  # fmt: skip
    era = [
        seen("f1.1000", MARKS[0], kind="created", at=30.0),
        seen("f1.1001", MARKS[1], kind="created", at=31.0),
    ]
    watched = log(Segment("f1.0", [*kept[:4], *forgot, *era]), reread=[*kept[:4], *era])
    del watched.ends[gone]
    judged = verdict(watched, played=[ROLLBACK])
    assert judged.ok, judged.detail
    judged = verdict(watched)
    assert not judged.ok
    assert f"{gone} received, not held by the node" in judged.detail
