"""The ``streamsan`` command: ``wrap``, ``confirm``, ``replay``, ``show``, ``merge``.

Every user error ends with one line ``streamsan: error: ...`` on stderr and an exit code from the table
from :mod:`streamsan.exitcodes`, never a traceback. Options also come from the environment and pyproject.toml
(:mod:`streamsan.config`). A report is printed before it is written: a file that cannot be written costs
``wrap`` one warning line (the command's exit code is kept), and ``replay`` / ``merge`` an error line, never
the findings.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile

from . import exitcodes as X
from . import wrap
from .config import PRECEDENCE, ConfigError, add_arguments, environment_warnings, resolve
from .replay import replay_trace
from .report.build import version
from .report.formats import render
from .report.io import ReportError, load_report, prepare_output, write_report, write_text
from .report.merge import merge_reports
from .confirm.orchestrate import DEFAULT_DELAY_MS, Confirmer
from .confirm.plan import PlanError, plan
from .report.render_text import count_text, render_text
from .report.verdict import fail_on_race_exit
from .status import StatusLine, analysis_progress
from .suppressions import SuppressionError, apply_suppressions, load_suppressions
from .trace import TraceError

# Where wrap writes a machine format by default: the report's path with this ending instead of ".json".
MACHINE_ENDINGS = {"json": ".json", "html": ".html", "sarif": ".sarif", "perfetto": ".perfetto.json"}
REPORT_OPTIONS = ("format", "fail_on_race", "allow_incomplete", "suppressions")


class UsageError(Exception):
    """Bad command-line usage; the message is one line."""


class OutputError(Exception):
    """Standard output cannot be written (closed, full); the message is one line."""


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


def _stdout():
    if sys.stdout is None:
        raise OutputError("standard output is closed")
    return sys.stdout


def _emit(text: str, stream) -> None:
    """Write text to a standard stream; OutputError when that fails (BrokenPipeError passes: see main)."""
    try:
        stream.write(text)
        stream.flush()
    except BrokenPipeError:
        raise
    except (OSError, ValueError) as e:  # (ValueError: a closed stream)
        raise OutputError(getattr(e, "strerror", None) or str(e)) from None


def _exit_for(report: dict, args) -> int:
    """The exit code that the report earns under --fail-on-race (OK without it), saying why when it fails
    without races."""
    if not args.fail_on_race:
        return X.OK
    code, why = fail_on_race_exit(report, args.allow_incomplete)
    if why:
        print(why, file=sys.stderr)
    return code


def _rules(args) -> list:
    """The suppression rules asked for (read before any long work, so that a bad file fails early)."""
    return load_suppressions(args.suppressions) if args.suppressions else []


def _suppress(report: dict, rules: list) -> dict:
    return apply_suppressions(report, rules) if rules else report


def _replay_all(paths: list, status: StatusLine) -> dict:
    if len(paths) == 1:
        return replay_trace(paths[0], progress=analysis_progress(status, paths[0], 1, 1))
    reports = []
    for i, p in enumerate(paths, 1):
        found = sum(len(r["races"]) for r in reports)
        reports.append(replay_trace(p, with_process=True, progress=analysis_progress(status, p, i, len(paths), found)))
    return merge_reports(reports)


def cmd_replay(args) -> int:
    if args.report is not None:
        prepare_output(args.report)
    rules = _rules(args)
    status = StatusLine(sys.stderr)
    try:
        report = _suppress(_replay_all(args.traces, status), rules)
    finally:
        status.clear()
    _emit(render(report, args.format, root=os.getcwd()), _stdout())
    if args.report is not None:
        write_report(report, args.report)
        print(f"streamsan: report written to {args.report}", file=sys.stderr)
    return _exit_for(report, args)


def cmd_show(args) -> int:
    report = load_report(args.report_file)
    rules = _rules(args)
    try:
        report = _suppress(report, rules)
        text = render(report, args.format, root=os.getcwd())
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ReportError(f"{args.report_file}: malformed report ({type(e).__name__}: {e})") from None
    _emit(text, _stdout())
    return _exit_for(report, args)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _distinct(paths: list, reports: list) -> list:
    """The reports, each once: a report given again would count its findings twice. Again means the same file,
    or the same content naming the same traced processes (a copy); two processes' reports may be equal
    otherwise."""
    kept: list[tuple[str, str, dict]] = []
    for path, report in zip(paths, reports):
        key = json.dumps(report, sort_keys=True)
        with_pids = any(p.get("pid") is not None for p in report.get("processes", []))
        same = next((p for p, k, _ in kept if _same_file(p, path) or (with_pids and k == key)), None)
        if same is not None:
            print(f"streamsan: warning: {path} is the same report as {same}: merged once", file=sys.stderr)
            continue
        kept.append((path, key, report))
    return [r for _, _, r in kept]


def cmd_merge(args) -> int:
    prepare_output(args.output)
    reports = _distinct(args.reports, [load_report(p) for p in args.reports])
    try:
        merged = merge_reports(reports)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ReportError(f"malformed report among the inputs ({type(e).__name__}: {e})") from None
    write_report(merged, args.output)
    print(f"streamsan: merged {count_text(len(reports), 'report')} ({count_text(merged['summary']['races'], 'race')})"
          f" into {args.output}", file=sys.stderr)
    return _exit_for(merged, args)


def _rendering_path(args) -> str | None:
    """Where wrap writes the report in the chosen format: ``--output`` (``-``: standard output); else, for a
    machine format, the report's path with the format's ending; None: on stderr, as the summary."""
    if args.output:
        return args.output
    ending = MACHINE_ENDINGS.get(args.format)
    if ending is None:
        return None
    stem, ext = os.path.splitext(args.report)
    return (stem if ext == ".json" else args.report) + ending


def _wrap_outputs(report: dict, args, rendering: str | None) -> None:
    """Print wrap's summary on stderr, then write the report and its rendering; a write that fails is one
    warning line."""
    summary = render(report, args.format) if rendering is None else render_text(report)
    try:
        _emit(summary, sys.stderr)
    except OutputError:
        pass  # (stderr itself is gone: there is nowhere to say anything)
    try:
        write_report(report, args.report)
        print(f"streamsan: report written to {args.report}", file=sys.stderr)
    except ReportError as e:
        print(f"streamsan: warning: {e}", file=sys.stderr)
    if rendering is None or (rendering == args.report and args.format == "json"):
        return
    text = render(report, args.format, root=os.getcwd())
    try:
        if rendering == "-":
            _emit(text, _stdout())
        else:
            write_text(text, rendering)
            print(f"streamsan: {args.format} report written to {rendering}", file=sys.stderr)
    except (ReportError, OutputError) as e:
        where = "" if rendering != "-" else "cannot write the standard output: "
        print(f"streamsan: warning: {where}{e}", file=sys.stderr)


def _confirm_options(args) -> None:
    """Check confirm's options before any run: a bad value is one error line."""
    if not args.delay_ms > 0:
        raise UsageError(f"--delay-ms must be a positive number of milliseconds, not {args.delay_ms:g}")
    if args.occurrences is not None and args.occurrences < 1:
        raise UsageError(f"--occurrences must be at least 1, not {args.occurrences}")


def _confirmed(report: dict, cmd: list, args) -> dict:
    """The report with each finding's confirmation (streamsan.confirm), progress on stderr."""
    if not report["races"]:
        print("streamsan: confirm: no finding to confirm", file=sys.stderr)
        return report
    confirmer = Confirmer(cmd, delay_ms=args.delay_ms, occurrences=args.occurrences,
                          say=lambda line: print(f"streamsan: confirm: {line}", file=sys.stderr))
    return confirmer.confirm(report, args.finding or ())


def cmd_confirm(args) -> int:
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        raise UsageError("confirm needs a command, e.g. 'streamsan confirm -- python train.py'")
    _confirm_options(args)
    prepare_output(args.output)
    if args.report is not None:
        report = load_report(args.report)
        plan(report, args.finding or ())  # (an unknown --finding fails before any run)
    else:
        report = _traced(cmd, args.scope)
    report = _confirmed(report, cmd, args)
    _emit(render_text(report), sys.stderr)
    write_report(report, args.output)
    print(f"streamsan: report written to {args.output}", file=sys.stderr)
    return X.OK


def _traced(cmd: list, scope: str) -> dict:
    """The report of one traced run of cmd, as wrap makes it (for confirm, when no report is given)."""
    session_dir = tempfile.mkdtemp(prefix="streamsan-")
    try:
        rc = wrap.run_command(cmd, wrap.child_env(session_dir, scope))
        still_running = wrap.wait_for_writers(session_dir)
        status = StatusLine(sys.stderr)
        try:
            report = wrap.collect_report(session_dir, cmd, status, still_running)
        finally:
            status.clear()
        report["exit_status"] = wrap.exit_status(rc)
        return report
    finally:
        shutil.rmtree(session_dir, ignore_errors=True)


def cmd_wrap(args) -> int:
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        raise UsageError("wrap needs a command, e.g. 'streamsan wrap -- python train.py'")
    if args.confirm:
        _confirm_options(args)
    prepare_output(args.report)
    rendering = _rendering_path(args)
    if rendering not in (None, "-"):
        prepare_output(rendering)
    if args.trace:
        prepare_output(args.trace, directory_ok=True)
    rules = _rules(args)
    session_dir = tempfile.mkdtemp(prefix="streamsan-")
    logging.getLogger("streamsan").debug("session directory %s, command %s", session_dir, cmd)
    try:
        rc = wrap.run_command(cmd, wrap.child_env(session_dir, args.scope))
        still_running = wrap.wait_for_writers(session_dir)
        status = StatusLine(sys.stderr)
        try:
            report = _suppress(wrap.collect_report(session_dir, cmd, status, still_running), rules)
        finally:
            status.clear()
        report["exit_status"] = wrap.exit_status(rc)
        if args.confirm:
            report = _confirmed(report, cmd, args)
        _wrap_outputs(report, args, rendering)
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
    if rc != 0:
        return X.SIGNAL - rc if rc < 0 else rc
    return _exit_for(report, args)


def _add_confirm_arguments(p) -> None:
    p.add_argument("--finding", action="append", metavar="FINGERPRINT",
                   help="confirm only this finding (repeatable; default: every finding, one run each)")
    p.add_argument("--delay-ms", type=float, default=DEFAULT_DELAY_MS, metavar="MS",
                   help="milliseconds of GPU delay before each delayed op (default: %(default)g)")
    p.add_argument("--occurrences", type=int, default=None, metavar="N",
                   help="delay only the first N occurrences of the call site (default: all)")


def _parser() -> _Parser:
    p = _Parser(prog="streamsan", description="Run-time CUDA stream race detector for PyTorch and CuPy.",
                epilog=X.HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"streamsan {version()}")
    p.add_argument("-v", "--verbose", action="store_true", help="show diagnostics (the 'streamsan' logger)")
    sub = p.add_subparsers(dest="subcommand", metavar="COMMAND")

    def add(name, help_text, options, run):
        sp = sub.add_parser(name, help=help_text, description=help_text, epilog=f"{PRECEDENCE}.\n\n{X.HELP}",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        # (SUPPRESS: a -v given before the command is not reset by this one's default)
        sp.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show diagnostics (the 'streamsan' logger)")
        add_arguments(sp, options)
        sp.set_defaults(run=run, options=options)
        return sp

    w = add("wrap", "run a command with every Python process in it traced, then report",
            ("report", "trace", "scope", "output", *REPORT_OPTIONS), cmd_wrap)
    w.add_argument("--confirm", action="store_true",
                   help="then confirm each finding: re-run the command with a GPU delay that flips it (see confirm)")
    _add_confirm_arguments(w)
    w.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")

    c = add("confirm", "show that findings change the program's values: re-run it with a GPU delay that flips "
            "each finding's unordered accesses, and compare checksums with unperturbed runs", ("scope",), cmd_confirm)
    c.add_argument("--report", metavar="REPORT", help="confirm this report's findings (default: trace the command "
                   "once first, as wrap does)")
    c.add_argument("-o", "--output", default="streamsan-confirm.json", metavar="OUT",
                   help="where to write the report with each finding's confirmation (default: %(default)s)")
    _add_confirm_arguments(c)
    c.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")

    r = add("replay", "analyze trace files and report", REPORT_OPTIONS, cmd_replay)
    r.add_argument("traces", nargs="+", metavar="TRACE")
    r.add_argument("--report", metavar="PATH", help="also write the JSON report here")

    s = add("show", "print a JSON report in any format", REPORT_OPTIONS, cmd_show)
    s.add_argument("report_file", metavar="REPORT")

    m = add("merge", "merge JSON reports, deduplicating races by fingerprint", ("fail_on_race", "allow_incomplete"),
            cmd_merge)
    m.add_argument("reports", nargs="+", metavar="REPORT")
    m.add_argument("-o", "--output", required=True, metavar="OUT")
    return p


def _silence_stdout() -> None:
    """Point the standard output at /dev/null, so that Python's own last flush at exit has nothing to fail on."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        pass


def main(argv=None) -> int:
    """Run the command line; returns the exit code."""
    try:
        parser = _parser()
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        if args.verbose:
            _verbose()
        for line in environment_warnings():
            print(line, file=sys.stderr)
        if args.subcommand is None:  # bare `streamsan`
            _emit(parser.format_help(), _stdout())
            return X.OK
        given = {k: getattr(args, k) for k in args.options}
        vars(args).update(resolve(given, args.options))
        return args.run(args)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else X.OK
    except (UsageError, TraceError, ReportError, ConfigError, SuppressionError, PlanError) as e:
        print(f"streamsan: error: {e}", file=sys.stderr)
        return X.USAGE
    except OutputError as e:
        print(f"streamsan: error: cannot write the standard output: {e}", file=sys.stderr)
        _silence_stdout()
        return X.USAGE
    except wrap.CommandError as e:
        print(f"streamsan: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("streamsan: interrupted", file=sys.stderr)
        return X.INTERRUPTED
    except BrokenPipeError:  # `streamsan show r.json | head`
        _silence_stdout()
        return X.OK
