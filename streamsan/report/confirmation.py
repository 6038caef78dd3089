"""The ``confirmation`` of a finding (written by ``streamsan confirm``) as one sentence, with `code` spans as
the fix and the missing edge have, for every renderer; and the counts of outcomes over a report."""

from __future__ import annotations

OUTCOME_WORDS = {"confirmed": "Confirmed", "not-confirmed": "Not confirmed", "inconclusive": "Inconclusive"}


def _short(location: str) -> str:
    """A location by its file's name and line (``cache_utils.py:79``), as people cite code in a sentence."""
    return location.rsplit("/", 1)[-1] if location else "an unknown location"


def _op_at(op, location) -> str:
    what = f"`{op}`" if op else "the ops"
    return f"{what} at `{_short(location)}`"


def _delay(d: dict) -> str:
    times = f"the first {d['limit']}" if d.get("limit") else "every one"
    return (f"with {d['ms']:g} ms of GPU delay on {d['stream']} before {_op_at(d['op'], d['location'])} "
            f"({times} of its occurrences: {d['occurrences']} delayed)")


def _changed(e: dict) -> str:
    if e["what"] == "stdout":
        return "the program's standard output changed"
    what = f"the value observed as `{e['name']}`" if e["what"] == "observed" else \
        f"the output of {_op_at(e['op'], e['location'])}"
    where = f" in process {e['process']}" if e.get("process") else ""
    text = f"{what}{where} changed in {e['changed']} of {e['occurrences']} occurrences"
    if e["changed"] < e["occurrences"]:
        text += f" (first: occurrence {e['first_changed']})"
    if e.get("largest_difference") is not None:
        text += f", its sum by up to {e['largest_difference']:.4g}"
    return text


def confirmation_text(c: dict) -> str:
    """The sentence: ``Confirmed: with 20 ms of GPU delay on the default stream before `aten::_to_copy` at
    `cache_utils.py:79` ..., the output of `aten::_to_copy` at `cache_utils.py:85` changed in 25 of 25
    occurrences``."""
    word = OUTCOME_WORDS.get(c["outcome"], c["outcome"])
    delay = _delay(c["delay"]) if c.get("delay") else None
    if c["outcome"] == "confirmed":
        return f"{word}: {delay}, " + "; ".join(_changed(e) for e in c["evidence"]) + "."
    if c["outcome"] == "not-confirmed":
        return (f"{word}: {delay}, none of the {c['compared']} values compared changed (the outputs at both "
                "accesses and the standard output). Not a proof that the race cannot change them: another "
                "timing, input or GPU may.")
    return f"{word}: {c.get('reason') or 'the runs could not be compared'}" + (f" ({delay})." if delay else ".")


def confirmation_counts(report: dict) -> dict:
    """outcome -> how many findings of the report have it (only those confirm ran on)."""
    counts: dict = {}
    for r in report.get("races", []):
        c = r.get("confirmation")
        if c:
            counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    return counts


def counts_text(report: dict) -> str | None:
    """``confirm: 2 confirmed, 1 not confirmed, 1 inconclusive``, or None for a report confirm did not run on."""
    counts = confirmation_counts(report)
    if not counts:
        return None
    return "confirm: " + ", ".join(f"{counts.get(o, 0)} {OUTCOME_WORDS[o].lower()}" for o in OUTCOME_WORDS)
