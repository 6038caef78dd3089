"""Patch: ``cupy.cuda.Device.synchronize``, a host synchronization with the whole device. ``Device`` is an
extension type: a transparent subclass with a traced ``synchronize`` replaces the name ``cupy.cuda.Device`` (and
``cupy.cuda.device.Device``), so ``Device`` objects that CuPy makes itself are not traced."""

from __future__ import annotations

from .... import events as E
from .. import active
from ..patching import Patches
from ..wrappers import transparent_subclass


def install(tracer):
    patches = Patches(tracer, "device")
    with patches:
        cp = tracer.cp
        Device = cp.cuda.Device

        def dsync(d):
            Device.synchronize(d)
            tr = active.tracer
            if tr is not None:
                tr._emit((E.DEVICE_SYNC, int(d.id), tr._stack()))

        TD = transparent_subclass(Device, "Device", {"synchronize": dsync})
        patches.replace(cp.cuda, "Device", TD)
        if getattr(cp.cuda, "device", None) is not None and getattr(cp.cuda.device, "Device", None) is Device:
            patches.replace(cp.cuda.device, "Device", TD)
    return patches.undo
