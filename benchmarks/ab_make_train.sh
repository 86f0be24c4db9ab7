#!/usr/bin/env bash
# `make train`'s command, shortened to $STEPS steps, on an older commit and on this checkout, alternated
# $ROUNDS times so that load from other processes hits both alike. Prints the median tokens/s of steps
# 6..end and the final loss of each run.
#   benchmarks/ab_make_train.sh ff2e065            # the commit before the run-plan redesign (issue 15)
set -euo pipefail
OLD_REV=${1:?usage: benchmarks/ab_make_train.sh OLD_COMMIT}
STEPS=${STEPS:-40} ROUNDS=${ROUNDS:-3}
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$HERE/.venv/bin/python}
WORK=$(mktemp -d)
trap 'git -C "$HERE" worktree remove --force "$WORK/old" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
git -C "$HERE" worktree add --detach -q "$WORK/old" "$OLD_REV"
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; old=$OLD_REV new=$(git -C "$HERE" rev-parse --short HEAD)"
for i in $(seq "$ROUNDS"); do
  for side in old new; do
    dir=$HERE; [ "$side" = old ] && dir=$WORK/old
    (cd "$dir" && PYTHONPATH=$dir "$PY" -m seektrain.cli.main train --nproc-per-node 2 --set run.dir="$WORK/$side-$i" \
       --set train.steps="$STEPS" --set run.progress_bar=false --set checkpoint.interval=0 >"$WORK/$side-$i.log" 2>&1)
    "$PY" - "$WORK/$side-$i/metrics.jsonl" "$side" "$i" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
rate = [r["tokens_per_s"] for r in rows[5:] if "tokens_per_s" in r]
print(f"{sys.argv[2]} {sys.argv[3]}: median {statistics.median(rate):.0f} tokens/s, final loss {rows[-1]['loss']:.4f}")
PY
  done
done
