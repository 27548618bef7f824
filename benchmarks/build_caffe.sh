#!/bin/bash
# Builds BVLC Caffe's `caffe` tool for the CPU with OpenBLAS, the reference
# that benchmarks/caffe_reference.py times ours against, on Debian 12 or a
# similar system (apt-get; run as root or with sudo).
#
#   bash benchmarks/build_caffe.sh [DIR]     # default DIR: ~/.cache/caffempi/caffe
#
# The source is PyPI's brocolli-caffe 9.0.2 sdist: BVLC Caffe at commit
# 9b891540 with extra layers (SSD and others) added beside it; the layers
# that LeNet and CIFAR10-quick use (convolution as per-image im2col + GEMM,
# pooling, inner product, ReLU, softmax loss) are BVLC's.  Built with the
# Makefile's Release flags (-O2), no OpenCV, LevelDB, Python or CUDA, on gcc
# 12 with protobuf 3.21.  Prints the binary's path.
set -euo pipefail
dir=${1:-$HOME/.cache/caffempi/caffe}
sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo
$sudo apt-get install -y --no-install-recommends build-essential libprotobuf-dev protobuf-compiler \
    libgoogle-glog-dev libgflags-dev libboost-system-dev libboost-thread-dev libboost-filesystem-dev \
    libboost-regex-dev libhdf5-dev libopenblas-dev liblmdb-dev >&2
mkdir -p "$dir"
cd "$dir"
[ -f brocolli-caffe-9.0.2.tar.gz ] || python3 -m pip download --no-deps --no-binary :all: -d . brocolli-caffe==9.0.2 >&2
rm -rf brocolli-caffe-9.0.2
tar xzf brocolli-caffe-9.0.2.tar.gz
cd brocolli-caffe-9.0.2
# the sdist ships caffe.pb.h/.cc from an older protoc, which the system's
# protobuf headers refuse: generate them again with the system's protoc
protoc -I src/caffe/proto --cpp_out=src/caffe/proto src/caffe/proto/caffe.proto
cp src/caffe/proto/caffe.pb.h include/caffe/proto/caffe.pb.h
# (its CMakeLists.txt is rewritten for a pycaffe wheel and skips the tools:
# the Makefile is BVLC's)
blas=/usr/lib/x86_64-linux-gnu/openblas-pthread
cat > Makefile.config <<EOF
CPU_ONLY := 1
USE_OPENCV := 0
USE_LEVELDB := 0
USE_LMDB := 1
BLAS := open
BLAS_INCLUDE := /usr/include/x86_64-linux-gnu/openblas-pthread
BLAS_LIB := $blas
INCLUDE_DIRS := /usr/include/hdf5/serial
LIBRARY_DIRS := /usr/lib/x86_64-linux-gnu/hdf5/serial /usr/lib/x86_64-linux-gnu
BUILD_DIR := build
DISTRIBUTE_DIR := distribute
Q ?= @
EOF
# the Makefile builds into .temp_release; name the tool alone (no tests)
make -j"$(nproc)" .temp_release/tools/caffe >&2
echo "$PWD/.temp_release/tools/caffe"
