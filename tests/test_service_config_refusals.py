"""`coordinator serve` refuses, before it writes any state, the configs whose guarantee it could
not keep: a generated population (its users repeat, so its epsilon protects nobody) and secagg
with adaptive clipping (refused by the config itself: each device's clipped bit would leave in
the clear). Driven through `boot`, which the CLI calls, so a missing check fails here instead of
starting a server that waits for devices."""

import pytest

from dpfleet.coordinator.config import load_config
from dpfleet.errors import DpfleetError
from dpfleet.service.boot import boot

BASE = ("rounds = 2\nseed = 0\n"
        "[data]\ndataset = \"shakespeare\"\nmax_clients = 20\nmax_examples = 4\neval_examples = 20\n{data}"
        "[model]\narch = \"cifg\"\nembedding_dim = 8\nhidden_dim = 8\nprojection_dim = 8\n"
        "[dp]\nnoise_multiplier = 1.0\nclip_norm = 0.5\nreport_goal = 5\n{dp}"
        "[aggregation]\nkind = \"{agg}\"\n")


@pytest.mark.parametrize("data, dp, agg, message", [
    ("generated_population = 100000\n", "", "plain", "data.generated_population"),
    ("", "adaptive_clipping = true\n", "secagg", "adaptive_clipping with secure aggregation"),
])
def test_serve_refuses_a_config_whose_guarantee_it_cannot_keep(tmp_path, data, dp, agg, message):
    config = tmp_path / "run.toml"
    config.write_text(BASE.format(data=data, dp=dp, agg=agg))
    state = tmp_path / "state"
    with pytest.raises(DpfleetError, match=message):
        boot(load_config(config), state, log=lambda s: None)
    assert not state.exists()  # nothing written


def test_serve_refuses_discrete_noise_with_more_devices_than_the_ring_is_sized_for(tmp_path):
    """Discrete noise's modular ring is planned for report_goal summands: overselected devices
    could wrap the SecAgg sum, so serve refuses before it writes any state."""
    config = tmp_path / "run.toml"
    config.write_text(BASE.format(data="", dp="noise = \"discrete\"\n", agg="secagg")
                      + "[service]\noverselect = 0.4\n")
    state = tmp_path / "state"
    with pytest.raises(DpfleetError, match="ring headroom is planned for report_goal"):
        boot(load_config(config), state, log=lambda s: None)
    assert not state.exists()  # nothing written
