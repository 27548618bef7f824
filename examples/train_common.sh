# Sourced by examples/*/train_*.sh: work from the repository root; $TRAIN runs
# `caffempi train` on NP MPI ranks (default 2) with the venv's Python and mpiexec.
cd "$( dirname "${BASH_SOURCE[0]}" )/.."
PYTHON=${PYTHON:-.venv/bin/python}
MPIRUN=${MPIRUN:-.venv/bin/mpiexec}
TRAIN="$MPIRUN -n ${NP:-2} $PYTHON -m caffempi train"
