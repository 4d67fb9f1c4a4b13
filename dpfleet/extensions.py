"""Extension points: the parts of a DP-FTRL run researchers change, as typed protocols.

This is the public face of `dpfleet.coordinator.engine.extensions`, where the protocols, the
built-in implementations and the guards live (the coordinator's layer: the engine needs them and
must not import the front door). Pass your own to `dpfleet.simulate(config, client_update=...,
clipping=..., noise=..., participation=...)`; see that module for what each protocol promises.
"""

from dpfleet.coordinator.engine.extensions import (  # noqa: F401 (re-exported)
    ClippingRule,
    DisjointPolicy,
    Eligible,
    LocalSGD,
    LocalUpdate,
    MatrixMechanism,
    Mechanism,
    NoiseStream,
    ParticipationPolicy,
    TreeMechanism,
    UniformPolicy,
    check_clipped,
    check_selection,
    clip_l2,
)

__all__ = [
    'ClippingRule', 'DisjointPolicy', 'Eligible', 'LocalSGD', 'LocalUpdate', 'MatrixMechanism',
    'Mechanism', 'NoiseStream', 'ParticipationPolicy', 'TreeMechanism', 'UniformPolicy',
    'check_clipped', 'check_selection', 'clip_l2'
]
