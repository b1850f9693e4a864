# Developer entry points: make venv | demo | test | lint
#
# `make venv` is idempotent: it does its work only when the stamp $(VENV)/.installed is
# missing or older than pyproject.toml, so every other target can depend on it cheaply.

PYTHON ?= python3
VENV ?= .venv
PYTEST_ARGS ?=

PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv sysdeps demo test lint

venv: $(STAMP)

# FUSE 3: fusermount3 to mount and unmount, libfuse3 headers and pkg-config to build
# pyfuse3. As root (CI, containers) they are installed with apt-get; otherwise we stop
# and say what to install.
sysdeps:
	@need=""; \
	command -v fusermount3 >/dev/null || need="$$need fuse3"; \
	pkg-config --exists fuse3 2>/dev/null || need="$$need libfuse3-dev pkg-config"; \
	if [ -n "$$need" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "apt-get install$$need"; \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get update -qq && apt-get install -y -qq $$need >/dev/null; \
		else \
			echo "bucketfs needs FUSE 3: sudo apt-get install -y$$need" >&2; exit 1; \
		fi; \
	fi

# torch and torchvision must come as one matched pair: torchvision's compiled ops only
# load into the torch build they were made for, and a mismatch shows up as
# `import torchvision` failing ("operator torchvision::nms does not exist"). That
# happens when a torch that is already installed (or offered by a pip find-links
# directory, such as a CPU-only wheel) satisfies the unpinned `torch` requirement but
# does not match the newest torchvision. So: install, check the import, and if it
# fails upgrade both together from the index, then check again.
# pyfuse3 with bucketfs's patch first (packaging/pyfuse3/build.py says why), so that the
# install below finds it satisfied; it is rebuilt when the patch's version changes.
$(STAMP): pyproject.toml packaging/pyfuse3/build.py | sysdeps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) packaging/pyfuse3/build.py --check || $(PY) packaging/pyfuse3/build.py --install
	$(PY) -m pip install -e '.[test,torch]'
	$(PY) -c 'import torchvision' 2>/dev/null || \
		$(PY) -m pip install --upgrade torch torchvision
	$(PY) -c 'import torch, torchvision; \
		print("torch", torch.__version__, "torchvision", torchvision.__version__)'
	touch $@

demo: venv
	$(PY) -m bucketfs.demo

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
