"""Input limits and key syntax (SPEC §2). Bad input is refused, never truncated.

Each check raises ``InvalidInput`` naming the request field, before anything is
read or written, so a refused request changes nothing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from fencemark.node.crdt import Record, tagset
from fencemark.node.crdt.record import (
    AFTER_TAG,
    ENDINGS,
    MAX_ATTEMPTS_TAG,
    OUTCOME,
    QUEUE_REGISTERS,
    STATUS,
    STATUSES,
)
from fencemark.node.rules import queue
from fencemark.node.rules.errors import InvalidInput

SEGMENT = re.compile(r"[A-Za-z0-9._:-]{1,128}")
KEY = re.compile(
    r"repo/([A-Za-z0-9._:-]{1,128})/mem/([A-Za-z0-9._:-]{1,128})/([A-Za-z0-9._:-]{1,128})"
)
FIELD_NAME = SEGMENT
REGION = re.compile(r"[A-Za-z0-9._-]{1,64}")
# A queue register's count or UTC milliseconds: canonical decimal (no sign, no leading 0).
DECIMAL = re.compile(r"0|[1-9][0-9]{0,19}")
# The identity a grant was made to (``tls.Identity`` as text): empty, or KIND/NAME.
GRANT_IDENTITY = re.compile(rf"((client|region)/{REGION.pattern})?")

MAX_VALUE_BYTES = 1 << 20
MAX_FIELDS = 256
MAX_TAGS = 256
MAX_TAG_CHARS = 256
MAX_OWNER_CHARS = 128
MIN_LEASE_S, MAX_LEASE_S, DEFAULT_LEASE_S = 1.0, 3600.0, 60.0
MAX_WAIT_S = 300.0
MAX_RECORD_BYTES = 4 << 20
MAX_PAGE_SIZE, DEFAULT_PAGE_SIZE = 1000, 100
HOME_TAG_PREFIX = "homeRegion:"
# The merge refusal of a state outside these limits (fencemark.node.rules.integrity.MergeRefused).
OVER_LIMIT = "over_limit"


class Key(NamedTuple):
    repo: str
    topic: str
    id: str

    def __str__(self) -> str:
        return f"repo/{self.repo}/mem/{self.topic}/{self.id}"


def key(value: str, name: str = "key") -> Key:
    match = KEY.fullmatch(value)
    if match is None:
        raise InvalidInput.field(
            name,
            f"must be repo/{{repo}}/mem/{{topic}}/{{id}} with segments matching"
            f" {SEGMENT.pattern}, got {value[:300]!r}",
        )
    return Key(*match.groups())


def segment(value: str, name: str) -> str:
    if SEGMENT.fullmatch(value) is None:
        raise InvalidInput.field(name, f"must match {SEGMENT.pattern}, got {value[:300]!r}")
    return value


def key_range(repo: str, topic: str = "") -> tuple[str, str]:
    """``[lower, upper)``: every key of ``repo`` (of ``topic``, when given), checked."""
    prefix = f"repo/{segment(repo, 'repo')}/mem/"
    if topic:
        prefix += segment(topic, "topic") + "/"
    return prefix, prefix[:-1] + chr(ord("/") + 1)  # every key that starts with prefix


def region(value: str, name: str = "region") -> str:
    if REGION.fullmatch(value) is None:
        raise InvalidInput.field(name, f"region must match {REGION.pattern}, got {value[:100]!r}")
    return value


def fields(values: Mapping[str, str], name: str = "fields") -> Mapping[str, str]:
    if len(values) > MAX_FIELDS:
        raise InvalidInput.field(name, f"at most {MAX_FIELDS} fields, got {len(values)}")
    for field_name, value in values.items():
        if FIELD_NAME.fullmatch(field_name) is None:
            raise InvalidInput.field(
                f"{name}[{field_name[:100]!r}]",
                f"field names must match {FIELD_NAME.pattern}",
            )
        value_field(value, f"{name}[{field_name!r}]")
    return values


def value_field(value: str, name: str) -> str:
    size = len(value.encode("utf-8"))
    if size > MAX_VALUE_BYTES:
        raise InvalidInput.field(name, f"value is {size} bytes; at most {MAX_VALUE_BYTES}")
    return value


def tags(values: Iterable[str], name: str = "tags") -> list[str]:
    checked = list(values)
    if len(checked) > MAX_TAGS:
        raise InvalidInput.field(name, f"at most {MAX_TAGS} tags, got {len(checked)}")
    for index, tag in enumerate(checked):
        if not 1 <= len(tag) <= MAX_TAG_CHARS:
            raise InvalidInput.field(
                f"{name}[{index}]", f"tags are 1-{MAX_TAG_CHARS} characters, got {len(tag)}"
            )
        if not tag.isprintable():
            raise InvalidInput.field(f"{name}[{index}]", "tags must be printable characters")
    return checked


def queue_tags(values: Iterable[str], name: str = "tags") -> None:
    """Tags the work queue reads (SPEC §8), on a client's write: ``maxAttempts:N``
    with N in 1..MAX_ATTEMPTS_LIMIT, ``after:<id>`` naming a valid id, at most
    MAX_AFTER_TAGS of those. ``priority:`` tags other than P0-P9 are plain tags."""
    waits = 0
    for index, tag in enumerate(values):
        if tag.startswith(MAX_ATTEMPTS_TAG):
            count = tag.removeprefix(MAX_ATTEMPTS_TAG)
            if not (count.isdigit() and 1 <= int(count) <= queue.MAX_ATTEMPTS_LIMIT):
                raise InvalidInput.field(
                    f"{name}[{index}]",
                    f"maxAttempts:N takes N from 1 to {queue.MAX_ATTEMPTS_LIMIT}, got {count!r}",
                )
        elif tag.startswith(AFTER_TAG):
            segment(tag.removeprefix(AFTER_TAG), f"{name}[{index}]")
            waits += 1
    if waits > queue.MAX_AFTER_TAGS:
        raise InvalidInput.field(name, f"at most {queue.MAX_AFTER_TAGS} after: tags, got {waits}")


def home_tag(values: Iterable[str], name: str = "tags") -> str | None:
    """The region named by the one ``homeRegion:`` tag, if any."""
    homes = [t[len(HOME_TAG_PREFIX) :] for t in values if t.startswith(HOME_TAG_PREFIX)]
    if len(set(homes)) > 1:
        raise InvalidInput.field(name, f"more than one homeRegion tag: {sorted(set(homes))}")
    if not homes:
        return None
    return region(homes[0], name)


def no_home_tags(values: Iterable[str], name: str) -> None:
    if any(t.startswith(HOME_TAG_PREFIX) for t in values):
        raise InvalidInput.field(name, "homeRegion is fixed when a record is created")


def record_size(record: Record, name: str, tags_name: str = "tags") -> None:
    """Limits on the whole record a write would leave (not only on the request)."""
    fields = len(record.field_values())
    if fields > MAX_FIELDS:
        raise InvalidInput.field(
            name, f"the record would have {fields} fields; at most {MAX_FIELDS}"
        )
    tags = len(tagset.value(record.tags))
    if tags > MAX_TAGS:
        raise InvalidInput.field(
            tags_name, f"the record would have {tags} tags; at most {MAX_TAGS}"
        )


def state(record: Record, size: int) -> None:
    """Every limit of a client write, on a whole record state of ``size`` encoded bytes.

    Replicated states obey the limits of client writes (SPEC §4), so a node checks a
    remote state, and the result of merging it, with this before anything is written
    (docs/consistency.md, *Limits and merges*). Cleared fields and removed tags count
    towards the size only, as they do for a client's write; their names are checked
    like the present ones' were when they were written.
    """
    key(record.key)
    if size > MAX_RECORD_BYTES:
        raise InvalidInput.field("state", f"the record is {size} bytes; at most {MAX_RECORD_BYTES}")
    if record.home is not None:
        region(record.home.value, "home_region")
    present = record.field_values()
    fields(present)
    for cleared in record.fields.keys() - present.keys():
        segment(cleared, "fields")
    present_tags = sorted(tagset.value(record.tags))
    tags(present_tags)
    no_home_tags(present_tags, "tags")  # the home is the record's own, not a tag
    for removed in record.tags.keys() - set(present_tags):
        tags([removed])
    queue_registers(record)
    for token, grant in record.fence.grants.items():
        owner(grant.owner, f"grants[{token}].owner")
        region(grant.region, f"grants[{token}].region")
        if GRANT_IDENTITY.fullmatch(grant.identity) is None:
            raise InvalidInput.field(
                f"grants[{token}].identity",
                f"an identity is client/NAME or region/NAME, got {grant.identity[:100]!r}",
            )


def queue_registers(record: Record) -> None:
    """The work-queue registers are the four ``QUEUE_REGISTERS``: a status word, an
    ending word and canonical decimal integers of at most 64 bits."""
    for name, reg in record.queue.items():
        where = f"queue.{name[:64]}"
        if name not in QUEUE_REGISTERS:
            raise InvalidInput.field(where, f"a queue register is one of {QUEUE_REGISTERS}")
        if name == STATUS:
            if reg.value not in STATUSES:
                raise InvalidInput.field(where, f"a status is one of {STATUSES}")
        elif name == OUTCOME:
            if reg.value not in ENDINGS:
                raise InvalidInput.field(where, f"an outcome is one of {ENDINGS}")
        elif DECIMAL.fullmatch(reg.value) is None or int(reg.value) >= 1 << 64:
            raise InvalidInput.field(where, "a decimal integer below 2**64, without leading 0")


def state_problem(record: Record, size: int) -> str | None:
    """What :func:`state` would refuse, in words; None when the state is within limits."""
    try:
        state(record, size)
    except InvalidInput as exc:
        return str(exc)
    return None


def owner(value: str, name: str = "owner") -> str:
    if not 1 <= len(value) <= MAX_OWNER_CHARS or not value.isprintable():
        raise InvalidInput.field(name, f"owner must be 1-{MAX_OWNER_CHARS} printable characters")
    return value


def seconds(value: float, name: str, low: float, high: float, default: float) -> float:
    if not math.isfinite(value):
        raise InvalidInput.field(name, "must be a finite number of seconds")
    if value == 0:
        return default
    if not low <= value <= high:
        raise InvalidInput.field(name, f"must be between {low:g} and {high:g} seconds")
    return value


def lease(value: float, name: str = "lease_seconds") -> float:
    return seconds(value, name, MIN_LEASE_S, MAX_LEASE_S, DEFAULT_LEASE_S)


def wait(value: float, name: str = "wait_seconds") -> float:
    return seconds(value, name, 0.0, MAX_WAIT_S, 0.0)


def page_size(value: int, name: str = "page_size") -> int:
    if value == 0:
        return DEFAULT_PAGE_SIZE
    if not 1 <= value <= MAX_PAGE_SIZE:
        raise InvalidInput.field(name, f"must be 1-{MAX_PAGE_SIZE}")
    return value
