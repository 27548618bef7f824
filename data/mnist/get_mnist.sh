#!/usr/bin/env bash
# This script downloads the MNIST data and unzips it (as BVLC's
# data/mnist/get_mnist.sh).  DOWNLOAD_TIMEOUT (seconds, default 120) bounds
# each download; the exit status is non-zero when a file could not be fetched.
set -u
DIR="$( cd "$( dirname "${BASH_SOURCE[0]}" )" && pwd )"
cd "$DIR"
T=${DOWNLOAD_TIMEOUT:-120}

fetch() {  # fetch URL FILE
    if command -v wget >/dev/null 2>&1; then
        wget -q -T "$T" -t 1 -O "$2.part" "$1"
    elif command -v curl >/dev/null 2>&1; then
        curl -fsSL --connect-timeout "$T" --max-time "$((T * 4))" -o "$2.part" "$1"
    else
        echo "neither wget nor curl is installed" >&2; return 1
    fi && mv "$2.part" "$2" || { rm -f "$2.part"; return 1; }
}

echo "Downloading..."
status=0
for fname in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
    if [ -s "$fname" ]; then continue; fi
    if fetch "http://yann.lecun.com/exdb/mnist/${fname}.gz" "${fname}.gz"; then
        echo "Unzipping ${fname}.gz..."
        gunzip -f "${fname}.gz" || { rm -f "${fname}.gz" "$fname"; status=1; }
    else
        echo "Could not download ${fname}.gz" >&2
        status=1
    fi
done
[ $status -eq 0 ] && echo "Done."
exit $status
