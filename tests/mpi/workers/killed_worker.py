"""A job whose rank 1 is killed (SIGKILL) once the world is up; rank 0
prints the /dev/shm files MPICH mapped for the job, deleted or not, so the
test can check that none is left behind."""
import os
import signal
import sys
import time

from caffempi.parallel.comm import get_world


def main():
    world = get_world("overlap")
    if world.rank == 0:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].rstrip("\n").replace(" (deleted)", "")
                     for line in f if "/dev/shm/mpich_shm_" in line}
        for p in sorted(paths):
            print("SHM", p)
        sys.stdout.flush()
        time.sleep(0.3)
    world.barrier()
    if world.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)          # ended by the launcher when rank 1 dies


if __name__ == "__main__":
    main()
