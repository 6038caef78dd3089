"""The distribution's metadata and layout: the license, the extras, the TOML reader, the hooks package, and
the wheel built without a C compiler (pure Python)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from tests.support.paths import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_license_file_is_the_apache_license_the_metadata_names():
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]


def test_classifiers_and_no_urls():
    assert "Programming Language :: Python :: 3" in PROJECT["classifiers"]
    assert not any(c.startswith("License ::") for c in PROJECT["classifiers"])  # the SPDX expression says it
    assert "urls" not in PROJECT


def test_the_cupy_extra_is_the_cuda_13_build():
    assert PROJECT["optional-dependencies"]["cupy"] == ["cupy-cuda13x"]


def test_toml_is_read_by_tomllib_or_tomli():
    assert PROJECT["dependencies"] == ['tomli>=1.1; python_version < "3.11"']
    assert not (ROOT / "streamsan" / "minitoml.py").exists()


def test_the_hooks_are_a_subpackage_of_streamsan():
    import streamsan.hooks.transformers as hooks

    assert Path(hooks.__file__).resolve() == ROOT / "streamsan" / "hooks" / "transformers.py"
    assert not (ROOT / "hooks").exists()


def test_a_wheel_built_without_a_compiler_is_pure_python(tmp_path):
    pytest.importorskip("setuptools.command.bdist_wheel")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "streamsan", src / "streamsan",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path / "out"), str(src)], env={"PATH": "/usr/bin:/bin", "CC": "false",
                                                               "HOME": str(tmp_path)},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    (wheel,) = (tmp_path / "out").iterdir()
    assert wheel.name == "streamsan-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert "Root-Is-Purelib: true" in z.read("streamsan-0.1.0.dist-info/WHEEL").decode()
    assert "streamsan/hooks/transformers.py" in names and "streamsan/report/schema.json" in names
    assert not any(n.endswith(".so") or ".data/" in n for n in names)
    assert "streamsan-0.1.0.dist-info/licenses/LICENSE" in names
