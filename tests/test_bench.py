"""``fencemark bench --quick`` end to end: every scenario produces numbers and files,
each run once (the change feed's in a test of its own, which needs no baseline).

A smoke test of the benchmark harness (issue 6), run against the real thing —
node processes, etcd and a durable Redis from Debian packages. It asserts
nothing about speed: figures from a shared two-core machine are for
``docs/performance.md``, never for pass/fail. Without ``etcd`` or
``redis-server`` it skips locally and fails under CI (``.ci/run`` installs them).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from fencemark.bench.runner import DOCS_BEGIN, DOCS_END
from fencemark.bench.scenarios import SCENARIOS
from tests import components
from tests.test_cli import fencemark

pytestmark = pytest.mark.slow

PLOTS = (
    "claim_cycle_latency.png",
    "claim_cycle_rpcs.png",
    "writes_latency.png",
    "replication_lag.png",
    "anti_entropy_bytes.png",
    "anti_entropy_convergence.png",
    "drain_items.png",
    "drain_latency.png",
    "pick_cost.png",
    "wan_latency.png",
    "wan_cut.png",
    "fleet_cost.png",
    "fleet_wakes.png",
    "failover_timeline.png",
)


@pytest.fixture(scope="module")
def servers() -> None:
    components.require("etcd", "redis")


def numbers(value: Any) -> list[float]:
    """Every number in a JSON value."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers(v)]
    return []


# Run by the test of its own below, which needs no baseline server: not twice.
ALONE = ("feed",)


@pytest.mark.long  # about three minutes
async def test_the_quick_benchmark_runs_every_scenario_and_writes_its_results(
    servers: None, tmp_path: Path
) -> None:
    results = tmp_path / "results"
    chosen = [name for name in SCENARIOS if name not in ALONE]
    ran = await fencemark("bench", *chosen, "--quick", "--results", str(results), limit_s=420)
    assert ran.code == 0, ran.stdout + ran.stderr[-4000:]
    report = json.loads((results / "results.json").read_text())
    assert report["mode"] == "quick"
    assert report["failed"] == {}
    assert set(report["scenarios"]) == set(chosen) == set(SCENARIOS) - set(ALONE)
    for name, scenario in report["scenarios"].items():
        figures = numbers(scenario["data"])
        assert figures and all(math.isfinite(f) for f in figures), (name, scenario["data"])
        for target in scenario["targets"]:
            assert target["measured"] is not None, (name, target)
            assert target["met"] in (True, False), (name, target)
    claims = report["scenarios"]["claims"]["data"]
    for clients in ("1", "16", "64"):
        for system in ("fencemark", "grpc-health", "etcd", "redis"):
            row = claims[clients][system]
            assert row["ops_per_s"] > 0 and row["errors"] == 0, (clients, system, row)
            # Each server's CPU per call, and the load generator's, were measured.
            assert row["server_ms_per_call"] >= 0 and row["loader_ms_per_call"] > 0, row
        assert claims[clients]["fencemark"]["server_ms_per_call"] > 0
    writes = report["scenarios"]["writes"]["data"]
    assert all(writes[c]["update"]["server_ms_per_call"] > 0 for c in ("1", "16", "64"))
    drain = report["scenarios"]["drain"]["data"]
    assert all(drain[a]["fencemark"]["server_ms_per_op"] > 0 for a in ("1", "16", "64"))
    wan = report["scenarios"]["wan"]["data"]
    for system in ("fencemark", "etcd", "redis"):
        row = wan["windows"]["4"]["50"][system]
        assert all(row[r]["items"] > 0 for r in ("us", "eu", "ap")), (system, row)
        ledger = wan["ledger"][system]
        assert ledger["finished"] > 0 and (ledger["done_twice"], ledger["lost"]) == (0, 0), ledger
        assert wan["cut"][system]["steady"]["ap"]["items"] > 0, (system, wan["cut"][system])
    # Cut off, ap drains its own items on Fencemark, and can do nothing on the others:
    # its etcd member has no quorum, and Redis is across the cut.
    assert wan["cut"]["fencemark"]["cut"]["ap"]["items"] > 0
    assert wan["cut"]["etcd"]["cut"]["ap"]["items"] == 0
    assert wan["cut"]["redis"]["cut"]["ap"]["items"] == 0
    assert wan["ledger"]["fencemark"]["identical"]
    # The harness checked itself: every baseline that crosses the network paid R.
    assert not any("no delay applied" in n for n in report["scenarios"]["wan"]["notes"])
    fleet_data = report["scenarios"]["fleet"]["data"]
    fleet = fleet_data["fleets"][0]
    assert fleet["agents"] == 100 and fleet["lapsed"] == 0 and fleet["renewals"] > 0
    assert fleet["woken_per_item"] >= 1 and fleet["work_claims"] > 0
    assert fleet["mcp_waiters"] > 0 and fleet["errors"] == {} and fleet["timeouts"] == 0
    # Every agent on a connection of its own: one descriptor each at the node.
    assert fleet["fds"] - fleet_data["base"]["fds"] >= 100
    across = fleet_data["regions"][0]  # waiters in us, items homed in eu
    assert across["woken_per_item"] >= 1 and across["calls_eu_per_item"] >= 1
    assert across["errors"] == {}
    check_failover(report["scenarios"]["failover"]["data"])
    markdown = (results / "results.md").read_text()
    assert "### Targets" in markdown and "| target |" in markdown
    for plot in PLOTS:
        assert (results / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot
    assert "results.md" in ran.stdout


def check_failover(data: dict[str, Any]) -> None:
    """The failover scenario's figures are all there, and Fencemark's ledger is clean:
    nothing done twice, lost or granted twice, no claim lost by its holder. (How long
    the failover took is for docs/performance.md: only that it ended.)"""
    for system in ("fencemark", "etcd", "redis"):
        row = data["failover"][system]
        for figure in ("window_s", "rate_before", "rate_after", "p99_before_ms", "p99_after_ms"):
            assert row[figure] is not None and row[figure] > 0, (system, figure, row)
        # A backlog that ran out early shows as a missing window or rate above (it is
        # sized from a steady rate of this run; a loaded machine may make that low).
        assert row["finished"] > 0, (system, row)
    fm = data["failover"]["fencemark"]
    clean = ("done_twice", "handed_out_twice", "lost", "tokens_reused", "tokens_below_earlier",
             "claims_lost")  # fmt: skip
    assert {figure: fm[figure] for figure in clean} == dict.fromkeys(clean, 0), fm
    assert fm["new_decider"] != fm["killed"] and fm["identical"], fm
    assert fm["holders"] > 0 and fm["holder_renewals"] >= fm["holders"], fm
    # An etcd window of a second may catch no take in flight: only Fencemark's holders
    # are there by design (``Holder``).
    assert fm["claims_across"] > 0, fm
    price = data["price"]
    for setup in ("one_node", "three_members"):
        drain, cycles = price[setup]["drain"], price[setup]["cycles"]
        assert drain["ops_per_s"] > 0 and drain["exactly_once"], (setup, drain)
        assert cycles["ops_per_s"] > 0 and cycles["errors"] == 0, (setup, cycles)
    assert price["drain_ratio"] > 0 and price["cycle_ratio"] > 0, price
    three = price["three_members"]["drain"]
    assert 0 < three["deciding_cpu_ms_per_item"] < three["cpu_ms_per_item"], three
    assert price["own_machines_bound"] > 0, price
    for system in ("etcd", "redis"):
        assert data["steady"][system]["rate"] > 0, (system, data["steady"][system])


async def test_the_quick_feed_scenario_delivers_every_write_to_every_watcher(
    tmp_path: Path,
) -> None:
    """``fencemark bench feed --quick``: three node processes on loopback, a writer at us,
    a watcher per region, then 0, 1 and 100 watchers at us while writers write. Every
    acknowledged write reaches every watcher, each region's event count is the writes',
    and the figures are ordered and positive; how fast is for docs/performance.md."""
    results = tmp_path / "results"
    ran = await fencemark("bench", "feed", "--quick", "--results", str(results), limit_s=120)
    assert ran.code == 0, ran.stdout + ran.stderr[-4000:]
    report = json.loads((results / "results.json").read_text())
    assert report["failed"] == {} and list(report["scenarios"]) == ["feed"]
    data = report["scenarios"]["feed"]["data"]
    delivery, writes = data["delivery"], data["delivery"]["writes"]
    assert writes > 0 and delivery["errors"] == 0
    for region in ("us", "eu", "ap"):
        row = delivery[region]
        assert (row["delivered"], row["undelivered"]) == (writes, 0), (region, row)
        # A region that merged two writes of a record shows one event for both.
        assert row["events"] + row["merged"] == writes, (region, row)
        assert row["p50_ms"] <= row["p99_ms"] <= row["max_ms"], row
    assert delivery["us"]["merged"] == 0  # the writer's own node commits each write alone
    assert delivery["cross_region"]["delivered"] == 2 * writes
    # A push follows the commit it carries; at the writer's own node the event may
    # come before the writer hears its acknowledgement (a latency of 0 or less).
    assert delivery["cross_region"]["p50_ms"] > 0 and delivery["cross_region"]["max_ms"] > 0
    for watchers in ("0", "1", "100"):
        row = data["cost"][watchers]
        assert row["writes"] > 0 and row["errors"] == 0, (watchers, row)
        assert row["events_missed"] == 0, (watchers, row)  # every watcher took every write
        assert row["writes_per_s"] > 0 and row["node_cpu_ms_per_write"] > 0, (watchers, row)
        assert 0 < row["p50_ms"] <= row["p99_ms"], (watchers, row)
    assert data["cost"]["0"]["rate_vs_none"] == 1.0
    assert (results / "feed_latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "### Change feed" in (results / "results.md").read_text()


async def test_a_full_run_writes_its_headline_between_the_markers_of_the_docs(
    tmp_path: Path,
) -> None:
    """The headline section is rewritten in place; what surrounds it stays."""
    from fencemark.bench.results import ScenarioResult, Settings, Table, at_most
    from fencemark.bench.runner import write_docs

    docs = tmp_path / "performance.md"
    docs.write_text(f"# Performance\n\nbefore\n\n{DOCS_BEGIN}\nold\n{DOCS_END}\n\nafter\n")
    plot = tmp_path / "plot.png"
    plot.write_bytes(b"\x89PNG\r\n\x1a\n")
    result = ScenarioResult(
        "lag",
        "Replication lag",
        {"p99_ms": 12.0},
        [Table("Lag", ["seen at", "p99 ms"], [["eu", "12.0"]])],
        [at_most("replication lag p99", 12.0, 50, " ms")],
        [plot],
    )
    write_docs([result], Settings.full(), tmp_path, docs)
    text = docs.read_text()
    assert text.startswith("# Performance\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "old" not in text
    assert "| replication lag p99 | ≤ 50 ms | 12.00 ms | **met** |" in text
    assert (tmp_path / "performance" / "plot.png").exists()
    assert "![plot](performance/plot.png)" in text


async def test_a_run_of_some_scenarios_rewrites_only_their_part_of_the_headline(
    tmp_path: Path,
) -> None:
    """``fencemark bench drain --docs FILE`` keeps what the other scenarios wrote."""
    from fencemark.bench.headline import parse
    from fencemark.bench.results import ScenarioResult, Settings, Table, at_least, at_most
    from fencemark.bench.runner import write_docs

    docs = tmp_path / "performance.md"
    docs.write_text(f"# Performance\n\n{DOCS_BEGIN}\nold\n{DOCS_END}\n")

    def lag(p99: float) -> ScenarioResult:
        return ScenarioResult(
            "lag",
            "Replication lag",
            {"p99_ms": p99},
            [Table("Lag", ["seen at", "p99 ms"], [["eu", f"{p99:.1f}"]])],
            [at_most("replication lag p99", p99, 50, " ms")],
        )

    drain = ScenarioResult(
        "drain",
        "Draining a backlog",
        {"ratio": 2.0},
        [Table("Drain", ["agents", "items/s"], [["16", "900"]])],
        [at_least("drained items/s / etcd, 16 agents", 2.0, 1.5, "x"),
         at_most("p99 per drained item, 16 agents", 30.0, 20, " ms")],
    )  # fmt: skip
    write_docs([drain, lag(60.0)], Settings.full(), tmp_path, docs)
    write_docs([lag(12.0)], Settings.full(), tmp_path, docs)
    text = docs.read_text()
    assert "old" not in text and "60.0" not in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[:3] == [
        "| target | goal | measured | verdict |",
        "| replication lag p99 | ≤ 50 ms | 12.00 ms | **met** |",  # SCENARIOS order
        "| drained items/s / etcd, 16 agents | ≥ 1.5x | 2.00x | **met** |",
    ]
    assert "| p99 per drained item, 16 agents | ≤ 20 ms | 30.00 ms | **NOT met** |" in rows
    assert text.index("### Replication lag") < text.index("### Draining a backlog")
    assert "| 16 | 900 |" in text and "| eu | 12.0 |" in text
    before = parse(text.split(DOCS_BEGIN)[1])
    write_docs([lag(13.0)], Settings.full(), tmp_path, docs)
    after = parse(docs.read_text().split(DOCS_BEGIN)[1])
    assert list(after) == ["lag", "drain"] and after["drain"] == before["drain"]
    assert after["lag"].targets == ["| replication lag p99 | ≤ 50 ms | 13.00 ms | **met** |"]


async def test_the_shard_measurement_runs_one_and_two_processes_without_errors() -> None:
    """``python -m fencemark.bench.shards`` (docs/scaling.md), one short repeat: the
    claim cycles run on one node process and split over two, every cycle completes,
    and the CPU it reports is the node processes' own."""
    from fencemark.bench.shards import compare

    ((one, two),) = await compare(clients=4, seconds=1.5, repeats=1)
    for run, processes in ((one, 1), (two, 2)):
        assert (run.processes, run.clients, run.errors) == (processes, 4, 0), run
        assert run.cycles_per_s > 0 and run.node_cores > 0 and run.cpu_ms_per_cycle > 0, run
