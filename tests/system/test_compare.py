"""benchmarks/compare.py: method lists, launch plans (single host and the multi-node testbed),
time to target and the ratios against Horovod."""
from __future__ import annotations

import sys
from pathlib import Path

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))


def test_compare_plans_and_skips_unregistered():
    """compare.py: baselines always present, unknown compressors skipped (not crashed), DDP commands built."""
    import compare

    a = compare.parse_args(["--quick", "--methods", "nosuchcodec:ratio=0.1", "topk:ratio=5", "fp16"])
    methods = compare.method_list(a)
    assert methods[:6] == ["horovod", "horovod:fp16", "none", "ddp", "ddp:fp16", "ddp:powersgd:rank=2"]
    assert methods.count("fp16") == 1
    plans = {m: compare.plan(m, a, Path("/tmp")) for m in methods}
    assert plans["nosuchcodec:ratio=0.1"]["status"] == "skipped"
    assert "not registered" in plans["nosuchcodec:ratio=0.1"]["reason"]
    assert plans["topk:ratio=5"]["status"] == "skipped"
    assert "--gloo" in plans["none"]["cmd"]
    # the reference is Horovod's own optimizer, not hvd_ext's uncompressed path
    assert "--plain-horovod" in plans["horovod"]["cmd"] and "--plain-horovod" not in plans["none"]["cmd"]
    i = plans["horovod:fp16"]["cmd"].index("--compression")
    assert plans["horovod:fp16"]["cmd"][i + 1] == "fp16"
    # DDP rows: scripts/train.py --engine ddp under torchrun; DDP's own hooks and hvd_ext's codecs on DDP
    def compression(plan):
        cmd = plan["cmd"]
        assert "torchrun" in cmd[0] and cmd[cmd.index("--engine") + 1] == "ddp"
        return cmd[cmd.index("--compression") + 1]

    assert compression(plans["ddp"]) == "ddp:allreduce"
    assert compression(plans["ddp:powersgd:rank=2"]) == "ddp:powersgd:rank=2,start=100"
    more = compare.parse_args(["--ddp", "--ddp-powersgd-start", "7"])
    got = {m: compare.plan(m, more, Path("/tmp")) for m in compare.method_list(more)}
    assert compression(got["ddp:batched_powersgd:rank=2"]) == "ddp:batched_powersgd:rank=2,start=7"
    assert compression(got["ddp+qsgd:bits=8"]) == "qsgd:bits=8" and got["ddp+auto"]["framework"].startswith("hvd_ext")
    assert compare.plan("ddp:nosuchhook", more, Path("/tmp"))["status"] == "skipped"
    # the DDP summary holds hvd_ext on DDP against the faster DDP baseline of the same run
    ok = lambda m, ms, acc: {"method": m, "status": "ok", "result": {"ms_per_step": ms, "test_acc": acc,  # noqa: E731
                                                                    "bytes_sent_per_step": 100}}
    md = "\n".join(compare.ddp_summary({"methods": [ok("ddp", 10.0, 0.9), ok("ddp:fp16", 8.0, 0.9),
                                                      ok("ddp+auto", 8.4, 0.91)]}))
    assert "`ddp+auto` | `ddp` / `ddp:fp16` -> `ddp:fp16` | 1.05x | +1.00 pt" in md

def test_time_to_target_and_ratios():
    import compare

    a = compare.parse_args(["--target", "0.9"])
    hist = [{"epoch": 1, "test_acc": 0.5, "train_time_s": 2.0}, {"epoch": 2, "test_acc": 0.92, "train_time_s": 4.0}]
    ref = {"method": "horovod", "framework": "horovod", "status": "ok", "result": {"history": hist, "ms_per_step": 10.0, "bytes_sent_per_step": 1000,
                                                          "test_acc": 0.92, "epochs": 2, "exchanges": 250}}
    fast = {"method": "x", "framework": "horovod+hvd_ext", "status": "ok", "result": {"history": [dict(h, train_time_s=h["train_time_s"] / 2) for h in hist],
                                                       "ms_per_step": 5.0, "bytes_sent_per_step": 10, "test_acc": 0.92,
                                                       "epochs": 2, "exchanges": 250}}
    for e in (ref, fast):
        compare.summarize(e, a)
    compare.add_ratios([ref, fast])
    assert ref["time_to_target_s"] == 4.0 and ref["epochs_to_target"] == 2
    assert fast["vs_horovod"]["speedup_ms_per_step"] == 2.0
    assert fast["vs_horovod"]["bytes_fewer"] == 100.0
    assert fast["vs_horovod"]["speedup_time_to_target"] == 2.0
    md = compare.markdown({"config": {"ranks": 2, "epochs": 2, "rate": "300mbit", "tbf_latency": "50ms", "target": 0.9},
                           "methods": [ref, fast, {"method": "y", "status": "skipped", "reason": "not registered"}]})
    assert "| `x` |" in md and "2.00x" in md and "100.0x" in md and "`y`: skipped" in md


def test_compare_nodes_plans():
    """compare.py --nodes 2 --ranks-per-node 2: multi-host launch lines on the testbed, dynamic process
    sets for every job, Horovod's hierarchical allreduce variable for horovod:hier, flat/node-aware pairs."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import compare

    a = compare.parse_args(["--nodes", "2", "--ranks-per-node", "2", "--rate", "300mbit", "--epochs", "1"])
    methods = compare.method_list(a)
    assert methods == ["horovod", "horovod:hier", "qsgd:bits=8,hierarchy=flat", "qsgd:bits=8",
                       "topk:ratio=0.01,hierarchy=flat", "topk:ratio=0.01"]
    assert a.ranks == 4
    plans = {m: compare.plan(m, a, Path("/tmp")) for m in ["horovod", "horovod:hier", "qsgd:bits=8"]}
    for p in plans.values():
        assert p["cmd"][:6] == ["horovodrun", "-np", "4", "-H", "node1:2,node2:2", "--gloo"]
    assert plans["horovod:hier"]["env"]["HOROVOD_HIERARCHICAL_ALLREDUCE"] == "1"
    assert "HOROVOD_HIERARCHICAL_ALLREDUCE" not in plans["horovod"]["env"]
    assert plans["qsgd:bits=8"]["routes"] == ["node:allgather"]
    assert compare.testbed_prefix(a)[1:7] == ["--nodes", "2", "--ranks-per-node", "2", "--inter", "300mbit"]
