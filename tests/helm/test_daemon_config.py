"""The daemon itself accepts every configuration the chart renders: `kvcompd --config FILE
--print-config` parses the ConfigMap's kvcompd.yaml (unknown keys, bad values and inconsistent
combinations stop it with exit code 2, docs/configuration.md) and prints back the same values.
Needs the kvcompd binary of the build (KVCOMP_BUILD_DIR, set by scripts/run_tests.sh)."""
import glob
import os
import subprocess

import pytest
import yaml

from conftest import REPO, VALUES_FILES, documents, load_values, render


def find_kvcompd():
    build = os.environ.get("KVCOMP_BUILD_DIR", os.path.join(REPO, "build"))
    for path in [os.path.join(build, "service", "kvcompd")] + sorted(
            glob.glob(os.path.join(build, "**", "kvcompd"), recursive=True)):
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


KVCOMPD = find_kvcompd()
pytestmark = pytest.mark.skipif(KVCOMPD is None, reason="kvcompd is not built in KVCOMP_BUILD_DIR")


def rendered_config(values):
    for _, doc in documents(render(values)):
        if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].endswith("-config"):
            return doc["data"]["kvcompd.yaml"]
    raise AssertionError("no daemon ConfigMap")


@pytest.mark.parametrize("path", VALUES_FILES, ids=os.path.basename)
def test_kvcompd_accepts_the_rendered_config(tmp_path, path):
    text = rendered_config(load_values(path))
    config = tmp_path / "kvcompd.yaml"
    config.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCOMP_")}
    r = subprocess.run([KVCOMPD, "--config", str(config), "--print-config"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    effective = yaml.safe_load(r.stdout)
    wanted = yaml.safe_load(text)
    for section, body in wanted.items():
        for key, value in body.items():
            got = effective[section][key]
            assert got == value or (isinstance(value, float) and abs(got - value) < 1e-9), \
                f"{section}.{key}: rendered {value!r}, kvcompd uses {got!r}"
