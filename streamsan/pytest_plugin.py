"""``pytest --streamsan``: one in-process streamsan Session traces the whole test session; a test during which
a new finding (a new fingerprint) appears fails with the finding's one-paragraph summary; at the end the
session writes one combined JSON report (each finding with the tests it occurred in) and prints its path.

Registered through the ``pytest11`` entry point. Without ``--streamsan`` it only adds its options. Options
also come from ``STREAMSAN_*`` variables and ``[tool.streamsan]`` (see :mod:`streamsan.config`). Under
``streamsan wrap`` (or another active session) its session joins that one (see :mod:`streamsan.session`).
"""

from __future__ import annotations

import pytest

_OPTIONS = ("report", "trace", "scope", "suppressions")


def pytest_addoption(parser) -> None:
    g = parser.getgroup("streamsan", "CUDA stream race detection (streamsan)")
    g.addoption("--streamsan", action="store_true", default=False,
                help="trace every test; a test during which a new CUDA stream race appears fails")
    g.addoption("--streamsan-report", metavar="PATH", default=None,
                help="where to write the combined JSON report (default: streamsan-report.json; env "
                     "STREAMSAN_REPORT)")
    g.addoption("--streamsan-trace", metavar="PATH", default=None,
                help="also record the session's trace file here (default: none; env STREAMSAN_TRACE)")
    g.addoption("--streamsan-scope", choices=("full", "hooks"), default=None,
                help="trace every CUDA op (full) or only inside library hooks (hooks) (default: full; env "
                     "STREAMSAN_SCOPE)")
    g.addoption("--streamsan-suppressions", metavar="FILE", default=None,
                help="a file of suppression rules; suppressed findings fail no test (default: none; env "
                     "STREAMSAN_SUPPRESSIONS)")


def pytest_configure(config) -> None:
    if config.getoption("streamsan"):
        config.pluginmanager.register(StreamsanPlugin(config), "streamsan-session")


class StreamsanPlugin:
    """The plugin object registered under ``--streamsan``."""

    def __init__(self, config):
        from .config import ConfigError, resolve
        from .report.io import ReportError, prepare_output
        from .session import Session
        from .suppressions import SuppressionError, load_suppressions

        given = {k: config.getoption(f"streamsan_{k}") for k in _OPTIONS}
        try:
            self.settings = resolve(given, _OPTIONS)
            self.rules = load_suppressions(self.settings["suppressions"]) if self.settings["suppressions"] else []
            prepare_output(self.settings["report"])
        except (ConfigError, SuppressionError, ReportError) as e:
            raise pytest.UsageError(f"streamsan: {e}") from None
        self.command = ["pytest", *config.invocation_params.args]
        self.tests: dict[str, list] = {}
        self.report = None
        self.session = Session(scope=self.settings["scope"], trace_path=self.settings["trace"],
                               header={"command": self.command}).start()

    def _counts(self) -> dict:
        return {f.fingerprint: f.count for f in self.session.findings}

    def _new_races(self, item, before: dict) -> list:
        """Race items of the findings that appeared during the test and no rule suppresses; every finding
        that occurred during it is attributed to the test."""
        from .report.build import race_item
        from .suppressions import first_match

        new = []
        for f in self.session.findings:
            if f.count == before.get(f.fingerprint, 0):
                continue
            self.tests.setdefault(f.fingerprint, []).append(item.nodeid)
            if f.fingerprint not in before:
                race = race_item(self.session.analyzer, f)
                if first_match(self.rules, race) is None:
                    new.append(race)
        return new

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        from .report.render_text import finding_text

        before = self._counts()
        try:
            result = yield
        except BaseException:
            races = self._new_races(item, before)
            if races:
                item.add_report_section("call", "streamsan", "\n\n".join(
                    finding_text(i, r) for i, r in enumerate(races, 1)))
            raise
        races = self._new_races(item, before)
        if races:
            plural = "race" if len(races) == 1 else "races"
            pytest.fail(f"streamsan: {len(races)} new CUDA stream {plural} during this test:\n\n" + "\n\n".join(
                finding_text(i, r) for i, r in enumerate(races, 1)), pytrace=False)
        return result

    def pytest_sessionfinish(self, session) -> None:
        from .report.build import build_report
        from .report.environment import collect_environment
        from .report.io import write_report
        from .suppressions import apply_suppressions

        s = self.session
        s.stop()
        report = build_report(s.analyzer, command=self.command,
                              environment=collect_environment(import_missing=False),
                              complete=s.complete, problems=s.problems)
        for race in report["races"]:
            race["tests"] = self.tests.get(race["fingerprint"], [])
        if self.settings["trace"] and report["races"] and s.writer is not None:
            from .report.syncs import attach_timelines, collect_timelines
            from .trace import TraceReader

            attach_timelines(report, collect_timelines(TraceReader(self.settings["trace"]).batches(), s.analyzer))
        self.report = apply_suppressions(report, self.rules) if self.rules else report
        write_report(self.report, self.settings["report"])

    def pytest_terminal_summary(self, terminalreporter) -> None:
        from .report.render_text import suppressed_text, totals_text

        if self.report is None:
            return
        terminalreporter.write_sep("-", "streamsan")
        terminalreporter.write_line(totals_text(self.report))
        for r in self.report.get("suppressed", []):
            terminalreporter.write_line(suppressed_text(r))
        terminalreporter.write_line(f"streamsan: report written to {self.settings['report']}")
