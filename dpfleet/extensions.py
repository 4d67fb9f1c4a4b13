"""Extension points: the parts of a DP-FTRL run researchers change, as typed protocols.

This is the public face of `dpfleet.coordinator.engine.extensions`, where the protocols, the
built-in implementations and the guards live (the coordinator's layer: the engine needs them and
must not import the front door). Pass your own to `dpfleet.simulate(config, client_update=...,
clipping=..., noise=..., participation=...)`; see that module for what each protocol promises.
"""

from dpfleet.coordinator.engine.extensions import *  # noqa: F403 (the public face re-exports)
from dpfleet.coordinator.engine.extensions import __all__  # noqa: F401 (one list, kept there)
