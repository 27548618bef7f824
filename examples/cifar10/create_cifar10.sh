#!/usr/bin/env bash
# This script converts the cifar data into lmdb format and computes the
# image mean (as BVLC's examples/cifar10/create_cifar10.sh).
set -eu
cd "$( dirname "${BASH_SOURCE[0]}" )/../.."
PYTHON=${PYTHON:-.venv/bin/python}
EXAMPLE=examples/cifar10
DATA=data/cifar10
DBTYPE=lmdb

echo "Creating $DBTYPE..."

rm -rf $EXAMPLE/cifar10_train_$DBTYPE $EXAMPLE/cifar10_test_$DBTYPE

$PYTHON tools/convert_cifar_data.py $DATA $EXAMPLE $DBTYPE

echo "Computing image mean..."

$PYTHON tools/compute_image_mean.py --backend=$DBTYPE \
  $EXAMPLE/cifar10_train_$DBTYPE $EXAMPLE/mean.binaryproto

echo "Done."
