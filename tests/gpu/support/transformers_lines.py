"""Where the installed transformers' cache code does what the transformers GPU tests expect findings at, spelled as
streamsan's report locations are (so that line shifts between transformers builds do not break the tests).
Imported only after the tests made sure transformers is installed."""

import inspect

from transformers import cache_utils

from streamsan.analysis.locations import short_path


def line_of(func, text):
    """``path:line`` of the line of ``func`` holding ``text``."""
    func = inspect.unwrap(func)  # (through torch.no_grad and the like)
    lines, start = inspect.getsourcelines(func)
    path = short_path(inspect.getsourcefile(func))
    for i, line in enumerate(lines):
        if text in line:
            return f"{path}:{start + i}"
    raise AssertionError(f"{text!r} not in {func.__qualname__}")


OFFLOAD_K = line_of(cache_utils.CacheLayerMixin.offload, 'self.keys = self.keys.to("cpu"')
OFFLOAD_V = line_of(cache_utils.CacheLayerMixin.offload, 'self.values = self.values.to("cpu"')
PREFETCH_K = line_of(cache_utils.CacheLayerMixin.prefetch, "self.keys = self.keys.to(self.device")
PREFETCH_V = line_of(cache_utils.CacheLayerMixin.prefetch, "self.values = self.values.to(self.device")
CAT_K = line_of(cache_utils.DynamicLayer.update, "self.keys = torch.cat")
CAT_V = line_of(cache_utils.DynamicLayer.update, "self.values = torch.cat")
