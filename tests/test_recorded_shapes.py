"""Shapes recorded by a profile of the served scenario replace the config's placeholders."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import config_with
from harness.errors import HarnessError
from harness.evaluate import device_shapes
from harness.targets import TARGETS


def test_recorded_shapes_become_the_served_cases(tmp_path):
    recorded = tmp_path / "profile.json"
    recorded.write_text(json.dumps({"served_shapes": {
        "decode": [{"batch": 7, "lengths": [3, 9], "weight": 0.9}, {"batch": 1, "lengths": [30, 30], "weight": 0.1}],
        "prefill": []}}))
    cfg = config_with(**{"served.recorded_shapes": str(recorded)})
    shapes = device_shapes(cfg, "attention", torch.device("cpu"))
    decode = [c for c in TARGETS["attention"].served_cases(shapes) if c.op == "decode"]
    assert [(c.params["batch"], c.params["length_range"]) for c in decode] == [(7, (3, 9)), (1, (30, 30))]
    assert shapes.prefill == cfg.targets.attention.cpu.prefill          # none recorded: placeholders stay


def test_a_missing_recorded_shapes_file_is_a_one_line_error(tmp_path):
    cfg = config_with(**{"served.recorded_shapes": str(tmp_path / "nope.json")})
    with pytest.raises(HarnessError, match="no such recorded-shapes file"):
        device_shapes(cfg, "attention", torch.device("cpu"))
