"""A pycaffe training script as BVLC's users write one (``import caffe``
being the only change), run by tests/mpi/test_pycaffe_mpi.py under
``mpiexec -n 2`` and as one process; nothing in it knows about MPI.

usage: pycaffe_script.py SOLVER ITERS OUT
OUT has a %d for the rank: each rank writes its weights, the gradients
on_gradients_ready saw, its first batch of data, its test scores and
what the module's multi-GPU calls answered.
"""
import sys

import numpy as np

import caffempi as caffe


def main(solver_path, iters, out):
    caffe.set_mode_cpu()
    count, rank = caffe.solver_count(), caffe.solver_rank()
    caffe.set_solver_count(count)          # BVLC's train.py calls these in each process
    caffe.set_solver_rank(rank)
    caffe.set_multiprocess(True)
    refused = []
    for call in (lambda: caffe.set_solver_count(count + 1), lambda: caffe.NCCL(None, b"uid")):
        try:
            call()
        except caffe.CaffeError as e:
            refused.append(str(e))

    solver = caffe.SGDSolver(solver_path)
    grads, first_batch = [], []
    solver.add_callback(lambda: None, lambda: grads.append(solver.net.param_diff.copy()))
    solver.net.after_forward(lambda i: i == 0 and not first_batch and
                             first_batch.append(solver.net.blobs["data"].data.copy()))
    solver.step(int(iters))
    np.savez(out % rank, w=solver.net.param_data, grads=np.asarray(grads), iter=solver.iter,
             first_batch=first_batch[0], test=np.asarray(solver.test_scores[0]),
             count=count, rank=rank, refused=np.asarray(refused))


if __name__ == "__main__":
    main(*sys.argv[1:4])
