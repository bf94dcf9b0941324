"""Summarise a cosmic-ray session: the mutation score and every surviving mutant.

``python mutation/score.py build/mutation/hlc.sqlite --module hlc --seconds 600``
(mutation/run.sh calls it). The score is killed / (killed + survived): mutants the
operator filter skipped are not counted, nor incompetent ones (a mutant that does
not even import). docs/testing.md records the scores and which survivors are
accepted as equivalent.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("session", type=Path)
    parser.add_argument("--module", default="")
    parser.add_argument("--seconds", type=int, default=0, help="wall-clock time of the run")
    args = parser.parse_args()

    cosmic_ray = Path(sys.executable).with_name("cosmic-ray")
    dump = subprocess.run(
        [str(cosmic_ray), "dump", str(args.session)], check=True, capture_output=True, text=True
    ).stdout
    counts: Counter[str] = Counter()
    survivors: list[tuple[str, str]] = []
    for line in dump.splitlines():
        item, result = json.loads(line)
        if result is None:
            counts["pending"] += 1
            continue
        if result["worker_outcome"] == "skipped":
            counts["skipped"] += 1
            continue
        outcome = result["test_outcome"]
        counts[outcome] += 1
        if outcome == "survived":
            (mutation,) = item["mutations"]
            where = f"{mutation['module_path']}:{mutation['start_pos'][0]}"
            survivors.append((f"{where} {mutation['operator_name']}", result.get("diff") or ""))

    judged = counts["killed"] + counts["survived"]
    score = 100 * counts["killed"] / judged if judged else 0.0
    ran = judged + counts["incompetent"]
    print(
        f"{args.module or args.session.stem}: score {score:.1f} % "
        f"({counts['killed']} killed, {counts['survived']} survived, "
        f"{counts['incompetent']} incompetent, {counts['skipped']} skipped by the filter, "
        f"{counts['pending']} pending)"
    )
    if args.seconds and ran:
        print(f"run: {args.seconds} s, {args.seconds / ran:.1f} s per mutant")
    for title, diff in survivors:
        print(f"\nsurvived: {title}")
        changed = [line for line in diff.splitlines() if line.startswith(("+", "-"))]
        print("\n".join(f"    {line}" for line in changed if not line.startswith(("+++", "---"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
