#!/usr/bin/env bash
# This script converts the mnist data into lmdb format (as BVLC's
# examples/mnist/create_mnist.sh).  Run from anywhere; paths are repo-relative.
set -eu
cd "$( dirname "${BASH_SOURCE[0]}" )/../.."
PYTHON=${PYTHON:-.venv/bin/python}
EXAMPLE=examples/mnist
DATA=data/mnist
BACKEND="lmdb"

echo "Creating ${BACKEND}..."

rm -rf $EXAMPLE/mnist_train_${BACKEND}
rm -rf $EXAMPLE/mnist_test_${BACKEND}

$PYTHON tools/convert_mnist_data.py $DATA/train-images-idx3-ubyte \
  $DATA/train-labels-idx1-ubyte $EXAMPLE/mnist_train_${BACKEND} --backend=${BACKEND}
$PYTHON tools/convert_mnist_data.py $DATA/t10k-images-idx3-ubyte \
  $DATA/t10k-labels-idx1-ubyte $EXAMPLE/mnist_test_${BACKEND} --backend=${BACKEND}

echo "Done."
