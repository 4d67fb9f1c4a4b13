"""`service serve` refuses, before it writes any state, the configs whose guarantee it could
not keep: a generated population (its users repeat, so its epsilon protects nobody). (Secagg with
adaptive clipping is served since the clipped bit is masked with the update: test_secagg_adaptive.)
Driven through `boot`, which the CLI calls, so a missing check fails here instead of
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
])
def test_serve_refuses_a_config_whose_guarantee_it_cannot_keep(tmp_path, data, dp, agg, message):
    config = tmp_path / "run.toml"
    config.write_text(BASE.format(data=data, dp=dp, agg=agg))
    state = tmp_path / "state"
    with pytest.raises(DpfleetError, match=message):
        boot(load_config(config), state, log=lambda s: None)
    assert not state.exists()  # nothing written



@pytest.mark.parametrize("text, message", [
    # simulator-only knobs mean nothing to devices that train by themselves
    (BASE.format(data="", dp="", agg="secagg") + "[backend]\nkind = \"ray\"\n",
     "backend.kind must be 'local'"),
])
def test_serve_refuses_what_only_the_service_checks(tmp_path, text, message):
    """boot's own refusals (the config parser accepts these), each before any state is written."""
    config = tmp_path / "run.toml"
    config.write_text(text)
    state = tmp_path / "state"
    with pytest.raises(DpfleetError, match=message):
        boot(load_config(config), state, log=lambda s: None)
    assert not state.exists()  # nothing written
