"""`streamsan confirm` without a GPU: the plan (which stream and call site each finding kind delays), the CLI's
argument errors, and the whole orchestration (number of runs, the report with each finding's confirmation, its
schema and renderings) with a fake runner that answers like the bundled transformers example would."""

import copy
import sys
import json
from pathlib import Path

import jsonschema
import pytest

from streamsan.cli import main
from streamsan.confirm import runtime
from streamsan.confirm.orchestrate import Confirmer
from streamsan.confirm.plan import PlanError, Site, plan, probe_for
from streamsan.report.render_html import render_html
from streamsan.report.render_markdown import render_markdown
from streamsan.report.render_text import render_text

ROOT = Path(__file__).parents[2]
BUNDLED = ROOT / "reports" / "transformers-48947.json"
SCHEMA = json.loads((ROOT / "streamsan" / "report" / "schema.json").read_text())
OFFLOAD_K, PREFETCH_K, CAT_K = ("transformers/cache_utils.py:79", "transformers/cache_utils.py:85",
                                "transformers/cache_utils.py:146")


def bundled():
    return json.loads(BUNDLED.read_text())


def race(report, kind, prev_location):
    return next(r for r in report["races"] if r["kind"] == kind and r["previous_access"]["location"] == prev_location)


def test_a_race_delays_the_earlier_access_on_its_stream_and_observes_both():
    p = probe_for(race(bundled(), "device-device", OFFLOAD_K))
    assert (p.delay, p.stream, p.unreachable) == (Site(OFFLOAD_K, "aten::_to_copy"), "the default stream", None)
    assert p.observed == (Site(OFFLOAD_K, "aten::_to_copy"), Site(PREFETCH_K, "aten::_to_copy"))


def test_a_missing_record_stream_delays_the_foreign_use_and_observes_every_op_at_the_allocation():
    p = probe_for(race(bundled(), "missing-record-stream", CAT_K))
    assert (p.delay, p.stream) == (Site(CAT_K, "aten::cat"), "the default stream")
    assert p.observed == (Site(CAT_K, "aten::cat"), Site(PREFETCH_K, None))


def test_an_alloc_reuse_delays_the_earlier_lifes_access_on_its_stream():
    r = copy.deepcopy(race(bundled(), "device-device", OFFLOAD_K))
    r["kind"] = "alloc-reuse"
    r["previous_access"]["agent"] = {"kind": "stream", "stream": "0x5", "device": 0, "role": "side"}
    p = probe_for(r)
    assert (p.delay, p.stream) == (Site(OFFLOAD_K, "aten::_to_copy"), "stream side")


@pytest.mark.parametrize("agent, op, why", [
    ({"kind": "host", "stream": None, "device": None, "role": "host"}, "Tensor.tolist",
     "the earlier access is the host's: no GPU delay can hold it back"),
    ({"kind": "stream", "stream": "0x9", "device": 0, "role": None}, "CUDAGraph.replay",
     "the earlier access is CUDAGraph.replay, which confirm cannot delay (only aten ops and CuPy calls)"),
])
def test_an_earlier_access_no_delay_reaches_is_planned_without_a_delay(agent, op, why):
    r = copy.deepcopy(race(bundled(), "device-device", OFFLOAD_K))
    r["previous_access"].update(agent=agent, op=op)
    p = probe_for(r)
    assert (p.delay, p.unreachable) == (None, why)


def test_the_plan_keeps_the_findings_asked_for_and_names_an_unknown_one():
    report = bundled()
    fp = race(report, "missing-record-stream", CAT_K)["fingerprint"]
    assert [p.fingerprint for p in plan(report, [fp])] == [fp]
    assert len(plan(report)) == 4
    with pytest.raises(PlanError, match="no finding with fingerprint nope in the report"):
        plan(report, ["nope"])


@pytest.mark.parametrize("argv, message", [
    (["confirm"], "confirm needs a command"),
    (["confirm", "--delay-ms", "0", "--", "true"], "--delay-ms must be a positive number of milliseconds, not 0"),
    (["confirm", "--occurrences", "0", "--", "true"], "--occurrences must be at least 1, not 0"),
    (["confirm", "--delay-ms", "soon", "--", "true"], "argument --delay-ms: invalid float value: 'soon'"),
    (["confirm", "--report", str(BUNDLED), "--finding", "nope", "--", "true"], "no finding with fingerprint nope"),
    (["confirm", "--report", "missing.json", "--", "true"], "missing.json"),
    (["wrap", "--confirm", "--occurrences", "-2", "--", "true"], "--occurrences must be at least 1, not -2"),
])
def test_argument_errors_are_one_line_and_exit_2(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("streamsan: error: ") and message in err
    assert not (tmp_path / "streamsan-confirm.json").exists()


class FakeProgram:
    """Answers each run as the offloaded-cache example would: two sites per hazard, three occurrences each.
    Delaying the offload changes the prefetched keys (``changes``); every other delay changes nothing."""

    def __init__(self, changes=True, noisy_baselines=False):
        self.specs = []
        self.changes = changes
        self.noisy = noisy_baselines

    def __call__(self, cmd, env):
        spec = json.loads(Path(env[runtime.ENV]).read_text())
        assert "STREAMSAN_SESSION_DIR" not in env and env["PYTHONPATH"].split(":")[0].endswith("_bootstrap")
        self.specs.append(spec)
        sites = [f"{s['op'] or '*'} @ {s['location']}" for s in spec["sites"]]
        delayed = spec["sites"][spec["delay_site"]] if spec["delay_site"] is not None else None
        values = []
        for occ in (1, 2, 3):
            for i, s in enumerate(spec["sites"]):
                v = float(i * 10 + occ)
                if self.changes and delayed == {"location": OFFLOAD_K, "op": "aten::_to_copy"} and \
                        s == {"location": PREFETCH_K, "op": "aten::_to_copy"} and occ > 1:
                    v += 0.25
                if self.noisy and delayed is None and len(self.specs) == 2 and s["location"] == CAT_K:
                    v += 1.0
                values.append([i, occ, [v, abs(v), 0.0]])
        obs = {"pid": 42, "argv": cmd, "sites": sites, "sequence": [i for _ in (1, 2, 3) for i in range(len(sites))],
               "truncated": False, "values": values, "delayed": 3 if delayed else 0, "error": None}
        Path(spec["out_dir"], "observed-42.json").write_text(json.dumps(obs))
        return 0, "qwen3: argmax match: True\n"


def confirmed(program, **kw):
    return Confirmer(["python", "example.py"], runner=program, **kw).confirm(bundled())


def test_two_baselines_then_one_run_per_finding_each_observing_every_site():
    program = FakeProgram()
    report = confirmed(program)
    assert len(program.specs) == 6
    assert [s["delay_site"] is None for s in program.specs] == [True, True, False, False, False, False]
    assert len({json.dumps(s["sites"]) for s in program.specs}) == 1
    outcomes = {(r["kind"], r["previous_access"]["location"]): r["confirmation"]["outcome"] for r in report["races"]}
    assert outcomes == {("device-device", OFFLOAD_K): "confirmed",
                        ("device-device", "transformers/cache_utils.py:80"): "not-confirmed",
                        ("missing-record-stream", CAT_K): "not-confirmed",
                        ("missing-record-stream", "transformers/cache_utils.py:147"): "not-confirmed"}
    c = race(report, "device-device", OFFLOAD_K)["confirmation"]
    assert c["delay"] == {"ms": 20.0, "stream": "the default stream", "op": "aten::_to_copy", "location": OFFLOAD_K,
                          "occurrences": 3, "limit": None}
    assert c["evidence"] == [{"what": "op", "op": "aten::_to_copy", "location": PREFETCH_K, "name": None,
                              "process": None, "changed": 2, "occurrences": 3, "first_changed": 2,
                              "largest_difference": 0.25}]
    assert c["runs"] == {"baselines": 2, "perturbed": 1}
    jsonschema.validate(report, SCHEMA)


def test_baselines_that_disagree_get_a_third_and_the_varying_site_is_inconclusive():
    program = FakeProgram(changes=False, noisy_baselines=True)
    report = confirmed(program, occurrences=1)
    assert len(program.specs) == 7 and [s["delay_site"] for s in program.specs[:3]] == [None] * 3
    assert program.specs[3]["occurrences"] == 1
    c = race(report, "missing-record-stream", CAT_K)["confirmation"]
    assert c["outcome"] == "inconclusive" and c["reason"].startswith("the values at aten::cat @ " + CAT_K)
    assert race(report, "device-device", OFFLOAD_K)["confirmation"]["outcome"] == "not-confirmed"


def test_the_confirmation_is_rendered_in_text_markdown_and_html():
    report = confirmed(FakeProgram())
    sentence = ("Confirmed: with 20 ms of GPU delay on the default stream before `aten::_to_copy` at "
                "`cache_utils.py:79` (every one of its occurrences: 3 delayed), the output of `aten::_to_copy` at "
                "`cache_utils.py:85` changed in 2 of 3 occurrences (first: occurrence 2), its sum by up to 0.25.")
    text = render_text(report)
    assert sentence in text and "streamsan: confirm: 1 confirmed, 3 not confirmed, 0 inconclusive" in text
    assert "Not confirmed: with 20 ms" in text and "Not a proof that the race cannot change them" in text
    assert "**Confirmation:** Confirmed: with 20 ms of GPU delay on the default stream before `aten::_to_copy`" in \
        render_markdown(report)
    assert "<dt>Confirmation</dt><dd>Confirmed: with 20 ms of GPU delay on the default stream before " \
           "<code>aten::_to_copy</code>" in render_html(report)


def test_a_report_without_confirmations_still_loads_validates_and_renders_as_before():
    report = bundled()
    jsonschema.validate(report, SCHEMA)
    assert "Confirm" not in render_text(report) and "confirm:" not in render_text(report)


def test_confirm_cli_writes_the_report_from_a_given_report(tmp_path, monkeypatch, capsys):
    program = FakeProgram()
    monkeypatch.setattr("streamsan.confirm.orchestrate.run_quietly", program)
    out = tmp_path / "confirmed.json"
    fp = race(bundled(), "device-device", OFFLOAD_K)["fingerprint"]
    assert main(["confirm", "--report", str(BUNDLED), "--finding", fp, "-o", str(out), "--", "python", "x.py"]) == 0
    report = json.loads(out.read_text())
    assert [bool(r.get("confirmation")) for r in report["races"]].count(True) == 1
    assert race(report, "device-device", OFFLOAD_K)["confirmation"]["outcome"] == "confirmed"
    err = capsys.readouterr().err
    assert "streamsan: confirm: run 3: 20 ms before aten::_to_copy @ " + OFFLOAD_K in err
    assert len(program.specs) == 3


def test_a_run_without_observations_is_inconclusive():
    def silent(cmd, env):
        return 0, ""
    report = confirmed(silent)
    reasons = {r["confirmation"]["reason"] for r in report["races"]}
    assert reasons == {"an unperturbed run failed (no process wrote observations (is the command a Python program "
                       "that imports torch or cupy?))"}


def test_real_runs_start_the_runtime_through_the_bootstrap_and_write_observations(tmp_path):
    """The default runner on a real Python program that imports torch (no GPU here: no op reaches a site)."""
    program = tmp_path / "prog.py"
    program.write_text("import torch\nprint(torch.ones(2).sum().item())\n")
    fp = race(bundled(), "device-device", OFFLOAD_K)["fingerprint"]
    lines = []
    report = Confirmer([sys.executable, str(program)], say=lines.append).confirm(bundled(), [fp])
    c = race(report, "device-device", OFFLOAD_K)["confirmation"]
    assert (c["outcome"], c["reason"]) == ("inconclusive", "the delayed call site was not reached in the perturbed run")
    assert c["delay"]["occurrences"] == 0 and c["runs"] == {"baselines": 2, "perturbed": 1}
    assert lines == ["run 1: unperturbed", "run 2: unperturbed, again",
                     f"run 3: 20 ms before aten::_to_copy @ {OFFLOAD_K} on the default stream ({fp})"]
