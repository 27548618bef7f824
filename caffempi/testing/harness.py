"""What the harnesses that start something outside this process share (the
emulated hosts, the one-node Slurm cluster): ``with harness:`` brings it
up and always takes it down, on an error too."""
from abc import ABC, abstractmethod


class Harness(ABC):
    """A context manager over :meth:`up` and :meth:`down`."""

    def __enter__(self):
        self.up()
        return self

    def __exit__(self, *exc):
        self.down()

    @abstractmethod
    def up(self):
        """Start everything; on a failure, leave nothing behind."""

    @abstractmethod
    def down(self):
        """Stop and remove everything (safe to call more than once)."""
