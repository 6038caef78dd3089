"""The ``streamsan`` command: ``wrap``, ``replay``, ``show``, ``merge``.

Every user error ends with one line ``streamsan: error: ...`` on stderr and an exit code from the table
from :mod:`streamsan.exitcodes`, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from . import exitcodes as X
from . import wrap
from .replay import replay_trace
from .report.build import version
from .report.io import ReportError, check_writable, load_report, write_report
from .report.merge import merge_reports
from .report.render_markdown import render_markdown
from .report.render_text import render_text
from .trace import TraceError

FORMATS = ("text", "markdown", "json")


class UsageError(Exception):
    """Bad command-line usage; the message is one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def render(report: dict, fmt: str) -> str:
    """The report in one of :data:`FORMATS`."""
    if fmt == "json":
        return json.dumps(report, indent=2) + "\n"
    if fmt == "markdown":
        return render_markdown(report)
    return render_text(report)


def _race_exit(report: dict, args) -> int:
    return X.RACES if args.fail_on_race and report["races"] else X.OK


def _finish(report: dict, args, out) -> None:
    """Write the report where asked and print it in the chosen format to ``out``."""
    if args.report:
        write_report(report, args.report)
    out.write(render(report, args.format))
    out.flush()
    if args.report:
        print(f"streamsan: report written to {args.report}", file=sys.stderr)


def cmd_replay(args) -> int:
    if args.report:
        check_writable(args.report)
    if len(args.traces) == 1:
        report = replay_trace(args.traces[0])
    else:
        report = merge_reports([replay_trace(t, with_process=True) for t in args.traces])
    _finish(report, args, sys.stdout)
    return _race_exit(report, args)


def cmd_show(args) -> int:
    report = load_report(args.report_file)
    try:
        sys.stdout.write(render(report, args.format))
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
    session_dir = tempfile.mkdtemp(prefix="streamsan-")
    try:
        rc = wrap.run_command(cmd, wrap.child_env(session_dir, args.scope))
        report = wrap.collect_report(session_dir, cmd)
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
    sub = p.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")

    def add(name, help_text):
        return sub.add_parser(name, help=help_text, description=help_text, epilog=X.HELP,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    def fmt(sp, default="text"):
        sp.add_argument("--format", choices=FORMATS, default=default, help=f"output format (default {default})")

    def fail(sp):
        sp.add_argument("--fail-on-race", action="store_true",
                        help=f"exit with {X.RACES} when any race was found")

    w = add("wrap", "run a command with every Python process in it traced, then report")
    w.add_argument("--report", default="streamsan-report.json", metavar="PATH",
                   help="where to write the JSON report (default ./streamsan-report.json)")
    w.add_argument("--trace", metavar="PATH", help="keep the trace file (a directory if several processes)")
    w.add_argument("--scope", choices=("full", "hooks"), default="full",
                   help="trace every CUDA op (full) or only inside library hooks (hooks)")
    fmt(w)
    fail(w)
    w.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")
    w.set_defaults(run=cmd_wrap)

    r = add("replay", "analyze trace files and report")
    r.add_argument("traces", nargs="+", metavar="TRACE")
    r.add_argument("--report", metavar="PATH", help="also write the JSON report here")
    fmt(r)
    fail(r)
    r.set_defaults(run=cmd_replay)

    s = add("show", "print a JSON report")
    s.add_argument("report_file", metavar="REPORT")
    fmt(s)
    fail(s)
    s.set_defaults(run=cmd_show)

    m = add("merge", "merge JSON reports, deduplicating races by fingerprint")
    m.add_argument("reports", nargs="+", metavar="REPORT")
    m.add_argument("-o", "--output", required=True, metavar="OUT")
    fail(m)
    m.set_defaults(run=cmd_merge)
    return p


def main(argv=None) -> int:
    """Run the command line; returns the exit code."""
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
        return args.run(args)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else X.OK
    except (UsageError, TraceError, ReportError) as e:
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
