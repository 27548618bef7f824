"""Caffe's solvers: SGD, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam.

``get_solver(path_or_param)`` builds the solver named by the parameter's
``type`` (or legacy ``solver_type``), as Caffe's SolverRegistry does;
``SGDSolver(path)`` etc. build one type directly, as in pycaffe.
"""
import os

import numpy as np

from ..common import CaffeError
from ..io import proto_io
from ..io.proto_io import ProtoError
from ..proto import caffe_pb2
from . import updates
from .solver import Solver, SolverAction, read_solver

__all__ = ["get_solver", "Solver", "SGDSolver", "NesterovSolver", "AdaGradSolver",
           "RMSPropSolver", "AdaDeltaSolver", "AdamSolver", "SolverAction",
           "SOLVER_TYPES", "read_solver"]


class SGDSolver(Solver):
    """Stochastic gradient descent with momentum (sgd_solver.cpp)."""
    type = "SGD"

    def compute_update_value(self, rate, block):
        updates.sgd(self.xp, self.net.param_diff[block], self.history[0][block], self._tmp[block],
                    self.local_rate(rate, block), self.param.momentum)


class NesterovSolver(SGDSolver):
    """Nesterov's accelerated gradient (nesterov_solver.cpp)."""
    type = "Nesterov"
    uses_scratch = True

    def compute_update_value(self, rate, block):
        updates.nesterov(self.xp, self.net.param_diff[block], self.history[0][block], self._tmp[block],
                         self.local_rate(rate, block), self.param.momentum, self.scratch()[block])


class AdaGradSolver(SGDSolver):
    """AdaGrad (adagrad_solver.cpp)."""
    type = "AdaGrad"

    def _check_solver_param(self):
        if self.param.momentum != 0:
            raise CaffeError("Momentum cannot be used with AdaGrad.")

    def compute_update_value(self, rate, block):
        updates.adagrad(self.xp, self.net.param_diff[block], self.history[0][block], self._tmp[block],
                        self.local_rate(rate, block), self.param.delta)


class RMSPropSolver(SGDSolver):
    """RMSProp (rmsprop_solver.cpp)."""
    type = "RMSProp"

    def _check_solver_param(self):
        p = self.param
        if p.momentum != 0:
            raise CaffeError("Momentum cannot be used with RMSProp.")
        if not 0 <= p.rms_decay < 1:
            raise CaffeError("rms_decay should lie between 0 and 1, got %g" % p.rms_decay)

    def compute_update_value(self, rate, block):
        updates.rmsprop(self.xp, self.net.param_diff[block], self.history[0][block], self._tmp[block],
                        self.local_rate(rate, block), self.param.rms_decay, self.param.delta)


class AdaDeltaSolver(SGDSolver):
    """AdaDelta (adadelta_solver.cpp); history: gradients then updates."""
    type = "AdaDelta"
    num_history = 2
    uses_scratch = True

    def compute_update_value(self, rate, block):
        updates.adadelta(self.xp, self.net.param_diff[block], self.history[0][block], self.history[1][block],
                         self._tmp[block], self.local_rate(rate, block), self.param.momentum, self.param.delta,
                         self.scratch()[block])


class AdamSolver(SGDSolver):
    """Adam (adam_solver.cpp); history: first moments then second moments."""
    type = "Adam"
    num_history = 2

    def prepare_update(self):
        """Also the bias correction of this step, sqrt(1 - b2^t) / (1 -
        b1^t) with t = iter + 1, into a 0-d array the update reads."""
        rate = super().prepare_update()
        if getattr(self, "_correction", None) is None:
            self._correction = self.xp.empty((), np.float32)
        p = self.param
        self._correction[...] = updates.adam_correction(p.momentum, p.momentum2, self.iter + 1)
        return rate

    def compute_update_value(self, rate, block):
        p = self.param
        updates.adam(self.xp, self.net.param_diff[block], self.history[0][block], self.history[1][block],
                     self._tmp[block], self.local_rate(rate, block), p.momentum, p.momentum2, p.delta,
                     self._correction)


SOLVER_TYPES = {cls.type: cls for cls in (SGDSolver, NesterovSolver, AdaGradSolver,
                                           RMSPropSolver, AdaDeltaSolver, AdamSolver)}


def solver_param(param, kwargs):
    """(SolverParameter, kwargs) of a path or a SolverParameter (a copy,
    upgraded), kwargs with the path as ``source``."""
    if isinstance(param, caffe_pb2.SolverParameter):
        p = caffe_pb2.SolverParameter()
        p.CopyFrom(param)
        try:
            proto_io.upgrade_solver_param(p, kwargs.get("source") or "<SolverParameter>")
        except ProtoError as e:
            raise CaffeError(str(e)) from None
        return p, kwargs
    return read_solver(param), dict(kwargs, source=os.fspath(param))


def get_solver(param, types=SOLVER_TYPES, **kwargs):
    """The solver of the parameter's type (its class from ``types``), from a
    path or a SolverParameter."""
    p, kwargs = solver_param(param, kwargs)
    cls = types.get(p.type)
    if cls is None:
        raise CaffeError("unknown solver type '%s' (known: %s)" % (p.type, ", ".join(types)))
    return cls(p, **kwargs)
