"""plot_training_log: training curves as a PNG (matplotlib, Agg backend),
with the chart types of BVLC's tools/extra/plot_training_log.py.example:

    0: Test accuracy  vs. Iters     1: Test accuracy  vs. Seconds
    2: Test loss      vs. Iters     3: Test loss      vs. Seconds
    4: Train learning rate vs. Iters  5: Train learning rate vs. Seconds
    6: Train loss     vs. Iters     7: Train loss     vs. Seconds
    8: Batch shares   vs. Iters     9: Batch shares   vs. Seconds  (caffempi's --balance)

    python tools/plot_training_log.py CHART_TYPE OUT.png LOG_OR_CSV [LOG_OR_CSV ...]

Each input is a training log (parsed with parse_log) or a .train/.test/.shares
CSV written by parse_log.  The share charts draw each rank's count as steps.
"""
import os

from ..common import CaffeError
from . import parse_log as _pl
from ..flags import FlagSet
from ._util import info, run_tool

CHARTS = {
    0: ("test", "accuracy", "NumIters"), 1: ("test", "accuracy", "Seconds"),
    2: ("test", "loss", "NumIters"), 3: ("test", "loss", "Seconds"),
    4: ("train", "LearningRate", "NumIters"), 5: ("train", "LearningRate", "Seconds"),
    6: ("train", "loss", "NumIters"), 7: ("train", "loss", "Seconds"),
    8: ("shares", "rank", "NumIters"), 9: ("shares", "rank", "Seconds"),
}
LABELS = {"NumIters": "Iters", "Seconds": "Seconds", "accuracy": "Test accuracy",
          "LearningRate": "Train learning rate", "rank": "Batch shares"}


def _rows(path, phase):
    if path.endswith((".train", ".test", ".shares")):
        if not path.endswith("." + phase):
            other = path[:path.rfind(".")] + "." + phase
            if not os.path.exists(other):
                raise CaffeError("%s: no .%s CSV beside it (%s)" % (path, phase, other))
            path = other
        return _pl.read_csv(path)
    train, test, shares = _pl.parse_all(path)
    return [{k: float(v) for k, v in r.items()} for r in {"train": train, "test": test, "shares": shares}[phase]]


def plot_chart(chart_type, out_png, inputs):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if chart_type not in CHARTS:
        raise CaffeError("chart type %r is not one of 0..%d" % (chart_type, max(CHARTS)))
    phase, field, xfield = CHARTS[chart_type]
    fig, ax = plt.subplots(figsize=(8, 5))
    plotted = 0
    for path in inputs:
        rows = _rows(path, phase)
        fields = [field] if phase != "shares" else [k for k in (rows[0] if rows else {}) if k.startswith("rank")]
        lines = 0
        for name in fields:
            ys = [(r[xfield], r[name]) for r in rows if name in r]
            if ys:
                label = os.path.basename(path) + ("" if phase != "shares" else " " + name)
                ax.plot([x for x, _ in ys], [y for _, y in ys], marker=".", label=label,
                        drawstyle="steps-post" if phase == "shares" else "default")
                lines += 1
        if not lines:
            info("%s: no %s %s values", path, phase, field)
        plotted += lines
    if not plotted:
        plt.close(fig)
        raise CaffeError("no %s %s values in %s" % (phase, field, ", ".join(inputs)))
    ylabel = LABELS.get(field, ("Test " if phase == "test" else "Train ") + field)
    ax.set_xlabel(LABELS[xfield])
    ax.set_ylabel(ylabel)
    ax.set_title("%s vs. %s" % (ylabel, LABELS[xfield]))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


FLAGS = FlagSet("plot_training_log", "Plot training curves as a PNG. Chart types: " + "; ".join(
    "%d: %s %s vs. %s" % (k, phase.capitalize(), field, LABELS[x]) for k, (phase, field, x) in sorted(CHARTS.items())))
FLAGS.argument("chart_type", "0..9", kind=int)
FLAGS.argument("output_png", "the PNG to write")
FLAGS.argument("LOG_OR_CSV", "training logs, or .train/.test CSV files written by parse_log", repeated=True)


def _main(flags, chart_type, output_png, *inputs):
    plot_chart(chart_type, output_png, list(inputs))
    info("Wrote %s", output_png)


def main(argv=None):
    return run_tool(FLAGS, _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
