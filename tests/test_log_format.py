"""Our training log, read with BVLC's tools/extra/parse_log.py logic (its
regular expressions, row building and extract_seconds' time parsing)."""
import datetime
import io
import math
import re
from collections import OrderedDict

import pytest
from google.protobuf import text_format

from caffempi import common
from caffempi.proto import caffe_pb2
from caffempi.solvers import get_solver

NET = """name: "cls"
layer { name: "data" type: "DummyData" top: "x" top: "label"
  dummy_data_param { shape { dim: 8 dim: 5 } shape { dim: 8 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy"
  include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""

# --- tools/extra/parse_log.py (BVLC master), verbatim regular expressions
regex_iteration = re.compile(r'Iteration (\d+)')
regex_train_output = re.compile(r'Train net output #(\d+): (\S+) = ([\.\deE+-]+)')
regex_test_output = re.compile(r'Test net output #(\d+): (\S+) = ([\.\deE+-]+)')
regex_learning_rate = re.compile(r'lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)')


def extract_datetime_from_line(line, year):
    line = line.strip().split()
    month = int(line[0][1:3])
    day = int(line[0][3:5])
    timestamp = line[1]
    pos = timestamp.rfind('.')
    ts = [int(x) for x in timestamp[:pos].split(':')]
    microsecond = int(timestamp[pos + 1:])
    return datetime.datetime(year, month, day, ts[0], ts[1], ts[2], microsecond)


def get_start_time(line_iterable, year):
    for line in line_iterable:
        line = line.strip()
        if line.find('Solving') != -1:
            return extract_datetime_from_line(line, year)
    return None


def parse_line_for_net_output(regex_obj, row, row_dict_list, line, iteration, seconds, learning_rate):
    output_match = regex_obj.search(line)
    if output_match:
        if not row or row['NumIters'] != iteration:
            if row:
                row_dict_list.append(row)
            row = OrderedDict([('NumIters', iteration), ('Seconds', seconds),
                               ('LearningRate', learning_rate)])
        row[output_match.group(2)] = float(output_match.group(3))
    if row and len(row_dict_list) >= 1 and len(row) == len(row_dict_list[0]):
        row_dict_list.append(row)
        row = None
    return row_dict_list, row


def parse_log(text):
    year = datetime.date.today().year
    iteration, learning_rate = -1, float('NaN')
    train_dict_list, test_dict_list = [], []
    train_row = test_row = None
    f = iter(text.splitlines(True))
    start_time = get_start_time(f, year)
    assert start_time is not None
    for line in f:
        m = regex_iteration.search(line)
        if m:
            iteration = float(m.group(1))
        if iteration == -1:
            continue
        seconds = (extract_datetime_from_line(line, year) - start_time).total_seconds()
        m = regex_learning_rate.search(line)
        if m:
            learning_rate = float(m.group(1))
        train_dict_list, train_row = parse_line_for_net_output(
            regex_train_output, train_row, train_dict_list, line, iteration, seconds, learning_rate)
        test_dict_list, test_row = parse_line_for_net_output(
            regex_test_output, test_row, test_dict_list, line, iteration, seconds, learning_rate)
    for dl in (train_dict_list, test_dict_list):
        if len(dl) > 1:
            dl[0]['LearningRate'] = dl[1]['LearningRate']
    return train_dict_list, test_dict_list


GLOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ [\w.]+:\d+\] ")


@pytest.fixture
def training_log():
    buf = io.StringIO()
    common.init_logging(stream=buf)
    sp = text_format.Parse('base_lr: 0.1 lr_policy: "step" gamma: 0.5 stepsize: 2 max_iter: 4 '
                           'display: 1 test_iter: 2 test_interval: 2 momentum: 0.9 random_seed: 1 '
                           'snapshot_after_train: false', caffe_pb2.SolverParameter())
    sp.net_param.CopyFrom(text_format.Parse(NET, caffe_pb2.NetParameter()))
    try:
        get_solver(sp).solve()
    finally:
        common.init_logging()
    return buf.getvalue()


def test_every_line_is_glog_formatted(training_log):
    lines = training_log.splitlines()
    head = [i for i, l in enumerate(lines) if "Initializing solver from parameters" in l][0]
    body = [l for l in lines[head:] if l and not re.match(r"^ *[a-z_0-9]+( \{|:)|^ *\}$", l)]
    for line in body:
        assert GLOG.match(line), line


def test_caffe_messages(training_log):
    text = training_log
    assert re.search(r"\] Iteration 0 \([\d.e+-]+ iter/s, [\d.e+-]+s/1 iters\), loss = [\d.]+\n", text)
    assert re.search(r"\]     Train net output #0: loss = [\d.]+ \(\* 1 = [\d.]+ loss\)\n", text)
    assert re.search(r"\] Iteration 2, lr = 0.05\n", text)
    assert re.search(r"\] Iteration 2, Testing net \(#0\)\n", text)
    assert re.search(r"\]     Test net output #0: accuracy = [\d.]+\n", text)
    assert re.search(r"\]     Test net output #1: loss = [\d.]+ \(\* 1 = [\d.]+ loss\)\n", text)
    assert re.search(r"\] Solving cls\n", text) and "Learning Rate Policy: step" in text
    assert re.search(r"\] Iteration 4, loss = [\d.]+\n", text)
    assert text.rstrip().endswith("Optimization Done.")


def test_parse_log_reads_train_and_test_rows(training_log):
    train, test = parse_log(training_log)
    assert [r["NumIters"] for r in train] == [0, 1, 2, 3]
    assert all(set(r) == {"NumIters", "Seconds", "LearningRate", "loss"} for r in train)
    assert [r["LearningRate"] for r in train] == [0.1, 0.1, 0.1, 0.05]
    assert all(math.isfinite(r["loss"]) and r["Seconds"] >= 0 for r in train)
    assert [r["NumIters"] for r in test] == [0, 2, 4]
    assert all(set(r) == {"NumIters", "Seconds", "LearningRate", "accuracy", "loss"} for r in test)
    assert all(0 <= r["accuracy"] <= 1 for r in test)
