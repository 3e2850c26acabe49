# make test: set the host up and run the whole suite (root for the privileged part).
# make demo: set the host up and run the main job.
# make smoke: build sdist + wheel and check they install and load in clean venvs (root).
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo smoke clean
setup:
	tools/setup

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup
	.venv/bin/dblp experiment

smoke: setup
	tools/smoke-install

clean:
	rm -rf .venv build dist *.egg-info pydblp/bpf_src
