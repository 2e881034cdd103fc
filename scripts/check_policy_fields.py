#!/usr/bin/env python3
"""Checks every spelling of the compression policy's fields outside C++ against their one
declaration (core/include/kvcomp/core/policy_fields.def, printed as JSON by the
policy_fields_json program):

- service/thrift/kvcomp.thrift, struct Policy: one field per declared field, same id, name, type
  and default, and no other (the IDL's default is the field's absent value: what an unset field
  means, which differs from a new policy's default where policy_absent.def says so);
- docs/configuration.md: the default_policy table (one row per field, in declaration order, the
  row kvcompd's --help text gives) and the default_policy block of the example configuration;
- docs/format.md: the policy records table (one row per tag, with its length and range);
- helm/kvcomp: values.yaml's policy block (camelCase keys, same defaults), values.schema.json's
  policy properties (type, enum names, minimum/maximum) and the template that renders them;
- client/python/src/bind_engine.cc: Policy's keywords, their defaults and read-only attributes
  (token_budget is Python's `budget`, None for 0).

On a mismatch it prints what to write where and exits 1. --fix rewrites the two derived blocks
of docs/configuration.md from the declaration.

  python3 scripts/check_policy_fields.py --fields-json-from build/tests/core/policy_fields_json
  (a ctest: policy_fields_check)
"""
import argparse
import json
import os
import re
import subprocess
import sys

import yaml

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PYTHON_KEYWORDS = {"token_budget": "budget"}  # Python's budget=None means "use ratio"

errors = []


def fail(where, message):
    errors.append(f"{where}: {message}")


def camel(name):
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def read(*path):
    with open(os.path.join(REPO, *path)) as f:
        return f.read()


def same_value(field, got, key="default"):
    want = field.get(key, field["default"])
    if isinstance(want, bool) or isinstance(got, bool):
        return got is want
    if isinstance(want, (int, float)):
        return isinstance(got, (int, float)) and abs(got - want) <= 1e-12 * max(1, abs(want))
    return got == want


# ---- Thrift IDL ----

def thrift_default(field):
    """The IDL's default: the field's absent value (what an unset field means on the wire,
    which is not the default of a new policy where that changed: policy_absent.def)."""
    absent = field.get("absent", field["default"])
    if field["thrift_type"] == "string":
        return f'"{absent}"'
    if field["thrift_type"] == "bool":
        return "true" if absent else "false"
    if field["thrift_type"] == "double":
        d = float(absent)
        return repr(d)
    return str(absent)


def check_thrift(fields):
    where = "service/thrift/kvcomp.thrift (struct Policy)"
    text = read("service", "thrift", "kvcomp.thrift")
    m = re.search(r"^struct Policy \{\n(.*?)^\}", text, re.S | re.M)
    if not m:
        fail(where, "no struct Policy")
        return
    declared = {}
    for line in m.group(1).splitlines():
        f = re.match(r"\s*(\d+):\s*(\w+)\s+(\w+)\s*(?:=\s*([^,/]+?))?\s*,?\s*(//.*)?$", line)
        if f:
            declared[f.group(3)] = (int(f.group(1)), f.group(2), (f.group(4) or "").strip())
        elif line.strip() and not line.strip().startswith("//"):
            fail(where, f"unparsed line: {line.strip()}")
    names = {f["name"] for f in fields}
    for field in fields:
        want = (f'  {field["thrift_id"]}: {field["thrift_type"]} {field["name"]} = '
                f'{thrift_default(field)},')
        got = declared.get(field["name"])
        if got is None:
            fail(where, f"missing field; add: {want}")
            continue
        fid, ftype, fdefault = got
        ok = fid == field["thrift_id"] and ftype == field["thrift_type"]
        if ok:
            try:
                value = yaml.safe_load(fdefault) if fdefault else None
            except yaml.YAMLError:
                value = None
            ok = value is not None and same_value(field, value, "absent")
        if not ok:
            fail(where, f"{field['name']} is `{fid}: {ftype} {field['name']} = {fdefault}`; "
                        f"the declaration says: {want.strip()}")
    for extra in sorted(set(declared) - names):
        fail(where, f"field {extra} is not in policy_fields.def")


# ---- docs/configuration.md ----

def config_row(field):
    key = f"default_policy.{field['name']}"
    env = "KVCOMP_" + key.replace(".", "_").upper()
    return (f"| `{key}` | {field['unit']} | `{field['default_text']}` | `{env}` | "
            f"{field['help']} |")


def config_rows_span(lines):
    """(first, end) line indexes of the default_policy table's rows."""
    rows = [i for i, line in enumerate(lines) if line.startswith("| `default_policy.")
            and not line.startswith("| `default_policy.preset`")]  # a preset, not a field
    if not rows:
        return None
    return rows[0], rows[-1] + 1


def example_span(lines):
    """(first, end) line indexes of the `default_policy:` block's entries in the example."""
    for i, line in enumerate(lines):
        if line == "default_policy:":
            j = i + 1
            while j < len(lines) and lines[j].startswith("  "):
                j += 1
            return i + 1, j
    return None


def check_configuration(fields, fix):
    where = "docs/configuration.md"
    path = os.path.join(REPO, "docs", "configuration.md")
    lines = read("docs", "configuration.md").splitlines()
    want_rows = [config_row(f) for f in fields]
    want_example = [f"  {f['name']}: {f['default_text']}" for f in fields]
    rows, example = config_rows_span(lines), example_span(lines)
    if rows is None:
        fail(where, "no default_policy table")
        return
    if example is None:
        fail(where, "no default_policy block in the example configuration")
        return
    if fix:
        # The later block first, so the earlier span's indexes stay valid.
        for (a, b), new in sorted([(rows, want_rows), (example, want_example)], reverse=True):
            lines[a:b] = new
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return
    got_rows = lines[rows[0]:rows[1]]
    if got_rows != want_rows:
        for want in want_rows:
            if want not in got_rows:
                fail(where, f"default_policy table: expected the row\n    {want}")
        for got in got_rows:
            if got not in want_rows:
                fail(where, f"default_policy table: row not from the declaration\n    {got}")
        if sorted(got_rows) == sorted(want_rows):
            fail(where, "default_policy table: rows not in declaration order")
    got_example = lines[example[0]:example[1]]
    if got_example != want_example:
        fail(where, "example configuration's default_policy block should read:\n"
             + "\n".join(want_example))


# ---- docs/format.md ----

def check_format_doc(fields):
    where = "docs/format.md (Policy records)"
    text = read("docs", "format.md")
    m = re.search(r"### Policy records.*?\n\| tag \| length \| field \|\n\| --- \| --- \| --- \|\n"
                  r"((?:\|[^\n]*\|\n)+)", text, re.S)
    if not m:
        fail(where, "no policy records table")
        return
    rows = {}
    for line in m.group(1).splitlines():
        r = re.match(r"\| (\d+) \| (\d+) \| (.*) \|$", line)
        if r:
            rows[int(r.group(1))] = (int(r.group(2)), r.group(3))
    for field in fields:
        row = rows.get(field["tlv_tag"])
        rng = field["range"]["text"]
        hint = (f"| {field['tlv_tag']} | {field['tlv_bytes']} | "
                f"{field['name'].replace('_', ' ')}{', ' + rng if rng else ''} |")
        if row is None:
            fail(where, f"no row for tag {field['tlv_tag']} ({field['name']}); add e.g.\n    "
                        f"{hint}")
            continue
        if row[0] != field["tlv_bytes"]:
            fail(where, f"tag {field['tlv_tag']} ({field['name']}) has length {row[0]}, the "
                        f"declaration {field['tlv_bytes']}")
        if rng and rng not in row[1]:
            fail(where, f"tag {field['tlv_tag']} ({field['name']}): the row should say its range "
                        f"{rng}")
        if field["names"] and not all(n in row[1] for n in field["names"]) and \
                "header byte" not in row[1]:
            fail(where, f"tag {field['tlv_tag']} ({field['name']}): the row should number "
                        f"{', '.join(field['names'])}")
    for extra in sorted(set(rows) - {f["tlv_tag"] for f in fields}):
        fail(where, f"tag {extra} is not in policy_fields.def")


# ---- Helm chart ----

def schema_want(field):
    want = {}
    if field["names"]:
        want = {"type": "string", "enum": field["names"]}
    elif field["type"] == "bool":
        want = {"type": "boolean"}
    elif field["type"] == "double":
        want = {"type": "number"}
    else:
        want = {"type": "integer", "minimum": 0}
    rng = field["range"]
    if rng["kind"] in ("at_least", "closed", "below"):
        want["minimum"] = rng["lo"]
    if rng["kind"] == "closed":
        want["maximum"] = rng["hi"]
    if rng["kind"] == "below":
        want["exclusiveMaximum"] = rng["hi"]
    return want


def check_helm(fields):
    values = yaml.safe_load(read("helm", "kvcomp", "values.yaml")).get("policy", {})
    schema = json.loads(read("helm", "kvcomp", "values.schema.json"))
    props = schema["properties"]["policy"]["properties"]
    helpers = read("helm", "kvcomp", "templates", "_helpers.tpl")
    names = set()
    for field in fields:
        key = camel(field["name"])
        names.add(key)
        if key not in values:
            fail("helm/kvcomp/values.yaml", f"policy.{key} is missing (documented, default "
                                            f"{field['default_text']})")
        elif not same_value(field, values[key]):
            fail("helm/kvcomp/values.yaml", f"policy.{key} is {values[key]!r}, the daemon's "
                                            f"default {field['default_text']}")
        prop = props.get(key)
        want = schema_want(field)
        if prop is None:
            fail("helm/kvcomp/values.schema.json", f"policy.{key} is missing; wants {want} and "
                                                   "a description")
        else:
            for k, v in want.items():
                if prop.get(k) != v:
                    fail("helm/kvcomp/values.schema.json",
                         f"policy.{key}.{k} is {prop.get(k)!r}, the declaration {v!r}")
            for k in ("maximum", "exclusiveMaximum"):
                if k in prop and k not in want:
                    fail("helm/kvcomp/values.schema.json",
                         f"policy.{key}.{k} is {prop[k]!r}, the declaration has no such bound")
        if not re.search(rf'"{field["name"]}"\s+(\(\w+ )?\$p\.{key}\b', helpers):
            fail("helm/kvcomp/templates/_helpers.tpl",
                 f'the $policy dict lacks "{field["name"]}" $p.{key}')
    for extra in sorted(set(values) - names):
        fail("helm/kvcomp/values.yaml", f"policy.{extra} is not in policy_fields.def")
    for extra in sorted(set(props) - names):
        fail("helm/kvcomp/values.schema.json", f"policy.{extra} is not in policy_fields.def")


# ---- Python binding ----

def check_python(fields):
    where = "client/python/src/bind_engine.cc (kvcomp.Policy)"
    text = read("client", "python", "src", "bind_engine.cc")
    named = text.find('"Policy"')  # the class_ that registers kvcomp.Policy
    start = text.rfind("nb::class_<CompressionPolicy>", 0, named) if named >= 0 else -1
    end = text.find("nb::class_<", start + 1)
    if start < 0:
        fail(where, "no nb::class_<CompressionPolicy>")
        return
    block = text[start:end]
    args = {}
    for name, value in re.findall(r'nb::arg\("(\w+)"\)\s*=\s*(nb::none\(\)|"[^"]*"|[^,)\s]+)', block):
        value = value.strip()
        if value == "nb::none()":
            args[name] = None
        else:
            try:
                args[name] = yaml.safe_load(value)
            except yaml.YAMLError:
                args[name] = value
    attrs = set(re.findall(r'\.def_(?:ro|prop_ro)\(\s*"(\w+)"', block))
    if '#include "kvcomp/core/policy_fields.def"' in block and "BindPolicyField(" in block:
        # Attributes generated from the declaration (all but token_budget, which is `budget`).
        attrs |= {f["name"] for f in fields if f["name"] not in PYTHON_KEYWORDS}
    keywords = set()
    for field in fields:
        kw = PYTHON_KEYWORDS.get(field["name"], field["name"])
        keywords.add(kw)
        if kw not in args:
            fail(where, f'no keyword {kw}; add nb::arg("{kw}") = <default> to the constructor '
                        "and its parameter to MakePolicy")
        else:
            got = args[kw]
            ok = (got is None and field["default"] in (0, None)) if kw != field["name"] \
                else same_value(field, got)
            if not ok:
                fail(where, f"keyword {kw} defaults to {got!r}, the declaration to "
                            f"{field['default_text']}")
        if kw not in attrs:
            fail(where, f'no attribute {kw}; add .def_ro("{kw}", ...) or .def_prop_ro')
    for extra in sorted(set(args) - keywords):
        fail(where, f"keyword {extra} is not in policy_fields.def")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--fields-json", help="the declaration as JSON (a file)")
    source.add_argument("--fields-json-from", help="a program printing it (policy_fields_json)")
    parser.add_argument("--fix", action="store_true",
                        help="rewrite docs/configuration.md's derived policy blocks")
    parser.add_argument("--root", help="repository to check (default: this script's)")
    args = parser.parse_args()
    if args.root:
        global REPO
        REPO = os.path.abspath(args.root)
    if args.fields_json:
        with open(args.fields_json) as f:
            fields = json.load(f)
    else:
        fields = json.loads(subprocess.run([args.fields_json_from], check=True,
                                           capture_output=True, text=True).stdout)
    if not fields:
        print("check_policy_fields: the declaration is empty", file=sys.stderr)
        return 1
    check_thrift(fields)
    check_configuration(fields, args.fix)
    check_format_doc(fields)
    check_helm(fields)
    check_python(fields)
    if errors:
        print("check_policy_fields: these spellings disagree with "
              "core/include/kvcomp/core/policy_fields.def:", file=sys.stderr)
        for e in errors:
            print("- " + e, file=sys.stderr)
        return 1
    print(f"check_policy_fields: ok ({len(fields)} fields)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
