"""The forger's forgeries, pushed into real nodes: each refused by the rule named for it.

No containers: in-process nodes on loopback serving mutual TLS (tests/cluster.py),
certificates of a development CA, alice's live claim at us, and the hostile peer
posing as eu with eu's own node certificate and key — the chaos tier's ``forge``
fault in miniature. A forgery that stopped testing its rule (merged, or refused by
another rule first) shows here before a chaos run reports it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fencemark.node.crdt.hlc import wall_clock_ms
from fencemark.node.security.signing import Signer
from fencemark.node.security.tls import init_dir
from tests.chaos.forger import (
    KEPT,
    RULES,
    Refusals,
    birth_forgeries,
    bound_forgeries,
    claim_forgeries,
    own_birth_forgery,
    queue_forgeries,
)
from tests.cluster import Cluster, wait_converged
from tests.test_signed_grants import REGIONS, claimed_at_us, client, files, push, state_of


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    directory = tmp_path / "certs"
    init_dir(directory, regions=REGIONS, clients=["alice"])
    return directory


@pytest.mark.slow
async def test_every_forgery_is_refused_by_the_rule_named_for_it(
    tmp_path: Path, certs: Path
) -> None:
    async with Cluster(tmp_path, REGIONS) as cluster:
        key, token, _ = await claimed_at_us(cluster, certs, "held")
        us = cluster.nodes["us"]
        field = f"progress.alice.{token}.0"
        async with client(us, certs) as alice:
            await alice.update(key, fields={field: "alice"}, fencing_token=token)
        await wait_converged([us, cluster.nodes["eu"]])
        held = await state_of(us, key)
        assert held.fence.unreleased() and held.fence.fence == token
        assert held.seen.keys() == {"eu"}  # eu held alice's claim, and said so

        now = wall_clock_ms()
        eu = Signer.from_files(files(certs, "eu"))
        forged = [
            *bound_forgeries(held, now),
            *queue_forgeries(held, now, eu),
            *birth_forgeries(held, "ap", eu),
            *own_birth_forgery(held, "eu", eu),
            *claim_forgeries(
                held, now, posing="eu", signer=eu, home_node=us.storage.node_id, field=field
            ),
        ]
        assert sorted(name for name, _ in forged) == sorted(RULES)  # each kind, once

        async with client(us, certs) as reader:
            refusals = await Refusals.at(reader, "eu")
            assert refusals.node_id == us.storage.node_id
            kept = held
            for name, state in forged:
                assert await push(us, certs, "eu", state) == (name in KEPT), name
                last = us.replicator.peer_stats("eu").last_refusal
                assert await refusals.of(key) == RULES[name], (name, last)
                if name in KEPT:
                    kept = kept.merge(state)
                    assert (await state_of(us, key)).home_region == "us"
            # Nothing was refused since: no new refusal reads as none.
            assert await refusals.of(key) == ""

        # Nothing changed but the void birth kept as evidence, and alice's claim is
        # hers: she writes under it and releases.
        assert await state_of(us, key) == kept and kept.creators == {"us"}
        async with client(us, certs) as alice:
            await alice.update(key, fields={f"progress.alice.{token}.1": "alice"},
                               fencing_token=token)  # fmt: skip
            assert (await alice.release_claim(key, token)).released
