#!/usr/bin/env python
"""Measure point-to-point TCP bandwidth (run inside a shaped namespace / testbed).

One process, over 127.0.0.1 (or --host ADDR, e.g. a node's own address):

    scripts/shaped-cluster --rate 100mbit -- python benchmarks/netprobe.py --mbytes 8

Two processes, e.g. across the nodes of `shaped-cluster --nodes 2` (the receiver
measures and prints; the sender retries connecting for --wait seconds):

    python benchmarks/netprobe.py --listen 5201 --mbytes 8 &     # on node1
    ssh node2 python benchmarks/netprobe.py --connect node1:5201 --mbytes 8

Prints one JSON line: {"mbit_s": ..., "bytes": ..., "seconds": ...} (the sender
of a two-process run prints {"sent": BYTES}). The clock starts after the first
--skip-kb KiB (more than the tbf bucket) so the burst does not inflate it.
"""
import argparse
import json
import socket
import threading
import time


def receive(conn, total, skip):
    got, t0, g0 = 0, None, 0
    while got < total:
        b = conn.recv(1 << 20)
        if not b:
            break
        got += len(b)
        if t0 is None and got >= skip:
            t0, g0 = time.perf_counter(), got
    if t0 is None:
        raise SystemExit(f"netprobe: received only {got} bytes (< --skip-kb)")
    res = {"bytes": got - g0, "seconds": time.perf_counter() - t0}
    conn.sendall(b"k")
    conn.close()
    res["mbit_s"] = res["bytes"] * 8 / res["seconds"] / 1e6
    return res


def send(host, port, total, wait):
    deadline = time.time() + wait
    while True:
        try:
            s = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)
    s.settimeout(None)
    chunk = b"\0" * (1 << 20)
    sent = 0
    while sent < total:
        n = min(len(chunk), total - sent)
        s.sendall(chunk[:n])
        sent += n
    s.recv(1)
    s.close()
    return sent


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--mbytes", type=float, default=8.0, help="payload to send (MiB)")
    p.add_argument("--skip-kb", type=int, default=512, help="KiB received before the clock starts")
    p.add_argument("--host", default="127.0.0.1", help="address of the one-process probe (bind and connect)")
    p.add_argument("--listen", type=int, metavar="PORT", help="receive one connection on PORT (all addresses)")
    p.add_argument("--connect", metavar="HOST:PORT", help="send to a --listen receiver")
    p.add_argument("--wait", type=float, default=20.0, help="seconds the sender retries connecting")
    a = p.parse_args(argv)
    total = int(a.mbytes * 2**20)
    skip = a.skip_kb * 1024
    if a.connect:
        host, port = a.connect.rsplit(":", 1)
        print(json.dumps({"sent": send(host, int(port), total, a.wait)}), flush=True)
        return
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if a.listen is not None:
        srv.bind(("0.0.0.0", a.listen))
        srv.listen(1)
        c, _ = srv.accept()
        print(json.dumps(receive(c, total, skip)), flush=True)
        return
    srv.bind((a.host, 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    res = {}

    def recv():
        c, _ = srv.accept()
        res.update(receive(c, total, skip))

    th = threading.Thread(target=recv)
    th.start()
    send(a.host, port, total, a.wait)
    th.join()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
