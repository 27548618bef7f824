#!/usr/bin/env bash
# This script downloads the CIFAR10 (binary version) data and unzips it (as
# BVLC's data/cifar10/get_cifar10.sh).  DOWNLOAD_TIMEOUT bounds the download.
set -eu
DIR="$( cd "$( dirname "${BASH_SOURCE[0]}" )" && pwd )"
cd "$DIR"
T=${DOWNLOAD_TIMEOUT:-600}
URL=http://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz

echo "Downloading..."
if command -v wget >/dev/null 2>&1; then
    wget --no-check-certificate -q -T "$T" -t 1 -O cifar-10-binary.tar.gz "$URL"
else
    curl -fsSL --connect-timeout "$T" -o cifar-10-binary.tar.gz "$URL"
fi

echo "Unzipping..."
tar -xf cifar-10-binary.tar.gz && rm -f cifar-10-binary.tar.gz
mv cifar-10-batches-bin/* . && rm -rf cifar-10-batches-bin

echo "Done."
