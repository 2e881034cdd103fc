"""Start a real kvcompd for tests (Python side; the C++ twin is kvcompd_process.h).

    from kvcompd_fixture import Kvcompd
    with Kvcompd(binary) as d:               # ephemeral loopback ports, fresh data dir
        d.data_endpoint                       # "127.0.0.1:<port>" for the UCX client
        d.control_port, d.metrics_port
        d.metrics()["kvcomp_caches_stored"]   # parsed /metrics
        d.restart()                           # same data dir, new ports
    # leaving the block sends SIGTERM and waits

find_kvcompd() locates the binary: $KVCOMPD, else $KVCOMP_BUILD_DIR/service/kvcompd, else
build*/service/kvcompd under the repository; built_kvcompd() is the same, None where none is
built. Only the standard library is used.

Run `python3 tests/integration/kvcompd_fixture.py PATH_TO_KVCOMPD` for a self-test.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Dict, List, Optional

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def find_kvcompd() -> str:
    """Path of a built kvcompd binary, or raises FileNotFoundError."""
    if os.environ.get("KVCOMPD"):
        return os.environ["KVCOMPD"]
    candidates = []
    if os.environ.get("KVCOMP_BUILD_DIR"):
        candidates.append(os.path.join(os.environ["KVCOMP_BUILD_DIR"], "service", "kvcompd"))
    candidates += sorted(glob.glob(os.path.join(_REPO, "build*", "service", "kvcompd")))
    for c in candidates:
        if os.access(c, os.X_OK):
            return c
    raise FileNotFoundError("kvcompd not built (set KVCOMPD or KVCOMP_BUILD_DIR)")


def sigstop(proc) -> None:
    """SIGSTOP, returning once every thread of the process is stopped (state T): kill() returns
    before the kernel has stopped them, and a thread still running could answer a request."""
    os.kill(proc.pid, signal.SIGSTOP)
    for _ in range(2000):
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.001)
    raise AssertionError("the process did not stop")


def built_kvcompd() -> Optional[str]:
    """find_kvcompd(), or None where none is built (tests that need one skip then)."""
    try:
        return find_kvcompd()
    except FileNotFoundError:  # pragma: no cover - the build makes it
        return None


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$")


def parse_metrics(text: str) -> Dict[str, float]:
    """Prometheus text -> {'name' or 'name{labels}': value} (labels as exposed)."""
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


class Kvcompd:
    """A kvcompd child process on loopback ephemeral ports with its own data directory."""

    def __init__(self, binary: Optional[str] = None, flags: Optional[List[str]] = None,
                 data_dir: Optional[str] = None, env: Optional[Dict[str, str]] = None,
                 token_file: Optional[str] = None):
        self.binary = binary or find_kvcompd()
        self._own_dir = data_dir is None
        self.root = tempfile.mkdtemp(prefix="kvcompd-py-") if data_dir is None else data_dir
        self.data_dir = os.path.join(self.root, "data")
        self.flags = list(flags or [])
        if token_file:
            self.flags.append(f"--auth.token_file={token_file}")
        self.env = dict(os.environ, **(env or {}))
        self.proc: Optional[subprocess.Popen] = None
        self.ports: Dict[str, int] = {}
        self.log_path = os.path.join(self.root, "kvcompd.log")

    # --- lifecycle ---
    def start(self, timeout: float = 30.0) -> "Kvcompd":
        ready = os.path.join(self.root, "ready.yaml")
        if os.path.exists(ready):
            os.remove(ready)
        args = [self.binary, "--data_plane.port=0", "--control_plane.port=0",
                "--metrics.port=0", f"--storage.data_dir={self.data_dir}",
                f"--process.ready_file={ready}", "--engine.workers=2",
                "--engine.cpu_threads=1"] + self.flags
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvcompd exited with {self.proc.returncode}:\n{self.log()}")
            if os.path.exists(ready):
                ports = {}
                with open(ready) as f:
                    for line in f:
                        k, _, v = line.partition(":")
                        ports[k.strip()] = int(v)
                if ports.get("data_port") and ports.get("control_port"):
                    self.ports = ports
                    return self
            time.sleep(0.02)
        self.stop(signal.SIGKILL)
        raise TimeoutError(f"kvcompd not ready after {timeout}s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Sends `sig` and waits; returns the exit code (negative: killed by a signal)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rc = self.proc.returncode
        self.proc = None
        return rc

    def restart(self, sig: int = signal.SIGTERM) -> "Kvcompd":
        self.stop(sig)
        return self.start()

    def reload_tokens(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGHUP)

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "Kvcompd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # --- endpoints ---
    @property
    def data_endpoint(self) -> str:
        return f"127.0.0.1:{self.ports['data_port']}"

    @property
    def control_port(self) -> int:
        return self.ports["control_port"]

    @property
    def metrics_port(self) -> int:
        return self.ports["metrics_port"]

    def http_get(self, path: str) -> tuple:
        """(status, body) of GET http://127.0.0.1:<metrics_port><path>."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}{path}",
                                        timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> Dict[str, float]:
        return parse_metrics(self.http_get("/metrics")[1])

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""


def _self_test(binary: str) -> int:
    with Kvcompd(binary) as d:
        assert d.http_get("/healthz")[0] == 200
        assert d.http_get("/readyz")[0] == 200
        m = d.metrics()
        assert m["kvcomp_ready"] == 1.0, m
        assert m["kvcomp_caches_stored"] == 0.0, m
        assert "OPEN single-tenant mode" in d.log()
        first = dict(d.ports)
        d.restart()
        assert d.metrics()["kvcomp_ready"] == 1.0
        rc = d.stop()
        assert rc == 0, rc
        assert "stopped" in d.log()
        del first
    print("kvcompd_fixture self-test: ok")
    return 0


if __name__ == "__main__":
    sys.exit(_self_test(sys.argv[1] if len(sys.argv) > 1 else find_kvcompd()))
