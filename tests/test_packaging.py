"""The wheel: what setup.py ships besides the package proper (finetune/, model_tests/, integrations/, configs/), and
that an installed wheel finds its bundled recipes without the source checkout."""
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    env = {**os.environ, "HFAB_BUILD_CUDA": "0"}
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]  # offline: reuse it
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(out), str(ROOT)],
                   check=True, env=env, timeout=300)
    (built,) = out.glob("hf_attention_backends-*.whl")
    return built


def test_wheel_ships_the_recipes_and_the_top_level_folders(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"hf_attention_backends/configs/{kind}/{p.name}"
                for kind in ("finetune", "accelerate") for p in (ROOT / "configs" / kind).glob("*.yaml")}
    expected |= {f"hf_attention_backends/{pkg}/{p.name}" for pkg in ("finetune", "model_tests")
                 for p in (ROOT / pkg).glob("*.py")}
    assert len(expected) > 20 and expected <= names, sorted(expected - names)


def test_installed_wheel_lists_and_reads_its_bundled_recipes(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, timeout=300)
    code = ("import sys, hf_attention_backends as h; from hf_attention_backends import cli; "
            "from hf_attention_backends.finetune.config import load_recipe; "
            "print(h.__file__); print(load_recipe('smollm2_race').convert.backend); "
            "sys.exit(cli.main(['finetune', '--list']))")
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.splitlines()
    assert Path(out[0]).is_relative_to(target) and out[1] == "race"
    listed = [line.split() for line in out[2:] if line.startswith("  ")]
    assert {name for name, _ in listed} >= {"tiny_smoke", "smollm2_race", "single_gpu", "fsdp"}
    assert all(Path(path).is_relative_to(target) and Path(path).is_file() for _, path in listed)
