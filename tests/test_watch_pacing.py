"""A watcher's Consul loop rests after a read that changed, three times what decoding it took, so
that a prefix or service that changes many times a second cannot hold the event loop in back-to-
back decodes (at 10,000 models it held the park after a fifth failure back by seconds); a read
that ran out unchanged decoded nothing and owes no rest."""

from __future__ import annotations

import time
import uuid

from nomad_driver.consul import Consul
from nomad_driver.watcher.watch import REST_PER_DECODE, kv_fetch


async def test_after_a_read_that_changed_the_next_waits_three_times_its_decoding(consul_url: str) -> None:
    prefix = f"pacing-{uuid.uuid4().hex[:8]}/"
    consul = Consul(consul_url)
    try:
        # Big enough that decoding it takes tens of milliseconds (8 MB of values).
        for i in range(400):
            await consul.kv_put(f"{prefix}{i:04d}", "x" * 20_000)
        busy, quiet = kv_fetch(consul, prefix, wait_s=1.0), kv_fetch(consul, prefix, wait_s=1.0)
        index, _ = await quiet(0)
        # The quiet loop's last read ran out unchanged: it owes no rest.
        assert (await quiet(index))[0] == index and consul.last_decode_s == 0.0
        index, entries = await busy(0)
        assert len(entries) == 400
        rest_s = REST_PER_DECODE * consul.last_decode_s

        await consul.kv_put(f"{prefix}0000", "changed")
        _, seen = await quiet(index)
        started = time.monotonic()
        _, seen_late = await busy(index)
        busy_s = time.monotonic() - started
        assert seen[f"{prefix}0000"].value == seen_late[f"{prefix}0000"].value == b"changed"
        # The busy loop rested its whole due before it read, and then decoded. Compared with the
        # rest plus this read's own decoding, not with the quiet loop's read: on two loaded cores
        # one decode of 8 MB took from 0.16 to 0.32 s, and a difference of two reads was noise.
        assert rest_s > 0 and busy_s >= rest_s + consul.last_decode_s, (busy_s, rest_s, consul.last_decode_s)
    finally:
        await consul.close()
