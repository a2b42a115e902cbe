"""The layer contracts (``.importlinter``): kept by the package, broken by a cycle added to a copy."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
LINT = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([LINT, "--config", str(root / ".importlinter"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def copy(tmp_path):
    shutil.copytree(ROOT / "hvd_ext", tmp_path / "hvd_ext", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path)
    return tmp_path


def test_package_keeps_every_contract():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


@pytest.mark.parametrize("module, line, broken", [
    # a lower layer importing an upper one (and so closing a cycle: pipeline imports exchange)
    ("exchange/cost.py", "from ..pipeline import GradientPipeline  # noqa", "hvd_ext.exchange is not allowed to import"),
    # a codec importing the spec front door (spec imports the codecs)
    ("compression/topk.py", "from ..spec import compression_from_spec  # noqa", "hvd_ext.compression is not allowed"),
    # one route importing another
    ("exchange/routes/allgather.py", "from .sparse_rs import encode_pairs  # noqa", "is not allowed to import"),
])
def test_added_cycle_breaks_a_contract(copy, module, line, broken):
    path = copy / "hvd_ext" / module
    path.write_text(path.read_text() + "\n" + line + "\n")
    r = lint(copy)
    assert r.returncode != 0 and broken in r.stdout, r.stdout[-3000:]


def test_functions_stay_short():
    """No function in hvd_ext/ is over 60 lines (docstring included): a longer one is split by step."""
    import ast
    long = []
    for path in sorted((ROOT / "hvd_ext").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "\n".join(long)
