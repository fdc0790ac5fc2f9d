# Two commands do everything on a fresh Debian/Ubuntu machine with Python 3.10+:
#   make demo   - set up, then train a small model with BackwardGraphCallback (writes vdl_log/)
#   make test   - set up, then run the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# PaddleFormers pins numpy<=1.26.4 and PaddleDetection needs numpy==1.23.5: their
# integration tests (tests/integrations/) run in a venv of their own each
PFVENV  := .venv-pf
DETVENV := .venv-det
APT    := $(shell if [ "$$(id -u)" = 0 ]; then echo "apt-get"; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then echo "sudo apt-get"; fi)

.PHONY: setup setup-demo venvs engine browser demo test docs docs-pictures bench clean paddleformers-venv ppdet-venv

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV) || { echo "python venv failed: install python3-venv (apt-get install -y python3-venv)"; exit 1; }
	$(BIN)/pip install -q --upgrade pip

# Two stamps: the demo needs only the package (and the pip engine); the tests need their
# extras too (pytest, playwright, notebooks, Model Explorer, SwanLab/TensorBoard/W&B and their readers).
$(VENV)/.installed-demo: $(BIN)/activate pyproject.toml setup.cfg
	$(BIN)/pip install -q -e '.[pure]'
	touch $@

$(VENV)/.installed-test: $(BIN)/activate pyproject.toml setup.cfg
	$(BIN)/pip install -q -e '.[pure,test,explorer,dashboards-test,docs]'
	touch $@

# A venv of its own for one integration's tests: $(1) its folder, $(2) its setup.cfg extra
define INTEGRATION_VENV
$(1)/.installed: pyproject.toml setup.cfg
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install -q --upgrade pip
	$(1)/bin/pip install -q -e '.[pure,$(2)]' 'pytest>=7'
	touch $$@
endef
$(eval $(call INTEGRATION_VENV,$(PFVENV),paddleformers))
$(eval $(call INTEGRATION_VENV,$(DETVENV),ppdet))

paddleformers-venv: $(PFVENV)/.installed

ppdet-venv: $(DETVENV)/.installed

# Graphviz's `dot` through apt where we may; otherwise the graphviz-pure extra
# installed above is used automatically.
engine:
	@command -v dot >/dev/null 2>&1 || { \
	  if [ -n "$(APT)" ]; then { $(APT) update -qq && DEBIAN_FRONTEND=noninteractive $(APT) install -y -qq graphviz >/dev/null; } \
	    || echo "WARNING: apt-get could not install graphviz; using the pip engine graphviz-pure"; \
	  else echo "no root/sudo: using the pip engine graphviz-pure instead of the system dot"; fi; }

# Debian's Chromium for the dashboard and report browser tests (skipped without it).
browser:
	@test -x /usr/bin/chromium || { \
	  if [ -n "$(APT)" ]; then { $(APT) update -qq && DEBIAN_FRONTEND=noninteractive $(APT) install -y -qq chromium >/dev/null; } \
	    || echo "WARNING: apt-get could not install chromium; the browser tests will be skipped"; \
	  else echo "no root/sudo: browser tests will be skipped (apt-get install chromium)"; fi; }

setup-demo: $(VENV)/.installed-demo engine

setup: $(VENV)/.installed-test engine

# The demo starts from an empty vdl_log/ (a rerun would otherwise add a second run beside the
# first, and a dashboard left open would show every step twice).
demo: setup-demo
	@if [ -d vdl_log ]; then echo "removing the previous demo's vdl_log/"; rm -rf vdl_log; fi
	$(BIN)/python examples/train_lenet.py --log-dir vdl_log

# The three venvs are independent: built side by side (pip waits on downloads and disk more
# than on the CPU), then the system packages one apt run at a time.
venvs:
	$(MAKE) --no-print-directory -j3 $(VENV)/.installed-test $(PFVENV)/.installed $(DETVENV)/.installed

test: venvs engine browser
	$(BIN)/python -m pytest -q -ra --doctest-modules paddleviz_hooks tests
	$(PFVENV)/bin/python -m pytest -q -ra tests/integrations/test_paddleformers_trainer.py
	$(DETVENV)/bin/python -m pytest -q -ra tests/integrations/test_ppdet_trainer.py

# The user guide on http://127.0.0.1:8000 (MkDocs, Material theme; API pages from the docstrings)
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve -a 127.0.0.1:8000

# The pictures the README and the guide show, made anew from real captures
docs-pictures: setup browser
	$(BIN)/python docs/pictures.py

bench: setup
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) $(PFVENV) $(DETVENV) vdl_log demo_out test-output site
