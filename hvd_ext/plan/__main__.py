"""``python -m hvd_ext.plan``: the planner's command line (see :mod:`hvd_ext.plan`).

    python -m hvd_ext.plan --model resnet50 --cluster dgx-a100 --nodes 16
    python -m hvd_ext.plan --params 120e6 --compute-ms 80 --cluster pcie-consumer-10gbe --plot step.png
    horovodrun -np 8 python -m hvd_ext.plan --measure --out calib.json     # on the user's cluster
    python -m hvd_ext.plan --model bert-large --calibration calib.json --nodes 32
    horovodrun -np 8 python -m hvd_ext.plan --measure --model-file my_model.py   # with its compute time
    python -m hvd_ext.plan --model-file my_model.py --calibration calib.json --nodes 16

A model file is a Python file that defines ``model()``, returning the torch module (its
``named_parameters()`` give the real bucket layout), and, for ``--measure``, ``step(model)``, which
runs one forward and backward of a training batch on the module's device.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import math
import sys
from pathlib import Path

from ..optimizer import DEFAULT_BUCKET_BYTES
from . import DEFAULT_METHODS, plan, presets
from .report import plot_bandwidth_sweep


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m hvd_ext.plan", description=__doc__.split("\n")[0])
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", choices=list(presets.MODELS), help="a published model (gives the compute time)")
    what.add_argument("--params", type=float, help="parameter count (e.g. 25.6e6)")
    what.add_argument("--sizes", help="the model's tensors, comma-separated sizes or shapes (e.g. 4096x1024,1024,10)")
    what.add_argument("--model-file", help="a Python file defining model() (and step(model) for --measure)")
    p.add_argument("--compute-ms", type=float, default=None, help="one step's forward + backward, ms")
    p.add_argument("--cluster", default="p3-v100-25gbe", help=f"preset: {', '.join(presets.CLUSTERS)}")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--inter-gbps", type=float, default=None, help="inter-node bandwidth, Gbit/s")
    p.add_argument("--intra-gbps", type=float, default=None, help="intra-node bandwidth, Gbit/s")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), help="hvd_ext specs to predict")
    p.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / 2 ** 20,
                   help="the optimizer's bucket_bytes, MiB (a larger bucket pays the latency of the collectives "
                        "Horovod does not fuse, alltoalls, less often)")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "none"],
                   help="the job's optimizer (sgd: with momentum): some codecs' routes depend on it")
    p.add_argument("--calibration", default=None, help="a file --measure wrote: its links and codec speeds")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--plot", default=None, help="draw step time against inter-node bandwidth here (PNG)")
    p.add_argument("--measure", action="store_true", help="under horovodrun/mpirun: measure links, codecs "
                   "and (with --model-file) the step's compute time; write --out")
    p.add_argument("--out", default="hvd_ext_calibration.json", help="where --measure writes")
    return p.parse_args(argv)


def parse_sizes(text: str) -> list:
    """'4096x1024,1024' -> [(4096, 1024), (1024,)]; a clear error naming what is accepted."""
    try:
        shapes = [tuple(int(d) for d in item.strip().split("x")) for item in text.split(",") if item.strip()]
    except ValueError:
        shapes = []
    if not shapes or any(d < 1 for s in shapes for d in s):
        raise SystemExit(f"--sizes: bad value {text!r}; accepted: tensor sizes or shapes >= 1, comma-separated "
                         "(e.g. 4096x1024,1024,10)")
    return shapes


def load_model_file(path: str, measure: bool = False):
    """The module ``path`` defines, loaded as ``python path`` would run it (its folder importable): its
    ``model()`` is required, and with ``measure`` its ``step(model)``."""
    file = Path(path)
    if not file.is_file():
        raise SystemExit(f"--model-file: no file {path!r}; accepted: a Python file defining model()")
    loader = importlib.machinery.SourceFileLoader(f"hvd_ext_plan_model_{file.stem}", str(file))
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    sys.modules[loader.name] = mod      # as for any imported module (dataclasses, pickling look it up)
    folder = str(file.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        loader.exec_module(mod)
    except (Exception, SystemExit) as e:
        del sys.modules[loader.name]
        raise SystemExit(f"--model-file {path}: loading it raised {type(e).__name__}: {e}; accepted: a Python "
                         "file defining model() (and step(model) for --measure)") from e
    needed = ["model", "step"] if measure else ["model"]
    missing = [n for n in needed if not callable(getattr(mod, n, None))]
    if missing:
        raise SystemExit(f"--model-file {path}: defines no {' or '.join(f'{n}()' for n in missing)}; accepted: a "
                         "file defining model() -> torch.nn.Module and, for --measure, step(model) (one forward "
                         "and backward on the module's device)")
    return mod


def build_model(mod, path: str):
    """``mod.model()``, refused unless it is a torch module."""
    import torch

    net = mod.model()
    if not isinstance(net, torch.nn.Module):
        raise SystemExit(f"--model-file {path}: model() returned {type(net).__name__}; accepted: a torch.nn.Module")
    return net


MEASURE_OPTIONS = ("measure", "model_file", "methods", "out")   # the rest are a plan's inputs and outputs


def measure_command(a) -> int:
    """``--measure``: the calibration of this job, with the step's compute time when a model file is given.
    Bad input is refused before any collective."""
    from .calibration import measure_to_file

    defaults = vars(parse_args([]))
    given = [f"--{k.replace('_', '-')}" for k, v in vars(a).items() if k not in MEASURE_OPTIONS and v != defaults[k]]
    if given:
        raise SystemExit(f"--measure: {', '.join(given)} not used in a measurement; accepted with --measure: "
                         "--model-file FILE (to time its step), --methods, --out (a plan reads the file with "
                         "--calibration)")
    step = None
    if a.model_file:
        import horovod.torch as hvd
        import torch

        mod = load_model_file(a.model_file, measure=True)
        net = build_model(mod, a.model_file)
        hvd.init()
        device = torch.device("cpu")
        if torch.cuda.is_available():   # the rank's own GPU, also for tensors step() makes on "cuda"
            device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
            torch.cuda.set_device(device)
        net = net.to(device)
        step = lambda: mod.step(net)  # noqa: E731
    measure_to_file(a.out, methods=a.methods, step=step)
    return 0


def model_input(a):
    """The planner's model from the command line: a published name, a parameter count, sizes or a file."""
    if a.model:
        return a.model
    if a.params:
        return int(a.params)
    if a.sizes:
        return parse_sizes(a.sizes)
    if a.model_file:
        return build_model(load_model_file(a.model_file), a.model_file)
    raise SystemExit("give --model NAME, --params COUNT, --sizes LIST or --model-file FILE")


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.measure:
        return measure_command(a)
    from ..exchange.cost import LinkModel
    from ..exchange.calibration import load

    cal = load(a.calibration) if a.calibration else None
    base = presets.CLUSTERS.get(a.cluster)
    if base is None:
        raise SystemExit(f"unknown --cluster {a.cluster!r}; accepted: {', '.join(presets.CLUSTERS)}")
    inter = LinkModel(alpha=base.inter.alpha, bandwidth=a.inter_gbps * presets.GBIT) if a.inter_gbps else None
    intra = LinkModel(alpha=base.intra.alpha, bandwidth=a.intra_gbps * presets.GBIT) if a.intra_gbps else None
    if not (math.isfinite(a.bucket_mb) and round(a.bucket_mb * 2 ** 20) >= 1):
        raise SystemExit(f"--bucket-mb: bad value {a.bucket_mb!r}; accepted: MiB of one bucket, at least a byte "
                         f"(default {DEFAULT_BUCKET_BYTES / 2 ** 20:g})")
    model = model_input(a)
    try:   # a bad input says what was wrong and what is accepted, without a traceback
        p = plan(model, compute_s=None if a.compute_ms is None else a.compute_ms / 1e3, cluster=base,
                 nodes=a.nodes, gpus_per_node=a.gpus_per_node, intra=intra, inter=inter, methods=a.methods,
                 calibration=cal, optimizer=a.optimizer, bucket_bytes=round(a.bucket_mb * 2 ** 20))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    i = p.inputs
    print(f"{i['params'] / 1e6:.1f}M parameters, compute {i['compute_s'] * 1e3:.1f} ms/step on {i['device']}; "
          f"{i['nodes']} node(s) x {i['gpus_per_node']} GPUs; intra {i['intra']['bandwidth'] * 8 / 1e9:.3g} Gbit/s, "
          f"inter {i['inter']['bandwidth'] * 8 / 1e9:.3g} Gbit/s")
    print(p.table())
    print(f"auto would pick: {', '.join(f'{k} on {v} bucket(s)' for k, v in p.auto_pick.items())} "
          "(assuming its accuracy guard admits the lossy candidates)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"inputs": i, "rows": p.records(), "auto_pick": p.auto_pick}, f, indent=1, default=str)
    if a.plot:
        plot_bandwidth_sweep(p, a.plot)
        print(f"plot: {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
