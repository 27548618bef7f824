"""Whether a call lets other Python threads run (releases the GIL)."""
import threading
import time


def stall_shares(fn, repeats=3, tick=0.0005):
    """Calls ``fn()`` ``repeats`` times while a thread ticks every ``tick``
    seconds; returns, for each call, the longest gap between ticks inside
    it as a share of the call's length: near 1 when ``fn`` held the GIL
    throughout, small when it let the ticker run.  Take the smallest, for a
    loaded machine."""
    ticks, running = [], True

    def ticker():
        while running:
            ticks.append(time.perf_counter())
            time.sleep(tick)
    thread = threading.Thread(target=ticker)
    thread.start()
    shares = []
    try:
        for _ in range(repeats):
            time.sleep(10 * tick)
            start = time.perf_counter()
            fn()
            end = time.perf_counter()
            time.sleep(10 * tick)
            marks = [start] + [t for t in ticks if start <= t <= end] + [end]
            shares.append(max(b - a for a, b in zip(marks, marks[1:])) / (end - start))
    finally:
        running = False
        thread.join()
    return shares
