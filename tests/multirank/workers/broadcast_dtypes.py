"""hvd_ext.broadcast_parameters / broadcast_optimizer_state on bf16, fp16 and fp32 models: every
rank starts from its own weights and optimizer state (rank 1 has none), and must end bit-identical
to rank 0's; Horovod's own broadcast raises on bf16 (why these exist). One RESULT per rank."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

import hvd_ext  # noqa: E402
from common import Checks, init_horovod, small_batch  # noqa: E402


def model_of(dtype, rank):
    torch.manual_seed(100 + rank)  # different weights on every rank
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).to(dtype)
    m.register_buffer("seen", torch.full((2,), float(rank), dtype=dtype))
    return m


def train_a_bit(model, opt, rank, steps):
    for i in range(steps):
        x, y = small_batch(rank, i)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(model[0].weight.dtype)).float(), y).backward()
        opt.step()


def bits(t):
    return t.detach().reshape(-1).view(torch.uint8).clone() if t.dtype == torch.bfloat16 else t.detach().clone()


def main():
    rank, size = init_horovod(hvd)
    checks = Checks(rank)
    out = {}
    for dname, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        for oname in ("sgd", "adam"):
            model = model_of(dtype, rank)
            params = list(model.parameters())
            opt = (torch.optim.SGD(params, lr=0.1 + rank, momentum=0.9) if oname == "sgd"
                   else torch.optim.Adam(params, lr=1e-3 * (rank + 1)))
            if oname == "adam":
                opt = hvd_ext.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression="none")
                opt.set_gradient_exchange(False)  # local steps only: every rank's state its own
            if rank != 1:  # rank 1 keeps a fresh optimizer: no state at all
                train_a_bit(model, opt, rank, 2 + rank)
            hvd_ext.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd_ext.broadcast_optimizer_state(opt, root_rank=0)
            sd = opt.state_dict()
            mine = [bits(t) for t in model.state_dict().values()]
            state = [bits(v) for pid in sorted(sd["state"]) for _, v in sorted(sd["state"][pid].items())
                     if isinstance(v, torch.Tensor)]
            first = hvd.broadcast_object([mine, state, opt.param_groups[0]["lr"]], root_rank=0,
                                         name=f"bc.check.{dname}.{oname}")
            case = f"{dname} {oname}"
            checks.expect(f"{case}: parameters and buffers bit-identical to rank 0's",
                          all(torch.equal(a, b) for a, b in zip(mine, first[0])) and len(mine) == len(first[0]))
            checks.expect(f"{case}: optimizer state bit-identical to rank 0's (a fresh optimizer too)",
                          len(state) == len(first[1]) and len(state) > 0
                          and all(torch.equal(a, b) for a, b in zip(state, first[1])), (len(state), len(first[1])))
            checks.expect(f"{case}: param-group options from rank 0", opt.param_groups[0]["lr"] == first[2],
                          opt.param_groups[0]["lr"])
            checks.expect(f"{case}: the dtype is kept", all(p.dtype == dtype for p in model.parameters()))
    try:
        hvd.broadcast_parameters(model_of(torch.bfloat16, rank).state_dict(), root_rank=0)
        out["horovod_bf16"] = "ok"
    except Exception as e:  # noqa: BLE001 -- recorded: the reason these functions exist
        out["horovod_bf16"] = f"{type(e).__name__}: {e}"[:120]
    checks.expect("bad params: a clear error naming what is accepted",
                  "accepted" in _error(lambda: hvd_ext.broadcast_parameters(3, 0)))
    checks.emit(**out)


def _error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


if __name__ == "__main__":
    main()
