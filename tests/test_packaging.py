"""The editable install (`make install`: `pip install -e .`) builds quietly: setuptools' editable backend,
run on this pyproject.toml in a scratch tree of empty packages, takes the plain .pth strategy and emits no
warning (its meta-path-finder strategy prints an "Editable installation" block that pip shows on every install).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

BUILD = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("always")
    from setuptools import build_meta
    print(build_meta.build_editable(sys.argv[1]))
""")


def _packages(config: dict) -> list[str]:
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return [pattern.rstrip("*") for pattern in include]


def _scratch_project(tmp: Path) -> Path:
    project = tmp / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (project / "README.md").write_text("scratch\n")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for package in _packages(config):
        (project / package).mkdir()
        (project / package / "__init__.py").write_text("")
    for module in config["tool"]["setuptools"].get("py-modules", []):
        (project / f"{module}.py").write_text("")
    return project


@pytest.mark.timeout(120)
def test_editable_build_prints_no_warning(tmp_path):
    project = _scratch_project(tmp_path)
    out = tmp_path / "wheels"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-c", BUILD, str(out)], cwd=project, capture_output=True, text=True,
                          timeout=110)
    assert proc.returncode == 0, proc.stderr
    assert "Editable installation" not in proc.stderr + proc.stdout, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    wheel = out / proc.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as zf:
        pth = [n for n in zf.namelist() if n.endswith(".pth")]
        assert len(pth) == 1, zf.namelist()
        assert zf.read(pth[0]).decode().strip() == str(project.resolve())
