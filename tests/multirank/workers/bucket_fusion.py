"""Horovod's tensor fusion takes hvd_ext's bucket allreduces as it takes its own tensors, which the
planner's step model assumes (``hvd_ext.plan.model.fused_groups``). With a long Horovod cycle every
bucket of a step is ready within one cycle, so the step's buckets travel in fewer allreduces than
there are buckets. Horovod's timeline (rank 0) says which tensors each allreduce carried.

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


def allreduces(path):
    """{start time: [tensor names]} of the Gloo allreduces of hvd_ext's buckets in a Horovod timeline."""
    text = open(path).read().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    names = {e["pid"]: e["args"].get("name", "") for e in events if e.get("name") == "process_name"}
    ops = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "B" and e.get("name") == "GLOO_ALLREDUCE" and ".hvd_ext.ar.b" in names[e["pid"]]:
            ops[e["ts"]].append(names[e["pid"]])
    return ops


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
        ops = allreduces(sys.argv[1])
        tensors = sum(len(v) for v in ops.values())
        checks.expect("fusion: every bucket's allreduce is in the timeline", tensors == STEPS * buckets,
                      (tensors, buckets))
        checks.expect("fusion: Horovod fused the buckets, two or more an allreduce on average", 2 * len(ops) <= tensors,
                      sorted(len(v) for v in ops.values()))
        data["allreduces"] = len(ops)
    checks.expect("fusion: a bucket per layer", buckets == 8, buckets)
    checks.emit(**data)


if __name__ == "__main__":
    main()
