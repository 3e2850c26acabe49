# make test: set the host up and run the whole suite (root for the privileged part).
# make demo: set the host up and run the main job (about 4 minutes).
# make paper: the main job's paper scenario, 3 seeds (docs/experiment.md).
# make smoke: build sdist + wheel and check they install and load in clean venvs (root).
# make vm-test: the privileged core in Vagrant VMs on kernels 6.1 and 6.12, and a two-VM job (root;
#   41 minutes here under software emulation, boxes built afresh: vagrant/README.md).
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo paper smoke vm-test clean
setup:
	tools/setup

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup
	.venv/bin/dblp experiment

paper: setup
	.venv/bin/dblp experiment --scenario paper --seeds 3

smoke: setup
	tools/smoke-install

vm-test:
	vagrant/vm-test

clean:
	rm -rf .venv build dist *.egg-info pydblp/bpf_src
