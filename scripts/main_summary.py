#!/usr/bin/env python
"""Compare the main job's two runs (plain Horovod, hvd_ext) measured on the same network.

    python scripts/main_summary.py PLAIN.json HVD_EXT.json "network description"
"""
from __future__ import annotations

import json
import sys


def main(argv):
    plain, ext = (json.load(open(p)) for p in argv[1:3])
    net = argv[3] if len(argv) > 3 else "?"
    print(f"\n== main job summary ({plain['ranks']} ranks, {plain['epochs']} epochs, network: {net})")
    print(f"{'':28}{'plain Horovod':>16}{'hvd_ext':>16}{'hvd_ext / Horovod':>20}")
    rows = [("test accuracy (%)", 100 * plain["test_acc"], 100 * ext["test_acc"], None),
            ("ms per step", plain["ms_per_step"], ext["ms_per_step"], ext["ms_per_step"] / plain["ms_per_step"]),
            ("bytes sent per step", plain["bytes_sent_per_step"], ext["bytes_sent_per_step"],
             ext["bytes_sent_per_step"] / max(plain["bytes_sent_per_step"], 1e-9)),
            ("train time (s)", plain["train_time_s"], ext["train_time_s"],
             ext["train_time_s"] / plain["train_time_s"])]
    for label, a, b, r in rows:
        print(f"{label:<28}{a:>16.2f}{b:>16.2f}{(f'{r:.3f}x' if r is not None else f'{b - a:+.2f} pts'):>20}")
    print(f"hvd_ext compression: {ext['compression']}")
    if ext.get("auto"):
        print(f"auto's choice per bucket: {ext['auto'].get('choice')}")


if __name__ == "__main__":
    main(sys.argv)
