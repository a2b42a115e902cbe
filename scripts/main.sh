#!/usr/bin/env bash
# Newcomer command (a): set everything up, then run the main job:
# a short 2-rank data-parallel training run on MNIST-1D that prints test accuracy,
# bytes on the wire per step and time per step, plain Horovod first, then hvd_ext.
#   bash scripts/main.sh                      # defaults
#   COMPRESSION=fp16 EPOCHS=4 bash scripts/main.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
EPOCHS="${EPOCHS:-8}"
COMPRESSION="${COMPRESSION:-randomk:ratio=0.01}"
for spec in none "$COMPRESSION"; do
  echo "== horovodrun -np 2 python scripts/train.py --compression $spec --epochs $EPOCHS"
  horovodrun -np 2 --gloo python scripts/train.py --compression "$spec" --epochs "$EPOCHS" "$@"
done
