"""Reports and trace files built from hand-made events (``report_scenarios``), and a validator of the report
schema, for the tests of the report, its renderers and the command line."""

from __future__ import annotations

import json
import os

import pytest

from streamsan.report.build import build_report
from streamsan.trace import TraceWriter
from tests.support import report_scenarios as S
from tests.support.paths import ROOT

ENV = {"streamsan": "0.1.0", "python": "3.11", "torch": "2.11.0", "gpus": ["NVIDIA H200"]}


def report_of(events, **kw):
    """The report of an event sequence, as if ``python run.py`` had run on an H200."""
    return build_report(S.analyze(events), command=["python", "run.py"], environment=ENV, **kw)


def validator():
    """A validator of ``streamsan/report/schema.json`` (skips the test without jsonschema)."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "streamsan" / "report" / "schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def write_trace(path, batches, close=True, header=None, ends=None):
    """Write a trace (without its end frame unless ``close``); ``ends`` gets the offset where each batch's
    frame ends."""
    w = TraceWriter(str(path), {"command": ["python", "run.py"], **(header or {})})
    for b in batches:
        w.write(b)
        if ends is not None:
            ends.append(os.fstat(w.fd).st_size)
    if close:
        w.close()
    else:
        os.close(w.fd)
    return path
