"""A wheelhouse for a machine without a package registry: what ray_ppu needs that it lacks.

Air-gapped PPU nodes (and the accelerator machines our device checks run on) have an image
with torch, its CUDA-compatible stack and most of the scientific Python world, but no Ray or
Megatron-Core, and cannot reach PyPI. :func:`build` resolves ray_ppu's dependencies for the
target's Python and platform (``pip install --dry-run --report``, the resolver pip itself runs
there), drops every distribution the target already has (``--have``: its ``pip freeze``, or
one name per line), downloads the rest as wheels (``pip download --no-deps``) and, with
``slim``, repacks Ray's wheel without the parts a training run never imports (its Java jars,
RLlib, Serve, the LLM library: 35 of its 79 MB). The result installs offline with
``pip install --no-index --find-links DIR -r DIR/requirements.txt``.

Ray and Megatron-Core are pinned to the versions installed here, the ones the tests ran.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "any")
# top-level parts of Ray's wheel that a ray_ppu run never imports
RAY_UNUSED = ("ray/jars/", "ray/rllib/", "ray/serve/", "ray/llm/")
PINNED = ("ray", "megatron-core")  # to the versions installed here


def normalize(name: str) -> str:
    """PEP 503's normal form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_have(path: Path) -> set[str]:
    """Names (normalized) in a ``pip freeze`` / ``pip list --format=freeze`` output or a list
    of names; blank lines and ``#`` comments skipped."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(normalize(re.split(r"[=<>!~ @\[;]", line, maxsplit=1)[0]))
    return names


def requirements(dashboard: bool = True, extras: tuple = ()) -> list[str]:
    """ray_ppu's runtime requirements and those of its ``extras`` (``tokenizers``: the Qwen2
    vocabulary the benchmarks' corpora are tokenized with), Ray and Megatron-Core pinned to
    what is installed; ``dashboard`` False: Ray without its ``default`` extra (the dashboard
    and its agents: opencensus, py-spy, virtualenv, ~15 MiB a benchmark machine does without)."""
    wanted = []
    for req in metadata.requires("ray-ppu") or []:
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", req)
        if extra and extra.group(1) not in extras:
            continue
        req = req.split(";")[0].strip()
        name = re.split(r"[=<>!~ \[;]", req, maxsplit=1)[0]
        if normalize(name) in PINNED:
            listed = re.search(r"\[([^\]]*)\]", req)
            kept = [e for e in (listed.group(1).split(",") if listed else [])
                    if dashboard or e.strip() != "default"]
            req = f"{name}{'[' + ','.join(kept) + ']' if kept else ''}=={metadata.version(name)}"
        wanted.append(req)
    return wanted


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    path: Path

    @property
    def mib(self) -> float:
        return self.path.stat().st_size / 2 ** 20


def _pip(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [l for l in proc.stderr.splitlines() if l.strip() and "is ignored" not in l]
        raise SystemExit(f"pip {args[0]} failed: " + " | ".join(lines[-3:]))


def _target(python: str) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def resolve(reqs: list[str], python: str) -> dict[str, dict]:
    """pip's resolution of ``reqs`` for the target: normalized name → its report entry's
    metadata (name, version, requires_dist)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        _pip("install", "--dry-run", "--quiet", "--ignore-installed", "--report", str(report),
             "--target", str(Path(tmp) / "target"), *_target(python), *reqs)
        found = json.loads(report.read_text())["install"]
    return {normalize(item["metadata"]["name"]): item["metadata"] for item in found}


def needed(reqs: list[str], resolved: dict[str, dict], have: set[str],
           python: str) -> list[str]:
    """What the target lacks: the distributions reachable from ``reqs`` through their
    requirements (markers evaluated for the target, extras as asked), not walking into those
    the target has (torch's own CUDA libraries are the image's business)."""
    from packaging.requirements import Requirement

    env = {"python_version": python, "python_full_version": f"{python}.0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "implementation_name": "cpython", "platform_python_implementation": "CPython",
           "os_name": "posix"}
    todo = [Requirement(r) for r in reqs]
    found: list[str] = []
    while todo:
        req = todo.pop()
        name = normalize(req.name)
        if name in have or name in found or name not in resolved:
            continue
        found.append(name)
        for dep in resolved[name].get("requires_dist") or []:
            dep = Requirement(dep)
            extras = set(req.extras) or {""}
            if dep.marker is None or any(dep.marker.evaluate({**env, "extra": e})
                                         for e in extras):
                todo.append(dep)
    return found


def slim_ray(wheel: Path) -> Path:
    """Ray's wheel rewritten without :data:`RAY_UNUSED` (its RECORD too); same file name."""
    slimmed = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slimmed, "w",
                                                        zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(RAY_UNUSED):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(line for line in data.decode().splitlines(keepends=True)
                               if not line.startswith(RAY_UNUSED)).encode()
            dst.writestr(info, data)
    slimmed.replace(wheel)
    return wheel


def build(out: Path, have: set[str], python: str = "3.12", slim: bool = True,
          max_mib: float = 60.0, dashboard: bool = True, extras: tuple = ()) -> dict:
    """The wheelhouse in ``out``: wheels, ``requirements.txt``; a report of what it holds."""
    out.mkdir(parents=True, exist_ok=True)
    wanted = requirements(dashboard, extras)
    resolved = resolve(wanted, python)
    missing = [(resolved[n]["name"], resolved[n]["version"])
               for n in needed(wanted, resolved, have, python)]
    for old in out.glob("*.whl"):
        old.unlink()
    if missing:
        _pip("download", "--quiet", "--no-deps", "--dest", str(out), *_target(python),
             *(f"{n}=={v}" for n, v in missing))
    wheels = []
    for name, version in missing:
        stem = normalize(name).replace("-", "_")
        path = next(p for p in out.glob("*.whl") if normalize(p.name.split("-")[0]).replace(
            "-", "_") == stem)
        if slim and normalize(name) == "ray":
            slim_ray(path)
        wheels.append(Wheel(name, version, path))
    (out / "requirements.txt").write_text("".join(f"{w.name}=={w.version}\n" for w in wheels))
    total = sum(w.mib for w in wheels)
    report = {"python": python, "wheels": {w.name: [w.version, round(w.mib, 2)] for w in wheels},
              "total_mib": round(total, 1), "skipped_present": len(resolved) - len(missing)}
    if total > max_mib:
        biggest = ", ".join(f"{w.path.name} {w.mib:.1f} MiB"
                            for w in sorted(wheels, key=lambda w: -w.mib)[:3])
        raise SystemExit(f"the wheelhouse is {total:.1f} MiB, over --max-mib {max_mib:g} "
                         f"(largest: {biggest})")
    return report
