#!/usr/bin/env bash
# Newcomer command (a): set everything up, then run the main job:
# a short 2-rank data-parallel training run on MNIST-1D that prints test accuracy,
# bytes on the wire per step and time per step -- plain Horovod first, then hvd_ext,
# on the same network, and the ratio between the two.
#   bash scripts/main.sh                                    # compression=auto, 300 Mbit/s shaped loopback
#   COMPRESSION=qdist:bits=3 EPOCHS=4 bash scripts/main.sh   # any spec from hvd_ext.list_compressors()
#   NET=unshaped bash scripts/main.sh                        # or NET=100mbit, 1gbit, ...
# The shaped network needs root and iproute2 (scripts/shaped-cluster: a private network
# namespace whose loopback is rate-limited, removed on exit); without them the job says why
# and runs unshaped.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
EPOCHS="${EPOCHS:-8}"
COMPRESSION="${COMPRESSION:-auto}"
NET="${NET:-300mbit}"
OUT="$ROOT/runs/main"
mkdir -p "$OUT"
PREFIX=()
if [ "$NET" != "unshaped" ]; then
  WHY="$(python -c 'import sys; sys.path.insert(0, "benchmarks"); from common import check_testbed; print(check_testbed() or "")')"
  if [ -z "$WHY" ]; then
    PREFIX=("$ROOT/scripts/shaped-cluster" --rate "$NET" --)
    NETDESC="loopback shaped to $NET (tc tbf in a private network namespace)"
  else
    echo "== cannot shape the network ($WHY): running unshaped"
    NETDESC="unshaped loopback ($WHY)"
  fi
else
  NETDESC="unshaped loopback"
fi
echo "== network: $NETDESC"
echo "== plain Horovod: horovodrun -np 2 python scripts/train.py --plain-horovod --epochs $EPOCHS"
"${PREFIX[@]}" horovodrun -np 2 -H localhost:2 --gloo python scripts/train.py --plain-horovod --epochs "$EPOCHS" \
  --json "$OUT/plain.json" "$@"
echo "== hvd_ext: horovodrun -np 2 python scripts/train.py --compression $COMPRESSION --epochs $EPOCHS"
"${PREFIX[@]}" horovodrun -np 2 -H localhost:2 --gloo python scripts/train.py --compression "$COMPRESSION" \
  --epochs "$EPOCHS" --json "$OUT/hvd_ext.json" "$@"
python scripts/main_summary.py "$OUT/plain.json" "$OUT/hvd_ext.json" "$NETDESC"
