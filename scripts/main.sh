#!/usr/bin/env bash
# Newcomer command (a): set everything up, then run the main job:
# a short 2-rank data-parallel training run on MNIST-1D that prints test accuracy,
# bytes on the wire per step and time per step -- plain Horovod first, then hvd_ext.
#   bash scripts/main.sh                                   # defaults: 8 epochs, top-k 1% (whole-model budget)
#   COMPRESSION=qdist:bits=3 EPOCHS=4 bash scripts/main.sh  # any spec from hvd_ext.list_compressors()
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
EPOCHS="${EPOCHS:-8}"
COMPRESSION="${COMPRESSION:-topk:ratio=0.01,scope=model}"
echo "== plain Horovod: horovodrun -np 2 python scripts/train.py --plain-horovod --epochs $EPOCHS"
horovodrun -np 2 --gloo python scripts/train.py --plain-horovod --epochs "$EPOCHS" "$@"
echo "== hvd_ext: horovodrun -np 2 python scripts/train.py --compression $COMPRESSION --epochs $EPOCHS"
horovodrun -np 2 --gloo python scripts/train.py --compression "$COMPRESSION" --epochs "$EPOCHS" "$@"
