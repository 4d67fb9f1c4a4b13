"""The operator's client of the admin API lives with the protocol (`dpfleet.edge.wire.admin_client`),
where the emulated fleet, which may not import the service, uses it too; these are its names."""

from dpfleet.edge.wire.admin_client import (  # noqa: F401
    AdminClient,
    AdminTarget,
    target_from_state,
    target_from_url,
)
