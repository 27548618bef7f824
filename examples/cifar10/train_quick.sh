#!/usr/bin/env bash
# CIFAR-10 quick: 4,000 iterations at lr 0.001, then 1,000 at lr 0.0001
# (as BVLC's examples/cifar10/train_quick.sh), on NP MPI ranks (default 2).
set -eu
. "$( dirname "${BASH_SOURCE[0]}" )/../train_common.sh"

$TRAIN --solver=models/cifar10/cifar10_quick_solver.prototxt "$@"

# reduce learning rate by factor of 10 after 8 epochs
$TRAIN --solver=models/cifar10/cifar10_quick_solver_lr1.prototxt \
  --snapshot=examples/cifar10/cifar10_quick_iter_4000.solverstate.h5 "$@"
