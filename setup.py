import glob
import os
import shutil

from setuptools import setup, find_packages
from setuptools.command.build_py import build_py as _build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class build_py(_build_py):
    """Also ship the CUDA sources: top-level kernels/*.cu, *.cuh -> hvd_ext/_cu/ in the build.

    Editable installs (pip install -e .) skip the copy; hvd_ext.kernels then reads kernels/
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
    extras_require={"gpu": ["cupy-cuda12x"]},
)
