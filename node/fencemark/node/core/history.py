"""A record's claim history (SPEC §8, ``Records.History``): what its home decided.

Events are read off the change itself — the record before and after one local
commit at the home — so every path that grants, renews, ends, takes back or
reopens a claim is covered without telling this module about it. They are kept
by the node that decided them, in the same commit as the state (``store.events``),
the newest ``KEPT`` per record; a node that is not a record's home keeps none.
"""

from __future__ import annotations

from fencemark.node.crdt import Record
from fencemark.node.crdt.record import ATTEMPTS, OPEN, PARKED, STATUS
from fencemark.node.rules.admission import Caller, acts_for
from fencemark.node.store.events import Event

# Event kinds, lowercase words like every other reason on the wire.
GRANTED, RENEWED, RELEASED, LAPSED, FORCED, REOPENED, MOVED = (
    "granted", "renewed", "released", "lapsed", "forced", "reopened", "moved",
)  # fmt: skip
KINDS = (GRANTED, RENEWED, RELEASED, LAPSED, FORCED, REOPENED, MOVED)


def events_of(
    before: Record, after: Record, *, at_ms: int, note: str = "", actor: str = ""
) -> list[Event]:
    """The claim events of the change from ``before`` to ``after`` made here at
    ``at_ms``, in the order they happened; ``note`` (an operator's reason) and
    ``actor`` (the operator's identity) go with a take-back or a reopen."""
    events: list[Event] = []
    old, new = before.fence, after.fence
    parked = after.status == PARKED and before.status != PARKED
    # Newly ended tokens (a grant that folds old ones out of the fence ends none).
    ended = (new.released | new.lapsed) - (old.released | old.lapsed)
    for token in sorted(ended):
        grant = new.grants.get(token) or old.grants.get(token)
        owner, identity = (grant.owner, grant.identity) if grant is not None else ("", "")
        outcome = after.outcome
        words = [outcome.value] if outcome is not None and outcome.stamp.epoch == token else []
        if parked:
            words.append(PARKED)
        kind = LAPSED if token in new.lapsed - old.lapsed else RELEASED
        detail = " ".join(word for word in words if word != LAPSED)
        events.append(Event(at_ms, kind, token, owner, identity, detail))
    if new.moved > old.moved and old.holder() is not None and old.unreleased():
        holder = old.holder()
        assert holder is not None
        events.append(Event(at_ms, FORCED, old.fence, holder.owner, holder.identity, note, actor))
    for token in sorted(set(new.grants) - set(old.grants)):
        grant = new.grants[token]
        events.append(Event(at_ms, GRANTED, token, grant.owner, grant.identity))
    holder = new.holder()
    if (
        holder is not None
        and new.fence == old.fence
        and new.expiry(new.fence) > old.expiry(old.fence)
    ):
        events.append(Event(at_ms, RENEWED, new.fence, holder.owner, holder.identity))
    status, attempts = after.queue.get(STATUS), after.queue.get(ATTEMPTS)
    if (
        status is not None
        and status != before.queue.get(STATUS)
        and status.value == OPEN
        and attempts is not None
        and attempts.value == "0"
        and attempts.stamp == status.stamp
    ):
        events.append(Event(at_ms, REOPENED, old.fence, detail=note, actor=actor))
    return events


def moved(record: Record, *, at_ms: int) -> Event:
    """The event of the home moving ``record``'s fence when two of its births met
    (``Replica.merge``): every claim below the token, granted on either side while
    they were apart, is superseded; the detail names the regions the births came
    from. A merge is not otherwise a decision of the home, so this is the one claim
    event a merge records."""
    births = " ".join(sorted(record.births))
    return Event(at_ms, MOVED, record.fence.moved, detail=f"births {births}")


def shown_to(caller: Caller, events: list[Event], record: Record, now_ms: int) -> list[Event]:
    """What ``caller`` may see of ``record``'s ``events``, as ``ClaimStatus`` shows
    it (docs/security.md, *Claims are bound to identities*): the live claim's token
    only to an identity that acts for its holder, and the identity a grant was made
    to only to that identity or one that acts for others."""
    holder = record.fence.holder() if record.claim_live(now_ms) else None
    live = record.fence.fence if holder is not None and not acts_for(caller, holder) else 0
    return [
        event._replace(
            token=0 if live and event.token == live else event.token,
            identity=event.identity if _sees(caller, event.identity) else "",
        )
        for event in events
    ]


def _sees(caller: Caller, identity: str) -> bool:
    return caller.acts_for_others or not identity or identity == caller.identity
