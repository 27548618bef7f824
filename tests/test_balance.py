"""Uneven batch shares (--balance) in one process: each layer's say
(Layer.share_scale), the net's loss weights and reshapes, the share
arithmetic and the balancer's decisions on a simulated pair of ranks.
The MPI runs against one process are tests/mpi/test_balance.py."""
import time

import numpy as np
import pytest
from google.protobuf import text_format

import caffempi.layer_types.data  # noqa: F401  (registers the data layers)
from caffempi import CaffeError, Net, TRAIN
from caffempi.data.reader import shard_positions
from caffempi.parallel.balance import ShareBalancer, parse_balance, proportional_shares
from caffempi.parallel.comm import PendingScalars
from caffempi.proto import caffe_pb2

LOSS = {
    "softmax": 'type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label"',
    "none": 'type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" loss_param { normalization: NONE }',
    "full": 'type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" loss_param { normalization: FULL }',
    "euclidean": 'type: "EuclideanLoss" bottom: "ip2" bottom: "target"',
    "sigmoid": 'type: "SigmoidCrossEntropyLoss" bottom: "ip2" bottom: "target"',
}


def mlp(batch, loss="softmax", extra="", shard=(0, 1)):
    text = '''
layer { name: "data" type: "MemoryData" top: "data" top: "label"
        memory_data_param { batch_size: %d channels: 2 height: 3 width: 3 } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 7 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu" type: "ReLU" bottom: "ip1" top: "ip1" }
%s
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "target" type: "DummyData" top: "target"
        dummy_data_param { shape { dim: %d dim: 4 } data_filler { type: "constant" value: 0.5 } } }
layer { name: "sil" type: "Silence" bottom: "target" }
layer { name: "loss" %s top: "loss" }
''' % (batch, extra, batch, LOSS[loss])
    if loss in ("euclidean", "sigmoid"):
        text = text.replace('layer { name: "sil" type: "Silence" bottom: "target" }', "")
    from caffempi.common import set_random_seed
    set_random_seed(3)
    return Net(text_format.Parse(text, caffe_pb2.NetParameter()), TRAIN, data_shard=shard)


def gradient(net, x, y):
    net.layers[0].reset(x, y)
    net.clear_param_diffs()
    net.forward_backward()
    return net.param_diff.copy()


@pytest.mark.parametrize("loss", sorted(LOSS))
@pytest.mark.parametrize("shares", [(9, 3), (1, 11), None])
def test_the_mean_of_uneven_shares_is_the_global_gradient(loss, shares):
    """Rank r's gradient on its share, weighted as the net weights it, and
    averaged over the ranks as the sums do: the one-process gradient of the
    global batch, for losses normalised by the batch, by all outputs and
    not at all (where 'the global gradient' is the equal split's, 1/N of
    the sum)."""
    r = np.random.RandomState(0)
    x = r.randn(12, 2, 3, 3).astype(np.float32)
    y = r.randint(0, 4, 12).astype(np.float32)
    ranks = []
    for rank in range(2):
        net = mlp(6, loss, shard=(rank, 2))
        net.set_batch_shares(shares)
        ranks.append(gradient(net, x, y))
    mean = (ranks[0] + ranks[1]) / 2
    if loss == "none":                  # the equal split's: each rank's sum over its records, halved
        split = [mlp(6, loss, shard=(rank, 2)) for rank in range(2)]
        want = (gradient(split[0], x, y) + gradient(split[1], x, y)) / 2
    else:
        want = gradient(mlp(12, loss), x, y)
    np.testing.assert_allclose(mean, want, rtol=0, atol=2e-6 * max(1.0, float(np.abs(want).max())))


def test_shares_reshape_the_net_and_weight_its_loss():
    net = mlp(6, shard=(1, 2))
    r = np.random.RandomState(1)
    net.layers[0].reset(r.randn(12, 2, 3, 3).astype(np.float32), np.zeros(12, np.float32))
    net.set_batch_shares((8, 4))
    net.forward_backward()
    assert net.blobs["data"].shape == (4, 2, 3, 3) and net.blobs["ip2"].shape == (4, 4)
    assert float(net.blobs["loss"].diff) == pytest.approx(4 / 6)
    net.set_batch_shares(None)
    net.forward_backward()
    assert net.blobs["data"].shape == (6, 2, 3, 3) and float(net.blobs["loss"].diff) == 1.0


@pytest.mark.parametrize("extra,loss,why", [
    ('layer { name: "bn" type: "BatchNorm" bottom: "ip1" top: "ip1" }', "softmax", "layer 'bn' (BatchNorm)"),
    ('layer { name: "cat" type: "Concat" bottom: "ip1" bottom: "ip1" top: "c" concat_param { axis: 0 } }\n'
     'layer { name: "s" type: "Silence" bottom: "c" }', "softmax", "layer 'cat' (Concat)"),
    ('layer { name: "red" type: "Reduction" bottom: "ip1" top: "red" }\n'
     'layer { name: "s" type: "Silence" bottom: "red" }', "softmax", "layer 'red' (Reduction)"),
    ("", "softmax_ignore", "layer 'loss' (SoftmaxWithLoss)"),
])
def test_nets_that_mix_samples_keep_equal_shares(extra, loss, why):
    LOSS["softmax_ignore"] = LOSS["softmax"] + " loss_param { ignore_label: 3 }"
    net = mlp(6, loss, extra, shard=(0, 2))
    batch, reason = net.shareable_batch()
    assert batch is None and why in reason
    with pytest.raises(CaffeError, match="cannot split its batch unevenly"):
        net.set_batch_shares((8, 4))
    net.set_batch_shares(None)            # equal shares always go


def test_global_statistics_batchnorm_and_axis_one_layers_allow_shares():
    extra = ('layer { name: "bn" type: "BatchNorm" bottom: "ip1" top: "ip1" '
             'batch_norm_param { use_global_stats: true } }\n'
             'layer { name: "cat" type: "Concat" bottom: "ip1" bottom: "ip1" top: "c" }\n'
             'layer { name: "s" type: "Silence" bottom: "c" }')
    assert mlp(6, "softmax", extra, shard=(0, 2)).shareable_batch() == (6, None)


def test_share_counts_are_checked():
    net = mlp(6, shard=(0, 2))
    for bad in [(6, 5), (12, 0), (4, 4, 4)]:
        with pytest.raises(CaffeError, match="2 positive counts summing to 12"):
            net.set_batch_shares(bad)
    p = text_format.Parse('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 } } }',
                          caffe_pb2.NetParameter())
    assert "no data layer" in Net(p, TRAIN).shareable_batch()[1]


def test_positions_of_uneven_shares_cover_the_global_batch_once():
    for shares in [(5, 1, 6), (4, 4, 4), (1, 1, 10)]:
        for k in range(3):
            got = [shard_positions(k, 4, r, 3, shares) for r in range(3)]
            assert sum(got, []) == list(range(12 * k, 12 * k + 12))
            assert [len(g) for g in got] == list(shares)
    assert shard_positions(2, 3, 1, 2) == [13, 15, 17]      # equal shares: Caffe's interleaving


def test_proportional_shares():
    assert proportional_shares(64, [1.0, 3.0]) == (48, 16)
    assert proportional_shares(12, [1.0, 2.0, 3.0]) == (7, 3, 2)        # 6.5 3.3 2.2 by largest remainders
    assert proportional_shares(64, [1.0, 1000.0], floor=3) == (61, 3)
    assert sum(proportional_shares(101, [0.3, 0.7, 0.11])) == 101
    assert parse_balance("auto") == ("auto", None, None) and parse_balance(" 3:1") == ("fixed", (3, 1), None)
    assert parse_balance("auto:0.5") == ("auto", None, 0.5) and parse_balance("off") == ("off", None, None)
    for bad in ("on", "3", "3:0", "a:b", "auto:0", "auto:x", "off:1"):
        with pytest.raises(CaffeError, match="--balance"):
            parse_balance(bad)


class PairWorld:
    """Rank 0 of two; the other rank's seconds a record come from ``other``
    when an exchange starts; ``read`` counts the exchanges waited for."""
    rank, size = 0, 2

    def __init__(self, other):
        self.other = other
        self.exchanges = self.read = 0
        self.waited = 0.0

    def waited_seconds(self):
        return self.waited

    def start_allreduce_scalars(self, values, op="sum", what=""):
        assert op == "sum" and values[1] == 0.0        # rank 1's slot is rank 1's to fill
        self.exchanges += 1
        return PendingScalars(np.array([values[0], self.other(self.exchanges)]), self._wait)

    def _wait(self):
        self.read += 1


class SimulatedClock:
    now = 0.0

    def __call__(self):
        return self.now


def simulated_pair(mode):
    """(net, rank 1's seconds a record {"per_record": ...}, world, balancer,
    iterate(n)): rank 0 of a pair at 1 ms a record, batch 6."""
    net = mlp(6, shard=(0, 2))
    net.layers[0].reset(np.zeros((12, 2, 3, 3), np.float32), np.zeros(12, np.float32))
    slow = {"per_record": 0.003}
    world = PairWorld(lambda _: slow["per_record"])
    clock = SimulatedClock()
    balancer = ShareBalancer(mode, clock=clock)
    balancer.attach(world, net)

    def iterate(n, waited=0.0, worked_after_backward=0.0, between=0.0):
        """``n`` iterations: rank 0's forward and backward take 1 ms a
        record of its share and wait ``waited`` seconds in collectives,
        then it works ``worked_after_backward`` more to its update's end,
        and ``between`` more before the next (a test pass, a snapshot)."""
        for _ in range(n):
            balancer.before_iteration()
            net.forward_backward()
            shares = net.batch_shares
            clock.now += 0.001 * (shares[0] if shares else 6) + waited
            world.waited += waited
            balancer.after_backward()
            clock.now += worked_after_backward
            balancer.after_update()
            clock.now += between
    return net, slow, world, balancer, iterate


def test_the_balancer_follows_speeds_with_hysteresis_and_resumes():
    net, slow, world, balancer, iterate = simulated_pair("auto:0.1")
    iterate(5)                             # the first exchange starts at the fifth backward's end
    assert net.batch_shares is None and world.exchanges == 1 and world.read == 0
    iterate(1)                             # read at the next iteration, it sets the period: 0.1 s / 18 ms = 6
    assert world.read == 1 and net.batch_shares is None and balancer.state()["period"] == 6
    iterate(6)                             # 1 ms a record against 3: 9 and 3
    assert net.batch_shares == (9, 3) and net.blobs["data"].shape[0] == 9
    saved = balancer.state()
    slow["per_record"] = 0.00224          # 8 and 4 would gain 0.4% of the step, under 2%: no change
    assert proportional_shares(12, [0.001, 0.00224]) == (8, 4)
    iterate(12)
    assert net.batch_shares == (9, 3) and world.exchanges > 2
    slow["per_record"] = 0.001            # as fast again: equal shares, Caffe's rule
    iterate(12)
    assert net.batch_shares is None
    again = ShareBalancer("auto:0.1")
    again.attach(world, net)
    again.load_state(saved)
    assert net.batch_shares == (9, 3)
    again.before_iteration()
    assert again.state()["count"] == saved["count"] + 1


def test_auto_decides_every_iteration_from_smoothed_speeds_and_logs_at_most_once_a_while(caplog):
    """Plain ``auto`` starts an exchange at the end of every backward
    after the warm-up, reads it at the next iteration's start and moves
    the shares there, from each rank's seconds a record smoothed (half the
    last exchange's, half the estimate before); the log's share lines are
    spaced by ``log_every``, the last change kept for the first decision
    after it.  Detaching completes the exchange in flight."""
    net, slow, world, balancer, iterate = simulated_pair("auto")
    assert balancer.smoothing == 0.5 and ShareBalancer("auto:0.1").smoothing == 1.0
    balancer.log_every = 3600.0
    with caplog.at_level("INFO"):
        iterate(5)                         # the first exchange starts; nothing waits for it yet
        assert world.exchanges == 1 and world.read == 0 and net.batch_shares is None
        iterate(1)                         # read and decided: 1 ms a record against 3
        assert world.exchanges == 2 and world.read == 1 and net.batch_shares == (9, 3)
        slow["per_record"] = 0.001
        iterate(1)                         # the exchange read here was rank 1's step at 3 ms
        assert net.batch_shares == (9, 3)
        iterate(1)                         # rank 1 estimated at 2 ms, then 1.5
        assert world.exchanges == 4 and net.batch_shares == (8, 4)
        iterate(1)
        assert world.exchanges == 5 and net.batch_shares == (7, 5)
        iterate(2)                         # 1.25 ms: 7 and 5 still; 1.125 ms: equal again
        assert world.exchanges == 7 and world.read == 6 and net.batch_shares is None
        lines = [r.getMessage() for r in caplog.records if "step ms" in r.getMessage()]
        assert lines == ["Batch shares: 9 3 of 12 (step ms by rank: 6.0 18.0)"]
        balancer.log_every = 0.0
        iterate(1)                         # no change, but the last one is logged now
        lines = [r.getMessage() for r in caplog.records if "step ms" in r.getMessage()]
        assert lines[1:] == ["Batch shares: 6 6 of 12 (step ms by rank: 7.0 5.6)"]
        iterate(1)
        assert len([r for r in caplog.records if "step ms" in r.getMessage()]) == 2
    assert world.read == world.exchanges - 1
    balancer.detach()
    assert world.read == world.exchanges


def test_a_rank_is_measured_by_its_work_to_the_update_not_its_waits():
    """A step's seconds from an iteration's start to its backward's end and
    from there to the update's end, less those the rank waited in
    collectives: a wait for the slower rank does not make the faster one
    look slow, work after backward counts, and what runs between
    iterations does not."""
    net, slow, world, balancer, iterate = simulated_pair("auto")
    iterate(6, waited=0.012, between=0.05)  # 6 ms of work and 12 of waiting: 1 ms a record against 3
    assert net.batch_shares == (9, 3)
    slow["per_record"] = 0.002
    iterate(8, waited=0.0, worked_after_backward=0.006)   # (6 + 6) / 6: as slow as rank 1
    assert net.batch_shares is None


def test_watched_waits_are_added_up_once():
    from caffempi.parallel.watchdog import Watchdog
    watchdog = Watchdog(0, None, abort=None)
    with watchdog.watch("a sum"):
        with watchdog.watch("inside it"):
            time.sleep(0.02)
    assert 0.02 <= watchdog.waited < 0.5
    waited = watchdog.waited
    time.sleep(0.02)                       # outside a wait
    with watchdog.watch("a barrier"):
        pass
    assert watchdog.waited - waited < 0.01


def test_the_balancer_keeps_equal_shares_where_it_must(caplog):
    world = PairWorld(lambda _: 0.01)
    net = mlp(6, "softmax", 'layer { name: "bn" type: "BatchNorm" bottom: "ip1" top: "ip1" }', shard=(0, 2))
    balancer = ShareBalancer("auto")
    with caplog.at_level("INFO"):
        balancer.attach(world, net)
    assert not balancer.active and "equal (--balance=auto): layer 'bn' (BatchNorm)" in caplog.text
    with pytest.raises(CaffeError, match="--balance=9:3: layer 'bn'"):
        ShareBalancer("9:3").attach(world, net)
    with pytest.raises(CaffeError, match="give 2 counts summing to 12"):
        ShareBalancer("9:4").attach(world, mlp(6, shard=(0, 2)))
    readings = []
    fixed = ShareBalancer("9:3", clock=lambda: readings.append(1) or 0.0)
    fixed.attach(world, mlp(6, shard=(0, 2)))
    fixed.before_iteration()
    fixed.after_backward()
    fixed.after_update()
    assert fixed.net.batch_shares == (9, 3)
    assert not readings                    # fixed shares measure nothing, keep nothing
