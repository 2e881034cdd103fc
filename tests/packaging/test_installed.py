"""The installed kvcomp, as a user has it after `pip install .` and `cmake --install`: run by
tests/packaging/run.sh with the fresh virtual environment's python, outside the source tree.

- kvcomp imports from that environment's site-packages (not the source tree), with the client;
- the `kvcomp` command and `python -m kvcomp` run;
- examples/prefill_push.py and decode_pull.py (which import the installed package) run against a
  real kvcompd on loopback;
- the C++ example built against the installed C++ package (find_package and pkg-config) does too;
- the wheel is a manylinux wheel whose extension loads every library it links, but glibc's,
  libstdc++'s and CUDA's, from the wheel itself (for the wheel of
  scripts/build_portable_wheel.sh, KVCOMP_PACKAGING_STATIC_DEPS=1: manylinux_2_28 or older, its
  C++ dependencies linked in, UCX's libraries bundled).
"""

import json
import os
import subprocess
import sys

import pytest

VENV = os.environ.get("KVCOMP_PACKAGING_VENV")
REPO = os.environ.get("KVCOMP_REPO", "")
# The wheel of scripts/build_portable_wheel.sh: its C++ dependencies are linked statically.
STATIC_DEPS = os.environ.get("KVCOMP_PACKAGING_STATIC_DEPS") == "1"
pytestmark = pytest.mark.skipif(not VENV, reason="run by tests/packaging/run.sh")

if VENV:
    sys.path.append(os.path.join(REPO, "tests", "integration"))  # the daemon fixture only
    from kvcompd_fixture import Kvcompd, find_kvcompd  # noqa: E402


def run(args, **kw):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(args, capture_output=True, text=True, timeout=180, env=env, **kw)


@pytest.fixture(scope="module")
def daemon():
    with Kvcompd(find_kvcompd()) as d:
        yield d


def test_the_package_is_the_installed_one():
    import kvcomp
    site = os.path.realpath(os.path.join(VENV, "lib"))
    assert os.path.realpath(kvcomp.__file__).startswith(site), kvcomp.__file__
    assert not os.path.realpath(kvcomp.__file__).startswith(os.path.realpath(REPO) + os.sep)
    assert hasattr(kvcomp._kvcomp, "_Client")  # the wheel carries the SDK's client
    assert os.path.realpath(sys.prefix) == os.path.realpath(VENV)


def test_the_environment_is_isolated():
    """Only what the wheel declares is installed: no system site-packages behind it."""
    import importlib.util
    assert not sys.flags.no_site
    assert importlib.util.find_spec("tqdm") is None  # the [cli] extra's, not installed
    assert all(os.path.realpath(p).startswith(os.path.realpath(VENV)) or "site-packages" not in p
               for p in sys.path)


# What a manylinux wheel may take from the system (auditwheel's policies), and CUDA's runtime
# libraries, which come with CUDA.
SYSTEM_LIBS = ("libc.so", "libm.so", "libdl.so", "librt.so", "libpthread.so", "ld-linux",
               "libstdc++.so", "libgcc_s.so", "libcudart.so", "libcublas.so", "libcublasLt.so",
               "libcusolver.so", "libcusparse.so", "libnvJitLink.so")


def test_the_wheel_is_manylinux_and_carries_its_libraries():
    """The installed wheel's tag is manylinux_2_N, and the extension's needed libraries are the
    system's allowed ones or copies inside the wheel (kvcomp.libs, under names of their own), which
    the loader takes from there: Abseil, Thrift, c-ares, UCX, OpenSSL need not be installed."""
    import re

    import kvcomp
    wheel = os.path.basename(os.environ["KVCOMP_PACKAGING_WHEEL"])
    m = re.search(r"-manylinux_2_(\d+)_x86_64\.whl$", wheel)
    assert m, wheel
    print(f"wheel tag: manylinux_2_{m.group(1)}")
    ext = kvcomp._kvcomp.__file__
    libs = os.path.join(os.path.dirname(os.path.dirname(ext)), "kvcomp.libs")
    bundled = set(os.listdir(libs))
    out = run(["readelf", "-d", ext]).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)
    assert needed, out
    if STATIC_DEPS:
        # scripts/build_portable_wheel.sh: Abseil, Thrift, c-ares and the C++ runtime (libc++)
        # linked into the extension, only UCX's libraries bundled, glibc 2.28 at most.
        assert int(m.group(1)) <= 28, wheel
        assert any(n.startswith("libucp") for n in bundled), bundled
        assert not [n for n in needed if n.startswith(("libabsl", "libthrift", "libcares",
                                                       "libstdc++", "libgcc_s", "libssl"))], needed
        dynsym = run(["objdump", "-T", ext]).stdout
        versions = re.findall(r"GLIBC_2\.(\d+)", dynsym)
        assert versions and max(int(v) for v in versions) <= 28, sorted(set(versions))
        exported = [line.split()[-1] for line in dynsym.splitlines()
                    if re.search(r"\s\.text\s", line)]
        assert exported == ["PyInit__kvcomp"], exported[:20]  # libc++ & co. stay private
        # This process (kvcomp imported) maps none of the system's copies of those libraries
        # (OpenSSL may be the interpreter's own, for hashlib and ssl).
        with open("/proc/self/maps") as f:
            mapped = {line.split()[-1] for line in f if "/" in line}
        system = [p for p in mapped if os.path.dirname(p) != libs and
                  re.search(r"/lib(absl|thrift|uc[mpst]|cares|numa)", p)]
        assert not system, system
    else:
        assert any(n.startswith("libabsl_") for n in bundled) and \
            any(n.startswith("libthrift") for n in bundled) and \
            any(n.startswith("libucp") for n in bundled), bundled
    foreign = [n for n in needed if n not in bundled and not n.startswith(SYSTEM_LIBS)]
    assert not foreign, foreign
    resolved = dict(re.findall(r"^\s*(\S+) => (\S+)", run(["ldd", ext]).stdout, re.M))
    for n in needed:
        if n in bundled:
            assert os.path.realpath(os.path.dirname(resolved[n])) == os.path.realpath(libs), \
                (n, resolved[n])


def test_the_version():
    import kvcomp
    import importlib.metadata
    assert kvcomp.__version__ == importlib.metadata.version("kvcomp")
    with open(os.path.join(REPO, "CMakeLists.txt")) as f:
        assert f"project(kvcomp VERSION {kvcomp.__version__} " in f.read()
    exe = os.path.join(VENV, "bin", "kvcomp")
    r = run([exe, "--version"])
    assert r.returncode == 0 and r.stdout.strip() == f"kvcomp {kvcomp.__version__}", r
    r = run([find_kvcompd(), "--version"])
    assert r.returncode == 0 and r.stdout.strip() == f"kvcompd {kvcomp.__version__}", r


def test_the_command_line_entry_points():
    exe = os.path.join(VENV, "bin", "kvcomp")
    r = run([exe, "--help"])
    assert r.returncode == 0 and "loadgen" in r.stdout, r.stderr
    assert r.stdout.startswith("usage: kvcomp "), r.stdout
    r = run([sys.executable, "-m", "kvcomp", "--help"])
    assert r.returncode == 0 and "loadgen" in r.stdout, r.stderr
    r = run([exe, "put", "--help"])
    assert "KVCOMP_ENDPOINTS" in r.stdout and "--keys" in r.stdout, r.stdout


def test_kvcomp_put_get_lookup_against_kvcompd(daemon, tmp_path):
    """The command without the [cli] extra (no tqdm, no safetensors), endpoints from the
    environment."""
    import numpy as np
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 2, 64, 64)).astype(np.float16)
    np.save(tmp_path / "k.npy", k)
    np.save(tmp_path / "v.npy", k[::-1].copy())
    exe = os.path.join(VENV, "bin", "kvcomp")
    env = dict(os.environ, KVCOMP_ENDPOINTS=f"{daemon.data_endpoint},127.0.0.1:{daemon.control_port}")
    env.pop("PYTHONPATH", None)

    def cli(*args):
        return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, env=env,
                              cwd=tmp_path)
    r = cli("put", "-m", "pkg/model", "-k", "cli", "--keys", "k.npy", "--values", "v.npy",
            "--policy", "ratio=0,moments=false")
    assert r.returncode == 0, r.stderr
    r = cli("get", "-m", "pkg/model", "-k", "cli", "--out", "c.kvc")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "c.kvc").stat().st_size > 0
    r = cli("lookup", "-m", "pkg/model", "-k", "cli")
    assert r.returncode == 0 and json.loads(r.stdout)["original_tokens"] == 64, r.stdout + r.stderr
    r = cli("lookup", "-m", "pkg/model", "-k", "absent")
    assert r.returncode == 1 and "KeyError" in r.stderr


def test_examples_run_against_kvcompd(daemon, tmp_path):
    ep = ["--endpoint", daemon.data_endpoint]
    ex = os.path.join(REPO, "examples")
    r = run([sys.executable, os.path.join(ex, "prefill_push.py"), *ep, "--key", "pkg",
             "--layers", "2", "--tokens", "512"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ratio"] > 1.2
    r = run([sys.executable, os.path.join(ex, "decode_pull.py"), *ep, "--key", "pkg"],
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["attention_shape"] == [32, 1, 128] and out["correction_changed_output"] > 0


@pytest.mark.parametrize("which", ["find_package", "pkg-config"])
def test_cpp_example_built_against_the_installed_package(daemon, which):
    exes = os.environ["KVCOMP_PACKAGING_CPP"].split(":")
    exe = exes[0] if which == "find_package" else exes[1]
    r = run([exe, daemon.data_endpoint, "512"])
    assert r.returncode == 0, r.stderr
    assert "stored" in r.stdout
