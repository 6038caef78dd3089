"""``streamsan confirm``: show that a finding changes the numbers, by re-running the program with a GPU delay
that flips the finding's unordered pair of accesses and comparing checksums of the values it computes.

The parent side (:mod:`.orchestrate`) plans one perturbation per finding (:mod:`.plan`), runs the program
unperturbed as baselines and once per finding perturbed, and decides (:mod:`.decide`) from the observations each
run leaves. Inside each run, :mod:`.runtime` finds the ops at the planned call sites, delays one (:mod:`.inject`)
and checksums their outputs on their own streams (:mod:`.observe`). Nothing here is imported or installed by
``wrap`` or ``watch()``: only a run that ``confirm`` starts (``STREAMSAN_CONFIRM`` set) loads the runtime.
"""
