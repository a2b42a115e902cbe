#!/usr/bin/env bash
# Newcomer command (b): set everything up, check the layer contracts (.importlinter), run the tests.
#   bash scripts/test.sh            # all tests
#   bash scripts/test.sh -k sparse  # extra arguments go to pytest
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
lint-imports --config .importlinter
exec python -m pytest -rs -q tests "$@"
