"""What a wheel ships and how a build refuses to run against a torch it cannot see. (CI also builds a real wheel and
runs it from a fresh environment: .ci/wheel_smoke.py.)"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import torch_zipkv

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_build_py_ships_every_module(tmp_path):
    """setup.py's build_py (what bdist_wheel packs) copies every .py file under torch_zipkv/, subpackages included:
    a package list that names only torch_zipkv would ship neither engine/ nor integrations/."""
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    source = {p.relative_to(ROOT).as_posix() for p in (ROOT / "torch_zipkv").rglob("*.py")}
    built = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.py")}
    assert {"torch_zipkv/engine/engine.py", "torch_zipkv/integrations/transformers.py"} <= source
    assert source - built == set()


def test_an_isolated_build_stops_with_a_message(tmp_path):
    """A build that cannot import torch (pip's isolated build environment: torch is not a build requirement) stops at
    once, saying to build with --no-build-isolation, and writes nothing into the tree."""
    blocked = tmp_path / "torch"
    blocked.mkdir()
    (blocked / "__init__.py").write_text("raise ImportError('no torch in this build environment')\n")
    info = ROOT / "torch_zipkv" / "_build_info.py"
    before = info.read_bytes() if info.exists() else None
    proc = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode != 0
    assert "pip install --no-build-isolation ." in proc.stderr and "Traceback" not in proc.stderr
    assert (info.read_bytes() if info.exists() else None) == before


def test_importing_the_library_sets_no_environment_variable():
    """Importing torch_zipkv and every subpackage leaves os.environ as torch (whose _dynamo sets
    TORCHINDUCTOR_CACHE_DIR) and transformers left it; a test-data module that lived in the package set HF_HUB_OFFLINE
    at import."""
    code = ("import os, torch, torch._dynamo, transformers; before = dict(os.environ); "
            "import torch_zipkv, torch_zipkv.engine, torch_zipkv.integrations.transformers, torch_zipkv.serve; "
            "print(sorted(set(os.environ.items()) ^ set(before.items())))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_the_package_holds_no_test_data_loader():
    """The SmolLM2 loader and real-KV data live in examples/ (repository data), not in the library."""
    assert not (ROOT / "torch_zipkv" / "realkv.py").exists()
    assert not hasattr(torch_zipkv, "realkv")
