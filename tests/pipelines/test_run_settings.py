"""KFP 2.17's run-level settings (`dsl.PipelineConfig`): the config's TTLs and deadline in the compiled package."""

from __future__ import annotations

import pytest
import yaml

from rangefinder.config import parse_config
from rangefinder.errors import ConfigError
from rangefinder.pipelines.pipeline import compile_pipeline


def _pipeline_config(cfg, tmp_path) -> dict:
    path = compile_pipeline(cfg, str(tmp_path / "p.yaml"))
    docs = list(yaml.load_all(open(path), Loader=yaml.CSafeLoader))  # libyaml: the pure-Python parser took seconds
    return docs[1]["platforms"]["kubernetes"].get("pipelineConfig", {})


def test_the_configs_ttls_and_deadline_are_compiled_into_the_package(tmp_path):
    cfg = parse_config({"kubernetes": {"ttl_seconds_after_finished": 86400, "ttl_seconds_after_success": 3600,
                                       "ttl_seconds_after_failure": 259200, "active_deadline_seconds": 172800}})
    assert _pipeline_config(cfg, tmp_path) == {
        "resourceTtlOnCompletion": 86400, "resourceTtlOnSuccess": 3600, "resourceTtlOnFailure": 259200,
        "activeDeadlineSeconds": 172800,
    }


def test_the_default_keeps_a_finished_run_for_a_week_and_sets_no_deadline(tmp_path):
    assert _pipeline_config(parse_config({}), tmp_path) == {"resourceTtlOnCompletion": 7 * 24 * 3600}


def test_none_leaves_the_settings_out(tmp_path):
    assert _pipeline_config(parse_config({"kubernetes": {"ttl_seconds_after_finished": None}}), tmp_path) == {}


@pytest.mark.parametrize("field,value", [("ttl_seconds_after_failure", -1), ("active_deadline_seconds", 0),
                                         ("ttl_seconds_after_finished", 2**31)])
def test_an_out_of_range_setting_is_one_config_error_naming_it(field, value):
    with pytest.raises(ConfigError, match=f"kubernetes.{field}"):
        parse_config({"kubernetes": {field: value}})
