#!/usr/bin/env bash
# CIFAR-10 full: 60,000 iterations at lr 0.001, 5,000 at 0.0001, 5,000 at
# 0.00001 (as BVLC's examples/cifar10/train_full.sh), on NP MPI ranks (default 2).
set -eu
. "$( dirname "${BASH_SOURCE[0]}" )/../train_common.sh"

$TRAIN --solver=models/cifar10/cifar10_full_solver.prototxt "$@"

# reduce learning rate by factor of 10
$TRAIN --solver=models/cifar10/cifar10_full_solver_lr1.prototxt \
  --snapshot=examples/cifar10/cifar10_full_iter_60000.solverstate.h5 "$@"

# reduce learning rate by factor of 10
$TRAIN --solver=models/cifar10/cifar10_full_solver_lr2.prototxt \
  --snapshot=examples/cifar10/cifar10_full_iter_65000.solverstate.h5 "$@"
