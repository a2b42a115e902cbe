import glob
import os
import shutil

from setuptools import setup, find_packages
from setuptools.command.build_py import build_py as _build_py

HERE = os.path.dirname(os.path.abspath(__file__))
CUPY = {"11": "cupy-cuda11x", "12": "cupy-cuda12x", "13": "cupy-cuda13x"}


def cuda_major():
    """The CUDA major version the GPU kernels will run with: torch's CUDA build, else the driver's
    (nvidia-smi), else 12. A CuPy wheel of another major version cannot load."""
    try:
        import torch
        if torch.version.cuda:
            return torch.version.cuda.split(".")[0]
    except Exception:
        pass
    try:
        import re
        import subprocess
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
        m = re.search(r"CUDA Version:\s*(\d+)", out)
        if m:
            return m.group(1)
    except Exception:
        pass
    return "12"


class build_py(_build_py):
    """Also ship the CUDA sources: top-level kernels/*.cu, *.cuh -> hvd_ext/_cu/ in the build.

    Editable installs (pip install -e .) skip the copy; hvd_ext.ops.cuda_kernels then reads kernels/
    from the source tree next to the package."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dst = os.path.join(self.build_lib, "hvd_ext", "_cu")
        os.makedirs(dst, exist_ok=True)
        for src in sorted(glob.glob(os.path.join(HERE, "kernels", "*.cu")) +
                          glob.glob(os.path.join(HERE, "kernels", "*.cuh"))):
            shutil.copy2(src, os.path.join(dst, os.path.basename(src)))


setup(
    name="hvd_ext",
    version="0.1.0",
    description="Communication-efficient gradient and parameter exchange for Horovod + PyTorch",
    license="Apache-2.0",
    packages=find_packages(include=["hvd_ext", "hvd_ext.*"]),
    cmdclass={"build_py": build_py},
    python_requires=">=3.9",
    install_requires=["torch", "numpy"],
    # "gpu": the CuPy wheel of this machine's CUDA major version; or name it: cuda11, cuda12, cuda13
    extras_require=dict({"gpu": [CUPY.get(cuda_major(), "cupy-cuda12x")]},
                        **{f"cuda{v}": [w] for v, w in CUPY.items()}),
)
