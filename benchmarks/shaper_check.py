#!/usr/bin/env python
"""The testbed's shapers against a link: what a transfer after an idle spell, and an all-to-all of every
rank at once, take on each (``benchmarks/common.py``, ``SHAPERS``), against the line rate.

    python benchmarks/shaper_check.py [--rates 100mbit 1gbit] [--ranks 8]

For each shaper and rate, in a fresh ``scripts/shaped-cluster`` namespace:

1. ``idle``: one TCP connection sends SIZE bytes after 50 ms idle and waits for a one-byte reply,
   9 times (median); a link sends them in SIZE / rate, a token bucket lets its burst through at once;
2. ``alltoall``: ``--ranks`` processes, connected each to each, send 70 KB to every other rank at
   once, 6 rounds a second apart (median round, the slowest rank's); and the shaper's drops
   (``tc -s qdisc``): a queue too short for every rank's window drops, and TCP then recovers.

Writes benchmarks/results/shaper_check.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

IDLE_SIZES = (100_000, 300_000)
A2A_BYTES, A2A_ROUNDS, BASE_PORT = 70_000, 6, 29900


def idle_probe(size: int, gap: float = 0.05, reps: int = 9) -> float:
    """Median seconds to send ``size`` bytes after ``gap`` idle and read a one-byte reply."""
    srv = socket.create_server(("127.0.0.1", 0))

    def sink():
        c, _ = srv.accept()
        while True:
            got = 0
            while got < size:
                b = c.recv(1 << 20)
                if not b:
                    return
                got += len(b)
            c.sendall(b"k")

    threading.Thread(target=sink, daemon=True).start()
    s = socket.create_connection(srv.getsockname())
    times = []
    for _ in range(reps):
        time.sleep(gap)
        t0 = time.perf_counter()
        s.sendall(bytes(size))
        s.recv(1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _a2a_rank(r: int, n: int, start: float, q) -> None:
    srv = socket.create_server(("127.0.0.1", BASE_PORT + r), backlog=n)
    peers = {}

    def accept():
        for _ in range(n - 1 - r):
            c, _ = srv.accept()
            peers[int(c.recv(4).decode())] = c

    t = threading.Thread(target=accept)
    t.start()
    time.sleep(0.5)
    for j in range(r):
        c = socket.create_connection(("127.0.0.1", BASE_PORT + j))
        c.sendall(b"%04d" % r)
        peers[j] = c
    t.join()
    buf, times = bytes(A2A_BYTES), []

    def recv(c):  # this round's bytes only (the next round's may follow them)
        got = 0
        while got < A2A_BYTES:
            b = c.recv(min(1 << 20, A2A_BYTES - got))
            if not b:
                raise ConnectionError("shaper_check: a peer closed its connection")
            got += len(b)

    for k in range(A2A_ROUNDS):
        time.sleep(max(0.0, start + 0.5 + k - time.time()))  # every rank starts the round at once
        t0 = time.perf_counter()
        threads = [threading.Thread(target=c.sendall, args=(buf,)) for c in peers.values()]
        threads += [threading.Thread(target=recv, args=(c,)) for c in peers.values()]
        for x in threads:
            x.start()
        for x in threads:
            x.join()
        times.append(time.perf_counter() - t0)
    q.put(times)


def alltoall_probe(n: int) -> dict:
    """Median seconds of a round (the slowest rank's) and the loopback shaper's drops."""
    q, start = mp.Queue(), time.time() + 1.0
    procs = [mp.Process(target=_a2a_rank, args=(r, n, start, q)) for r in range(n)]
    for p in procs:
        p.start()
    res = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    qdisc = subprocess.run(["tc", "-s", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
    drops = re.search(r"dropped (\d+)", qdisc)
    return {"round_s": statistics.median(max(x[k] for x in res) for k in range(A2A_ROUNDS)),
            "drops": int(drops.group(1)) if drops else None}


def worker(args) -> None:
    out = {"idle": {str(s): idle_probe(s) for s in IDLE_SIZES}}
    if args.only != "idle":
        out["alltoall"] = alltoall_probe(args.ranks)
    print(json.dumps(out))


def rate_bits(rate: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)bit", rate.lower())
    if m is None:
        raise SystemExit(f"shaper_check: rate must look like 100mbit or 1gbit, got {rate!r}")
    return float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def render(doc) -> str:
    lines = ["# The testbed's shapers against a link", "", f"`{doc['command']}`; load at start "
             f"{doc['loadavg_start']}. A link would take the line-rate time; ms are medians (module doc).", "",
             "| shaper | rate | after idle: 100 KB ms (line) | 300 KB ms (line) | alltoall round ms (line) | drops |",
             "|---|---|---|---|---|---|"]
    for r in doc["results"]:
        line = {k: f"{v * 1e3:.1f} ({r['line_s'][k] * 1e3:.1f})" for k, v in r["idle"].items()}
        a = r["alltoall"]
        lines.append(f"| {r['shaper']} | {r['rate']} | {line[str(IDLE_SIZES[0])]} | {line[str(IDLE_SIZES[1])]} | "
                     f"{a['round_s'] * 1e3:.0f} ({r['line_s']['alltoall'] * 1e3:.0f}) | {a['drops']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    import common

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--only", choices=["idle"], default=None, help="the worker: only the idle probe")
    common.add_load_option(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    common.refuse_if_loaded(args)
    machine, load, results = common.machine_info(), common.loadavg(), []
    for shaper in common.SHAPERS:
        for rate in args.rates:
            cmd = common.shaped_prefix(rate, shaper=shaper) + [common.PY, __file__, "--worker",
                                                               "--ranks", str(args.ranks)]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=common.child_env())
            if r.returncode != 0:
                raise SystemExit(f"shaper_check: {shaper} at {rate} failed:\n{r.stderr[-2000:]}")
            res = json.loads(r.stdout.strip().splitlines()[-1])
            bits = rate_bits(rate)
            res.update(shaper=shaper, rate=rate, line_s={**{str(s): 8 * s / bits for s in IDLE_SIZES},
                       "alltoall": 8 * args.ranks * (args.ranks - 1) * A2A_BYTES / bits})
            results.append(res)
    common.save_results("shaper_check", common.results_doc("shaper_check.py", argv, machine, load, results), render)


if __name__ == "__main__":
    main()
