# The contributor loop (build-dev, lint, fmt, test-fast, test, bench; docs/development.md,
# "Contributor loop"), run inside the virtualenv that `pip install -e '.[test]'` set up, and
# the wheels, the sdist and their checks: the steps the release workflow runs
# (.github/workflows/release.yml), callable here. docs/development.md, "Wheels", says what
# each produces and checks.

PYTHON ?= python3
# The manylinux policy of the Linux wheels: glibc 2.28 (RHEL 8, Debian 10, Ubuntu 18.10 and
# later), the policy PyTorch's wheels use, so anywhere torch and SGLang install, this does.
POLICY ?= manylinux_2_28
DIST ?= dist
# A Debian arm64 root with python3.11 in it (`make aarch64-root`), run under qemu.
AARCH64_ROOT ?= /opt/aarch64-root
MATURIN = $(PYTHON) -m maturin

# The same paths .ci/run lints.
PY_SOURCES = python tests benches scripts

.PHONY: build-dev lint fmt test-fast test bench \
	release-tools wheels wheel-x86_64 wheel-aarch64 sdist check-wheels check-sdist \
	test-wheel aarch64-root prove-aarch64 clean-dist

# Editable install into the active virtualenv, release profile (benchmarks of a debug build
# mean nothing). Python edits apply at once; rerun after Rust edits.
build-dev:
	$(MATURIN) develop --release

# What .ci/run checks before the tests, in its order.
lint:
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	$(PYTHON) -m ruff check $(PY_SOURCES)
	$(PYTHON) -m ruff format --check $(PY_SOURCES)
	$(PYTHON) -m mypy

fmt:
	cargo fmt
	$(PYTHON) -m ruff format $(PY_SOURCES)
	$(PYTHON) -m ruff check --fix $(PY_SOURCES)

# Tests that start no processes (the `procs` marker), stopping at the first failure.
test-fast:
	$(PYTHON) -m pytest -m "not procs" -x -q

# The README's test command, the suite CI runs.
test:
	$(PYTHON) -m pytest --benchmark-disable

# The micro benchmarks: Rust primitive vs Python twin in one run (docs/performance.md).
bench:
	$(PYTHON) -m pytest benches/ --benchmark-only

release-tools:
	$(PYTHON) -m pip install --group release

wheels: wheel-x86_64 wheel-aarch64 sdist

wheel-x86_64:
	$(MATURIN) build --release --zig --compatibility $(POLICY) \
		--target x86_64-unknown-linux-gnu --out $(DIST)

wheel-aarch64:
	rustup target add aarch64-unknown-linux-gnu
	$(MATURIN) build --release --zig --compatibility $(POLICY) \
		--target aarch64-unknown-linux-gnu --out $(DIST)

sdist:
	$(MATURIN) sdist --out $(DIST)

# The policy check: auditwheel names the newest glibc symbol each wheel needs.
check-wheels:
	for wheel in $(DIST)/*.whl; do $(PYTHON) -m auditwheel show "$$wheel" || exit 1; done

# The sdist builds back into the same wheel: same files, same bytes but the compiled core's.
check-sdist:
	$(PYTHON) scripts/sdist_roundtrip.py --dist $(DIST) --policy $(POLICY)

# The x86-64 wheel in fresh venvs (3.11, 3.12, 3.13), no Rust on PATH, run from outside
# the checkout (tests/package/test_wheel.py).
test-wheel:
	SESSIONGATE_WHEEL_DIR=$(abspath $(DIST)) $(PYTHON) -m pytest tests/package/test_wheel.py -v

# An aarch64 CPython from Debian's arm64 packages, unpacked (not installed) into a folder.
aarch64-root:
	dpkg --print-foreign-architectures | grep -qx arm64 || dpkg --add-architecture arm64
	apt-get update -qq
	apt-get install -y -qq qemu-user-static
	rm -rf $(AARCH64_ROOT).debs && mkdir -p $(AARCH64_ROOT).debs $(AARCH64_ROOT)
	cd $(AARCH64_ROOT).debs && apt-get download python3.11-minimal:arm64 \
		libpython3.11-minimal:arm64 libpython3.11-stdlib:arm64 libc6:arm64 zlib1g:arm64 \
		libexpat1:arm64 libgcc-s1:arm64 libffi8:arm64 libssl3:arm64 libbz2-1.0:arm64 \
		liblzma5:arm64 libsqlite3-0:arm64 libuuid1:arm64 libcrypt1:arm64
	for deb in $(AARCH64_ROOT).debs/*.deb; do dpkg-deb -x "$$deb" $(AARCH64_ROOT); done

# The aarch64 wheel's core loads and computes under qemu with an aarch64 Python.
prove-aarch64:
	rm -rf $(DIST)/aarch64-unpacked
	$(PYTHON) -m zipfile -e $(wildcard $(DIST)/*manylinux*_aarch64.whl) $(DIST)/aarch64-unpacked
	PYTHONPATH=$(abspath $(DIST))/aarch64-unpacked qemu-aarch64-static -L $(AARCH64_ROOT) \
		$(AARCH64_ROOT)/usr/bin/python3.11 scripts/core_smoke.py

clean-dist:
	rm -rf $(DIST)
