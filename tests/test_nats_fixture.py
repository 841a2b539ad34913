import nats


async def test_real_nats_server_round_trip(nats_url):
    nc = await nats.connect(nats_url)
    sub = await nc.subscribe("tidal.test.echo")
    await nc.publish("tidal.test.echo", b"ping")
    msg = await sub.next_msg(timeout=2)
    assert msg.data == b"ping"
    js = nc.jetstream()
    kv = await js.create_key_value(bucket="fixture_probe")
    rev = await kv.put("k", b"v")
    assert (await kv.get("k")).revision == rev
    await nc.close()
