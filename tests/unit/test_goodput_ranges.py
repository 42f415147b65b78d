# moved verbatim from tests/unit/test_periphery_hardening.py (split by subject, issue 24)
"""Goodput inputs are held to a sane range, through the API and ``dcp-volumes plan`` (issue 18
#8), without servers.
"""

from __future__ import annotations

from typing import Any

import pytest
from _cli import run_cli

from dcp_volumes import errors
from dcp_volumes.cli._exit import EXIT_USAGE
from dcp_volumes.goodput import FailureModel, TierCosts, plan_intervals


@pytest.mark.parametrize(("flags", "match"), [
    (["--fleet-mtbf-hours", "1e-300", "--fleet-gpus", "8"], "fleet_mtbf_hours"),
    (["--fleet-mtbf-hours", "1e300", "--fleet-gpus", "8"], "fleet_mtbf_hours"),
    (["--afr", "0.05", "--restart-cost-s", "1e300"], "restart_cost_s"),
    (["--afr", "0.05", "--job-hours", "1e300"], "job_hours"),
    (["--afr", "1e300"], "afr"),
], ids=["mtbf-tiny", "mtbf-huge", "restart-huge", "job-hours-huge", "afr-huge"])
def test_plan_refuses_out_of_range_inputs_naming_the_range(flags: list[str], match: str
                                                           ) -> None:
    result = run_cli("plan", "--gpus", "8", "--checkpoint-cost-s", "60", *flags)
    assert result.returncode == EXIT_USAGE, result
    assert match in result.stderr
    assert "valid range" in result.stderr or "fraction per GPU-year" in result.stderr


@pytest.mark.parametrize("build", [
    lambda: FailureModel(gpus=10**12, afr=0.05),
    lambda: plan_intervals(FailureModel(gpus=8, afr=0.05), checkpoint_cost_s=1e300),
    lambda: plan_intervals(FailureModel(gpus=8, afr=0.05), checkpoint_cost_s=60,
                           intervals_s=[1e300]),
    lambda: TierCosts(local_save_s=1, remote_save_s=1e300, local_survives=0.5),
], ids=["gpus", "checkpoint-cost", "interval", "tier-cost"])
def test_goodput_inputs_have_a_sane_range(build: Any) -> None:
    with pytest.raises(errors.ConfigError, match="valid range"):
        build()
