"""A rank killed mid-step (SIGKILL, no cleanup): the job must end non-zero, no rank left hanging.
argv[1]: every | local | event. Rank 1 kills itself at step 3 (inside backward for 'every').
No RESULT line: the test checks the exit status and how soon after the kill the job ended."""
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hvd_ext  # noqa: E402
from common import init_horovod  # noqa: E402


def die(*_):
    print(f"KILLED {time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main():
    mode = sys.argv[1]
    rank, _ = init_horovod(hvd, mpi_world=mode == "event")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = hvd_ext.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(), compression="topk:ratio=0.5")
    spec = {"every": "every", "local": "local:period=2", "event": "event:tau_min=1,tau_max=2"}[mode]
    sync = hvd_ext.sync_from_spec(spec)(opt, model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(10_000):
        x = torch.randn(8, 6)
        y = torch.randint(0, 3, (8,))
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if rank == 1 and step == 3 and mode == "every":
            model[0].weight.register_hook(die)  # dies inside backward, with buckets in flight
        loss.backward()
        if rank == 1 and step == 3:
            die()
        sync.step(loss)
    print("unreachable: training loop ended", flush=True)


if __name__ == "__main__":
    main()
