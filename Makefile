# make test: set the host up and run the whole suite (root for the privileged part).
# make demo: set the host up and run the main job (about 4 minutes).
# make paper: the main job's paper scenario, 3 seeds (about 17 minutes; docs/experiment.md).
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo paper clean
setup:
	tools/setup

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup
	.venv/bin/dblp experiment

paper: setup
	.venv/bin/dblp experiment --scenario paper --seeds 3

clean:
	rm -rf .venv build *.egg-info
