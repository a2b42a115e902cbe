#!/usr/bin/env python
"""The planner against the testbed: predicted / measured step time and bytes, per method, per world.

    python benchmarks/plan_check.py                               # N = 2, 4 at 300mbit and unshaped
    python benchmarks/plan_check.py --ranks 2 4 8 --rates 100mbit 300mbit 1gbit unshaped --nodes2x2 300mbit

For each (N, rate) one job (``horovodrun --gloo`` in a shaped namespace, ``scripts/shaped-cluster``;
``--nodes2x2 RATE``: 2 nodes x 2 ranks of the multi-node testbed, inter-node links at RATE). The links
are shaped as a NIC sends, at their rate from the first byte and without drops when every rank sends
at once (``--shaper line``, ``common.SHAPERS``): the planner models such a link, and the default
testbed's token bucket would let 256 KiB through at once after every idle spell (a step's whole
exchange where it is compressed), its short queue drop 8 ranks' alltoall.

1. ``hvd_ext.plan.calibration.measure`` calibrates the job: the flat link (across nodes: the intra
   and inter links), codec speeds on this CPU
   with the ranks running at once (so ranks that share cores share them here too), the
   compute time of the main job's CNN step without any exchange, and each collective's cost
   right after that step (``busy_lat_by_kind``: waiting for the slowest rank and, with ranks
   sharing cores, for the scheduler);
2. the methods take turns, ``--rounds`` rounds of ``--steps`` steps (as ``overhead.py``), so this
   machine's drift hits them alike; measured: median ms/step (each rank's median over the rounds,
   the ranks' mean) and each round's (the ranks' mean: the row's spread), bytes sent per rank per
   step; the step without any exchange takes its turns too, against the calibrated compute time;
   the sparse reduce-scatter is timed after its first rebalance of the owner ranges (the steady
   state the planner predicts: before it, the ranges are even and the entries are not);
3. ``hvd_ext.plan.plan`` predicts every method from that calibration, on the route the job took;
   reported: predicted / measured step time per method, its median and spread over the methods,
   and the wire bytes ratio (the wire bytes hvd_ext's exchange counted; Horovod's: the ring's);
4. the bytes on the wire, counted by the kernel: per turn the testbed interface's sent bytes
   (a one-node world's loopback, divided among its ranks: bytes per rank; across nodes each node's
   eth0, its NIC: bytes on the busiest link, the nodes' mean), less what it carries with no exchange
   (Horovod's background loop coordinates every cycle; measured in the ``compute`` turns), against
   the planner's bytes per rank (per NIC across nodes). They include TCP/IP headers and acks.

Writes benchmarks/results/plan_check.{json,md} (``--out NAME``: NAME.{json,md}).

    python benchmarks/plan_check.py --rescore benchmarks/results/plan_check.json [...]

predicts every row of saved runs again, at this code, from each world's saved calibration: once with
the calibrated compute time and once with the step without exchange as it was timed in the same
turns as the methods (the planner's compute input taken in the measurement's own conditions), and
both again with no overlap of the exchange with backward; prints predicted / measured per row, the
codec time the planner prices, and how many rows are within +-25%. Nothing is run and nothing written.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# measured name -> (planner row label, route)
METHODS = {
    "horovod": ("horovod", "allreduce"),
    "horovod fp16": ("horovod fp16", "allreduce"),
    "qsgd:bits=8,exchange=twophase": ("qsgd:bits=8,exchange=twophase", "twophase"),
    "topk:ratio=0.01,exchange=twophase": ("topk:ratio=0.01,exchange=twophase", "sparse_rs"),
    "powersgd:warmup=0": ("powersgd:warmup=0", "allreduce"),  # its steady state, as the plan predicts
}
WITHIN = (0.75, 1.25)  # the step-time target: predicted / measured within +-25%


def worker(args) -> None:
    import horovod.torch as hvd
    import torch

    import common
    from hvd_ext.exchange.routes.sparse_rs import REBALANCE_EVERY
    from hvd_ext.plan import plan
    from hvd_ext.plan.calibration import measure

    hvd.init()
    torch.set_num_threads(1)
    N = hvd.size()
    step = common.main_cnn_step(args.batch)

    def make(m):  # across nodes, the route the model picks from the start (no flat / node-aware trial in the timing)
        run = common.main_cnn_run(m, args.channels, m + (",hierarchy_trial=0" if hvd.cross_size() > 1 else ""))
        hvd.broadcast_parameters(run[0].state_dict(), root_rank=0)
        return run

    floor = make("compute")
    for _ in range(3):
        step(floor)
    cal = measure(methods=[m for m in METHODS if not m.startswith("horovod")], step=lambda: step(floor),
                  steps=args.steps)
    runs = {m: make(m) for m in METHODS}
    runs["compute"] = floor  # the step without any exchange, timed in the same turns (a reference)
    def wire(run):  # modelled wire bytes this rank sent so far (hvd_ext's exchange counts them)
        return sum(run[1].stats.extra.get("wire_by_link", {}).values()) if hasattr(run[1], "stats") else 0.0

    wire0 = {}
    for m, run in runs.items():
        # the sparse reduce-scatter's owner ranges start even and move to where the entries fall
        # at its first rebalance; the planner predicts that steady state, so the timing starts after it
        warm = max(args.warmup, REBALANCE_EVERY + 2) if METHODS.get(m, ("", ""))[1] == "sparse_rs" else args.warmup
        for _ in range(warm):
            step(run)
        wire0[m] = wire(run)
    iface, times, on_wire = timed_and_counted(runs, step, args)
    model = runs["horovod"][0]
    dense = 4.0 * sum(p.numel() for p in model.parameters())
    measured = {}
    for m, run in runs.items():
        t, *per_round = hvd.allreduce(torch.tensor([statistics.median(times[m]), *times[m]], dtype=torch.float64),
                                      op=hvd.Average, name=f"plan_check.t.{m}").tolist()
        if hasattr(run[1], "stats"):
            sent = (wire(run) - wire0[m]) / (args.rounds * args.steps)
        else:  # Horovod's ring allreduce: 2(N-1)/N of the (fp16: half) dense gradient per rank
            sent = 2.0 * (N - 1) / N * dense * (0.5 if m.endswith("fp16") else 1.0)
        measured[m] = {"step_s": t, "rounds_s": per_round, "bytes_sent": sent}
    floor_s = measured.pop("compute")["step_s"]
    specs = [m for m in METHODS if not m.startswith("horovod")]
    p = plan(model, compute_s=cal["compute_s"], cluster=None, nodes=cal["nodes"], gpus_per_node=cal["local"],
             device="cpu", methods=specs, calibration=cal, breakeven_search=False)
    if hvd.rank() == 0:
        rows = result_rows(p, runs, measured, iface, on_wire, hvd.cross_size() > 1)
        Path(args.worker_out).write_text(json.dumps({"ranks": N, "calibration": cal, "rows": rows,
                                                     "params": int(dense / 4), "channels": args.channels,
                                                     "compute_in_turns_s": floor_s}, indent=1))


def result_rows(p, runs: dict, measured: dict, iface: str, on_wire: dict, across_nodes: bool) -> list:
    """One row per method: measured and predicted (plan ``p``) step and bytes, on the route the job took
    on its largest bucket; the interface's bytes against the planner's per rank (across nodes: per NIC)."""
    rows = []
    for m, (label, route) in METHODS.items():
        taken = getattr(runs[m][1], "stats", None)
        taken = taken.extra.get("routes") if taken is not None else None
        if taken:
            route = taken[-1] if isinstance(taken, list) else route
        pr = p.row(label, route)
        counted, predicted_link = on_wire.get(m), (pr.nic if across_nodes else pr.wire)
        rows.append({"method": m, "route": route, "measured_step_ms": measured[m]["step_s"] * 1e3,
                     "measured_rounds_ms": [t * 1e3 for t in measured[m]["rounds_s"]],
                     "predicted_step_ms": pr.step_s * 1e3, "step_ratio": pr.step_s / measured[m]["step_s"],
                     "measured_bytes": measured[m]["bytes_sent"], "predicted_bytes": pr.wire,
                     "bytes_ratio": pr.wire / max(measured[m]["bytes_sent"], 1.0),
                     "interface": iface, "interface_bytes": counted, "predicted_interface_bytes": predicted_link,
                     "interface_ratio": predicted_link / counted if counted else None})
    return rows


def timed_and_counted(runs: dict, step, args) -> tuple:
    """(interface, seconds per step of each run in turns, {method: bytes per step on the interface}):
    a one-node world's ranks all send over its loopback, read by rank 0; across nodes a node's eth0
    is its NIC, read by its first rank, the nodes' mean. Every rank returns the same bytes."""
    import horovod.torch as hvd
    import torch

    import common

    iface = "eth0" if hvd.cross_size() > 1 else "lo"
    reads = hvd.local_rank() == 0 and common.interface_tx_bytes(iface) is not None
    counted: dict = {}
    times = common.time_in_turns(runs, step, args.rounds, args.steps,
                                 lambda name: hvd.allreduce(torch.zeros(1), name=f"plan_check.{name}"),
                                 (lambda: common.interface_tx_bytes(iface)) if reads else None, counted)
    own = wire_bytes_counted(counted, args.steps, 1 if iface == "eth0" else hvd.size()) if reads else {}
    names = list(runs)
    total = hvd.allreduce(torch.tensor([own.get(m, 0.0) for m in names] + [float(reads)], dtype=torch.float64),
                          op=hvd.Sum, name="plan_check.interface").tolist()
    return iface, times, ({m: total[i] / total[-1] for i, m in enumerate(names) if m != "compute"}
                          if total[-1] else {})


def wire_bytes_counted(counted: dict, steps: int, ranks: int) -> dict:
    """{method: bytes per step per rank on the interface} from :func:`common.time_in_turns`'s counts:
    each turn's bytes less what the interface carries with no exchange (Horovod's background loop
    coordinates every cycle: the ``compute`` turns' bytes per second, over the turn's seconds),
    divided among the ``ranks`` that send through it; the median over the turns."""
    idle = sum(b for b, _ in counted["compute"]) / max(sum(t for _, t in counted["compute"]), 1e-9)
    return {m: statistics.median(max(b - idle * t, 0.0) / steps / ranks for b, t in turns)
            for m, turns in counted.items() if m != "compute"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes2x2", nargs="*", default=[], help="also 2 nodes x 2 ranks at these inter-node rates")
    ap.add_argument("--rescore", nargs="+", metavar="JSON", help="predict saved runs again (see the module doc)")
    import common

    common.add_world_options(ap, out="plan_check", steps=10, rounds=4, ranks=[2, 4], rates=["300mbit", "unshaped"],
                             shaper="line")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.rescore:
        return print(rescore(args.rescore))
    common.refuse_if_loaded(args)
    machine = common.machine_info()  # with the load at the start, before our own ranks add to it
    load = common.loadavg()

    def summary(res) -> str:
        ratios = [row["step_ratio"] for row in res["rows"]]
        return f"predicted/measured step median {statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]"

    results = common.run_worlds(__file__, "plan_check_logs", args, summary)
    common.save_results(args.out, common.results_doc("plan_check.py", argv, machine, load, results), render)


def predict_again(res: dict, compute_s: float) -> dict:
    """{(method, route): (predicted seconds per step, the same with no overlap, priced codec seconds)} of a
    saved world, at this code, from its saved calibration and ``compute_s``. No overlap: every bucket's
    collective's link and codec time (fused as Horovod fuses them) after the whole compute (a CPU whose
    cores the ranks fill cannot hide them)."""
    from hvd_ext.examples.mnist1d import MNIST1DCNN
    from hvd_ext.plan import plan

    cal = res["calibration"]
    model = MNIST1DCNN(res.get("channels", 128))
    if sum(p.numel() for p in model.parameters()) != res["params"]:
        raise SystemExit(f"--rescore: the saved world's model had {res['params']} parameters, not "
                         f"MNIST1DCNN({res.get('channels', 128)})'s")
    p = plan(model, compute_s=compute_s, cluster=None, nodes=cal["nodes"], gpus_per_node=cal["local"], device="cpu",
             methods=[m for m in METHODS if not m.startswith("horovod")], calibration=cal, breakeven_search=False)
    out = {}
    for row in res["rows"]:
        r = p.row(METHODS[row["method"]][0], row["route"])
        out[(row["method"], row["route"])] = (r.step_s, compute_s + r.exchange_s,
                                              sum(b.code for b in r.buckets))
    return out


def rescore(paths) -> str:
    """Every row of the saved runs at ``paths`` predicted again (module doc), as a table and counts."""
    lines = ["| file | ranks | link | method | measured ms | pred/meas | over rounds | pred/meas, compute in turns | "
             "no overlap | priced codec ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    within = [0, 0, 0, 0]
    n = reached = 0
    ok = lambda q: q is not None and WITHIN[0] <= q <= WITHIN[1]  # noqa: E731
    for path in paths:
        for res in json.loads(Path(path).read_text())["results"]:
            cal_pred = predict_again(res, res["calibration"]["compute_s"])
            turns = res.get("compute_in_turns_s")
            turn_pred = predict_again(res, turns) if turns else None
            for row in res["rows"]:
                key, meas = (row["method"], row["route"]), row["measured_step_ms"] / 1e3
                step, serial, code = cal_pred[key]
                qt = turn_pred[key][0] / meas if turn_pred else None
                qts = turn_pred[key][1] / meas if turn_pred else None
                n += 1
                reached += reaches(step * 1e3, row)
                for i, q in enumerate((step / meas, qt, serial / meas, qts)):
                    within[i] += ok(q)
                in_turns = f"{qt:.2f}" if qt is not None else "-"
                lines.append(f"| {Path(path).name} | {res['ranks']} | {res['rate']} | `{row['method']}` "
                             f"| {meas * 1e3:.2f} | {step / meas:.2f} | {spread(step * 1e3, row)} | {in_turns} "
                             f"| {serial / meas:.2f} | {code * 1e3:.2f} |")
    lines += ["", f"Within +-25%: {within[0]} of {n} rows with the calibrated compute, {within[1]} with the "
              f"compute timed in turns; with no overlap: {within[2]} and {within[3]}; within +-25% of some "
              f"round (runs that kept their rounds): {reached}."]
    return "\n".join(lines)


def round_ratios(predicted_ms: float, row: dict) -> list:
    """Predicted / each round's measured step (none where the run kept no rounds)."""
    return [predicted_ms / t for t in row.get("measured_rounds_ms", []) if t > 0]


def spread(predicted_ms: float, row: dict) -> str:
    """The range of :func:`round_ratios`, as the tables print it."""
    q = round_ratios(predicted_ms, row)
    return f"{min(q):.2f}-{max(q):.2f}" if q else "-"


def reaches(predicted_ms: float, row: dict) -> bool:
    """Whether some round's measured step is within the target of the prediction."""
    return any(WITHIN[0] <= q <= WITHIN[1] for q in round_ratios(predicted_ms, row))


def render(doc) -> str:
    from common import TESTBED_NODES_WAIT

    lines = ["# The planner against the testbed", "",
             f"`{doc['command']}`; load at start {doc['loadavg_start']}. The main job's CNN "
             "(MNIST-1D, batch 64 per rank), one job per world; every prediction from the calibration "
             "the same job measured (`hvd_ext.plan.calibration.measure`). Horovod's rows wait as Horovod "
             "does (a spin); hvd_ext's rows wait by `HVD_EXT_WAIT`'s rule (`hvd_ext/exchange/waiting.py`: "
             "they sleep where a node runs more ranks than cores). The 2 nodes x 2 worlds set "
             f"`HVD_EXT_WAIT={TESTBED_NODES_WAIT}`: their nodes share this machine's cores, which a rank "
             "cannot see.", "",
             "Bytes: `counted` is the exchange's own count (Horovod's: the ring's); `on the wire` the "
             "interface's kernel counter (per rank on one node, per node NIC across nodes: see the module "
             "doc), with the planner's bytes for it.", "",
             "`over rounds`: predicted / each round's measured step, the row's own spread.", "",
             "| ranks | link | method | route | measured ms/step | predicted | pred/meas | over rounds "
             "| bytes pred/counted | on the wire, KB/step | pred/wire |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in doc["results"]:
        for row in res["rows"]:
            wire, q = row.get("interface_bytes"), row.get("interface_ratio")
            lines.append(f"| {res['ranks']} | {res['rate']} | `{row['method']}` | {row['route']} | "
                         f"{row['measured_step_ms']:.2f} | {row['predicted_step_ms']:.2f} | "
                         f"{row['step_ratio']:.2f} | {spread(row['predicted_step_ms'], row)} | "
                         f"{row['bytes_ratio']:.2f} | " + (f"{wire / 1e3:.1f} | {q:.2f} |" if wire else "- | - |"))
    lines += ["", "Per world, step time predicted / measured over the five methods, whether the "
              "planner ranks the fastest method first, and the step without any exchange: calibrated "
              "(the planner's compute time) and timed in the same turns as the methods:", "",
              "| ranks | link | median | min | max | fastest measured | fastest predicted | compute ms: "
              "calibrated | in turns |", "|---|---|---|---|---|---|---|---|---|"]
    for res in doc["results"]:
        r = [row["step_ratio"] for row in res["rows"]]
        fm = min(res["rows"], key=lambda row: row["measured_step_ms"])["method"]
        fp = min(res["rows"], key=lambda row: row["predicted_step_ms"])["method"]
        turns = res.get("compute_in_turns_s")
        lines.append(f"| {res['ranks']} | {res['rate']} | {statistics.median(r):.2f} | {min(r):.2f} | {max(r):.2f} "
                     f"| `{fm}` | `{fp}` | {res['calibration'].get('compute_s', 0) * 1e3:.1f} | "
                     + (f"{turns * 1e3:.1f} |" if turns is not None else "- |"))
    rows = [row for res in doc["results"] for row in res["rows"]]
    allr = [row["step_ratio"] for row in rows]
    if allr:
        lines += ["", f"Step time, predicted / measured, all rows: median {statistics.median(allr):.2f}, "
                  f"range [{min(allr):.2f}, {max(allr):.2f}] over {len(allr)} rows; within +-25%: "
                  f"{sum(WITHIN[0] <= q <= WITHIN[1] for q in allr)}"
                  + (f"; within +-25% of some round: {sum(reaches(row['predicted_step_ms'], row) for row in rows)}."
                     if any(row.get("measured_rounds_ms") for row in rows) else ".")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
