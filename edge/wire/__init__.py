"""The coordinator's wire protocol, in one place: what crosses the network between the service,
its devices (the emulated fleet's, or any real client) and its operator.

It owns the protocol version and its refusal (`protocol`), the URL paths, the names of the files
a coordinator's state directory shares with its fleet (`protocol`), the message shapes with the
checks that turn malformed input into one-line `WireError`s (`messages`), the exact bytes a
device signs or MACs and the device's half of the session handshake (`auth`), and the
operator's client of the admin API (`admin_client`). The contract in words is `PROTOCOL.md`
beside this file.

Why in `edge` (the device side), not in `service`: the service, the emulated fleet and a device
client must all speak it, and import-linter's layers let all three import `edge`, while the
fleet may import nothing of the service (a device knows the protocol, never the server's
internals). So the protocol depends on nothing above the floor (and `aiohttp` / `cryptography`),
and the service only verifies and answers what this package defines.
"""
