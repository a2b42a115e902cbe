#!/usr/bin/env python
"""Measure point-to-point TCP bandwidth over 127.0.0.1 (run inside a shaped namespace).

    scripts/shaped-cluster --rate 100mbit -- python benchmarks/netprobe.py --mbytes 8

Prints one JSON line: {"mbit_s": ..., "bytes": ..., "seconds": ...}. The clock
starts after the first 256 KiB (the tbf bucket) so the burst does not inflate it.
"""
import argparse
import json
import socket
import threading
import time


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--mbytes", type=float, default=8.0, help="payload to send (MiB)")
    p.add_argument("--skip-kb", type=int, default=512, help="KiB received before the clock starts")
    a = p.parse_args(argv)
    total = int(a.mbytes * 2**20)
    skip = a.skip_kb * 1024
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    res = {}

    def recv():
        c, _ = srv.accept()
        got, t0 = 0, None
        while got < total:
            b = c.recv(1 << 20)
            if not b:
                break
            got += len(b)
            if t0 is None and got >= skip:
                t0, g0 = time.perf_counter(), got
        res["bytes"] = got - g0
        res["seconds"] = time.perf_counter() - t0
        c.sendall(b"k")
        c.close()

    th = threading.Thread(target=recv)
    th.start()
    s = socket.create_connection(("127.0.0.1", port))
    chunk = b"\0" * (1 << 20)
    sent = 0
    while sent < total:
        n = min(len(chunk), total - sent)
        s.sendall(chunk[:n])
        sent += n
    s.recv(1)
    s.close()
    th.join()
    res["mbit_s"] = res["bytes"] * 8 / res["seconds"] / 1e6
    print(json.dumps(res))


if __name__ == "__main__":
    main()
