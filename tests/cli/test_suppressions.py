"""Suppressions: the file format and its errors, which findings each rule matches, the report's ``suppressed``
list and summary, merging, the renderers, and --suppressions on replay, show and wrap."""

from __future__ import annotations

import json
import sys

import pytest

from streamsan import exitcodes
from streamsan.cli import main
from streamsan.report.merge import merge_reports
from streamsan.report.render_markdown import render_markdown
from streamsan.report.render_text import render_text
from streamsan.suppressions import (Rule, SuppressionError, apply_suppressions, load_suppressions,
                                    parse_suppressions)
from tests.support import report_scenarios as S
from tests.support.report_kit import report_of, validator
from tests.support.report_kit import write_trace
from tests.support.wrap_kit import child  # noqa: F401  (fixture)


def two_races():
    """device-device (cache_utils.py:120 -> :140) and host-device (cache_utils.py:120 -> run.py:9)."""
    return report_of(S.pinned_d2h_then_h2d(3) + S.host_read_after_d2h()[len(S.prologue()):])


def test_parse_rules_comments_and_blank_lines():
    text = ("# known races\n\nfingerprint:0a1b2c3d4e5f6789  # upstream bug #48947\n"
            "  frame:*/cache_utils.py:14?   #  the cache's prefetch  \nkind:host-device # debug prints\n")
    assert parse_suppressions(text, "s.supp") == [
        Rule("fingerprint", "0a1b2c3d4e5f6789", "upstream bug #48947", "s.supp", 3),
        Rule("frame", "*/cache_utils.py:14?", "the cache's prefetch", "s.supp", 4),
        Rule("kind", "host-device", "debug prints", "s.supp", 5),
    ]


@pytest.mark.parametrize("line,message", [
    ("kind:host-device", "s.supp:2: a rule needs a reason: add '# why' after 'kind:host-device'"),
    ("kind:host-device #   ", "s.supp:2: a rule needs a reason: add '# why' after 'kind:host-device'"),
    ("race:foo  # tsan habit", "s.supp:2: unknown rule 'race:foo' (rules start with fingerprint:, frame: or kind:)"),
    ("cache_utils.py  # no type", "s.supp:2: unknown rule 'cache_utils.py' (rules start with fingerprint:, frame: "
                                  "or kind:)"),
    ("frame:   # empty", "s.supp:2: frame: needs a value"),
    ("fingerprint:XYZ  # bad", "s.supp:2: fingerprint 'XYZ' is not lowercase hex"),
    ("kind:data-race  # bad", "s.supp:2: unknown kind 'data-race' (kinds: device-device, host-device, "
                              "alloc-reuse, missing-record-stream)"),
])
def test_bad_rules_name_their_line(line, message):
    with pytest.raises(SuppressionError) as e:
        parse_suppressions(f"# header\n{line}\n", "s.supp")
    assert str(e.value) == message


def test_missing_suppression_file(tmp_path):
    with pytest.raises(SuppressionError) as e:
        load_suppressions(str(tmp_path / "nope.supp"))
    assert str(e.value) == f"{tmp_path / 'nope.supp'}: no such suppression file"


@pytest.mark.parametrize("rule,suppressed_kinds", [
    ("kind:host-device", ["host-device"]),
    ("frame:*/run.py:9", ["host-device"]),
    ("frame:prefetch", ["device-device"]),  # a function name, in the later access's stack
    ("frame:*/cache_utils.py:120", ["device-device", "host-device"]),  # the earlier access of both
    ("frame:*/site-packages/torch/*", ["device-device", "host-device"]),  # library frames count too
    ("frame:nothing_here", []),
])
def test_what_each_rule_matches(rule, suppressed_kinds):
    rep = two_races()
    out = apply_suppressions(rep, parse_suppressions(f"{rule}  # why", "s.supp"))
    assert [r["kind"] for r in out["suppressed"]] == suppressed_kinds
    assert [r["kind"] for r in out["races"]] == [k for k in ("device-device", "host-device")
                                                 if k not in suppressed_kinds]


def test_suppressed_findings_are_moved_counted_and_valid():
    rep = two_races()
    fp = rep["races"][0]["fingerprint"]
    rules = parse_suppressions(f"kind:host-device  # debug print\nfingerprint:{fp}  # upstream bug\n", "s.supp")
    out = apply_suppressions(rep, rules)
    assert out["races"] == []
    assert [(r["kind"], r["count"], r["suppression"]) for r in out["suppressed"]] == [
        ("device-device", 3, {"rule": f"fingerprint:{fp}", "reason": "upstream bug", "file": "s.supp", "line": 2}),
        ("host-device", 1, {"rule": "kind:host-device", "reason": "debug print", "file": "s.supp", "line": 1}),
    ]
    s = out["summary"]
    assert (s["races"], s["occurrences"], s["suppressed"]) == (0, 0, 2)
    assert s["events"] == rep["summary"]["events"] and rep["races"] != []  # counters kept, input untouched
    validator().validate(json.loads(json.dumps(out)))
    assert not validator().is_valid(dict(out, suppressed=[rep["races"][0]]))  # an item needs its suppression


def test_no_match_still_records_that_rules_were_applied():
    out = apply_suppressions(two_races(), parse_suppressions("kind:alloc-reuse  # x", "s.supp"))
    assert out["suppressed"] == [] and out["summary"]["suppressed"] == 0 and len(out["races"]) == 2


def test_merge_keeps_suppressed_findings_deduplicated():
    rules = parse_suppressions("kind:device-device  # known", "s.supp")
    a = apply_suppressions(report_of(S.pinned_d2h_then_h2d(2), process={"pid": 1}), rules)
    b = apply_suppressions(report_of(S.pinned_d2h_then_h2d(3), process={"pid": 2}), rules)
    m = merge_reports([a, b, report_of(S.host_read_after_d2h(), process={"pid": 3})])
    assert [(r["kind"], r["count"]) for r in m["suppressed"]] == [("device-device", 5)]
    assert [r["kind"] for r in m["races"]] == ["host-device"]
    assert m["summary"]["suppressed"] == 1
    assert "suppressed" not in merge_reports([report_of(S.alloc_reuse())])


def test_text_and_markdown_show_suppressed_findings():
    out = apply_suppressions(two_races(), parse_suppressions("kind:host-device  # debug | print", "s.supp"))
    text = render_text(out)
    assert text.splitlines()[0].endswith("3 streams; 1 suppressed).")
    assert ("streamsan: suppressed: host-device x1 at u/proj/run.py:9 by kind:host-device (debug | print)"
            in text.splitlines())
    md = render_markdown(out)
    assert ("### Suppressed (1)\n\n| Kind | Later access | Count | Rule | Reason |\n|---|---|---:|---|---|\n"
            "| host-device | read `aten::sum` on the host at `u/proj/run.py:9` | 1 | `kind:host-device` | "
            "debug \\| print |\n") in md


# ---------------------------------------------------------------- the command line
@pytest.fixture
def files(tmp_path):
    trace = write_trace(tmp_path / "t.sstrace", [S.pinned_d2h_then_h2d(3)])
    supp = tmp_path / "s.supp"
    supp.write_text("frame:*/cache_utils.py:140  # the prefetch race, fixed upstream\n")
    return trace, supp


def test_replay_and_show_with_suppressions(capsys, files, tmp_path):
    trace, supp = files
    out_path = tmp_path / "r.json"
    code = main(["replay", str(trace), "--suppressions", str(supp), "--report", str(out_path), "--fail-on-race"])
    out, _ = capsys.readouterr()
    assert code == 0  # suppressed findings do not fail
    assert out.splitlines()[0].startswith("streamsan: no races found (")
    assert ("streamsan: suppressed: device-device x3 at u/proj/cache_utils.py:140 by frame:*/cache_utils.py:140 "
            "(the prefetch race, fixed upstream)") in out.splitlines()
    rep = json.loads(out_path.read_text())
    assert rep["suppressed"][0]["suppression"] == {"rule": "frame:*/cache_utils.py:140", "reason":
                                                   "the prefetch race, fixed upstream", "file": str(supp), "line": 1}
    plain = tmp_path / "plain.json"
    assert main(["replay", str(trace), "--report", str(plain)]) == 0
    capsys.readouterr()
    assert main(["show", str(plain), "--fail-on-race"]) == exitcodes.RACES
    capsys.readouterr()
    assert main(["show", str(plain), "--fail-on-race", "--suppressions", str(supp), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["suppressed"] == 1


def test_bad_suppression_file_fails_before_running(capsys, files, tmp_path, monkeypatch):
    trace, supp = files
    supp.write_text("# ok\nkind:device-device\n")
    monkeypatch.chdir(tmp_path)
    for argv in (["replay", str(trace)], ["wrap", "--", sys.executable, "-c", "open('ran', 'w')"]):
        code = main([*argv[:1], "--suppressions", str(supp), *argv[1:]])
        err = capsys.readouterr().err
        assert code == exitcodes.USAGE
        assert err == (f"streamsan: error: {supp}:2: a rule needs a reason: add '# why' after "
                       f"'kind:device-device'\n")
    assert not (tmp_path / "ran").exists()


def test_wrap_with_suppressions(capfd, child, tmp_path):
    supp = tmp_path / "s.supp"
    supp.write_text("kind:device-device  # the child's known race\n")
    code = main(["wrap", "--suppressions", str(supp), "--fail-on-race", "--", *child, "race", "0"])
    err = capfd.readouterr().err
    assert code == 0, err
    assert ("streamsan: suppressed: device-device x2 at u/proj/cache_utils.py:140 by kind:device-device "
            "(the child's known race)") in err.splitlines()
    rep = json.loads((tmp_path / "streamsan-report.json").read_text())
    assert rep["races"] == [] and rep["summary"]["suppressed"] == 1 and len(rep["processes"]) == 1
