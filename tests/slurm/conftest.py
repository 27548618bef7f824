"""A one-node Slurm cluster (caffempi.testing.slurm) for the session: started
once, by the first test that asks for it, and taken down at the end, also
when tests fail.  Where Slurm cannot run (not installed, not root, daemons
that will not start) the tests skip with the reason, unless
CAFFEMPI_TEST_SLURM=required (.ci/run sets it once it has installed
slurm-wlm): then they fail."""
import os

import pytest

from caffempi.testing import slurm as slurm_mod


def _unavailable(reason):
    if os.environ.get("CAFFEMPI_TEST_SLURM") == "required":
        pytest.fail("CAFFEMPI_TEST_SLURM=required, but " + reason, pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm():
    reason = slurm_mod.unavailable_reason()
    if reason:
        _unavailable(reason)
    cluster = slurm_mod.SlurmCluster()
    try:
        cluster.up()
    except (RuntimeError, OSError) as e:
        _unavailable("the Slurm daemons did not start: %s" % e)
    try:
        yield cluster
    finally:
        cluster.down()
