"""Elastic training through a worker removal and re-addition (tests/multirank/test_elastic.py).

Run under ``horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script DISC
--network-interface lo --gloo``; DISC prints the file given as ``--hosts-file``, which
rank 0 rewrites: ``localhost:1`` (a worker is removed) once the job has trained at
size 2, ``localhost:2`` (a worker is added back) once it has trained at size 1. Every
decision depends on the synced step counter, the phase and ``hvd.size()`` only, so all
ranks agree. Eight models, each with its own hvd_ext optimizer, share one
``hvd.elastic.TorchState``: topk with error feedback on the two-phase (sparse
reduce-scatter) route, PowerSGD (compressor state), ``none``, ``auto`` (decided before the
removal: the joiner takes the decision) and topk after a dense warm-up (the joiner's routes
differ from the survivor's until it takes the step counter), every step; two
under ``hvd_ext.LocalSGD``: ``local`` (period 4, parameter averages only) and ``warm``
(topk inside a warm-up longer than the run, i.e. gradient exchange switched on by the
strategy); and ``adapt`` under ``hvd_ext.AdaptiveSync``.

With ``--crash-at N`` (DISC listing two "hosts", ``localhost:1`` and ``127.0.0.1:1``)
the worker of rank 1 exits at step N instead: the survivor's next collective fails
(HorovodInternalError), ``TorchState.restore`` brings back the last commit, and it trains
on alone up to ``--max-steps``.

Each rank prints one RESULT line: the world sizes it trained at, the reset callbacks
it saw, per optimizer its pipeline step (against the synced step counter), routes
and residual norm at each world change, and the eval losses before and after; and its
named checks (common.Checks), run here: "all: ..." on every rank, "survivor: ..." on the rank
of the first world that trained through, "joiner: ..." on the re-added one, "crash: ..." on
the survivor of --crash-at. The test compares the ranks with each other.
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
from common import Checks  # noqa: E402

SPECS = {"topk": "topk:ratio=0.1,route=twophase", "powersgd": "powersgd:rank=2,warmup=10", "none": "none",
         "auto": "auto:warmup=2,accuracy=relaxed,candidates=none,topk:ratio=0.1", "topkw": "topk:ratio=0.1,warmup=5",
         "local": "none", "warm": "topk:ratio=0.1", "adapt": "none"}
SYNC = {"local": dict(period=4), "warm": dict(period=4, warmup=10 ** 6),
        "adapt": dict(min_period=1, max_period=4)}   # AdaptiveSync: its decision in flight across steps
LOCAL_ONLY = ("local", "adapt")   # strategies whose optimizer never exchanges gradients


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts-file", required=True)
    ap.add_argument("--steps-at-2", type=int, default=20)      # before the removal is requested
    ap.add_argument("--steps-at-1", type=int, default=20)      # at size 1 before the re-add is requested
    ap.add_argument("--steps-after", type=int, default=50)     # back at size 2 before the end
    ap.add_argument("--max-steps", type=int, default=4000)     # give up (the test fails) past this
    ap.add_argument("--sleep", type=float, default=0.01)
    ap.add_argument("--crash-at", type=int, default=0)      # rank 1 of the first world exits at this step
    return ap.parse_args()


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def residual_norm(opt):
    mem = opt._pipeline.feedback.memory
    return float(sum(float(v.float().norm()) ** 2 for k, v in mem.items() if "\x00" not in k) ** 0.5)


class Job:
    """The models, optimizers and strategies in one hvd.elastic.TorchState, and what the ranks saw."""

    def __init__(self, args):
        self.args = args
        torch.manual_seed(0)
        self.w_true = torch.randn(16, 1)
        self.x_eval = torch.randn(256, 16)
        self.y_eval = self.x_eval @ self.w_true
        self.models = {k: make_model() for k in SPECS}   # same seed on every process, rank 0's is broadcast anyway
        self.opts = {k: hvd_ext.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                                     named_parameters=m.named_parameters(), compression=SPECS[k],
                                                     bucket_bytes=1 << 20)
                     for k, m in self.models.items()}
        self.syncs = {k: (hvd_ext.AdaptiveSync if k == "adapt" else hvd_ext.LocalSGD)(self.opts[k], self.models[k], **kw)
                      for k, kw in SYNC.items()}
        init_loss = {k: self.eval_loss(k) for k in SPECS}
        kw = {}
        for k in SPECS:
            kw[f"model_{k}"], kw[f"opt_{k}"] = self.models[k], self.opts[k]
        self.state = hvd.elastic.TorchState(step=0, phase=0, mark=0, init_loss=init_loss, **kw)
        self.resets = []
        self.state.register_reset_callbacks([lambda: self.resets.append({"size": hvd.size(), "rank": hvd.rank()})])
        self.joined = None
        self.restores = []  # steps at which TorchState.restore ran (a collective failed: HorovodInternalError)
        _restore = self.state.restore

        def restore():
            _restore()
            self.restores.append(self.state.step)

        self.state.restore = restore
        self.events = []

    def eval_loss(self, k):
        with torch.no_grad():
            return float(F.mse_loss(self.models[k](self.x_eval), self.y_eval))

    def sync_state(self, k):
        s = self.syncs[k]
        return {"steps": s.steps, "since_sync": s.since_sync, "syncs": s.syncs, "world_changes": s.world_changes,
                "grad_steps": s.grad_steps}

    def snapshot(self, when):
        return {"when": when, "step": self.state.step, "size": hvd.size(), "rank": hvd.rank(),
                "syncs": {k: self.sync_state(k) for k in self.syncs},
                "opts": {k: {"pipeline_step": o._pipeline.step, "pipeline_size": o._pipeline.size,
                             "routes": list(o._pipeline.routes), "residual": residual_norm(o),
                             "owner_entries": len(o._pipeline.owner_memory.memory),
                             "world_changes": o.world_changes} for k, o in self.opts.items()}}

    def write_hosts(self, text):
        if hvd.rank() == 0:
            tmp = self.args.hosts_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, self.args.hosts_file)

    def one_step(self, state):
        for k, m in self.models.items():
            g = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
            x = torch.randn(32, 16, generator=g)
            loss = F.mse_loss(m(x), x @ self.w_true)
            self.opts[k].zero_grad()
            loss.backward()
            if k in self.syncs:
                self.syncs[k].step(loss)
            else:
                self.opts[k].step()
        state.step += 1

    def next_phase(self, state, size):
        """True: done; False: gave up (step limit); None: go on."""
        args = self.args
        if args.crash_at:
            if state.step >= args.max_steps:
                return True
        elif state.phase == 0 and state.step >= args.steps_at_2 and size == 2:
            state.phase = 1
            self.write_hosts("localhost:1\n")
        elif state.phase == 1 and size == 1:
            state.phase, state.mark = 2, state.step
        elif state.phase == 2 and state.step >= state.mark + args.steps_at_1:
            state.phase = 3
            self.write_hosts("localhost:2\n")
        elif state.phase == 3 and size == 2:
            state.phase, state.mark = 4, state.step
        elif state.phase == 4 and state.step >= state.mark + args.steps_after:
            return True
        if state.step >= args.max_steps:
            return False
        return None

    def train(self, state):
        if self.joined is None:
            self.joined = state.step
        last_size = None
        while True:
            size = hvd.size()
            if size != last_size:
                self.events.append(self.snapshot("before"))
            self.one_step(state)
            if self.args.crash_at and state.step == self.args.crash_at and hvd.rank() == 1 and self.joined == 0:
                os._exit(3)  # a worker dies: no clean removal
            if size != last_size:
                self.events.append(self.snapshot("after"))
                last_size = size
            done = self.next_phase(state, size)
            if done is not None:
                return done
            time.sleep(self.args.sleep)
            state.commit()

    def result(self, finished, sync_end):
        state = self.state
        return dict(sync_end=sync_end, rank=hvd.rank(), size=hvd.size(), pid=os.getpid(), finished=finished,
                    step=state.step, phase=state.phase, joined_at=self.joined, resets=self.resets,
                    restores=self.restores, events=self.events,
                    pipeline_steps={k: o._pipeline.step for k, o in self.opts.items()},
                    routes={k: list(o._pipeline.routes) for k, o in self.opts.items()},
                    world_changes={k: o.world_changes for k, o in self.opts.items()},
                    init_loss=state.init_loss, final_loss={k: self.eval_loss(k) for k in SPECS})


def check_converged(c, r):
    for k, loss in r["final_loss"].items():
        c.expect(f"{k}: converged (final loss below 0.5 and 5% of the initial)",
                 loss < 0.5 and loss < 0.05 * r["init_loss"][k], (loss, r["init_loss"][k]))


def check_survivor(c, r):
    # LocalSGD averaged at the expected steps
    c.expect("LocalSGD averaged about every 4 steps", r["sync_end"]["local"]["syncs"] >= r["step"] // 4 - 2,
             (r["sync_end"]["local"], r["step"]))
    # The survivor trained at sizes 2, 1, 2; the reset callbacks saw the new sizes.
    after = [e for e in r["events"] if e["when"] == "after"]
    before = [e for e in r["events"] if e["when"] == "before"]
    c.expect("trained at sizes 2, 1, 2", [e["size"] for e in after] == [2, 1, 2], [e["size"] for e in after])
    c.expect("the reset callbacks saw sizes 1, 2", [x["size"] for x in r["resets"]] == [1, 2], r["resets"])
    c.expect("two world changes per optimizer, none for local",
             r["world_changes"] == {"topk": 2, "powersgd": 2, "none": 2, "auto": 2, "topkw": 2, "warm": 2, **{k: 0 for k in LOCAL_ONLY}}, r["world_changes"])
    for i, e in enumerate(after):  # routes rebuilt for the new size; the step counter continued
        t = e["opts"]["topk"]
        c.expect(f"world {i} (size {e['size']}): topk's pipeline rebuilt for the size, its routes for it",
                 t["pipeline_size"] == e["size"]
                 and t["routes"] == (["sparse_rs"] if e["size"] == 2 else ["allgather"]), t)
        c.expect(f"world {i} (size {e['size']}): pipeline steps and strategy steps follow the step counter",
                 all(o["pipeline_step"] == e["step"] for k, o in e["opts"].items() if k not in LOCAL_ONLY)
                 and all(s["steps"] == e["step"] for s in e["syncs"].values()), e)
    # At size 1: the owner-side memory of the sparse reduce-scatter (its residual and owner ranges)
    # was dropped, the worker residual (error feedback) came through the reset
    c.expect("before size 1: topk has a residual and owner entries",
             before[1]["opts"]["topk"]["residual"] > 0 and before[1]["opts"]["topk"]["owner_entries"] >= 1,
             before[1]["opts"]["topk"])
    c.expect("at size 1: the owner memory was dropped", after[1]["opts"]["topk"]["owner_entries"] == 0,
             after[1]["opts"]["topk"])
    c.expect("back at size 2: topk's and powersgd's residuals came through",
             before[2]["opts"]["topk"]["residual"] > 0 and before[2]["opts"]["powersgd"]["residual"] > 0,
             before[2]["opts"])
    check_converged(c, r)


def check_joiner(c, r):
    # The joined worker started from zero residual and step 0 and took the step counter over
    jb = [e for e in r["events"] if e["when"] == "before"][0]
    ja = [e for e in r["events"] if e["when"] == "after"][0]
    c.expect("no reset callback, joined at size 2", r["resets"] == [] and jb["size"] == 2, (r["resets"], jb["size"]))
    c.expect("started from step 0 and zero residual",
             all(o["pipeline_step"] == 0 and o["residual"] == 0 for o in jb["opts"].values())
             and all(s["steps"] == 0 for s in jb["syncs"].values()), jb)
    c.expect("took the step counter over after its first step",
             all(o["pipeline_step"] == r["joined_at"] + 1 for k, o in ja["opts"].items() if k not in LOCAL_ONLY)
             and all(s["steps"] == r["joined_at"] + 1 for s in ja["syncs"].values()), (r["joined_at"], ja))
    c.expect("topk has a residual after its first step", ja["opts"]["topk"]["residual"] > 0, ja["opts"]["topk"])


def check_readd(checks, r):
    c = checks.section("all")
    c.expect("reached the end through both phases (not the step limit), at size 2",
             r["finished"] and r["phase"] == 4 and r["size"] == 2, (r["finished"], r["phase"], r["size"]))
    # hvd_ext state followed the synced step counter through both resets (local: never exchanges)
    c.expect("pipeline steps follow the step counter (local: 0)",
             r["pipeline_steps"] == {**{k: r["step"] for k in r["pipeline_steps"]}, **{k: 0 for k in LOCAL_ONLY}},
             (r["pipeline_steps"], r["step"]))
    c.expect("topk routes back to ['sparse_rs']", r["routes"]["topk"] == ["sparse_rs"], r["routes"])
    if r["joined_at"] == 0:
        check_survivor(checks.section("survivor"), r)
    else:
        check_joiner(checks.section("joiner"), r)


def check_crash(c, r, args):
    steps = args.max_steps
    c.expect(f"trained on alone to step {steps}", r["finished"] and r["size"] == 1 and r["step"] == steps,
             (r["finished"], r["size"], r["step"]))
    c.expect("HorovodInternalError -> restore from the last commit",
             r["restores"] and r["restores"][0] <= args.crash_at, r["restores"])
    c.expect("the reset callback saw size 1", [x["size"] for x in r["resets"]] == [1], r["resets"])
    c.expect("pipeline steps follow the step counter (local: 0)",
             r["pipeline_steps"] == {**{k: steps for k in r["pipeline_steps"]}, **{k: 0 for k in LOCAL_ONLY}}, r["pipeline_steps"])
    c.expect("one world change per optimizer, none for local",
             r["world_changes"] == {"topk": 1, "powersgd": 1, "none": 1, "auto": 1, "topkw": 1, "warm": 1, **{k: 0 for k in LOCAL_ONLY}}, r["world_changes"])
    before = [e for e in r["events"] if e["when"] == "before"]
    after = [e for e in r["events"] if e["when"] == "after"]
    c.expect("trained at sizes 2, 1", [e["size"] for e in after] == [2, 1], [e["size"] for e in after])
    # the restored hvd_ext state matches the restored step counter; residuals came back with it
    c.expect("restored: the pipeline steps are the restored step counter's, at size 1",
             before[1]["size"] == 1
             and all(o["pipeline_step"] == before[1]["step"] for k, o in before[1]["opts"].items() if k not in LOCAL_ONLY),
             before[1])
    c.expect("restored: topk's residual came back", before[1]["opts"]["topk"]["residual"] > 0,
             before[1]["opts"]["topk"])
    c.expect("size 1: topk on allgather, no owner memory",
             after[1]["opts"]["topk"]["routes"] == ["allgather"] and after[1]["opts"]["topk"]["owner_entries"] == 0,
             after[1]["opts"]["topk"])
    check_converged(c, r)


def main():
    args = parse_args()
    hvd.init()
    job = Job(args)
    finished = hvd.elastic.run(job.train)(job.state)
    sync_end = {k: job.sync_state(k) for k in job.syncs}
    for s in job.syncs.values():
        s.finish()
    r = job.result(finished, sync_end)
    checks = Checks(r["rank"])
    if args.crash_at:
        check_crash(checks.section("crash"), r, args)
    else:
        check_readd(checks, r)
    checks.emit(**r)


if __name__ == "__main__":
    main()
