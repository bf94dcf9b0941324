"""The authorization table and the access map file (fencemark.node.api.authz)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fencemark.node.api.authz import METHOD_RIGHTS, AccessMap, Right, load_access, parse_access
from fencemark.node.api.handlers import SERVICES
from fencemark.node.rules.admission import Caller
from fencemark.node.rules.errors import Denial, PermissionDenied
from fencemark.node.security.tls import Identity


def test_every_method_of_every_service_needs_a_right() -> None:
    methods = {f"/{s.full_name}/{m.name}" for s in SERVICES for m in s.methods}
    assert methods == set(METHOD_RIGHTS)


def test_a_method_missing_from_the_table_is_refused_to_everyone() -> None:
    denied = AccessMap().check(Identity("client", "alice"), "/fencemark.v1.Records/Future")
    assert denied is not None and denied.denial is Denial.MISSING_RIGHT


def test_nodes_read_and_replicate_clients_get_what_the_map_says() -> None:
    access = parse_access({"clients": {"alice": ["read"], "*": ["read", "write"]}})
    node = Identity("region", "eu")
    assert access.rights(node) == {Right.READ, Right.REPLICATE}
    assert access.rights(Identity("client", "alice")) == {Right.READ}
    assert access.rights(Identity("client", "bob")) == {Right.READ, Right.WRITE}
    assert parse_access({"clients": {}}).rights(Identity("client", "bob")) == frozenset()
    assert AccessMap().check(None, "/fencemark.v1.Records/Get") is not None


def test_access_files_in_toml_and_json(tmp_path: Path) -> None:
    toml = tmp_path / "access.toml"
    toml.write_text('[clients]\nalice = ["read", "claim"]\n')
    as_json = tmp_path / "access.json"
    as_json.write_text(json.dumps({"clients": {"alice": ["read", "claim"]}}))
    for path in (toml, as_json):
        assert load_access(path).rights(Identity("client", "alice")) == {Right.READ, Right.CLAIM}


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"clients": {"alice": ["fly"]}}, "rights are"),
        ({"clients": {"alice": ["replicate"]}}, "node certificates only"),
        ({"clients": {"al ice": ["read"]}}, "client"),
        ({"clients": {"alice": "read"}}, "list of rights"),
        ({"users": {}}, "unknown keys"),
    ],
)
def test_a_bad_access_map_is_refused_in_words(data: dict[str, object], says: str) -> None:
    with pytest.raises(Exception, match=says):
        parse_access(data)


def test_acting_for_others_is_a_right_of_the_map_and_no_method_needs_it() -> None:
    """``act-for-others`` only widens what the claim rules accept (``admission.acts_for``):
    the default (no map) gives it to no one, and it is no method's right."""
    access = parse_access({"clients": {"ops": ["claim", "act-for-others"], "alice": ["claim"]}})
    assert access.caller(Identity("client", "ops")) == Caller("client/ops", acts_for_others=True)
    assert access.caller(Identity("client", "alice")) == Caller("client/alice")
    assert not AccessMap().caller(Identity("client", "alice")).acts_for_others
    assert not access.caller(Identity("region", "eu")).acts_for_others
    assert Right.ACT_FOR_OTHERS not in METHOD_RIGHTS.values()
    with pytest.raises(PermissionDenied):
        access.caller(None)


def test_the_rights_table_of_security_md_is_the_code_s() -> None:
    """docs/security.md's table of rights and methods says what METHOD_RIGHTS says,
    row for row (it once said ForceRelease needed act-for-others; it needs operate)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "security.md").read_text()
    table = text[text.index("| right | methods |") :].split("\n\n", 1)[0]
    documented: dict[str, set[str]] = {}
    for row in table.splitlines()[2:]:
        right, methods = (cell.strip() for cell in row.strip("|").split("|", 1))
        documented[right.strip("`")] = set(re.findall(r"`(\w+\.\w+)`", methods))
    in_code: dict[str, set[str]] = {right.value: set() for right in Right}
    for method, right in METHOD_RIGHTS.items():
        in_code[right.value].add(method.removeprefix("/fencemark.v1.").replace("/", "."))
    assert documented == in_code
