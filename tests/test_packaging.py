"""The package as users get it: a wheel and an sdist that pass ``twine check``, and the
README's quick start run by the wheel installed into a fresh virtualenv (outside the
checkout, so nothing is imported from the source tree)."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_wheel_and_sdist_pass_twine_check_and_carry_the_scripts(dist: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    proc = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = set(zipfile.ZipFile(wheel).namelist())
    lua = {Path(n).name for n in names if n.endswith(".lua")}
    shipped = {p.name for p in (ROOT / "zerda_cache" / "storage" / "lua").glob("*.lua")}
    assert lua == shipped
    assert "zerda_cache/py.typed" in names
    assert any(n.startswith("zerda_cache/service/") for n in names)
    assert any(n.startswith("zerda_cache/integrations/") for n in names)
    assert not any(n.startswith("tests/") for n in names)


def test_the_quick_start_runs_from_the_installed_wheel(dist: Path, tmp_path: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "--progress-bar", "off", str(wheel)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    quick_start = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    assert "CacheManager" in quick_start
    proc = subprocess.run(
        [str(python), "-c", quick_start], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = proc.stdout.splitlines()[0]
    assert first.startswith("Settings > Security > Reset password."), proc.stdout
    where = subprocess.run(
        [str(python), "-c", "import zerda_cache; print(zerda_cache.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    ).stdout
    assert str(venv) in where  # the wheel's copy, not the checkout's
    cli = subprocess.run(
        [str(venv / "bin" / "zerda-cache"), "--help"], capture_output=True, text=True
    )
    assert cli.returncode == 0 and "worker" in cli.stdout
