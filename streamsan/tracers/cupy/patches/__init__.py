"""The CuPy surfaces the tracer replaces while it runs, one module each.

Every module has ``install(tracer) -> undo``: it replaces its surface (now, and in modules the program imports
later when they are imported, through ``tracer.on_import``) and returns the function that puts back exactly what
it replaced. :data:`..tracer.PATCHES` is the order of installation; ``stop`` undoes in reverse. A surface that does
not look as expected (another CuPy version) is noted and traced less, never an error raised into the program.
"""
