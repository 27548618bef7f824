"""Emulated hosts on one Linux machine, for trying and testing multi-host
runs: each host is a network namespace with one interface, ``eth0``, on a
bridge in a namespace of its own, optionally rate-limited with ``tc``'s
token bucket on both ends; MPICH's ``mpiexec -f`` or Open MPI's ``mpirun
-machinefile`` (whichever MPI is installed: :meth:`Cluster.launcher`) starts
the remote daemons through a stand-in for ssh that enters the host's
namespace (with its own host name, so that MPI sees separate nodes).
Traffic never leaves the namespaces made here: they have no route anywhere
else.  Each host gives up on unacknowledged TCP data after about 13 s
(``net.ipv4.tcp_retries2=5``, :data:`TCP_RETRIES2`), so that a launcher
waiting on a host whose link is down ends (Open MPI's would otherwise wait
about 15 minutes).

    with Cluster(2, rate="1gbit") as cluster:
        result = cluster.mpiexec(["python", "-m", "caffempi", "train", "--solver=S"], timeout=600)
        print(cluster.link_bytes())        # bytes each host's eth0 sent and received

or from a shell (as root), one rank per host unless ``--ppn`` says more:

    python -m caffempi.testing.cluster --hosts 2 --rate 1gbit -- \
        python -m caffempi train --solver=models/mnist/lenet_solver.prototxt

Needs root (or CAP_NET_ADMIN) and iproute2's ``ip`` and ``tc``;
:func:`unavailable_reason` says why not where they are missing.  The
namespaces are always removed: on leaving the ``with`` block, on an
exception, on Ctrl-C, and, for a process killed outright, by the next
:class:`Cluster` with the same prefix.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from ..parallel.launch import OPEN_MPI_FORWARD_SIGNALS, is_open_mpi, mpiexec_path
from .harness import Harness

# MPICH's wheel is built ch4:ucx,ofi and would move bytes between ranks on
# one physical machine through shared memory: force TCP on the emulated link
# (Open MPI: the options of Cluster.launcher).
TCP_ENV = {"MPICH_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0",
           "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}

# Retransmissions of unacknowledged TCP data before the kernel gives up on
# the connection (Linux's default 15: about 15 minutes; 5: about 13 s).  Open
# MPI's mpirun, ending a job, waits until every host's daemon confirms; one
# behind a link that went down holds it until then.
TCP_RETRIES2 = 5

_STANDIN = """#!/bin/sh
# ssh for emulated hosts: drop ssh's options, enter the host's namespace
# with its own host name, run the command there
while [ $# -gt 0 ]; do
  case "$1" in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"; shift
exec ip netns exec "$host" unshare --uts sh -c "hostname $host; $*"
"""


def _mpiexec(mpiexec=None):
    return mpiexec or mpiexec_path() or "mpiexec"


def unavailable_reason():
    """Why emulated hosts cannot be made here, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return "'%s' (iproute2/util-linux) is not installed" % tool
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    name = "cmprobe%d" % os.getpid()
    p = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if p.returncode:
        return "ip netns add failed: %s" % (p.stderr.strip() or p.returncode)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args, check=True):
    p = subprocess.run(["ip"] + list(args), capture_output=True, text=True)
    if check and p.returncode:
        raise RuntimeError("ip %s: %s" % (" ".join(args), p.stderr.strip()))
    return p.stdout


class Cluster(Harness):
    """``hosts`` emulated hosts named ``<prefix>h0``, ``<prefix>h1``, ... at
    10.<net>.<sub>.1, .2, ...; ``rate``: tc's rate for every link (e.g.
    ``"1gbit"``; None: the veth's own speed)."""

    # tc tbf's token bucket on each end of a rate-limited link: after an idle
    # spell this many bytes leave at once (256 KB: enough for tbf at 10 Gbit/s)
    burst_bytes = 256 * 1024

    def __init__(self, hosts=2, rate=None, prefix=None):
        self.count = int(hosts)
        self.rate = rate
        self.prefix = prefix or "cm%s" % uuid.uuid4().hex[:5]
        sub = int(self.prefix.encode().hex(), 16) % 250
        self.subnet = "10.213.%d" % sub
        self.hosts = ["%sh%d" % (self.prefix, i) for i in range(self.count)]
        self.addresses = ["%s.%d" % (self.subnet, i + 1) for i in range(self.count)]
        self.bridge = self.prefix + "br"
        self._dir = None
        self._old_handlers = {}

    # ------------------------------------------------------------ set-up
    def up(self):
        self.down()                       # what a killed run with this prefix left
        self._trap_signals()
        try:
            _ip("netns", "add", self.bridge)
            _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge, "link", "set", "br0", "up")
            for i, (host, addr) in enumerate(zip(self.hosts, self.addresses)):
                port = "p%d" % i
                _ip("netns", "add", host)
                _ip("-n", host, "link", "set", "lo", "up")
                _ip("-n", host, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                    "netns", self.bridge)
                _ip("-n", host, "addr", "add", addr + "/24", "dev", "eth0")
                _ip("-n", host, "link", "set", "eth0", "up")
                self.run_on(i, ["sysctl", "-q", "-w", "net.ipv4.tcp_retries2=%d" % TCP_RETRIES2], check=True,
                            capture_output=True)
                _ip("-n", self.bridge, "link", "set", port, "master", "br0")
                _ip("-n", self.bridge, "link", "set", port, "up")
                if self.rate:
                    for ns, dev in ((host, "eth0"), (self.bridge, port)):
                        self._tc(ns, dev)
            self._dir = tempfile.mkdtemp(prefix=self.prefix)
            self.standin = os.path.join(self._dir, "ssh")
            with open(self.standin, "w") as f:
                f.write(_STANDIN)
            os.chmod(self.standin, 0o755)
            self.hostfile = os.path.join(self._dir, "hosts")
            with open(self.hostfile, "w") as f:
                f.write("".join("%s:1\n" % h for h in self.hosts))
        except BaseException:
            self.down()
            raise

    def _tc(self, ns, dev):
        p = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                            "rate", self.rate, "burst", str(self.burst_bytes), "latency", "50ms"],
                           capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError("tc on %s/%s: %s" % (ns, dev, p.stderr.strip()))

    def down(self):
        """Remove every namespace of this prefix (their links go with them)
        and end what still runs in them (an MPI daemon of a killed job)."""
        for ns in _ip("netns", "list", check=False).split("\n"):
            name = ns.split(" ")[0]
            if name.startswith(self.prefix) and (name in self.hosts or name == self.bridge):
                for pid in _ip("netns", "pids", name, check=False).split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                _ip("netns", "del", name, check=False)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._restore_signals()

    def _trap_signals(self):
        """SIGTERM/SIGHUP end the process through Python's exit path, so the
        namespaces are removed (SIGINT already raises KeyboardInterrupt)."""
        def leave(signum, frame):
            raise SystemExit(128 + signum)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, leave)
            except ValueError:      # not the main thread
                pass

    def _restore_signals(self):
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers = {}

    # -------------------------------------------------------------- running
    def run_on(self, host, args, **kwargs):
        """Run a command in one host's namespace (subprocess.run's kwargs)."""
        return subprocess.run(["ip", "netns", "exec", self.hosts[host]] + list(args), **kwargs)

    def launcher(self, ranks_per_host=1, mpiexec=None):
        """The launcher and its options that start ``ranks_per_host`` ranks on
        every host, as docs/parallel.md gives them for real hosts, with
        ``hosts`` for the machinefile, then the options that reach the
        emulated hosts (the ssh stand-in; root).  ``mpiexec``: the one beside
        this Python or on PATH, else the name "mpiexec"; for Open MPI its
        ``mpirun``, started with signals forwarded, over TCP on eth0."""
        mpiexec = _mpiexec(mpiexec)
        n = str(self.count * ranks_per_host)
        if is_open_mpi(mpiexec):
            mpirun = os.path.join(os.path.dirname(mpiexec), "mpirun")
            real = ([mpirun if os.access(mpirun, os.X_OK) else mpiexec] + OPEN_MPI_FORWARD_SIGNALS
                    + ["-machinefile", "hosts", "-n", n, "--map-by", "ppr:%d:node" % ranks_per_host,
                       "--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "eth0",
                       "--prtemca", "oob_tcp_if_include", "eth0"])
            emulated = ["--prtemca", "plm_ssh_agent", self.standin]
            if os.geteuid() == 0:
                emulated.append("--allow-run-as-root")
        else:
            real = [mpiexec, "-f", "hosts", "-n", n, "-ppn", str(ranks_per_host), "-iface", "eth0"]
            emulated = ["-launcher", "ssh", "-launcher-exec", self.standin]
        return real, emulated

    def mpiexec_command(self, args, ranks_per_host=1, mpiexec=None):
        """The command line that starts ``args`` on every host, from host 0
        (:meth:`launcher`)."""
        real, emulated = self.launcher(ranks_per_host, mpiexec)
        line = "%s slots=%d\n" if is_open_mpi(_mpiexec(mpiexec)) else "%s:%d\n"
        with open(self.hostfile, "w") as f:
            f.write("".join(line % (h, ranks_per_host) for h in self.hosts))
        real = [self.hostfile if a == "hosts" else a for a in real]
        return ["ip", "netns", "exec", self.hosts[0], "unshare", "--uts", "sh", "-c",
                'hostname %s; exec "$@"' % self.hosts[0], "sh"] + real + emulated + list(args)

    def mpiexec(self, args, ranks_per_host=1, env=None, timeout=None, **kwargs):
        """``mpiexec`` over the emulated hosts, over TCP; a CompletedProcess
        (text output captured unless kwargs say otherwise)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.mpiexec_command(args, ranks_per_host), env=self._env(env), timeout=timeout,
                              **kwargs)

    def popen(self, args, ranks_per_host=1, env=None, **kwargs):
        """As :meth:`mpiexec`, started in the background (a Popen)."""
        return subprocess.Popen(self.mpiexec_command(args, ranks_per_host), env=self._env(env), **kwargs)

    @staticmethod
    def _env(env):
        full = dict(os.environ if env is None else env)
        if not is_open_mpi(_mpiexec()):
            full.update(TCP_ENV)
        return full

    def set_link(self, host, up):
        """Take host ``host``'s link down (False) or up again (True)."""
        _ip("-n", self.hosts[host], "link", "set", "eth0", "up" if up else "down")

    def link_bytes(self):
        """[(bytes sent, bytes received)] of every host's eth0."""
        out = []
        for host in self.hosts:
            stats = {}
            for direction in ("tx", "rx"):
                path = "/sys/class/net/eth0/statistics/%s_bytes" % direction
                p = subprocess.run(["ip", "netns", "exec", host, "cat", path], capture_output=True, text=True)
                stats[direction] = int(p.stdout.strip() or 0)
            out.append((stats["tx"], stats["rx"]))
        return out


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(prog="python -m caffempi.testing.cluster",
                                 description="Run a command under mpiexec across emulated hosts (network "
                                             "namespaces, TCP) and print the bytes each host's link moved.")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--ppn", type=int, default=1, help="ranks per host")
    ap.add_argument("--rate", default=None, help="tc rate of every link, e.g. 100mbit, 1gbit, 10gbit")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each rank runs")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command given (-- python -m caffempi train ...)")
    reason = unavailable_reason()
    if reason:
        print("cluster: %s" % reason, file=sys.stderr)
        return 2
    with Cluster(args.hosts, args.rate) as cluster:
        before = cluster.link_bytes()
        t = time.time()
        p = cluster.mpiexec(command, args.ppn, capture_output=False)
        after = cluster.link_bytes()
        print("cluster: exit %d after %.1f s; bytes sent/received per host: %s" % (
            p.returncode, time.time() - t,
            ", ".join("%s %d/%d" % (h, a[0] - b[0], a[1] - b[1])
                      for h, a, b in zip(cluster.hosts, after, before))), file=sys.stderr)
        return p.returncode


if __name__ == "__main__":
    sys.exit(main())
