#!/usr/bin/env bash
# One rule module's mutation run: `mutation/run.sh hlc` (what `make mutate MODULE=hlc`
# runs for each module). Session, filter, baseline, every mutant, score:
# build/mutation/<module>.{sqlite,txt}. docs/testing.md, *Mutation testing*.
set -euo pipefail
cd "$(dirname "$0")/.."
module=${1:?usage: mutation/run.sh MODULE (one of mutation/*.toml)}
config=mutation/$module.toml
[[ -f $config && $module != operators ]] || { echo "no mutation config for '$module'"; exit 2; }
bin=.venv/bin
out=build/mutation
session=$out/$module.sqlite
path=$(sed -n 's/^module-path = "\(.*\)"$/\1/p' "$config")

# cosmic-ray writes each mutant into the work tree and puts the file back after its
# test run. Start only from a committed file, so that whatever stops a run midway,
# the file is restored from git on the way out.
git diff --quiet HEAD -- "$path" || {
  echo "$path has uncommitted changes: commit or stash them first"; exit 2; }
trap 'git checkout -q HEAD -- "$path"' EXIT

mkdir -p "$out"
"$bin/cosmic-ray" init --force "$config" "$session"
"$bin/cr-filter-operators" "$session" mutation/operators.toml
echo "== $module: baseline (the unmutated module must pass its tests)"
"$bin/cosmic-ray" baseline "$config"
started=$(date +%s)
"$bin/cosmic-ray" exec "$config" "$session"
"$bin/python" mutation/score.py "$session" --module "$module" \
  --seconds $(( $(date +%s) - started )) | tee "$out/$module.txt"
