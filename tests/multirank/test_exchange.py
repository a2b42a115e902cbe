"""The exchange routes on real Horovod ranks (Gloo), odd and even N, bit for bit the simulated world.
The per-rank checks run in the worker (tests/multirank/workers/exchange_scale.py)."""
import pytest

from helpers.checks import assert_checks

SPECS = ("qsgd:bits=8,route=twophase", "efsignsgd:route=twophase", "topk:ratio=0.02,route=twophase",
         "sig:ratio=0.02,route=twophase", "topk:ratio=0.02", "qdist:bits=3", "fp16", "bf16")


# ---- the same routes on real Horovod ranks (Gloo), odd and even N ----------------------------------
@pytest.mark.parametrize("np_", [3, 4])
def test_real_horovod_routes_equal_the_simulated_world(np_):
    from conftest import launch

    results = launch("exchange_scale.py", np=np_, launcher="gloo", timeout=300)
    assert_checks(results)
    for r in results:
        assert r["size"] == np_
        for spec in SPECS:  # every spec ran, with its named checks
            assert spec in r and any(n.startswith(spec + ":") for n in r["checks"]), spec
