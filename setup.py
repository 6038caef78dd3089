"""The optional C part of the torch tracer (``streamsan/_ctracer.c``); everything else is in pyproject.toml.
Without a C compiler the build goes on without it, and the tracer runs in Python alone."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("streamsan._ctracer", ["streamsan/_ctracer.c"], optional=True)])
