# make test: set the host up and run the whole suite (root for the privileged part).
# make demo: set the host up and run the main job.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo clean
setup:
	tools/setup

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup
	.venv/bin/dblp experiment

clean:
	rm -rf .venv build *.egg-info
