# make test: set the host up, run the whole suite (root for the privileged part), then the data
#   path's tests on the pure-Python paths (DBLP_NATIVE=0).
# make demo: set the host up and run the main job (about 4 minutes).
# make paper: the claim's measurement: the paper scenario on both workloads (lm, mlp), seeds
#   SEED.. (default 300-305), DBLP's relaxed bound HIGH (fixed: P_low + k, the paper's; loss:
#   P_low + the network's measured loss), relaxations RELAX (default none; about 70 minutes
#   here; docs/experiment.md; RELAX=none,ef,rotate,both for the whole ablation, about 2 hours).
# make smoke: build sdist + wheel and check they install and load in clean venvs (root).
# make vm-test: the privileged core in Vagrant VMs on kernels 6.1 and 6.12, and a two-VM job (root;
#   41 minutes here under software emulation, boxes built afresh: vagrant/README.md).
PY := .venv/bin/python
PYTEST_ARGS ?=
SEED ?= 300
SEEDS ?= 6
RELAX ?= none
HIGH ?= fixed

.PHONY: setup test demo paper smoke vm-test clean
setup:
	tools/setup

# the data path's tests once more on the pure-Python paths (the compiled loops' reference)
PYTHON_PATH_TESTS := tests/unit/test_collective.py tests/unit/test_collective_shards.py \
	tests/unit/test_transport_udp_loopback.py tests/unit/test_matcher_properties.py \
	tests/linux/test_fuzz_matrix.py tests/linux/test_transport_xsk.py tests/linux/test_dataplane_xsk.py \
	tests/linux/test_multiqueue.py

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)
	DBLP_NATIVE=0 $(PY) -m pytest -q $(PYTEST_ARGS) $(PYTHON_PATH_TESTS)

demo: setup
	.venv/bin/dblp experiment

paper: setup
	.venv/bin/dblp experiment --scenario paper --model lm --seed $(SEED) --seeds $(SEEDS) \
	    --relax $(RELAX) --static-relax none --high $(HIGH) --out dblp-paper-lm
	.venv/bin/dblp experiment --scenario paper --model mlp --seed $(SEED) --seeds $(SEEDS) \
	    --relax $(RELAX) --static-relax none --high $(HIGH) --out dblp-paper-mlp

smoke: setup
	tools/smoke-install

vm-test:
	vagrant/vm-test

clean:
	rm -rf .venv build dist *.egg-info pydblp/bpf_src
