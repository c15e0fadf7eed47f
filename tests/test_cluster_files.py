"""Lint of the cluster definitions in cluster/ (fast; no Ray is started).

- every YAML file parses;
- cluster/ray-cluster.yaml validates against the ray-schema.json of the installed Ray and
  survives Ray's own config preparation; its start commands run against a stand-in `ray`;
- the KubeRay manifests use only fields of the KubeRay CRDs (tests/data/kuberay_fields.json,
  derived from the CRD files by tests/data/derive_kuberay_fields.py) and keep the PPU settings
  and secure defaults;
- cluster/runtime_env.yaml is a valid runtime_env without secrets;
- both start scripts pass `bash -n` and, run with a stand-in `ray` first on PATH, start Ray with
  the PPU count, environment, dashboard address and token handling they promise.
"""

from __future__ import annotations

import ast
import copy
import importlib.metadata
import importlib.util
import json
import os
import re
import stat
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "cluster"
SCRIPTS = ["start-head.sh", "start-ppu-worker.sh"]
YAML_FILES = sorted(CLUSTER.rglob("*.yaml"))
FIELDS = json.loads((REPO / "tests" / "data" / "kuberay_fields.json").read_text())
FAKE_TOKEN = "fake-token-0f9e8d7c6b5a"
GENERATED_TOKEN = "generated-token-1a2b3c4d5e6f"


def unit_instance_resources() -> str:
    """The value ray_ppu itself uses (read from the source: importing it pulls in torch)."""
    tree = ast.parse((REPO / "ray_ppu" / "launch" / "launcher.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                getattr(t, "id", None) == "UNIT_INSTANCE_RESOURCES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("UNIT_INSTANCE_RESOURCES not found in ray_ppu/launch/launcher.py")


def load(rel: str):
    return yaml.safe_load((CLUSTER / rel).read_text())


# --------------------------------------------------------------------------- YAML syntax


def test_cluster_dir_has_all_definitions():
    names = {p.relative_to(CLUSTER).as_posix() for p in CLUSTER.rglob("*") if p.is_file()}
    assert {"start-head.sh", "start-ppu-worker.sh", "ray-cluster.yaml", "runtime_env.yaml",
            "README.md", "kuberay/raycluster.yaml", "kuberay/rayjob.yaml"} <= names


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.relative_to(CLUSTER).as_posix())
def test_yaml_parses(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs), f"{path}: no mapping document"


# --------------------------------------------------------------------------- cluster launcher


def ray_schema() -> dict:
    spec = importlib.util.find_spec("ray")
    return json.loads((Path(spec.origin).parent / "autoscaler" / "ray-schema.json").read_text())


def test_cluster_launcher_yaml_validates_against_ray_schema():
    jsonschema.validate(load("ray-cluster.yaml"), ray_schema())


def test_ray_schema_check_can_fail():
    cfg = load("ray-cluster.yaml")
    cfg["min_workers"] = 2  # not a top-level field of Ray's schema
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cfg, ray_schema())


def test_cluster_launcher_yaml_survives_ray_prepare_config():
    # What `ray up` does before anything else: fill in the provider's defaults, then validate.
    # The local provider aborts here on available_node_types, so the roles live in the commands.
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = load("ray-cluster.yaml")
    assert "available_node_types" not in cfg
    prepared = prepare_config(copy.deepcopy(cfg))
    validate_config(prepared)
    (node_type,) = prepared["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == len(cfg["provider"]["worker_ips"])


def test_cluster_launcher_copies_token_and_keeps_it_private():
    cfg = load("ray-cluster.yaml")
    assert cfg["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token"}
    assert any("chmod 600 ~/.ray/auth_token" in c for c in cfg["setup_commands"])


# --------------------------------------------------------------------------- stand-in ray

FAKE_RAY = r"""#!/usr/bin/env bash
# Stand-in for the ray CLI: records arguments and environment per sub-command.
sub="$1"
printf '%s\n' "$@" > "$FAKE_RAY_DIR/$sub.args"
env > "$FAKE_RAY_DIR/$sub.env"
if [[ "$sub" == get-auth-token ]]; then
  # As the real command: write the token file, print the token on stdout.
  mkdir -p "$HOME/.ray"
  printf '%s' "$FAKE_GENERATED_TOKEN" > "$HOME/.ray/auth_token"
  printf '%s' "$FAKE_GENERATED_TOKEN"
  echo >&2
fi
"""

FAKE_PYTHON = r"""#!/usr/bin/env bash
# Stand-in interpreter for PPU detection: prints what torch.cuda.device_count() would.
touch "$FAKE_RAY_DIR/python.called"
[[ -n "${FAKE_DEVICE_COUNT:-}" ]] || exit 1
echo "$FAKE_DEVICE_COUNT"
"""


class Run:
    """One script run against the stand-in ray."""

    def __init__(self, proc: subprocess.CompletedProcess, logs: Path):
        self.proc, self.logs = proc, logs
        self.output = proc.stdout + proc.stderr

    def called(self, sub: str) -> bool:
        return (self.logs / f"{sub}.args").exists()

    def args(self, sub: str = "start") -> list[str]:
        return (self.logs / f"{sub}.args").read_text().splitlines()

    def flag(self, name: str, sub: str = "start") -> str | None:
        values = [a.split("=", 1)[1] for a in self.args(sub) if a.startswith(f"--{name}=")]
        assert len(values) <= 1, values
        return values[0] if values else None

    def env(self, sub: str = "start") -> dict[str, str]:
        out = {}
        for line in (self.logs / f"{sub}.env").read_text().splitlines():
            if "=" in line:
                key, value = line.split("=", 1)
                out[key] = value
        return out

    def ppu(self) -> float:
        return json.loads(self.flag("resources"))["PPU"]


@pytest.fixture
def sandbox(tmp_path):
    """bin/ with the stand-ins, a private HOME, and a clean environment."""
    bin_dir, home, logs = tmp_path / "bin", tmp_path / "home", tmp_path / "logs"
    for d in (bin_dir, home, logs):
        d.mkdir()
    for name, text in (("ray", FAKE_RAY), ("python", FAKE_PYTHON)):
        exe = bin_dir / name
        exe.write_text(text)
        exe.chmod(0o755)
    system_path = os.pathsep.join(p for p in ("/usr/local/bin", "/usr/bin", "/bin") if Path(p).is_dir())
    base_env = {
        "PATH": f"{bin_dir}{os.pathsep}{system_path}",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "FAKE_RAY_DIR": str(logs),
        "FAKE_GENERATED_TOKEN": GENERATED_TOKEN,
        "FAKE_DEVICE_COUNT": "0",  # what torch on a machine without PPUs reports
    }

    def run_cmd(argv: list[str], **env: str) -> Run:
        for f in logs.iterdir():
            f.unlink()
        proc = subprocess.run(argv, env={**base_env, **env}, capture_output=True, text=True,
                              timeout=30, cwd=REPO)
        return Run(proc, logs)

    def run(script: str, **env: str) -> Run:
        return run_cmd(["bash", str(CLUSTER / script)], **env)

    run.cmd = run_cmd
    run.home = home
    return run


def write_token(home: Path, value: str = FAKE_TOKEN) -> Path:
    path = home / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_text(value)
    path.chmod(0o600)
    return path


def assert_training_env(env: dict[str, str]) -> None:
    units = env["RAY_custom_unit_instance_resources"]
    assert "PPU" in units.split(",")
    assert units == unit_instance_resources()
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert env["RAY_AUTH_MODE"] == "token"
    assert "NCCL_QUADRUPLE_CHANNELS" not in env


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_syntax(script):
    subprocess.run(["bash", "-n", str(CLUSTER / script)], check=True, timeout=10)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_header(script):
    text = (CLUSTER / script).read_text()
    assert text.startswith("#!/usr/bin/env bash\n#")
    assert "set -euo pipefail" in text
    assert "Usage" in text.split("set -euo pipefail")[0]
    code = re.sub(r"awk '[^']*'", "", text)  # awk's own $1 is no positional argument
    assert not re.search(r"\$\{?[0-9@*#]", code.replace("$0", "")), "positional arguments used"


# ----- head


def test_head_defaults(sandbox):
    r = sandbox("start-head.sh", NCCL_QUADRUPLE_CHANNELS="4")
    assert r.proc.returncode == 0, r.output
    assert "--head" in r.args()
    assert r.ppu() == 0
    assert r.flag("dashboard-host") == "127.0.0.1"
    assert_training_env(r.env())


def test_head_ppu_count_and_dashboard_host_overrides(sandbox):
    write_token(sandbox.home)
    r = sandbox("start-head.sh", PPU_COUNT="16", DASHBOARD_HOST="10.1.2.3")
    assert r.proc.returncode == 0, r.output
    assert r.ppu() == 16
    assert r.flag("dashboard-host") == "10.1.2.3"
    assert "10.1.2.3" in r.proc.stdout


def test_head_rejects_bad_ppu_count(sandbox):
    r = sandbox("start-head.sh", PPU_COUNT="sixteen")
    assert r.proc.returncode != 0 and not r.called("start")


def test_head_generates_token_without_printing_it(sandbox):
    r = sandbox("start-head.sh")
    assert r.proc.returncode == 0, r.output
    assert r.args("get-auth-token") == ["get-auth-token", "--generate"]
    token = sandbox.home / ".ray" / "auth_token"
    assert token.read_text() == GENERATED_TOKEN
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert GENERATED_TOKEN not in r.output
    assert str(token) in r.proc.stdout  # names the file instead


def test_head_keeps_existing_token_file(sandbox):
    write_token(sandbox.home)
    r = sandbox("start-head.sh")
    assert r.proc.returncode == 0, r.output
    assert not r.called("get-auth-token")
    assert FAKE_TOKEN not in r.output
    assert r.env()["RAY_AUTH_MODE"] == "token"


def test_head_never_prints_token_from_environment(sandbox):
    r = sandbox("start-head.sh", RAY_AUTH_TOKEN=FAKE_TOKEN)
    assert r.proc.returncode == 0, r.output
    assert not r.called("get-auth-token")
    assert r.env()["RAY_AUTH_TOKEN"] == FAKE_TOKEN  # handed to ray start ...
    assert FAKE_TOKEN not in r.output                # ... never shown


def test_head_token_path_must_exist(sandbox, tmp_path):
    r = sandbox("start-head.sh", RAY_AUTH_TOKEN_PATH=str(tmp_path / "missing"))
    assert r.proc.returncode != 0 and not r.called("start")


def test_head_prints_how_to_submit(sandbox):
    r = sandbox("start-head.sh")
    out = r.proc.stdout
    assert "ray job submit --address http://127.0.0.1:8265" in out
    assert "RAY_AUTH_MODE=token" in out and "RAY_AUTH_TOKEN_PATH=" in out
    assert "ssh -N -L 8265:127.0.0.1:8265" in out
    assert "start-ppu-worker.sh" in out


def test_head_passes_extra_ray_start_args(sandbox):
    r = sandbox("start-head.sh", RAY_START_ARGS="--num-cpus=32 --temp-dir=/tmp/r")
    assert r.flag("num-cpus") == "32" and r.flag("temp-dir") == "/tmp/r"


def test_head_auth_opt_out_is_loud(sandbox):
    r = sandbox("start-head.sh", RAY_AUTH_MODE="disabled")
    assert r.proc.returncode == 0, r.output
    assert r.env()["RAY_AUTH_MODE"] == "disabled"
    assert "OFF" in r.proc.stderr
    assert sandbox("start-head.sh", RAY_AUTH_MODE="tokn").proc.returncode != 0


# ----- PPU worker


def test_worker_requires_head_address(sandbox):
    write_token(sandbox.home)
    r = sandbox("start-ppu-worker.sh")
    assert r.proc.returncode != 0 and "HEAD_ADDRESS" in r.proc.stderr
    assert not r.called("start")


def test_worker_detection_falls_back_to_16(sandbox):
    # This machine has no PPU: torch.cuda.device_count() reports 0.
    write_token(sandbox.home)
    r = sandbox("start-ppu-worker.sh", HEAD_ADDRESS="10.0.0.1:6379", NCCL_QUADRUPLE_CHANNELS="4")
    assert r.proc.returncode == 0, r.output
    assert (r.logs / "python.called").exists()
    assert r.ppu() == 16
    assert r.flag("address") == "10.0.0.1:6379"
    assert "--head" not in r.args()
    assert_training_env(r.env())


def test_worker_detection_without_python(sandbox):
    write_token(sandbox.home)
    r = sandbox("start-ppu-worker.sh", HEAD_ADDRESS="10.0.0.1:6379", PYTHON="/nonexistent/python")
    assert r.proc.returncode == 0, r.output
    assert r.ppu() == 16


def test_worker_uses_detected_count(sandbox):
    write_token(sandbox.home)
    r = sandbox("start-ppu-worker.sh", HEAD_ADDRESS="10.0.0.1:6379", FAKE_DEVICE_COUNT="8")
    assert r.proc.returncode == 0, r.output
    assert r.ppu() == 8


def test_worker_ppu_count_override(sandbox):
    write_token(sandbox.home)
    r = sandbox("start-ppu-worker.sh", HEAD_ADDRESS="10.0.0.1:6379", PPU_COUNT="8")
    assert r.proc.returncode == 0, r.output
    assert r.ppu() == 8
    assert not (r.logs / "python.called").exists()


def test_worker_refuses_to_start_without_token(sandbox):
    r = sandbox("start-ppu-worker.sh", HEAD_ADDRESS="10.0.0.1:6379")
    assert r.proc.returncode != 0
    assert not r.called("start") and not r.called("get-auth-token")
    assert "auth_token" in r.proc.stderr


def test_worker_never_prints_token(sandbox):
    r = sandbox("start-ppu-worker.sh", HEAD_ADDRESS="10.0.0.1:6379", RAY_AUTH_TOKEN=FAKE_TOKEN)
    assert r.proc.returncode == 0, r.output
    assert r.env()["RAY_AUTH_TOKEN"] == FAKE_TOKEN
    assert FAKE_TOKEN not in r.output
    token = write_token(sandbox.home)
    r = sandbox("start-ppu-worker.sh", HEAD_ADDRESS="10.0.0.1:6379", RAY_AUTH_TOKEN_PATH=str(token))
    assert r.proc.returncode == 0, r.output
    assert FAKE_TOKEN not in r.output


# ----- the cluster launcher's start commands, run the same way


@pytest.mark.parametrize("role", ["head", "worker"])
def test_cluster_launcher_start_commands(sandbox, role):
    cfg = load("ray-cluster.yaml")
    commands = cfg[f"{role}_start_ray_commands"]
    assert commands[0] == "ray stop"
    r = sandbox.cmd(["bash", "-c", commands[-1]], RAY_HEAD_IP="192.0.2.10",
                    NCCL_QUADRUPLE_CHANNELS="4")
    assert r.proc.returncode == 0, r.output
    assert_training_env(r.env())
    if role == "head":
        assert "--head" in r.args() and r.ppu() == 0
        assert r.flag("dashboard-host") == "127.0.0.1"
    else:
        assert r.flag("address") == "192.0.2.10:6379" and r.ppu() == 16


# --------------------------------------------------------------------------- KubeRay

SCALARS = {"string": str, "boolean": bool, "integer": int, "number": (int, float)}


def type_ok(value, kind: str) -> bool:
    if kind in FIELDS or kind == "object":  # another table, or a plain object
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    if kind == "int-or-string":
        return isinstance(value, (int, str)) and not isinstance(value, bool)
    if kind in SCALARS:
        return isinstance(value, SCALARS[kind]) and (kind == "boolean" or not isinstance(value, bool))
    return True


def lint(doc: dict, table: str) -> list[str]:
    """Paths of `doc` that its table in kuberay_fields.json does not allow, with the reason."""
    errors: list[str] = []

    def visit(value, name: str, rel: str, where: str) -> None:
        paths, required = FIELDS[name]["paths"], FIELDS[name]["required"]
        if isinstance(value, dict):
            errors.extend(f"{where}: missing required field {k!r}"
                          for k in required.get(rel, []) if k not in value)
            for key, sub in value.items():
                child = f"{rel}.{key}" if rel else key
                at = f"{where}.{key}"
                star = f"{rel}.*" if rel else "*"
                if child in paths:
                    kind = paths[child]
                elif star in paths:
                    child, kind = star, paths[star]  # any key of a map
                else:
                    errors.append(f"{at}: no field {child!r} in {name}")
                    continue
                if not type_ok(sub, kind):
                    errors.append(f"{at}: {type(sub).__name__} where {kind} is expected")
                elif kind in FIELDS:
                    visit(sub, kind, "", at)
                elif isinstance(sub, (dict, list)):
                    visit(sub, name, child, at)
        elif isinstance(value, list):
            item = f"{rel}[]"
            if item not in paths:
                errors.append(f"{where}: items of {rel!r} are not in the derived list")
                return
            for i, sub in enumerate(value):
                if not type_ok(sub, paths[item]):
                    errors.append(f"{where}[{i}]: {type(sub).__name__} where {paths[item]} is expected")
                elif isinstance(sub, dict):
                    visit(sub, name, item, f"{where}[{i}]")

    visit(doc, table, "", table)
    return errors


KUBE_FILES = {"kuberay/raycluster.yaml": "RayCluster", "kuberay/rayjob.yaml": "RayJob",
              "kuberay/shared-pvc.yaml": "PersistentVolumeClaim"}


def test_kuberay_fields_file_names_its_source():
    assert "ray-project/kuberay" in FIELDS["_source"]
    assert "ray.io_rayclusters.yaml" in FIELDS["_source"] and "ray.io_rayjobs.yaml" in FIELDS["_source"]
    assert FIELDS["RayClusterSpec"]["paths"]["workerGroupSpecs[].rayStartParams.*"] == "string"


@pytest.mark.parametrize("rel,kind", KUBE_FILES.items())
def test_kube_manifest_uses_only_known_fields(rel, kind):
    doc = load(rel)
    assert doc["kind"] == kind
    assert lint(doc, kind) == []


def _worker(doc):
    return doc["spec"]["workerGroupSpecs"][0]


def _container(group):
    return group["template"]["spec"]["containers"][0]


MUTATIONS = {
    "misspelt group field": lambda d: _worker(d).update(rayStartParam={}),
    "misspelt container field": lambda d: _container(_worker(d)).update(volumeMount=[]),
    "integer env value": lambda d: _container(_worker(d))["env"][1].update(value=1),
    "integer rayStartParams value": lambda d: _worker(d)["rayStartParams"].update({"num-cpus": 8}),
    "missing groupName": lambda d: _worker(d).pop("groupName"),
    "unknown top-level spec field": lambda d: d["spec"].update(headGroup={}),
    "child of an opaque field": lambda d: d["spec"].update(networkPolicy={"head": {}}),
}


@pytest.mark.parametrize("mutation", MUTATIONS, ids=list(MUTATIONS))
def test_kube_lint_can_fail(mutation):
    doc = load("kuberay/raycluster.yaml")
    MUTATIONS[mutation](doc)
    assert lint(doc, "RayCluster"), mutation


def cluster_specs():
    return [("raycluster", load("kuberay/raycluster.yaml")["spec"]),
            ("rayjob", load("kuberay/rayjob.yaml")["spec"]["rayClusterSpec"])]


def test_rayjob_cluster_matches_raycluster():
    (_, a), (_, b) = cluster_specs()
    assert a == b


@pytest.mark.parametrize("name,spec", cluster_specs(), ids=["raycluster", "rayjob"])
def test_kuberay_ppu_settings_and_secure_defaults(name, spec):
    assert spec["rayVersion"] == importlib.metadata.version("ray")
    assert spec["authOptions"]["mode"] == "token"
    head, workers = spec["headGroupSpec"], spec["workerGroupSpecs"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    assert not head.get("enableIngress", False)
    assert "dashboard-host" not in head["rayStartParams"]
    assert head["resources"]["PPU"] == "0"
    assert [g["resources"]["PPU"] for g in workers] == ["16"]
    for group in [head, *workers]:
        pod = group["template"]["spec"]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in pod["volumes"] if "persistentVolumeClaim" in v}
        for c in pod["containers"]:
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert "PPU" in env["RAY_custom_unit_instance_resources"].split(",")
            assert env["RAY_custom_unit_instance_resources"] == unit_instance_resources()
            assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
            assert not {"RAY_AUTH_TOKEN", "RAY_AUTH_MODE"} & env.keys()  # KubeRay sets them
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert claims[mounts["/mnt/shared"]] == load("kuberay/shared-pvc.yaml")["metadata"]["name"]
    # The PPU device request: an extended resource (vendor-specific name) of 16 per worker pod.
    limits = _container(workers[0])["resources"]["limits"]
    extended = {k: v for k, v in limits.items() if k not in ("cpu", "memory")}
    assert list(extended.values()) == ["16"]
    assert "PLACEHOLDER" in (CLUSTER / "kuberay" / "raycluster.yaml").read_text()


def test_shared_volume_is_read_write_many():
    assert load("kuberay/shared-pvc.yaml")["spec"]["accessModes"] == ["ReadWriteMany"]


def test_rayjob_entrypoint_and_runtime_env():
    from ray.runtime_env import RuntimeEnv

    spec = load("kuberay/rayjob.yaml")["spec"]
    assert spec["entrypoint"] == "python entrypoints/pretrain.py --config /mnt/shared/run.yaml"
    env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert set(env) <= RuntimeEnv.known_fields
    assert env["working_dir"] == "/opt/ray_ppu"  # the repository inside the image
    RuntimeEnv(**{**env, "working_dir": str(REPO)})  # Ray checks the directory exists
    assert {"outputs/", ".venv/"} <= set(env["excludes"])
    assert env["env_vars"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


# --------------------------------------------------------------------------- runtime_env


def test_runtime_env_example():
    from ray.runtime_env import RuntimeEnv

    env = load("runtime_env.yaml")
    assert set(env) <= RuntimeEnv.known_fields, set(env) - RuntimeEnv.known_fields
    RuntimeEnv(**env)  # Ray's own type checks (e.g. env_vars values must be strings)
    assert {"outputs/", ".venv/"} <= set(env["excludes"])
    assert env["env_vars"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "working_dir" not in env  # given by --working-dir on the command line


def test_no_secrets_in_cluster_files():
    words = ("TOKEN", "SECRET", "PASSWORD", "ACCESS_KEY")
    env = load("runtime_env.yaml").get("env_vars", {})
    assert not [k for k in env if any(w in k.upper() for w in words)]
    for path in YAML_FILES:
        text = path.read_text()
        assert "access_key" not in text and "Bearer " not in text, path


def test_stand_in_ray_shadows_the_real_one(sandbox):
    # Guards the script tests: `ray` inside the scripts must be the stand-in.
    r = sandbox.cmd(["bash", "-c", "command -v ray; command -v python"])
    assert r.proc.stdout.split() == [str(sandbox.home.parent / "bin" / n) for n in ("ray", "python")]
