from setuptools import setup, find_packages

setup(
    name="hvd_ext",
    version="0.1.0",
    description="Communication-efficient gradient and parameter exchange for Horovod + PyTorch",
    license="Apache-2.0",
    packages=find_packages(include=["hvd_ext", "hvd_ext.*"]),
    package_data={"hvd_ext": ["kernels/*.cu"]},
    python_requires=">=3.9",
    install_requires=["torch", "numpy"],
)
