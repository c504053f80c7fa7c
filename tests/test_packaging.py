"""The package as users install it (issue #23): install requirements in step with the pins CI
tests, megatron-core's version checked at import, package data found without a checkout, a quiet
Python API, and a wheel that installs and runs from outside the checkout."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import aoe_megatron

ROOT = Path(__file__).resolve().parents[1]


def _pins(path: Path) -> dict:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins[req.name.lower().replace("_", "-")] = str(next(iter(req.specifier)).version)
    return pins


#: Each CI leg's pins, and the Python it runs on.
LEGS = {"3.11": ("requirements.txt", "requirements-eval.txt"), "3.12": ("requirements-mcore019.txt",)}


@pytest.mark.legs
@pytest.mark.parametrize("python", sorted(LEGS))
def test_install_requirements_admit_each_legs_pins_and_pin_megatron_core(python):
    """pyproject.toml admits every pin of each leg, under that leg's Python (megatron-core by an
    exact pin per Python), and each megatron-core pinned is a supported release."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {k: v for name in LEGS[python] for k, v in _pins(ROOT / name).items()}
    env = {"python_version": python, "python_full_version": f"{python}.0"}
    wanted = [Requirement(r) for r in [
        *project["dependencies"],
        *(r for extra in project["optional-dependencies"].values() for r in extra)]]
    wanted = [r for r in wanted if r.marker is None or r.marker.evaluate(env)]
    extras = {Requirement(r).name for extra in ("eval", "wandb")
              for r in project["optional-dependencies"][extra]}
    for req in wanted:
        name = req.name.lower().replace("_", "-")
        if name == "numpy" or (python != "3.11" and req.name in extras):
            continue  # numpy: what torch brings; lm-eval and wandb: tested on the first leg only
        assert name in pins, f"{name} is not pinned in {LEGS[python]}"
        assert req.specifier.contains(pins[name]), (str(req), pins[name])
    mcore = [r for r in wanted if r.name == "megatron-core"]
    assert len(mcore) == 1 and str(mcore[0].specifier) == f"=={pins['megatron-core']}"
    assert pins["megatron-core"] in aoe_megatron.SUPPORTED_MCORE
    assert not any(r.name.startswith("apex") for r in wanted)  # the PyPI "apex" is another project


def test_each_lower_bound_is_a_version_a_leg_runs():
    """The floors are true: the lower end of each range is pinned by one of the legs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = {}
    for names in LEGS.values():
        for name in names:
            for k, v in _pins(ROOT / name).items():
                pinned.setdefault(k, set()).add(v)
    for text in [*project["dependencies"], *(r for extra in project["optional-dependencies"].values()
                                             for r in extra)]:
        req = Requirement(text)
        name = req.name.lower().replace("_", "-")
        floors = [s.version for s in req.specifier if s.operator in (">=", "==")]
        if name == "numpy" or not floors:
            continue
        assert any(Version(v) == Version(floors[0]) for v in pinned[name]), (
            f"{text}: no leg runs {name} {floors[0]} (pins: {sorted(pinned[name])})")


def _import_with_megatron_core(version: str, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    """``import aoe_megatron`` where the metadata says megatron-core ``version`` is installed."""
    info = tmp_path / f"megatron_core-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: megatron-core\nVersion: {version}\n")
    return subprocess.run([sys.executable, "-c", "import aoe_megatron"], capture_output=True,
                          text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(tmp_path), **env})


@pytest.mark.legs
def test_another_megatron_core_is_refused_at_import(tmp_path):
    refused = _import_with_megatron_core("0.18.0", tmp_path)
    assert refused.returncode != 0
    assert ("ImportError: aoe-megatron supports megatron-core 0.16.1 and 0.19.2 (the releases its "
            "CI tests; 0.17 and later need Python 3.12), but megatron-core 0.18.0 is installed: "
            "install a supported one (pip install megatron-core==0.19.2 on Python 3.12, ==0.16.1 "
            "on 3.11), or set AOE_ALLOW_UNTESTED_MCORE=1 to try this one anyway"
            ) in refused.stderr, refused.stderr
    porting = _import_with_megatron_core("0.18.0", tmp_path, AOE_ALLOW_UNTESTED_MCORE="1")
    assert porting.returncode == 0, porting.stderr
    assert "going on, with the patches of megatron-core 0.16.1" in porting.stderr, porting.stderr


@pytest.mark.legs
def test_an_untested_release_follows_the_nearest_supported_one_below_it():
    from aoe_megatron import patches
    from aoe_megatron.runtime import versions

    assert versions.parse("0.20.0rc1") == (0, 20, 0) and versions.parse("0.19.2+nv") == (0, 19, 2)
    assert [versions.baseline_release(v) for v in ("0.15.0", "0.18.0", "0.19.2", "0.20.0rc1")] == [
        "0.16.1", "0.16.1", "0.19.2", "0.19.2"]
    assert patches.active_patches(versions.baseline_release("0.18.0")) == patches.ALL_PATCHES
    with pytest.raises(ImportError, match="megatron-core 0.18.0 is installed"):
        versions.check_mcore("0.18.0")
    # what our constructors pass on to megatron-core's: only the arguments this release takes
    newer = versions.installed_mcore() != "0.16.1"
    assert versions.constructor_kwargs(is_mtp_layer=False, name="decoder.layers.0.mlp") == (
        {"is_mtp_layer": False, "name": "decoder.layers.0.mlp"} if newer else {})


def test_package_data_is_found_through_the_package():
    from aoe_megatron.models.gpt import load_preset
    from aoe_megatron.runtime import resources

    assert {"tiny", "732m", "4b", "aoe_732m", "moe_732m"} <= set(resources.names("presets"))
    for relative in ("deepspeed/zero1.json", "deepspeed/zero3.json", "slurm/pretrain.sbatch",
                     "studies/default.yaml", "presets/ablations/c02_moe_aux.yaml"):
        assert resources.path(relative).is_file(), relative
    assert load_preset("732m").num_layers == load_preset(str(resources.path("presets/732m.yaml"))).num_layers
    with pytest.raises(ValueError, match=r"no preset 'nope'.*'732m'"):
        load_preset("nope")


@pytest.mark.legs
def test_the_readme_python_example_prints_one_line(tmp_path):
    """README.md's first ```python block, run as a user would (a fresh process, another folder):
    one line for the missing optional kernels, nothing per layer, no upstream warnings."""
    block = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert "build_gpt_model" in block
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (done.stdout + done.stderr).splitlines()
    assert lines == ["[rank 0] no TransformerEngine, no NVIDIA apex: using PyTorch kernels "
                     "(expected on CPU)"], lines


@pytest.mark.slow
def test_the_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    """Build the wheel, install it (no dependencies, no network) into a fresh virtualenv that
    borrows the pinned dependencies already installed, and from a folder outside the checkout:
    load the 732m preset, preprocess a small corpus, train the tiny preset 2 steps through the
    console script, resume it for a third step with --load (only Megatron-LM's flag names), and
    convert the checkpoint to HF."""
    # Built from a copy of what the wheel is made of: setuptools leaves build/ in its source
    # folder, and a stale build/ could put deleted modules into the wheel.
    source, wheels = tmp_path / "source", tmp_path / "wheels"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("aoe_megatron", "run"):
        shutil.copytree(ROOT / name, source / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                            "--no-build-isolation", "--wheel-dir", wheels, source],
                           capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next(wheels.glob("aoe_megatron-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    bin_ = venv / "bin"
    site = Path(subprocess.check_output([bin_ / "python", "-c", "import sysconfig; print("
                                         "sysconfig.get_paths()['purelib'])"], text=True).strip())
    # The pinned dependencies of this environment, as a plain path: its .pth files (our own
    # editable install among them) are not read, so aoe_megatron comes from the wheel.
    (site / "_pinned_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", bin_ / "python", "install",
                                "--quiet", "--no-deps", "--no-index", wheel],
                               capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    # An empty assets folder: the default tokenizer must come from the wheel. (HOME stays: a
    # fresh one would make DeepSpeed rebuild its CPU communication kernel, about 45 s.)
    env.update(AOE_MEGATRON_ASSETS=str(tmp_path / "no-assets"), PATH=f"{bin_}:{env.get('PATH', '')}")

    def run(*cmd, timeout=600) -> str:
        started = time.monotonic()
        done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=work,
                              env=env, timeout=timeout)
        assert done.returncode == 0, (cmd, (done.stdout + done.stderr)[-5000:])
        print(f"{time.monotonic() - started:5.1f} s  {Path(cmd[0]).name} {' '.join(map(str, cmd[1:3]))}")
        return done.stdout + done.stderr

    where = run(bin_ / "python", "-c", "import aoe_megatron; from aoe_megatron.models.gpt import "
                "load_preset; print(aoe_megatron.__file__); print(load_preset('732m').num_layers)")
    assert where.splitlines()[-2].startswith(str(site)), where
    assert where.splitlines()[-1] == "12", where

    with open(ROOT / "assets" / "corpus" / "shakespeare.jsonl") as fh:
        (work / "docs.jsonl").write_text("".join(next(fh) for _ in range(30)))
    run(bin_ / "aoe-preprocess", "--input", "docs.jsonl", "--output-prefix", "corpus/d",
        "--append-eod", "--workers", "1")
    (work / "data.yaml").write_text("blend:\n  - {prefix: corpus/d_text_document, weight: 1}\n"
                                    "split: '90,10,0'\n")
    train = [bin_ / "aoe-train", "--preset", "tiny", "--data-path", "data.yaml", "--global-batch-size",
             "2", "--micro-batch-size", "1", "--lr-warmup-iters", "1", "--eval-interval", "0"]
    out = run(*train, "--train-iters", "2", "--save", "ck", "--run-dir", "run")
    assert "deprecated" not in out, out[-3000:]
    assert (work / "ck" / "latest").read_text().strip() == "step_00000002"
    out = run(*train, "--train-iters", "3", "--load", "ck", "--save", "ck3", "--run-dir", "run3",
              "--override-opt_param-scheduler")  # a longer run: its own lr schedule
    assert "resumed from ck/step_00000002 at step 2" in out, out[-3000:]
    assert "note: --override-opt_param-scheduler: continuing" in out, out[-3000:]
    assert (work / "ck3" / "latest").read_text().strip() == "step_00000003"
    # the --load folder of another run is read, not written (its lock file is its first run's)
    assert sorted(p.name for p in (work / "ck").iterdir() if p.name != ".aoe-lock") == [
        "latest", "step_00000002"]
    run(bin_ / "aoe-convert-to-hf", "--checkpoint", "ck3", "--output", "hf")
    assert (work / "hf" / "config.json").is_file() and (work / "hf" / "tokenizer.model").is_file()
