"""The analysis core: from an event sequence (``streamsan.events``) to deduplicated race findings.

:class:`~streamsan.analysis.analyzer.Analyzer` is the entry point; it implements ``docs/semantics.md`` and imports
nothing of torch or cupy, so it also runs in the helper process and on recorded traces without a GPU.
"""
