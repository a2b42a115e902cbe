"""Horovod's tensor fusion takes hvd_ext's bucket allreduces as it takes its own tensors, which the
planner's step model assumes (``hvd_ext.plan.model.fused_groups``). With a long Horovod cycle every
bucket of a step is ready within one cycle, so Horovod fuses the step's buckets into fewer
allreduces. Horovod's timeline (rank 0) says which tensors it fused.

    horovodrun -np 2 --gloo python bucket_fusion.py TIMELINE.json
"""
import collections
import json
import os
import sys

os.environ["HOROVOD_CYCLE_TIME"] = "200"   # ms: the whole backward of the model below fits in one cycle
os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"
os.environ["HOROVOD_FUSION_THRESHOLD"] = str(128 * 2 ** 20)  # Horovod's default, whatever the caller's

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

from common import Checks  # noqa: E402

import hvd_ext  # noqa: E402

STEPS = 3


def bucket_allreduces(path):
    """(allreduces of hvd_ext's buckets, those of them Horovod fused with others) in a Horovod timeline:
    Horovod copies a tensor into its fusion buffer only when it fuses it with others."""
    text = open(path).read().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    names = {e["pid"]: e["args"].get("name", "") for e in events if e.get("name") == "process_name"}
    seen = collections.Counter(e.get("name") for e in events
                               if e.get("ph") == "B" and ".hvd_ext.ar.b" in names.get(e["pid"], ""))
    return seen["GLOO_ALLREDUCE"], seen["MEMCPY_IN_FUSION_BUFFER"]


def main():
    hvd.init()
    checks = Checks(hvd.rank())
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), compression="none",
                                       bucket_bytes=20000, overlap=False)  # a bucket per layer
    hvd.start_timeline(sys.argv[1])
    for _ in range(STEPS):
        opt.zero_grad()
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
    hvd.stop_timeline()
    buckets = len(opt._pipeline.buckets)
    data = {"buckets": buckets}
    if hvd.rank() == 0:
        tensors, fused = bucket_allreduces(sys.argv[1])
        checks.expect("fusion: every bucket's allreduce is in the timeline", tensors == STEPS * buckets,
                      (tensors, buckets))
        checks.expect("fusion: Horovod fused at least half of them", 2 * fused >= tensors, (fused, tensors))
        data.update(tensors=tensors, fused=fused)
    checks.expect("fusion: a bucket per layer", buckets == 8, buckets)
    checks.emit(**data)


if __name__ == "__main__":
    main()
