"""The optional C part of the torch tracer (``streamsan/_ctracer.c``); everything else is in pyproject.toml.
Without a C compiler the build goes on without it, the tracer runs in Python alone, and the wheel is a
pure-Python one (``py3-none-any``): nothing in it is tied to an interpreter or a platform."""

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

_BUILT: set = set()  # the extensions this build compiled


class OptionalBuildExt(build_ext):
    """build_ext that records which of the (optional) extensions it built."""

    def build_extension(self, ext):
        super().build_extension(ext)
        _BUILT.add(ext.name)


class WheelPureWithoutExt(bdist_wheel):
    """bdist_wheel that tags the wheel pure Python when no extension could be built."""

    def run(self):
        if not self.skip_build:
            self.reinitialize_command("build_ext").inplace = False
            self.run_command("build")
            if not _BUILT:  # the modules then go to purelib, as in any pure-Python wheel
                self.root_is_pure = True
                self.distribution.has_ext_modules = lambda: False
        super().run()


setup(ext_modules=[Extension("streamsan._ctracer", ["streamsan/_ctracer.c"], optional=True)],
      cmdclass={"build_ext": OptionalBuildExt, "bdist_wheel": WheelPureWithoutExt})
