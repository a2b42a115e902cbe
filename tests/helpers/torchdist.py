"""Run a function on N real processes joined by torch.distributed over gloo (the torch.distributed
transport and DDP tests): ``spawn_gloo(fn, size, *args)`` calls ``fn(rank, size, *args)`` on each
rank and returns what each returned, in rank order; a rank's exception fails the test with its
traceback, and a hang fails after ``timeout`` seconds."""
from __future__ import annotations

import io
import os
import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, size, port, queue, fn, args):
    try:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=size)
        torch.set_num_threads(1)
        res = fn(rank, size, *args)
        dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(res, buf)  # bytes, not shared tensors: the rank may exit before they are read
        queue.put((rank, buf.getvalue()))
    except Exception:  # noqa: BLE001 -- reported to the test
        queue.put((rank, traceback.format_exc()))


def spawn_gloo(fn, size: int, *args, timeout: float = 200.0):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, size, port, queue, fn, args)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        got = dict(queue.get(timeout=timeout) for _ in range(size))
    except Exception:  # noqa: BLE001 -- a rank hung or died without a word
        pytest.fail(f"a gloo rank gave no result within {timeout}s (hang?)")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    out = []
    for r in range(size):
        if isinstance(got[r], str):
            pytest.fail(f"rank {r} failed:\n{got[r]}")
        out.append(torch.load(io.BytesIO(got[r]), weights_only=False))
    return out
