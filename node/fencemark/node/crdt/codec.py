"""Canonical byte encoding of a record state, and its digest.

Equal states have equal bytes on every node: maps are written sorted by key,
integers as minimal unsigned LEB128 varints, strings as varint length + UTF-8,
booleans as one byte. ``decode`` accepts only canonical input (sorted, unique
keys, minimal varints, nothing trailing), so ``encode(decode(b)) == b`` for every
``b`` it accepts and the digest of a state is well defined.

Layout (format 6)::

    0x06 key births fields tags deleted grants lease_expiry released lapsed seals moved queue
         seen lease_seals
    births       = n (region stamp signature)*  sorted by region
    fields       = n (name stamp str signature)*  sorted by name
    tags         = n (tag stamp bool signature)*  sorted by tag
    deleted      = stamp bool signature
    grants       = n (token hlc owner region identity signature)*  sorted by token;
                   signature = bytes, empty on every grant but the fence's
    lease_expiry = n (token expiry_ms)*         sorted by token
    released     = n token*                     ascending
    lapsed       = n token*                     ascending
    seals        = n (token signature)*         sorted by token; the fence's only
    moved        = token signature
    queue        = n (name stamp str signature)*  sorted by name (SPEC §8: status, ...)
    seen         = n (region stamp signature)*  sorted by region
    lease_seals  = n (token expiry_ms signature)*  sorted by token; the fence's only
    stamp        = epoch hlc node
    bytes        = varint length, then the bytes

Format 5 had no ``seen`` and no lease seals; format 4 no queue registers either;
format 3 also had no signatures on registers, no seals and no signed move; format 2
also had one optional home (``0x00 | 0x01 stamp str``) instead of births, grants
without an identity, and neither ``lapsed`` nor ``moved``; format 1 also had no
signatures at all. Storage re-encodes them when it opens an older file
(``upgrade``); the wire takes the current format only.

What a home signs for a grant is ``grant_message`` (docs/security.md, *Signed
grants*): the record key, the token and the grant without its signature; for a
write made under a claim, ``write_message``; for the end of a claim, ``end_message``;
for a move, ``move_message``; for a lease's expiry, ``lease_message`` (*Signed
writes*); for having seen a record born elsewhere, ``seen_message`` (*Signed births*).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import TypeVar

from fencemark.node.crdt.fence import FenceState, Grant
from fencemark.node.crdt.hlc import Stamp
from fencemark.node.crdt.lww import LWW
from fencemark.node.crdt.record import Birth, Record

FORMAT = 6
# Before signed grants (1), before births (2), before signed writes (3), before the
# work queue (4), before ``seen`` (5): ``upgrade``.
LEGACY_FORMATS = (1, 2, 3, 4, 5)
GRANT_MESSAGE = b"fencemark grant v1\x00"  # domain separation of grant signatures
BIRTH_MESSAGE = b"fencemark birth v1\x00"  # ... of birth signatures
WRITE_MESSAGE = b"fencemark write v1\x00"  # ... of signed writes
END_MESSAGE = b"fencemark end v1\x00"  # ... of a claim's end (release, lapse)
MOVE_MESSAGE = b"fencemark move v1\x00"  # ... of a moved fence
SEEN_MESSAGE = b"fencemark seen v1\x00"  # ... of a region having seen a record
LEASE_MESSAGE = b"fencemark lease v1\x00"  # ... and of a lease's expiry
DIGEST_SIZE = 16
MAX_UINT = (1 << 64) - 1  # every integer in a state is a uint64 (tokens, stamps, expiries)

T = TypeVar("T")
K = TypeVar("K", int, str)


class DecodeError(ValueError):
    """The bytes are not the canonical encoding of a record state."""


def digest(encoded: bytes) -> bytes:
    """BLAKE2b-128 of a canonical encoding."""
    return hashlib.blake2b(encoded, digest_size=DIGEST_SIZE).digest()


# -- encoding -----------------------------------------------------------------


def _varint(out: bytearray, n: int) -> None:
    if 0 <= n < 0x80:  # most integers in a state (counts, small tokens): one byte
        out.append(n)
        return
    if not 0 <= n <= MAX_UINT:
        raise ValueError(f"cannot encode {n}: integers in a state are uint64")
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _str(out: bytearray, s: str) -> None:
    raw = s.encode("utf-8")
    _varint(out, len(raw))
    out += raw


def _bytes(out: bytearray, raw: bytes) -> None:
    _varint(out, len(raw))
    out += raw


def _stamp(out: bytearray, stamp: Stamp) -> None:
    _varint(out, stamp.epoch)
    _varint(out, stamp.hlc)
    _str(out, stamp.node)


def encode(record: Record) -> bytes:
    out = bytearray([FORMAT])
    _str(out, record.key)
    _births(out, record.births)
    _string_registers(out, record.fields)
    _varint(out, len(record.tags))
    for tag in sorted(record.tags):
        flag = record.tags[tag]
        _str(out, tag)
        _stamp(out, flag.stamp)
        out.append(int(flag.value))
        _bytes(out, flag.signature)
    _stamp(out, record.deleted.stamp)
    out.append(int(record.deleted.value))
    _bytes(out, record.deleted.signature)
    fence = record.fence
    _varint(out, len(fence.grants))
    for token in sorted(fence.grants):
        grant = fence.grants[token]
        _varint(out, token)
        _varint(out, grant.granted_hlc)
        _str(out, grant.owner)
        _str(out, grant.region)
        _str(out, grant.identity)
        _bytes(out, grant.signature)
    _varint(out, len(fence.lease_expiry))
    for token in sorted(fence.lease_expiry):
        _varint(out, token)
        _varint(out, fence.lease_expiry[token])
    for tokens in (fence.released, fence.lapsed):
        _varint(out, len(tokens))
        for token in sorted(tokens):
            _varint(out, token)
    _varint(out, len(fence.seals))
    for token in sorted(fence.seals):
        _varint(out, token)
        _bytes(out, fence.seals[token])
    _varint(out, fence.moved)
    _bytes(out, fence.moved_signature)
    _string_registers(out, record.queue)
    _births(out, record.seen)
    _varint(out, len(fence.lease_seals))
    for token in sorted(fence.lease_seals):
        expiry, signature = fence.lease_seals[token]
        _varint(out, token)
        _varint(out, expiry)
        _bytes(out, signature)
    return bytes(out)


def _births(out: bytearray, births: Mapping[str, Birth]) -> None:
    """Births and sightings: n (region stamp signature)*, sorted by region."""
    _varint(out, len(births))
    for region in sorted(births):
        birth = births[region]
        _str(out, region)
        _stamp(out, birth.stamp)
        _bytes(out, birth.signature)


def _string_registers(out: bytearray, registers: Mapping[str, LWW[str]]) -> None:
    """Fields and queue registers: n (name stamp str signature)*, sorted by name."""
    _varint(out, len(registers))
    for name in sorted(registers):
        reg = registers[name]
        _str(out, name)
        _stamp(out, reg.stamp)
        _str(out, reg.value)
        _bytes(out, reg.signature)


def grant_message(key: str, token: int, grant: Grant) -> bytes:
    """The bytes a home signs for granting ``token`` of ``key``: everything that
    identifies the grant (key, token, granted_hlc, owner, region), canonical."""
    out = bytearray(GRANT_MESSAGE)
    _str(out, key)
    _varint(out, token)
    _varint(out, grant.granted_hlc)
    _str(out, grant.owner)
    _str(out, grant.region)
    if grant.identity:  # grants made before identities were recorded sign without it
        _str(out, grant.identity)
    return bytes(out)


def birth_message(key: str, region: str, birth: Birth) -> bytes:
    """The bytes a region signs for creating ``key``: key, region and birth stamp."""
    return _region_message(BIRTH_MESSAGE, key, region, birth.stamp)


def seen_message(key: str, region: str, seen: Birth) -> bytes:
    """The bytes a region signs for having held ``key``, born elsewhere, at a stamp."""
    return _region_message(SEEN_MESSAGE, key, region, seen.stamp)


def _region_message(domain: bytes, key: str, region: str, stamp: Stamp) -> bytes:
    out = bytearray(domain)
    _str(out, key)
    _str(out, region)
    _stamp(out, stamp)
    return bytes(out)


def lease_message(key: str, token: int, expiry_ms: int) -> bytes:
    """The bytes the node deciding ``token``'s claim on ``key`` signs for setting its
    lease to end at ``expiry_ms`` (a grant, or a renewal)."""
    out = bytearray(LEASE_MESSAGE)
    _str(out, key)
    _varint(out, token)
    _varint(out, expiry_ms)
    return bytes(out)


def write_message(key: str, kind: str, name: str, register: LWW[str] | LWW[bool]) -> bytes:
    """The bytes the node admitting a write under a claim signs for one register it
    wrote: the record key, which register (``kind``: FIELD, TAG, QUEUE or DELETED,
    and its ``name``; ``""`` for DELETED), its stamp and its value."""
    out = bytearray(WRITE_MESSAGE)
    _str(out, key)
    _str(out, kind)
    _str(out, name)
    _stamp(out, register.stamp)
    if isinstance(register.value, bool):
        out.append(int(register.value))
    else:
        _str(out, register.value)
    return bytes(out)


def end_message(key: str, token: int) -> bytes:
    """The bytes the node ending ``token``'s claim on ``key`` (releasing it, or
    recording its lapse) signs."""
    out = bytearray(END_MESSAGE)
    _str(out, key)
    _varint(out, token)
    return bytes(out)


def move_message(key: str, token: int) -> bytes:
    """The bytes a home signs for moving ``key``'s fence to ``token``."""
    out = bytearray(MOVE_MESSAGE)
    _str(out, key)
    _varint(out, token)
    return bytes(out)


# -- decoding -----------------------------------------------------------------


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        pos = self.pos
        if pos >= len(self.data):
            raise DecodeError("truncated")
        self.pos = pos + 1
        return self.data[pos]

    def varint(self) -> int:
        data, pos = self.data, self.pos
        try:
            b = data[pos]
        except IndexError:
            raise DecodeError("truncated") from None
        if b < 0x80:  # the common one-byte case, without the loop
            self.pos = pos + 1
            return b
        n, shift = b & 0x7F, 7
        while True:
            pos += 1
            try:
                b = data[pos]
            except IndexError:
                raise DecodeError("truncated") from None
            if b == 0:
                raise DecodeError("non-minimal varint")
            n |= (b & 0x7F) << shift
            if n > MAX_UINT:
                raise DecodeError("varint exceeds uint64")
            if b < 0x80:
                self.pos = pos + 1
                return n
            shift += 7
            if shift > 63:  # a uint64 takes at most 10 bytes
                raise DecodeError("varint too long")

    def blob(self) -> bytes:
        size = self.varint()
        start = self.pos
        end = start + size
        if end > len(self.data):
            raise DecodeError("truncated bytes")
        self.pos = end
        return self.data[start:end]

    def str(self) -> str:
        size = self.varint()
        start = self.pos
        end = start + size
        if end > len(self.data):
            raise DecodeError("truncated string")
        self.pos = end
        try:
            return self.data[start:end].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DecodeError("invalid UTF-8") from exc

    def bool(self) -> bool:
        b = self.byte()
        if b > 1:
            raise DecodeError(f"invalid boolean byte {b}")
        return b == 1

    def stamp(self) -> Stamp:
        return Stamp(self.varint(), self.varint(), self.str())

    def sorted_map(self, key: Callable[[], K], value: Callable[[], T]) -> dict[K, T]:
        out: dict[K, T] = {}
        previous: K | None = None
        for _ in range(self.varint()):
            k = key()
            if previous is not None and k <= previous:
                raise DecodeError("map keys not strictly ascending")
            out[k] = value()
            previous = k
        return out


def decode(data: bytes) -> Record:
    return _decode(data, FORMAT)


def upgrade(data: bytes) -> bytes:
    """A stored state in the current format: a state of a legacy format is
    re-encoded (grants unsigned if format 1; the home as the one birth before
    format 3; registers unsigned before format 4; no queue registers before
    format 5, no ``seen`` nor lease seals before format 6); others are returned as they
    are. Only storage calls this, when it opens an older file: the wire takes the
    current format only."""
    if data[:1] not in (bytes([fmt]) for fmt in LEGACY_FORMATS):
        return data
    return encode(_decode(data, data[0]))


def _grant(r: _Reader, fmt: int) -> Grant:
    if fmt == 1:
        return Grant(r.varint(), r.str(), r.str())
    if fmt == 2:
        return Grant(r.varint(), r.str(), r.str(), r.blob())
    hlc, owner, region, identity = r.varint(), r.str(), r.str(), r.str()
    return Grant(hlc, owner, region, r.blob(), identity)


def _decode(data: bytes, fmt: int) -> Record:
    r = _Reader(data)
    if r.byte() != fmt:
        raise DecodeError("unknown format")
    key = r.str()
    births: dict[str, Birth]
    if fmt < 3:
        births = {}
        if r.bool():
            stamp = r.stamp()
            births[r.str()] = Birth(stamp)
    else:
        births = r.sorted_map(r.str, lambda: Birth(r.stamp(), r.blob()))
    signed = fmt >= 4
    fields = r.sorted_map(r.str, lambda: LWW(r.stamp(), r.str(), r.blob() if signed else b""))
    tags = r.sorted_map(r.str, lambda: LWW(r.stamp(), r.bool(), r.blob() if signed else b""))
    deleted = LWW(r.stamp(), r.bool(), r.blob() if signed else b"")
    grants = r.sorted_map(r.varint, lambda: _grant(r, fmt))
    lease_expiry = r.sorted_map(r.varint, r.varint)
    released = r.sorted_map(r.varint, lambda: None)
    lapsed: dict[int, None] = {}
    seals: dict[int, bytes] = {}
    moved, moved_signature = 0, b""
    if fmt >= 3:
        lapsed = r.sorted_map(r.varint, lambda: None)
        if signed:
            seals = r.sorted_map(r.varint, r.blob)
        moved = r.varint()
        if signed:
            moved_signature = r.blob()
    queue: dict[str, LWW[str]] = {}
    if fmt >= 5:
        queue = r.sorted_map(r.str, lambda: LWW(r.stamp(), r.str(), r.blob()))
    seen: dict[str, Birth] = {}
    lease_seals: dict[int, tuple[int, bytes]] = {}
    if fmt >= 6:
        seen = r.sorted_map(r.str, lambda: Birth(r.stamp(), r.blob()))
        lease_seals = r.sorted_map(r.varint, lambda: (r.varint(), r.blob()))
    if r.pos != len(data):
        raise DecodeError("trailing bytes")
    fence = FenceState(
        grants,
        lease_expiry,
        frozenset(released),
        frozenset(lapsed),
        moved,
        seals,
        moved_signature,
        lease_seals,
    )
    if any(g.signature for t, g in grants.items() if t != fence.fence):
        raise DecodeError("a signature on a grant that is not the fence")
    if any(t != fence.fence for t in seals):
        raise DecodeError("a seal of a token that is not the fence")
    if moved_signature and not moved:
        raise DecodeError("a signature of a move that was never made")
    if any(t != fence.fence for t in lease_seals):
        raise DecodeError("a lease seal of a token that is not the fence")
    return Record(key, births, fields, tags, deleted, fence, queue, seen)
