#!/usr/bin/env bash
# Train LeNet on MNIST with NP MPI ranks (default 2); extra arguments go to
# `caffempi train` (e.g. --snapshot=...).
set -eu
. "$( dirname "${BASH_SOURCE[0]}" )/../train_common.sh"

$TRAIN --solver=models/mnist/lenet_solver.prototxt "$@"
