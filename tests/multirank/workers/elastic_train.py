"""Elastic training through a worker removal and re-addition (tests/multirank/test_elastic.py).

Run under ``horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script DISC
--network-interface lo --gloo``; DISC prints the file given as ``--hosts-file``, which
rank 0 rewrites: ``localhost:1`` (a worker is removed) once the job has trained at
size 2, ``localhost:2`` (a worker is added back) once it has trained at size 1. Every
decision depends on the synced step counter, the phase and ``hvd.size()`` only, so all
ranks agree. Five models, each with its own hvd_ext optimizer, share one
``hvd.elastic.TorchState``: topk with error feedback on the two-phase (sparse
reduce-scatter) route, PowerSGD (compressor state) and ``none``, every step; and two
under ``hvd_ext.LocalSGD``: ``local`` (period 4, parameter averages only) and ``warm``
(topk inside a warm-up longer than the run, i.e. gradient exchange switched on by the
strategy).

With ``--crash-at N`` (DISC listing two "hosts", ``localhost:1`` and ``127.0.0.1:1``)
the worker of rank 1 exits at step N instead: the survivor's next collective fails
(HorovodInternalError), ``TorchState.restore`` brings back the last commit, and it trains
on alone up to ``--max-steps``.

Each rank prints one RESULT line: the world sizes it trained at, the reset callbacks
it saw, per optimizer its pipeline step (against the synced step counter), routes
and residual norm at each world change, and the eval losses before and after.
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import horovod.torch as hvd  # noqa: E402

import hvd_ext  # noqa: E402
from common import emit  # noqa: E402

SPECS = {"topk": "topk:ratio=0.1,exchange=twophase", "powersgd": "powersgd:rank=2,start_step=10", "none": "none",
         "local": "none", "warm": "topk:ratio=0.1"}
SYNC = {"local": dict(period=4), "warm": dict(period=4, warmup_steps=10 ** 6)}

ap = argparse.ArgumentParser()
ap.add_argument("--hosts-file", required=True)
ap.add_argument("--steps-at-2", type=int, default=20)      # before the removal is requested
ap.add_argument("--steps-at-1", type=int, default=20)      # at size 1 before the re-add is requested
ap.add_argument("--steps-after", type=int, default=50)     # back at size 2 before the end
ap.add_argument("--max-steps", type=int, default=4000)     # give up (the test fails) past this
ap.add_argument("--sleep", type=float, default=0.01)
ap.add_argument("--crash-at", type=int, default=0)      # rank 1 of the first world exits at this step
args = ap.parse_args()

hvd.init()
torch.manual_seed(0)
W_TRUE = torch.randn(16, 1)
X_EVAL = torch.randn(256, 16)
Y_EVAL = X_EVAL @ W_TRUE


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


models = {k: make_model() for k in SPECS}   # same seed on every process, rank 0's is broadcast anyway
opts = {k: hvd_ext.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                         named_parameters=m.named_parameters(), compression=SPECS[k],
                                         bucket_bytes=1 << 20)
        for k, m in models.items()}
syncs = {k: hvd_ext.LocalSGD(opts[k], models[k], **kw) for k, kw in SYNC.items()}


def eval_loss(k):
    with torch.no_grad():
        return float(F.mse_loss(models[k](X_EVAL), Y_EVAL))


init_loss = {k: eval_loss(k) for k in SPECS}
kw = {}
for k in SPECS:
    kw[f"model_{k}"], kw[f"opt_{k}"] = models[k], opts[k]
state = hvd.elastic.TorchState(step=0, phase=0, mark=0, init_loss=init_loss, **kw)
resets = []
state.register_reset_callbacks([lambda: resets.append({"size": hvd.size(), "rank": hvd.rank()})])
joined = {"step": None}
restores = []  # steps at which TorchState.restore ran (a collective failed: HorovodInternalError)
_restore = state.restore


def restore():
    _restore()
    restores.append(state.step)


state.restore = restore
events = []


def residual_norm(opt):
    mem = opt._pipeline.feedback.memory
    return float(sum(float(v.float().norm()) ** 2 for k, v in mem.items() if "\x00" not in k) ** 0.5)


def sync_state(k):
    s = syncs[k]
    return {"steps": s.steps, "since_sync": s.since_sync, "syncs": s.syncs, "world_changes": s.world_changes,
            "grad_steps": s.grad_steps}


def snapshot(when):
    return {"when": when, "step": state.step, "size": hvd.size(), "rank": hvd.rank(),
            "syncs": {k: sync_state(k) for k in syncs},
            "opts": {k: {"pipeline_step": o._pipeline.step, "pipeline_size": o._pipeline.size,
                         "routes": list(o._pipeline.routes), "residual": residual_norm(o),
                         "owner_entries": len(o._pipeline.owner_memory.memory),
                         "world_changes": o.world_changes} for k, o in opts.items()}}


def write_hosts(text):
    if hvd.rank() == 0:
        tmp = args.hosts_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.hosts_file)


@hvd.elastic.run
def train(state):
    if joined["step"] is None:
        joined["step"] = state.step
    last_size = None
    while True:
        size = hvd.size()
        if size != last_size:
            events.append(snapshot("before"))
        for k, m in models.items():
            g = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
            x = torch.randn(32, 16, generator=g)
            loss = F.mse_loss(m(x), x @ W_TRUE)
            opts[k].zero_grad()
            loss.backward()
            if k in syncs:
                syncs[k].step(loss)
            else:
                opts[k].step()
        state.step += 1
        if args.crash_at and state.step == args.crash_at and hvd.rank() == 1 and joined["step"] == 0:
            os._exit(3)  # a worker dies: no clean removal
        if size != last_size:
            events.append(snapshot("after"))
            last_size = size
        if args.crash_at:
            if state.step >= args.max_steps:
                return True
        elif state.phase == 0 and state.step >= args.steps_at_2 and size == 2:
            state.phase = 1
            write_hosts("localhost:1\n")
        elif state.phase == 1 and size == 1:
            state.phase, state.mark = 2, state.step
        elif state.phase == 2 and state.step >= state.mark + args.steps_at_1:
            state.phase = 3
            write_hosts("localhost:2\n")
        elif state.phase == 3 and size == 2:
            state.phase, state.mark = 4, state.step
        elif state.phase == 4 and state.step >= state.mark + args.steps_after:
            return True
        if state.step >= args.max_steps:
            return False
        time.sleep(args.sleep)
        state.commit()


finished = train(state)
sync_end = {k: sync_state(k) for k in syncs}
for s in syncs.values():
    s.finish()
emit(sync_end=sync_end, rank=hvd.rank(), size=hvd.size(), pid=os.getpid(), finished=finished, step=state.step, phase=state.phase,
     joined_at=joined["step"], resets=resets, restores=restores, events=events,
     pipeline_steps={k: o._pipeline.step for k, o in opts.items()},
     routes={k: list(o._pipeline.routes) for k, o in opts.items()},
     world_changes={k: o.world_changes for k, o in opts.items()},
     init_loss=state.init_loss, final_loss={k: eval_loss(k) for k in SPECS})
