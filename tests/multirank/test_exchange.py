"""The exchange routes on real Horovod ranks (Gloo), odd and even N, bit for bit the simulated world."""
import pytest


# ---- the same routes on real Horovod ranks (Gloo), odd and even N ----------------------------------
@pytest.mark.parametrize("np_", [3, 4])
def test_real_horovod_routes_equal_the_simulated_world(np_):
    from conftest import launch

    results = launch("exchange_scale.py", np=np_, launcher="gloo", timeout=300)
    for r in results:
        assert r["size"] == np_
        for spec in ("qsgd:bits=8,exchange=twophase", "efsignsgd:exchange=twophase",
                     "topk:ratio=0.02,exchange=twophase", "sig:ratio=0.02,exchange=twophase",
                     "topk:ratio=0.02", "qdist:bits=3", "fp16", "bf16"):
            x = r[spec]
            assert x["bitwise"], (spec, x["max_diff"])
            assert x["recv"] == x["sim_recv"], spec
            assert x["spread"] == 0.0, spec
        assert r["bf16"]["routes"] == r["fp16"]["routes"] == ["allreduce"]
        assert r["qsgd:bits=8,exchange=twophase"]["routes"] == ["twophase"]
        assert r["topk:ratio=0.02,exchange=twophase"]["routes"] == ["sparse_rs"]
