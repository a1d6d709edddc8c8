"""The cluster-launcher configs validate against the schema that ships with Ray, and their
node types are consistent."""

import json
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SCHEMA = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml"])
def test_launcher_config_validates(name):
    config = yaml.safe_load((DEPLOY / name).read_text())
    jsonschema.validate(config, SCHEMA)
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    gpu_types = [n for n, t in types.items() if t["resources"].get("GPU", 0) > 0]
    assert any("h100" in n for n in gpu_types) and any("a100" in n for n in gpu_types)
    assert any("spot" in n or "preemptible" in n for n in gpu_types)
    for n, t in types.items():
        assert 0 <= t["min_workers"] <= t["max_workers"] <= config["max_workers"], n
    assert any("troupe" in c for c in config["setup_commands"])
    assert all("RAY_AUTH_MODE=token" in c for c in config["head_start_ray_commands"] if "start" in c)
