"""The repository root on ``sys.path``, first: test code is imported as the ``tests`` package
(``from tests.support.torch_kit import ...``), whichever folder pytest is started from or given, and the
``streamsan`` found is this checkout's."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
