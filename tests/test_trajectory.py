"""benchmarks/trajectory.py's pure parts: variants, the solver rewrite, the
log parser and the per-variant summary (no training)."""
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("trajectory", REPO / "benchmarks" / "trajectory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LOG = """\
I1126 16:49:01.313097 13934 solver.py:671]     Test net output #0: accuracy = 0.106
I1126 16:49:01.313097 13934 solver.py:671]     Test net output #1: loss = 2.36571 (* 1 = 2.36571 loss)
I1126 16:49:01.362886 13934 solver.py:512] Iteration 0 (0 iter/s, 0.266898s/20 iters), loss = 2.35324
I1126 16:49:01.363028 13934 solver.py:519]     Train net output #0: loss = 2.35324 (* 1 = 2.35324 loss)
I1126 16:49:01.363145 13934 solver.py:438] Iteration 0, lr = 0.01
I1126 16:49:02.063469 13934 solver.py:512] Iteration 20 (28.5459 iter/s, 0.700626s/20 iters), loss = 1.27184
I1126 16:49:04.427097 13934 solver.py:604] Iteration 40, loss = 0.448463
I1126 16:49:04.427291 13934 solver.py:624] Iteration 40, Testing net (#0)
I1126 16:49:04.489161 13934 solver.py:671]     Test net output #0: accuracy = 0.914
"""


def test_parse_log_reads_display_and_last_losses_and_accuracies():
    t = load()
    assert t.parse_log(LOG) == {"loss": [[0, 2.35324], [20, 1.27184], [40, 0.448463]],
                                "accuracy": [0.106, 0.914]}


def test_parse_variant_splits_flags():
    t = load()
    assert t.parse_variant("exact=") == ("exact", [])
    assert t.parse_variant("r1=--compress=powersgd:1 --sfb=off") == ("r1", ["--compress=powersgd:1", "--sfb=off"])


def test_solver_text_sets_iterations_seed_and_prefix():
    t = load()
    base = 'test_interval: 500\nmax_iter: 500\nsnapshot_prefix: "x/y"\n'
    text = t.solver_text(base, 200, 3, "/tmp/a")
    assert "max_iter: 200\n" in text and "test_interval: 200\n" in text      # the last iteration is tested
    assert 'snapshot_prefix: "/tmp/a"' in text and text.endswith("random_seed: 3\n")
    text = t.solver_text(base + "random_seed: -1\n", 1000, 7, "/tmp/a")
    assert "test_interval: 500\n" in text and text.count("random_seed") == 1 and "random_seed: 7\n" in text
    # the demo solver has no random_seed: one is added
    assert "random_seed: 2" in t.solver_text(t.SOLVER.read_text(), 500, 2, "/tmp/a")


def test_summarise_medians_and_points():
    t = load()
    run = lambda acc, losses: {"accuracy": [0.1, acc], "loss": [[0, 2.0], [100, losses[0]], [200, losses[1]]]}
    runs = {"exact": {1: run(0.962, (0.4, 0.1)), 2: run(0.964, (0.3, 0.2)), 3: run(0.963, (0.5, 0.3))},
            "r1": {1: run(0.959, (0.6, 0.1)), 2: run(0.950, (0.4, 0.1)), 3: run(0.958, (0.5, 0.1))}}
    s = t.summarise(runs, "exact")
    assert s["exact"]["accuracy_median"] == 0.963 and s["exact"]["accuracy_diff_points"] == 0
    assert s["r1"]["accuracy"] == {1: 0.959, 2: 0.950, 3: 0.958}
    assert abs(s["r1"]["accuracy_diff_points"] - -0.5) < 1e-9
    assert s["exact"]["loss_median"] == [[0, 2.0], [100, 0.4], [200, 0.2]]


def test_plot_writes_a_small_svg_with_text_as_text(tmp_path):
    import pytest
    pytest.importorskip("matplotlib")
    t = load()
    summary = {"exact": {"accuracy_median": 0.963, "loss_median": [[0, 2.3], [100, 0.4], [200, 0.1]]},
               "r1": {"accuracy_median": 0.958, "loss_median": [[0, 2.3], [100, 0.45], [200, 0.09]]}}
    out = tmp_path / "loss.svg"
    t.plot(summary, 200, [1, 2, 3], out)
    svg = out.read_text()
    assert 'width="504pt"' in svg and "r1 (test acc. 0.958)" in svg and "glyph" not in svg
