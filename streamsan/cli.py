"""The ``streamsan`` command: ``wrap``, ``replay``, ``show``, ``merge``.

Every user error ends with one line ``streamsan: error: ...`` on stderr and an exit code from the table
from :mod:`streamsan.exitcodes`, never a traceback. Options also come from the environment and pyproject.toml
(:mod:`streamsan.config`).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile

from . import exitcodes as X
from . import wrap
from .config import PRECEDENCE, ConfigError, add_arguments, resolve
from .replay import replay_trace
from .report.build import version
from .report.formats import render
from .report.io import ReportError, check_writable, load_report, write_report
from .report.merge import merge_reports
from .status import StatusLine, analysis_progress
from .suppressions import SuppressionError, apply_suppressions, load_suppressions
from .trace import TraceError


class UsageError(Exception):
    """Bad command-line usage; the message is one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message} (see '{self.prog} --help')")


class _LogFormatter(logging.Formatter):
    def format(self, record) -> str:
        return f"streamsan: {record.levelname.lower()}: {record.getMessage().removeprefix('streamsan: ')}"


def _verbose() -> None:
    """Show the ``streamsan`` logger's diagnostics on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LogFormatter())
    log = logging.getLogger("streamsan")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)


def _race_exit(report: dict, args) -> int:
    return X.RACES if args.fail_on_race and report["races"] else X.OK


def _rules(args) -> list:
    """The suppression rules asked for (read before any long work, so that a bad file fails early)."""
    return load_suppressions(args.suppressions) if args.suppressions else []


def _suppress(report: dict, rules: list) -> dict:
    return apply_suppressions(report, rules) if rules else report


def _finish(report: dict, args, out) -> None:
    """Write the report where asked and print it in the chosen format to ``out``."""
    if args.report:
        write_report(report, args.report)
    out.write(render(report, args.format, root=os.getcwd()))
    out.flush()
    if args.report:
        print(f"streamsan: report written to {args.report}", file=sys.stderr)


def _replay_all(paths: list, status: StatusLine) -> dict:
    if len(paths) == 1:
        return replay_trace(paths[0], progress=analysis_progress(status, paths[0], 1, 1))
    reports = []
    for i, p in enumerate(paths, 1):
        found = sum(len(r["races"]) for r in reports)
        reports.append(replay_trace(p, with_process=True, progress=analysis_progress(status, p, i, len(paths), found)))
    return merge_reports(reports)


def cmd_replay(args) -> int:
    if args.report:
        check_writable(args.report)
    rules = _rules(args)
    status = StatusLine(sys.stderr)
    try:
        report = _suppress(_replay_all(args.traces, status), rules)
    finally:
        status.clear()
    _finish(report, args, sys.stdout)
    return _race_exit(report, args)


def cmd_show(args) -> int:
    report = load_report(args.report_file)
    try:
        report = _suppress(report, _rules(args))
        sys.stdout.write(render(report, args.format, root=os.getcwd()))
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ReportError(f"{args.report_file}: malformed report ({type(e).__name__}: {e})") from None
    return _race_exit(report, args)


def cmd_merge(args) -> int:
    check_writable(args.output)
    reports = [load_report(p) for p in args.reports]
    try:
        merged = merge_reports(reports)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ReportError(f"malformed report among the inputs ({type(e).__name__}: {e})") from None
    write_report(merged, args.output)
    print(f"streamsan: merged {len(reports)} reports ({merged['summary']['races']} races) into {args.output}",
          file=sys.stderr)
    return _race_exit(merged, args)


def cmd_wrap(args) -> int:
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        raise UsageError("wrap needs a command, e.g. 'streamsan wrap -- python train.py'")
    check_writable(args.report)
    if args.trace:
        check_writable(args.trace, directory_ok=True)
    rules = _rules(args)
    session_dir = tempfile.mkdtemp(prefix="streamsan-")
    logging.getLogger("streamsan").debug("session directory %s, command %s", session_dir, cmd)
    try:
        rc = wrap.run_command(cmd, wrap.child_env(session_dir, args.scope))
        wrap.wait_for_writers(session_dir)
        status = StatusLine(sys.stderr)
        try:
            report = _suppress(wrap.collect_report(session_dir, cmd, status), rules)
        finally:
            status.clear()
        report["exit_status"] = wrap.exit_status(rc)
        _finish(report, args, sys.stderr)
        if args.trace:
            try:
                kept = wrap.keep_traces(session_dir, args.trace)
            except OSError as e:
                raise ReportError(f"cannot keep the traces in {args.trace}: {e.strerror or e}") from None
            print(f"streamsan: trace{'s' if len(kept) > 1 else ''} kept in {', '.join(kept)}" if kept else
                  "streamsan: no trace to keep", file=sys.stderr)
    finally:
        shutil.rmtree(session_dir, ignore_errors=True)
    if args.fail_on_race and report["races"]:
        return X.RACES
    return X.SIGNAL - rc if rc < 0 else rc


def _parser() -> _Parser:
    p = _Parser(prog="streamsan", description="Run-time CUDA stream race detector for PyTorch and CuPy.",
                epilog=X.HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"streamsan {version()}")
    p.add_argument("-v", "--verbose", action="store_true", help="show diagnostics (the 'streamsan' logger)")
    sub = p.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")

    def add(name, help_text, options, run):
        sp = sub.add_parser(name, help=help_text, description=help_text, epilog=f"{PRECEDENCE}.\n\n{X.HELP}",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(sp, options)
        sp.set_defaults(run=run, options=options)
        return sp

    w = add("wrap", "run a command with every Python process in it traced, then report",
            ("report", "trace", "scope", "format", "fail_on_race", "suppressions"), cmd_wrap)
    w.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")

    r = add("replay", "analyze trace files and report", ("format", "fail_on_race", "suppressions"), cmd_replay)
    r.add_argument("traces", nargs="+", metavar="TRACE")
    r.add_argument("--report", metavar="PATH", help="also write the JSON report here")

    s = add("show", "print a JSON report in any format", ("format", "fail_on_race", "suppressions"), cmd_show)
    s.add_argument("report_file", metavar="REPORT")

    m = add("merge", "merge JSON reports, deduplicating races by fingerprint", ("fail_on_race",), cmd_merge)
    m.add_argument("reports", nargs="+", metavar="REPORT")
    m.add_argument("-o", "--output", required=True, metavar="OUT")
    return p


def main(argv=None) -> int:
    """Run the command line; returns the exit code."""
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
        if args.verbose:
            _verbose()
        given = {k: getattr(args, k) for k in args.options}
        vars(args).update(resolve(given, args.options))
        return args.run(args)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else X.OK
    except (UsageError, TraceError, ReportError, ConfigError, SuppressionError) as e:
        print(f"streamsan: error: {e}", file=sys.stderr)
        return X.USAGE
    except wrap.CommandError as e:
        print(f"streamsan: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("streamsan: interrupted", file=sys.stderr)
        return X.INTERRUPTED
    except BrokenPipeError:  # `streamsan show r.json | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return X.OK
