"""The exit codes of the ``streamsan`` command, in one place (listed in ``streamsan --help``)."""

OK = 0
USAGE = 2  # bad options; a missing, unreadable or invalid trace or report; unwritable output
RACES = 66  # races found under --fail-on-race (66 as ThreadSanitizer's: apart from a test runner's 1)
INCOMPLETE = 67  # under --fail-on-race: no race found, but the report is incomplete (events may be missing)
NOTHING_CHECKED = 68  # under --fail-on-race: no race found, but no CUDA stream work was traced at all
NOT_EXECUTABLE = 126  # wrap: the command cannot be executed
NOT_FOUND = 127  # wrap: the command was not found
SIGNAL = 128  # wrap: 128 + N when the command was killed by signal N
INTERRUPTED = 130  # streamsan itself was interrupted (Ctrl-C) outside a wrapped command

HELP = f"""exit codes:
  {OK:<5} success (races may have been found: see the report)
  {USAGE:<5} usage or input error: bad options, a missing or invalid trace or report, unwritable output
  {RACES:<5} races were found and --fail-on-race was given
  {INCOMPLETE:<5} --fail-on-race: no race found, but the report is incomplete (--allow-incomplete passes it)
  {NOTHING_CHECKED:<5} --fail-on-race: no race found, but nothing was checked: no CUDA stream work was traced
        (--allow-incomplete passes it)
  {NOT_EXECUTABLE:<5} wrap: the command cannot be executed
  {NOT_FOUND:<5} wrap: the command was not found
  128+N wrap: the command was killed by signal N
  other wrap: the command's own exit status
  {INTERRUPTED:<5} streamsan was interrupted"""
