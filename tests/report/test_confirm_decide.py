"""The decision of `streamsan confirm` over synthetic runs: confirmed only with a stable value that changed;
not confirmed when nothing observed changed; inconclusive when the runs cannot be compared."""

import pytest

from streamsan.confirm.decide import CONFIRMED, INCONCLUSIVE, NOT_CONFIRMED, STDOUT, Run, decide

A, B = "aten::_to_copy @ cache_utils.py:79", "aten::_to_copy @ cache_utils.py:85"
SEQ = (A, B, A, B)


def run(values=None, *, stdout="ok\n", code=0, sequence=SEQ, delayed=0, error=None):
    base = {(A, 1): (1.0, 1.0, 0.0), (B, 1): (2.0, 2.0, 0.0), (A, 2): (3.0, 3.0, 0.0), (B, 2): (4.0, 4.0, 0.0)}
    base.update(values or {})
    return Run(code, stdout, sequence, base, delayed, error)


def test_a_stable_value_that_changes_is_confirmed_with_which_op_and_how_much():
    d = decide([run(), run()], run({(B, 2): (6.5, 6.5, 0.0)}, delayed=2), [A, B])
    assert d.outcome == CONFIRMED and d.reason is None
    assert d.evidence == [{"site": B, "changed": 1, "occurrences": 2, "first_changed": 2, "largest_difference": 2.5}]


def test_nothing_changed_is_not_confirmed_and_counts_what_was_compared():
    d = decide([run(), run()], run(delayed=2), [A, B])
    assert d == (NOT_CONFIRMED, None, [], 5)  # four checksums and the standard output


def test_a_value_that_varies_between_baselines_is_no_evidence():
    noisy = [run(), run({(B, 2): (9.0, 9.0, 0.0)})]
    d = decide(noisy, run({(B, 2): (7.0, 7.0, 0.0)}, delayed=2), [A, B])
    assert d.outcome == INCONCLUSIVE and d.evidence == []
    assert d.reason == f"the values at {B} vary between unperturbed runs, and no stable value changed"


def test_an_unstable_value_elsewhere_does_not_hide_a_stable_change():
    noisy = [run(), run({(A, 1): (0.5, 0.5, 0.0)})]
    d = decide(noisy, run({(B, 1): (2.0, 3.0, 0.0)}, delayed=2), [A, B])
    assert d.outcome == CONFIRMED and [e["site"] for e in d.evidence] == [B]


def test_unstable_values_of_other_sites_leave_not_confirmed():
    other = "aten::mm @ model.py:3"
    noisy = [run({(other, 1): (1.0, 1.0, 0.0)}), run({(other, 1): (2.0, 2.0, 0.0)})]
    assert decide(noisy, run({(other, 1): (3.0, 3.0, 0.0)}, delayed=1), [A, B]).outcome == NOT_CONFIRMED


def test_a_changed_standard_output_is_evidence_when_the_baselines_agree_on_it():
    d = decide([run(), run()], run(stdout="diff 21.3\n", delayed=1), [A, B])
    assert d.outcome == CONFIRMED and d.evidence[0]["site"] == STDOUT
    varying = [run(stdout="took 1.2 s\n"), run(stdout="took 1.3 s\n")]
    assert decide(varying, run(stdout="took 1.9 s\n", delayed=1), [A, B]).outcome == NOT_CONFIRMED


def test_nan_checksums_compare_equal_to_each_other():
    nan = {(B, 1): (None, 0.0, 3.0)}
    assert decide([run(nan), run(nan)], run(nan, delayed=1), [A, B]).outcome == NOT_CONFIRMED
    d = decide([run(nan), run(nan)], run({(B, 1): (1.0, 1.0, 0.0)}, delayed=1), [A, B])
    assert d.outcome == CONFIRMED and d.evidence[0]["largest_difference"] is None


@pytest.mark.parametrize("baselines, perturbed, reason", [
    ([run(), run(sequence=SEQ + (A,))], run(delayed=1),
     "the control flow differs between unperturbed runs (5 observed ops instead of 4)"),
    ([run(), run()], run(sequence=(A, B, B, A), delayed=1),
     f"the control flow diverged under the delay (observed op 3 is {B} instead of {A})"),
    ([run(), run(code=1)], run(delayed=1), "the unperturbed runs end differently (exit codes [0, 1])"),
    ([run(), run()], run(code=-11, delayed=1), "the program failed under the delay (exit code -11, 0 without it)"),
    ([run(), run(error="no process wrote observations")], run(delayed=1),
     "an unperturbed run failed (no process wrote observations)"),
    ([run(), run()], run(delayed=1, error="CudaError: illegal address"),
     "the perturbed run failed (CudaError: illegal address)"),
    ([run(), run()], run(delayed=0), "the delayed call site was not reached in the perturbed run"),
])
def test_runs_that_cannot_be_compared_are_inconclusive(baselines, perturbed, reason):
    assert decide(baselines, perturbed, [A, B]) == (INCONCLUSIVE, reason, [], 0)


def test_a_diverged_run_with_changed_values_is_still_not_confirmed():
    d = decide([run(), run()], run({(B, 1): (0.0, 0.0, 0.0)}, sequence=SEQ[:3], delayed=1), [A, B])
    assert d.outcome == INCONCLUSIVE and d.evidence == []


def test_nothing_to_compare_is_inconclusive():
    empty = [Run(0, "a", (), {}, 0), Run(0, "b", (), {}, 0)]
    d = decide(empty, Run(0, "c", (), {}, 1), [A, B])
    assert d.outcome == INCONCLUSIVE and d.reason.startswith("nothing could be compared")


def test_one_baseline_is_enough_to_decide():
    assert decide([run()], run({(A, 1): (0.0, 0.0, 0.0)}, delayed=1), [A, B]).outcome == CONFIRMED
