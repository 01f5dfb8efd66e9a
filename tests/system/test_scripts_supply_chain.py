"""What `make test` downloads and runs first on PYTHONPATH: scripts/setup-vllm033.sh takes only the
pinned wheel (sha256 checked before anything is extracted, never an sdist), and the GPU device
check keeps its files in private temporary directories. The script runs offline here against a
local wheel directory (pip's own PIP_FIND_LINKS / PIP_NO_INDEX), a stand-in wheel of a few bytes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).parents[2]
SETUP = REPO / "scripts" / "setup-vllm033.sh"
WHEEL = "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"


def _stand_in_wheel(directory: Path) -> Path:
    """A wheel pip accepts as vllm 0.33.0 for linux x86_64, holding vllm/__init__.py."""
    directory.mkdir()
    path = directory / WHEEL
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm/__init__.py", "STAND_IN = True\n")
        z.writestr("vllm-0.33.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
        z.writestr("vllm-0.33.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
                                                  "Tag: cp38-abi3-manylinux_2_28_x86_64\n")
        z.writestr("vllm-0.33.0.dist-info/RECORD", "")
    return path


def _setup(dest: Path, links: Path, **env: str) -> subprocess.CompletedProcess[str]:
    run_env = dict(os.environ, VENV=str(Path(sys.executable).parents[1]), VLLM033=str(dest),
                   PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(links), **env)
    for k in ("PIP_CONSTRAINT", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "VLLM033_SHA256"):
        if k not in env:
            run_env.pop(k, None)
    return subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=120, env=run_env)


def test_a_wheel_that_is_not_the_pinned_one_is_never_extracted(tmp_path: Path) -> None:
    """The script extracted whatever `pip download vllm==0.33.0` gave (no pin, sdists allowed) and
    put its .py files first on the tests' PYTHONPATH."""
    links = tmp_path / "links"
    wheel = _stand_in_wheel(links)
    dest = tmp_path / "v"
    r = _setup(dest, links)
    assert r.returncode == 1, (r.stdout, r.stderr)
    got = hashlib.sha256(wheel.read_bytes()).hexdigest()
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"setup-vllm033: {WHEEL} has sha256 {got}, not the pinned 4b6bdec4"), r.stderr
    assert "nothing extracted" in line and "update the pin" in line
    assert not dest.exists() and not Path(f"{dest}.partial").exists()


def test_the_pinned_wheel_is_extracted_once(tmp_path: Path) -> None:
    links = tmp_path / "links"
    wheel = _stand_in_wheel(links)
    dest = tmp_path / "v"
    pin = hashlib.sha256(wheel.read_bytes()).hexdigest()
    r = _setup(dest, links, VLLM033_SHA256=pin)
    assert r.returncode == 0, r.stderr
    assert (dest / "vllm" / "__init__.py").read_text() == "STAND_IN = True\n"
    assert (dest / ".complete-0.33.0").exists() and not (dest / "vllm-0.33.0.dist-info").exists()
    wheel.unlink()  # idempotent: a second run downloads nothing
    r = _setup(dest, links, VLLM033_SHA256="0" * 64)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_an_sdist_is_never_built(tmp_path: Path) -> None:
    """pip builds an sdist by running its setup code (here with the venv's setuptools, no build
    isolation, which would fetch setuptools first); binary only, the script stops instead."""
    links = tmp_path / "links"
    links.mkdir()
    ran = tmp_path / "ran"
    sdist = links / "vllm-0.33.0.tar.gz"
    src = tmp_path / "vllm-0.33.0"
    src.mkdir()
    (src / "setup.py").write_text(f"open({str(ran)!r}, 'w').close()\nfrom setuptools import setup\n"
                                  "setup(name='vllm', version='0.33.0')\n")
    (src / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
    subprocess.run(["tar", "czf", str(sdist), "-C", str(tmp_path), "vllm-0.33.0"], check=True)
    r = _setup(tmp_path / "v", links, PIP_NO_BUILD_ISOLATION="0")
    assert r.returncode != 0 and not ran.exists() and not (tmp_path / "v").exists(), r.stderr


def test_the_gpu_device_check_uses_private_temporary_directories() -> None:
    """run.sh put fixed /tmp/site and /tmp/v first on PYTHONPATH: another local user could create
    them first and have their code imported."""
    for script in sorted((REPO / "scripts" / "gpu-device").glob("*.sh")) + [SETUP]:
        text = script.read_text()
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
        assert "/tmp/" not in text, script
    run = (REPO / "scripts" / "gpu-device" / "run.sh").read_text()
    assert "mktemp -d" in run and 'PYTHONPATH="$WORK/' in run
