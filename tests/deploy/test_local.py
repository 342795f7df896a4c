"""`megaserve up` refuses a bad Serve config in one message, before Ray starts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

BUILDER = "megaserve.deploy.builder:build_app"


def _up(config_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megaserve.deploy.cli", "up", str(config_path)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("config", "message"), [
    (None, "No such file or directory"),
    ("applications: [\n", "while parsing"),
    (yaml.safe_dump({"http_options": {"port": 8000}}), "a Serve config needs an `applications` list"),
    (yaml.safe_dump({"applications": [{"name": "x"}]}), "every application needs an `import_path`"),
    (yaml.safe_dump({"applications": [{"import_path": BUILDER, "args": {"latency": {"tp_size": 0}}}]}),
     "latency.tp_size\n  Input should be greater than or equal to 1"),
    (yaml.safe_dump({"applications": [{"import_path": BUILDER, "runtime_env": {"pip": ["x"]},
                                       "deployments": [{"name": "RouterDeployment"}]}],
                     "logging_config": {"encoding": "JSON"}}),
     "megaserve up does not apply logging_config, applications[].deployments, applications[].runtime_env; "
     "run the file with `serve run`"),
], ids=["missing-file", "bad-yaml", "no-applications", "no-import-path", "invalid-app-config", "not-applied"])
def test_a_bad_config_is_one_message_and_exit_code_2(tmp_path, config, message):
    path = tmp_path / "serve.yaml"
    if config is not None:
        path.write_text(config)
    done = _up(path)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert "starting Ray" not in done.stdout
