#!/usr/bin/env python3
"""Prints what `make test` ran, section by section: passed, skipped (each with its reason) and
failed, from the JUnit files ctest (--output-junit) and pytest (--junitxml) wrote. A test binary
that exits 77 is a skipped test (its last line of output says why); test cases that GoogleTest
skipped inside a binary that passed are listed too.

Usage: test_summary.py SECTION=FILE.xml ...   (a missing file is reported, not fatal)
"""

import re
import sys
import xml.etree.ElementTree as ET


def reason_of(case, skipped):
    out = (case.findtext("system-out") or "") + (case.findtext("system-err") or "")
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    msg = skipped.get("message", "")
    if msg.startswith("SKIP_RETURN_CODE") and lines:
        return lines[-1]
    return msg or (lines[-1] if lines else "no reason given")


def gtest_skips(case):
    """[  SKIPPED ] cases inside a GoogleTest binary that passed, with the reason printed above."""
    out = case.findtext("system-out") or ""
    found = []
    reason, take_next = "", False
    for line in out.splitlines():
        if line.startswith("[ RUN      ]"):
            reason = ""
        elif take_next and line.strip():
            reason, take_next = line.strip(), False
        elif line.rstrip().endswith(": Skipped"):
            take_next = True
        m = re.match(r"\[  SKIPPED \] (\S+) \(", line)
        if m:
            found.append((m.group(1), reason or "no reason given"))
    return found


def summarize(section, path):
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"{section}: no results ({e})")
        return 1
    cases = list(root.iter("testcase"))
    passed, skipped, failed, inner = [], [], [], []
    for c in cases:
        name = c.get("name")
        if c.get("classname") and c.get("classname") != name:
            name = f"{c.get('classname')}::{name}"
        s = c.find("skipped")
        if c.find("failure") is not None or c.find("error") is not None:
            failed.append(name)
        elif s is not None:
            skipped.append((name, reason_of(c, s)))
        else:
            passed.append(name)
            inner += [(f"{name}: {t}", r) for t, r in gtest_skips(c)]
    print(f"{section}: {len(passed)} passed, {len(skipped)} skipped, {len(failed)} failed")
    by_reason = {}
    for name, reason in skipped:
        by_reason.setdefault(reason, []).append(name)
    for reason, names in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
        print(f"  skipped ({len(names)}): {reason}\n      {shown}")
    if inner:
        print(f"  test cases skipped inside binaries that passed ({len(inner)}):")
        for name, reason in inner:
            print(f"      {name} -- {reason}")
    for name in failed:
        print(f"  FAILED: {name}")
    return 1 if failed else 0


def main(argv):
    status = 0
    print("== summary ==")
    for arg in argv[1:]:
        section, _, path = arg.partition("=")
        status |= summarize(section, path)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
