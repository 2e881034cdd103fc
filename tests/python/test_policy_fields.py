"""kvcomp.Policy against the policy's one declaration (core/include/kvcomp/core/policy_fields.def,
printed by the policy_fields_json program of the build): every declared field is a keyword with
the declared default and an attribute, and the constructor takes no keyword the declaration lacks.
token_budget is Python's `budget` (None = use ratio)."""
import glob
import json
import os
import re
import subprocess

import pytest

import kvcomp

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
ALIASES = {"token_budget": "budget"}


def find_program():
    build = os.environ.get("KVCOMP_BUILD_DIR", os.path.join(REPO, "build"))
    for path in [os.path.join(build, "tests", "core", "policy_fields_json")] + sorted(
            glob.glob(os.path.join(build, "**", "policy_fields_json"), recursive=True)):
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


PROGRAM = find_program()
pytestmark = pytest.mark.skipif(PROGRAM is None,
                                reason="policy_fields_json is not built in KVCOMP_BUILD_DIR")


@pytest.fixture(scope="module")
def fields():
    return json.loads(subprocess.run([PROGRAM], check=True, capture_output=True,
                                     text=True).stdout)


def keywords():
    doc = kvcomp.Policy.__init__.__doc__ or ""
    m = re.search(r"__init__\(self, (.*?)\) -> None", doc, re.S)
    assert m, doc
    return set(re.findall(r"(\w+):", m.group(1)))


def test_every_declared_field_is_a_keyword_with_its_default(fields):
    p = kvcomp.Policy()
    for f in fields:
        kw = ALIASES.get(f["name"], f["name"])
        got = getattr(p, kw)
        if kw == "budget":
            assert got is None and f["default"] == 0
            continue
        if isinstance(f["default"], float):
            assert got == pytest.approx(f["default"], rel=1e-15), kw
        else:
            assert got == f["default"], kw
        # The keyword takes the default explicitly and the policy is the same.
        assert kvcomp.Policy(**{kw: got}) == p, kw


def test_the_constructor_has_no_undeclared_keyword(fields):
    declared = {ALIASES.get(f["name"], f["name"]) for f in fields}
    assert keywords() == declared


def test_declared_ranges_are_enforced(fields):
    for f in fields:
        kw = ALIASES.get(f["name"], f["name"])
        rng = f["range"]
        if rng["kind"] in ("closed", "below"):
            over = rng["hi"] if rng["kind"] == "below" else rng["hi"] + 1
            with pytest.raises(ValueError, match=f["name"]):
                kvcomp.Policy(**{kw: type(f["default"])(over)})
        if f["names"]:
            for name in f["names"]:
                assert getattr(kvcomp.Policy(**{kw: name}), kw) == name


def test_new_policies_get_the_default_old_records_their_absent_value(fields):
    """A default that changed (policy_absent.def): Policy(), the presets' `default`, compress()
    without a policy and the CLI's --policy get the new default; a cache keeps the value it was
    written with; the declaration names the old value as what an absent record means."""
    import types

    from kvcomp import cli

    import numpy as np

    changed = {f["name"]: f for f in fields if f["absent"] != f["default"]}
    assert sorted(changed) == ["moments", "recent_fraction"]
    rf = changed["recent_fraction"]
    assert rf["absent"] == 0 and rf["default"] == kvcomp.Policy().recent_fraction
    mo = changed["moments"]
    assert mo["absent"] is True and mo["default"] is False and not kvcomp.Policy().moments
    assert kvcomp.preset("default") == kvcomp.Policy()
    assert cli._policy(types.SimpleNamespace(policy="scorer=keydiff")).recent_fraction == \
        rf["default"]
    rng = np.random.default_rng(3)
    k = rng.standard_normal((2, 400, 64)).astype(np.float32)
    v = rng.standard_normal((2, 400, 64)).astype(np.float32)
    c = kvcomp.compress(k, v)  # the default policy: manifold, half evicted, half of it recent
    assert c.policy.recent_fraction == rf["default"]
    assert not c.policy.moments and not c.has_moments
    kept = kvcomp.Policy().kept_per_head(400)
    recent = kvcomp.Policy().effective_recent(kept)
    assert recent == int(rf["default"] * kept) > 0
    for h in range(2):
        assert set(range(400 - recent, 400)) <= set(c.kept_positions(0, h).tolist())
    back = kvcomp.CompressedCache.from_bytes(c.to_bytes())
    assert back.policy == c.policy
    old = kvcomp.compress(k, v, kvcomp.Policy(recent_fraction=0.0, moments=True))
    back = kvcomp.CompressedCache.from_bytes(old.to_bytes())
    assert back.policy.recent_fraction == 0.0 and back.policy.moments and back.has_moments
