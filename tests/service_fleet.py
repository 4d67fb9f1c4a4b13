"""Test helpers for the coordinator service: a tiny config, the devices' data, and devices that
loop register -> check in -> take part until the run is done (what the fleet branch's emulated
phones do with more behaviour). Real sockets on 127.0.0.1, real signatures, real training."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dpfleet.coordinator.config import parse_config
from dpfleet.coordinator.engine.simulation import prepare_data
from dpfleet.edge.devices import Behaviour
from dpfleet.fleet.link import CoordinatorLink, LinkError
from dpfleet.fleet.participant import DropOut, take_part
from dpfleet.service.server import shutdown, start

TINY = {
    "rounds": 3, "eval_every": 3, "seed": 5, "checkpoint_every": 0,
    # no keyboard metrics (its beam search was over half of a run of this config): the tests of
    # the keyboard block set data.keyboard_words themselves
    "data": {"dataset": "shakespeare", "max_clients": 8, "eval_examples": 40, "max_examples": 8,
             "keyboard_words": 0},
    "tokenizer": {"kind": "sentencepiece", "vocab_size": 1024},
    "model": {"arch": "cifg", "embedding_dim": 8, "hidden_dim": 8, "projection_dim": 8},
    "client": {"lr": 1.0, "batch_size": 8, "trainer": "sequential"},
    "dp": {"noise_multiplier": 1.0, "clip_norm": 0.5, "report_goal": 3, "momentum": 0.5,
           "noise_seed": 11},
    "participation": {"mode": "uniform"},
    "service": {"checkin_retry_s": 0.2, "checkin_window_s": 1.0, "report_deadline_s": 15.0,
                "secagg_phase_deadline_s": 10.0},
}


async def register_all(url: str, keys: dict[str, Ed25519PrivateKey], link_class=CoordinatorLink,
                       **link_kwargs) -> dict:
    """One signed link per device (id -> key), each registered; close them with `close_all`."""
    links = {u: link_class(url, u, key, **link_kwargs) for u, key in keys.items()}
    for link in links.values():
        await link.register()
    return links


async def close_all(links: dict) -> None:
    for link in links.values():
        await link.close()


@contextlib.asynccontextmanager
async def serving(cfg, state: Path, keys: dict[str, Ed25519PrivateKey], poll_s: float = 1.0):
    """A running coordinator with every device registered: (running, links); on leaving, the
    links close, the driver stops (releasing held check-ins) and the service shuts down."""
    running = await start(cfg, state, log=lambda s: None, poll_s=poll_s)
    links = await register_all(running.url, keys, retries=0)
    try:
        yield running, links
    finally:
        await close_all(links)
        running.driver.stop()
        await shutdown(running)


async def checkin_all(links: dict) -> dict:
    """Every device checks in at once; replies by device id, in the links' order."""
    replies = await asyncio.gather(*(link.checkin() for link in links.values()))
    return dict(zip(links, replies, strict=True))


def tiny_cfg(**sections):
    values = {k: (dict(v) if isinstance(v, dict) else v) for k, v in TINY.items()}
    for key, value in sections.items():
        if isinstance(value, dict):
            values[key] = {**values.get(key, {}), **value}
        else:
            values[key] = value
    return parse_config(values)


def capture_sums(engine) -> list:
    """Spy (test only): records every aggregate the engine is asked to close a round with."""
    seen, close = [], engine.close_round

    def spy(plan, aggregate, stats):
        seen.append((plan, aggregate))
        return close(plan, aggregate, stats)

    engine.close_round = spy
    return seen


def honest_sum(like, updates: dict, honest: list):
    """The sum the service must have formed from the honest (position, user) reports only, in
    position order as it sums them, in `like`'s dtype: what an attack test compares with."""
    total = np.zeros_like(like)
    for _, u in honest:
        total += updates[u].delta
    return total


def fleet_data(cfg, folder: Path):
    """(user ids, examples by user) exactly as `simulate` prepares them."""
    _, data = prepare_data(cfg, folder / "vocabulary")
    return [c.user for c in data.train], {c.user: c.examples for c in data.train}


def device_keys(users) -> dict[str, Ed25519PrivateKey]:
    """A fresh Ed25519 identity per device."""
    return {u: Ed25519PrivateKey.generate() for u in users}


def one_round_world(root: Path):
    """(cfg, root, users, examples) of a one-round, 30% over-selected service run: the shared
    set-up of the attack test modules."""
    cfg = tiny_cfg(rounds=1, service={"overselect": 0.3})
    users, examples = fleet_data(cfg, root / "fleet")
    return cfg, root, users, examples


def model_hook(behaviour: Behaviour, number: int, attempt: int):
    """A `take_part` hook: the device vanishes where the device model says (fleet/worker.py's
    `Hooks` without the link delays: a download drop is drawn before the first message)."""

    def hook(phase: str) -> None:
        for p in (("download",) if phase in ("train", "commit") else ()) + (phase,):
            if behaviour.drops(p, number, attempt):
                raise DropOut(f"emulated dropout in phase {p}")

    return hook


async def device_loop(url: str, device_id: str, key: Ed25519PrivateKey, examples, *,
                      outcomes: list | None = None, ca_file=None, stop: asyncio.Event | None = None,
                      replies: list | None = None, runtime: str = "eager",
                      link_kw: dict | None = None, behaviour: Behaviour | None = None,
                      **take_part_kw) -> list:
    """One phone: register, then check in and take part until the run is done (`replies`
    collects (device, next round, check-in reply); `link_kw`: more `CoordinatorLink` options;
    `behaviour`: the device model that decides where it vanishes, as an emulated device's)."""
    outcomes = [] if outcomes is None else outcomes
    async with CoordinatorLink(url, device_id, key, ca_file=ca_file, backoff_s=0.05,
                               max_backoff_s=0.5, retries=8, **(link_kw or {})) as link:
        registered, refusals = False, 0
        while stop is None or not stop.is_set():
            try:  # a coordinator that is down (killed, restarting) is waited for
                if not registered:
                    await link.register()
                    registered = True
                reply = await link.checkin(runtime=runtime)
                if replies is not None:
                    replies.append((device_id, reply))
            except LinkError as exc:
                # a registration signed before a restart and read after it is refused (the new
                # process takes no request signed before it started, and a refusal is one answer):
                # tried again, as fleet/device.py does; a refusal that lasts is still raised
                refused = exc.status == 403 and not registered and refusals < 3
                refusals += refused
                if exc.status not in (0, 401, 503) and not refused:
                    raise
                await asyncio.sleep(0.3)
                continue
            if reply["kind"] == "done":
                break
            if reply["kind"] in ("retry", "refused"):
                await asyncio.sleep(reply["after_s"])
                continue
            kw, attempt = take_part_kw, (reply["round"], reply["attempt"])
            if any(o[:2] == attempt and o[2].kind == "dropped" for o in outcomes):
                await asyncio.sleep(0.2)  # vanished: it does not come back to this attempt
                continue
            if behaviour is not None:
                kw = {**take_part_kw, "before_phase": model_hook(behaviour, *attempt)}
            outcomes.append((*attempt, await take_part(link, reply, examples, **kw)))
    return outcomes


async def run_devices(url: str, keys: dict[str, Ed25519PrivateKey], examples: dict,
                      per_device: dict[str, dict] | None = None, **kw):
    """Every device's loop at once; `per_device[d]` adds or overrides keyword arguments of d's
    `take_part` (hooks that drop, a speed factor)."""
    per_device = per_device or {}
    tasks = [asyncio.create_task(device_loop(url, d, keys[d], examples[d],
                                             **{**kw, **per_device.get(d, {})})) for d in keys]
    try:
        return dict(zip(keys, await asyncio.gather(*tasks), strict=True))
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)


async def serve_to_end(cfg, state: Path, keys: dict[str, Ed25519PrivateKey], examples: dict,
                       devices_s: float = 60.0) -> dict:
    """Serve `cfg` on `state` until its run ends, every device taking part; its last status."""
    running = await start(cfg, state, log=lambda s: None)
    devices = asyncio.create_task(run_devices(running.url, keys, examples))
    await asyncio.wait_for(asyncio.shield(running.task), 120)
    await asyncio.wait_for(devices, devices_s)
    status = running.driver.status()
    await shutdown(running)
    return status
