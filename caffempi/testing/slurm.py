"""A one-node Slurm cluster on this machine, for trying and testing batch
jobs: MUNGE, slurmctld and slurmd from Debian's ``slurm-wlm`` started
directly (no systemd), in the foreground, with a generated ``slurm.conf``
in a temporary folder of their own: their own ports, state, spool, logs
and MUNGE key and socket, one node (this host, with its CPUs and memory as
``slurmd -C`` sees them) in one partition, no cgroups and no accounting.
Nothing of the system's Slurm or MUNGE configuration is read or changed.

    with SlurmCluster() as slurm:
        job = slurm.sbatch(["--ntasks=2", "examples/slurm/train.sbatch", "--solver=S"], cwd=d)
        state = slurm.wait(job, timeout=120)       # "COMPLETED", "FAILED", ...

or from a shell (as root), which runs a command with ``SLURM_CONF`` set to
the cluster's configuration and removes the cluster after it:

    python -m caffempi.testing.slurm -- sbatch --wait examples/slurm/train.sbatch --solver=S

Needs root (slurmd starts the job's processes as the submitting user) and
the ``slurm-wlm`` package (slurmctld, slurmd, the client commands, munged);
:func:`unavailable_reason` says why not where they are missing.  On leaving
the ``with`` block, on an exception and on SIGTERM, the cluster's jobs are
cancelled, the daemons and every process of the cluster's jobs are ended
and the folder is removed.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from .harness import Harness

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scancel", "scontrol", "sinfo", "squeue")
# names under which Debian installs the daemons (PATH may lack /usr/sbin)
_SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")
# set in the daemons' environment (and so in every process they start):
# how teardown finds this cluster's processes
_MARK = "CAFFEMPI_SLURM_DIR"


def which(name):
    """``name`` on PATH or in the sbin folders, or None."""
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(_SBIN))


def unavailable_reason():
    """Why a Slurm cluster cannot be started here, or None."""
    if sys.platform != "linux":
        return "Slurm's daemons need Linux"
    missing = [n for n in DAEMONS + CLIENTS if which(n) is None]
    if missing:
        return "%s not installed (Debian: apt-get install slurm-wlm)" % ", ".join(missing)
    if os.geteuid() != 0:
        return "slurmd starts jobs as their user and needs root"
    return None


def _free_ports(n):
    """``n`` TCP ports free on this host now (the kernel's picks)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def node_line():
    """This host as ``slurmd -C`` sees it: ``{"NodeName": ..., "CPUs": ...}``."""
    out = subprocess.run([which("slurmd"), "-C"], capture_output=True, text=True, timeout=30).stdout
    first = out.splitlines()[0] if out else ""
    fields = dict(f.split("=", 1) for f in first.split() if "=" in f)
    if "NodeName" not in fields or "CPUs" not in fields:
        raise RuntimeError("slurmd -C printed no node line: %r" % out)
    return fields


CONF = """\
# written by caffempi.testing.slurm: a one-node cluster in {dir}
ClusterName=caffempi
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge/munge.socket
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
PlugStackConfig={dir}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
# schedule a batch job when it is submitted, not up to 3 s later
SchedulerParameters=batch_sched_delay=0
MailProg=/bin/true
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait={kill_wait}
MinJobAge=600
SlurmctldDebug=info
SlurmdDebug=info
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} Boards={boards} SocketsPerBoard={sockets} CoresPerSocket={cores} ThreadsPerCore={threads} RealMemory={memory} State=UNKNOWN
PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


class SlurmCluster(Harness):
    """One node, this host, in partition ``partition``.  ``kill_wait``:
    seconds between a job's SIGTERM and its SIGKILL at its time limit or on
    ``scancel`` without ``--signal``.  ``env()`` is the environment for the
    client commands (``SLURM_CONF``); ``log()`` the daemons' logs."""

    def __init__(self, partition="caffempi", kill_wait=30, start_timeout=60):
        self.partition = partition
        self.kill_wait = int(kill_wait)
        self.start_timeout = start_timeout
        self.dir = None
        self.conf = None
        self.node = None
        self.cpus = None
        self._procs = {}
        self._old_handler = None

    # ------------------------------------------------------------ set-up
    def up(self):
        reason = unavailable_reason()
        if reason:
            raise RuntimeError("cannot start Slurm: " + reason)
        self._trap_sigterm()
        try:
            self._up()
        except BaseException:
            self.down()
            raise

    def _up(self):
        self.dir = tempfile.mkdtemp(prefix="caffempi-slurm-")
        os.chmod(self.dir, 0o755)     # jobs of other users read slurm.conf
        for sub in ("munge", "state", "spool"):
            os.mkdir(os.path.join(self.dir, sub), 0o700)
        os.chmod(os.path.join(self.dir, "munge"), 0o755)   # clients reach the socket
        node = node_line()
        self.node, self.cpus = node["NodeName"], int(node["CPUs"])
        # a little less than all the memory, so the node never reports less
        memory = max(1, int(int(node.get("RealMemory", "1024")) * 0.9))
        ctld_port, slurmd_port = _free_ports(2)
        self.conf = os.path.join(self.dir, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write(CONF.format(dir=self.dir, node=self.node, ctld_port=ctld_port, slurmd_port=slurmd_port,
                                kill_wait=self.kill_wait, cpus=self.cpus, boards=node.get("Boards", 1),
                                sockets=node.get("SocketsPerBoard", 1),
                                cores=node.get("CoresPerSocket", self.cpus),
                                threads=node.get("ThreadsPerCore", 1), memory=memory,
                                partition=self.partition))
        open(os.path.join(self.dir, "plugstack.conf"), "w").close()   # not the system's SPANK plug-ins
        key = os.path.join(self.dir, "munge", "munge.key")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        m = os.path.join(self.dir, "munge")
        self._start("munged", [which("munged"), "--foreground", "--force", "--socket=%s/munge.socket" % m,
                               "--key-file=%s" % key, "--log-file=%s/munged.log" % m,
                               "--pid-file=%s/munged.pid" % m, "--seed-file=%s/munged.seed" % m])
        self._wait_for(lambda: os.path.exists(os.path.join(m, "munge.socket")), "munged's socket")
        self._start("slurmctld", [which("slurmctld"), "-D", "-c", "-i", "-f", self.conf])
        self._start("slurmd", [which("slurmd"), "-D", "-N", self.node, "-f", self.conf])
        self._wait_for(self._node_idle, "node %s idle in sinfo" % self.node)

    def _start(self, name, cmd):
        out = open(os.path.join(self.dir, name + ".out"), "w")
        env = dict(os.environ, SLURM_CONF=self.conf, **{_MARK: self.dir})
        self._procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                             env=env, cwd=self.dir, start_new_session=True)
        out.close()

    def _wait_for(self, ready, what):
        t = time.time()
        while not ready():
            for name, p in self._procs.items():
                if p.poll() is not None:
                    raise RuntimeError("%s exited %s while waiting for %s:\n%s" % (name, p.returncode, what,
                                                                                    self.log()))
            if time.time() - t > self.start_timeout:
                raise RuntimeError("no %s after %ds:\n%s" % (what, self.start_timeout, self.log()))
            time.sleep(0.2)

    def _node_idle(self):
        p = self.run(["sinfo", "-h", "-N", "-n", self.node, "-o", "%T"], check=False, timeout=30)
        return p.returncode == 0 and p.stdout.strip() == "idle"

    def _trap_sigterm(self):
        """SIGTERM to this process (a test run stopped) takes the cluster down
        first; only from the main thread and where nobody else handles it."""
        try:
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                def handler(signum, frame):
                    self.down()
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    os.kill(os.getpid(), signal.SIGTERM)
                signal.signal(signal.SIGTERM, handler)
                self._old_handler = signal.SIG_DFL
        except ValueError:             # not the main thread
            pass

    # ---------------------------------------------------------- teardown
    def down(self):
        """Cancel every job, end the daemons and every process they started,
        remove the folder.  Safe to call twice and after a failed start."""
        if self.dir is None:
            return
        try:
            if self._procs.get("slurmctld") and self._procs["slurmctld"].poll() is None:
                self.run(["scancel", "--full", "--signal=KILL", "--partition=%s" % self.partition],
                         check=False, timeout=20)
                t = time.time()
                while time.time() - t < 10:
                    q = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=20)
                    if q.returncode or not q.stdout.strip():
                        break
                    time.sleep(0.2)
        except (OSError, subprocess.SubprocessError):
            pass
        for name in reversed(DAEMONS):
            p = self._procs.get(name)
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        self._kill_marked()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None
        self._procs = {}
        if self._old_handler is not None:
            try:
                signal.signal(signal.SIGTERM, self._old_handler)
            except ValueError:
                pass
            self._old_handler = None

    def _kill_marked(self):
        """SIGKILL what is left of the cluster: slurmstepd and job processes
        (they inherit the daemons' mark or the jobs' SLURM_CONF)."""
        marks = [("%s=%s" % (_MARK, self.dir)).encode(), ("SLURM_CONF=%s" % self.conf).encode()]
        me = os.getpid()
        for _ in range(3):
            found = []
            for pid in os.listdir("/proc"):
                if not pid.isdigit() or int(pid) == me:
                    continue
                try:
                    with open("/proc/%s/environ" % pid, "rb") as f:
                        environ = f.read().split(b"\0")
                except OSError:
                    continue
                if any(m in environ for m in marks):
                    found.append(int(pid))
            if not found:
                return
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.3)

    # ------------------------------------------------------------- using
    def env(self, **extra):
        """This environment with ``SLURM_CONF`` naming the cluster's configuration."""
        e = dict(os.environ, SLURM_CONF=self.conf)
        e.update({k: str(v) for k, v in extra.items()})
        return e

    def run(self, args, check=True, timeout=60, env=None, cwd=None):
        """Run a client command (``["sinfo", ...]``) against this cluster."""
        cmd = [which(args[0]) or args[0]] + [str(a) for a in args[1:]]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env=env or self.env(), cwd=cwd, stdin=subprocess.DEVNULL)
        if check and p.returncode:
            raise RuntimeError("%s exited %d: %s%s" % (" ".join(cmd), p.returncode, p.stdout, p.stderr))
        return p

    def sbatch(self, args, env=None, cwd=None):
        """Submit a batch job (``args``: sbatch's options, the script, its
        arguments); returns its id."""
        p = self.run(["sbatch", "--parsable", "--partition=%s" % self.partition] + list(args),
                     env=env, cwd=cwd, timeout=60)
        return int(p.stdout.strip().split(";")[0])

    def job(self, job_id):
        """``scontrol show job``'s fields of a job, e.g. ``["JobState"]``."""
        p = self.run(["scontrol", "show", "job", "-o", str(job_id)], timeout=30)
        return dict(f.split("=", 1) for f in p.stdout.split() if "=" in f)

    def state(self, job_id):
        return self.job(job_id)["JobState"]

    def wait(self, job_id, timeout=120, until=None):
        """Wait until the job has ended (or its state is in ``until``);
        returns its state."""
        t = time.time()
        while True:
            s = self.state(job_id)
            if (s in until) if until else s not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING",
                                                    "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING",
                                                    "STAGE_OUT"):
                return s
            if time.time() - t > timeout:
                raise TimeoutError("job %d still %s after %ds" % (job_id, s, timeout))
            time.sleep(0.2)

    def scancel(self, job_id, *options):
        self.run(["scancel"] + list(options) + [str(job_id)], timeout=30)

    def mpi_plugins(self):
        """``srun --mpi=list``'s plug-in names (``pmi2``, ``pmix``, ...)."""
        p = self.run(["srun", "--mpi=list"], check=False, timeout=30)
        text = p.stdout + p.stderr
        return re.findall(r"^\s*(?:srun: )?(?:MPI plugin types are\.\.\.)?\s*(\w[\w.-]*)\s*$", text, re.M)

    def log(self):
        """The daemons' logs, for messages."""
        parts = []
        for name in ("munge/munged.log", "slurmctld.log", "slurmd.log") + tuple(n + ".out" for n in DAEMONS):
            path = os.path.join(self.dir or "", name)
            if self.dir and os.path.exists(path):
                with open(path, errors="replace") as f:
                    parts.append("== %s\n%s" % (name, f.read()[-4000:]))
        return "\n".join(parts)


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run with SLURM_CONF set")
    a = ap.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    reason = unavailable_reason()
    if reason:
        print("slurm: " + reason, file=sys.stderr)
        return 2
    with SlurmCluster() as slurm:
        print("slurm: node %s (%d CPUs) idle; SLURM_CONF=%s" % (slurm.node, slurm.cpus, slurm.conf),
              file=sys.stderr)
        if not command:
            return 0
        return subprocess.call(command, env=slurm.env())


if __name__ == "__main__":
    sys.exit(main())
