#!/usr/bin/env bash
# Train LeNet on MNIST with NP MPI ranks (default 2); extra arguments go to
# `caffempi train` (e.g. --snapshot=...).
set -eu
cd "$( dirname "${BASH_SOURCE[0]}" )/../.."
PYTHON=${PYTHON:-.venv/bin/python}
MPIRUN=${MPIRUN:-.venv/bin/mpiexec}

$MPIRUN -n ${NP:-2} $PYTHON -m caffempi train --solver=models/mnist/lenet_solver.prototxt "$@"
