"""`make bench`: every benchmark in turn, one BLAS thread per process unless
the benchmark sets its own.  Each prints its own table; see their docstrings
for options (e.g. `benchmarks/scaling.py --comm overlap,thread,blocking`)."""
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = [
    ["net_speed.py", "--iterations", "20", "--threads", "1,2"],
    ["data_throughput.py"],
    ["data_wait.py"],
    ["scaling.py", "--unpaired"],
    ["sum_latency.py", "--runs", "1"],
    ["memory.py", "--no-search"],
]


def main():
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    failed = []
    for script, *args in RUNS:
        print("\n=== %s %s" % (script, " ".join(args)), flush=True)
        if subprocess.run([sys.executable, str(HERE / script)] + args, env=env).returncode:
            failed.append(script)
    if failed:
        sys.exit("failed: " + ", ".join(failed))


if __name__ == "__main__":
    main()
