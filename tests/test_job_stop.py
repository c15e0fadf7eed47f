"""`ray job stop` saves: every cluster definition gives the stop its save, and a job warns
when the wait it runs under is shorter."""

import logging
import re

import yaml

from conftest import REPO
from ray_ppu.config.loader import load
from ray_ppu.launch.job_stop import check_stop_wait

STOP_TIMEOUT = load(None, ["data.data_path=[x]"]).checkpoint.stop_timeout_s


def test_every_head_definition_waits_longer_than_a_stop_save():
    head = (REPO / "cluster" / "start-head.sh").read_text()
    wait = re.search(r'RAY_JOB_STOP_WAIT_TIME_S="\$\{RAY_JOB_STOP_WAIT_TIME_S:-(\d+)\}"', head)
    assert wait and int(wait.group(1)) > STOP_TIMEOUT
    launcher = yaml.safe_load((REPO / "cluster" / "ray-cluster.yaml").read_text())
    command = " ".join(launcher["head_start_ray_commands"])
    assert int(re.search(r"RAY_JOB_STOP_WAIT_TIME_S=(\d+)", command).group(1)) > STOP_TIMEOUT
    for name in ("raycluster.yaml", "rayjob.yaml"):
        text = (REPO / "cluster" / "kuberay" / name).read_text()
        docs = [d for d in yaml.safe_load_all(text) if d]
        spec = docs[-1]["spec"]
        spec = spec.get("rayClusterSpec", spec)
        env = spec["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
        values = {e["name"]: e.get("value") for e in env}
        assert int(values["RAY_JOB_STOP_WAIT_TIME_S"]) > STOP_TIMEOUT, name


def test_a_submitted_job_warns_when_the_stop_wait_is_short(monkeypatch, caplog):
    cfg = load(None, ["data.data_path=[x]"])
    monkeypatch.delenv("RAY_JOB_STOP_WAIT_TIME_S", raising=False)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    with caplog.at_level(logging.WARNING, logger="ray_ppu"):
        check_stop_wait(cfg)  # not a submitted job: nothing to say
        assert not caplog.records
        monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
        check_stop_wait(cfg)  # Ray's default wait, 3 s
        assert "kills this job 3 s after" in caplog.text and "RAY_JOB_STOP_WAIT_TIME_S=330" in caplog.text
        caplog.clear()
        monkeypatch.setenv("RAY_JOB_STOP_WAIT_TIME_S", "330")
        check_stop_wait(cfg)
        assert not caplog.records
