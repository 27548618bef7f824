#!/usr/bin/env bash
# CIFAR-10 quick: 4,000 iterations at lr 0.001, then 1,000 at lr 0.0001
# (as BVLC's examples/cifar10/train_quick.sh), on NP MPI ranks (default 2).
set -eu
cd "$( dirname "${BASH_SOURCE[0]}" )/../.."
PYTHON=${PYTHON:-.venv/bin/python}
MPIRUN=${MPIRUN:-.venv/bin/mpiexec}
TRAIN="$MPIRUN -n ${NP:-2} $PYTHON -m caffempi train"

$TRAIN --solver=models/cifar10/cifar10_quick_solver.prototxt "$@"

# reduce learning rate by factor of 10 after 8 epochs
$TRAIN --solver=models/cifar10/cifar10_quick_solver_lr1.prototxt \
  --snapshot=examples/cifar10/cifar10_quick_iter_4000.solverstate.h5 "$@"
