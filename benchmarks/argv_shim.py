#!/usr/bin/env python
"""Run a Python script with extra arguments taken from the environment.

    BENCH_EXTRA_ARGS='["--log", "/tmp/x"]' horovodrun -np 2 --gloo python benchmarks/argv_shim.py scripts/train.py --epochs 2

Launchers (horovodrun, torchrun) parse their whole command line with argparse
and reject arguments of the training script that look like an abbreviation of
one of theirs (``--log`` is ambiguous to both). Arguments in BENCH_EXTRA_ARGS
(a JSON list) never pass through the launcher: this shim appends them to the
script's argv and runs it as ``__main__``.
"""
import json
import os
import runpy
import sys

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: argv_shim.py SCRIPT [ARGS...]  (extra args in $BENCH_EXTRA_ARGS)")
    script = sys.argv[1]
    extra = json.loads(os.environ.get("BENCH_EXTRA_ARGS", "[]"))
    sys.argv = [script] + sys.argv[2:] + [str(x) for x in extra]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
