"""``infer serve --replicas 2`` end to end: two engine replicas on a local Ray cluster behind
one port, driven by the official openai SDK; routing affinity seen in ``x-infer-replica``;
a replica killed (``kill -9``) under load loses and hangs nothing; SIGTERM drains the
streams in flight, and stopping the server leaves no Ray process behind. On a 2-core
machine each replica runs one thread: this shows correctness and routing, not scaling
(benchmarks/sim_router.py measures that)."""

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import tinker
from tinker import types
from transformers import AutoTokenizer

from adapters.weights.resolve import resolve_model
from tests.e2e.server import INFER, free_port
from tests.support.otlp_receiver import Receiver, find_spans, running_receiver
from tests.support.peft_adapters import trained_adapter
from tests.support.ray_cluster import (
    BASE_NAME,
    ray_processes,
    running_replicas,
    start_fleet,
    stop_fleet,
    wait_for_replicas,
)

pytestmark = pytest.mark.slow
os.environ.setdefault("TINKER_TELEMETRY", "0")
TINKER_KEY = "tml-fleet"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
SECRET = "The secret word is pineapple."
PARENT_ID = "b7ad6b7169203331"

SYSTEM = (
    "You are the support assistant of a small bakery. Answer in one short sentence, "
    "politely, and never invent opening hours or prices that you were not given. "
)


@pytest.fixture(scope="module")
def traces() -> Iterator[Receiver]:
    with running_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def lora_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT adapter for the served model that learned ``SECRET`` (trained until it has:
    about 8 steps)."""
    folder = resolve_model(None, progress=False).path
    tokens = AutoTokenizer.from_pretrained(folder).encode(SECRET)
    return trained_adapter(folder, tokens, tmp_path_factory.mktemp("peft"), rank=4).path


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, traces: Receiver, lora_folder: Path
) -> Iterator[tuple[str, subprocess.Popen]]:
    assert not ray_processes(), "a Ray cluster is already running here"
    log = tmp_path_factory.mktemp("fleet") / "serve.log"
    otlp = f"http://127.0.0.1:{traces.server_address[1]}"
    url, process = start_fleet(
        log,
        *("--replicas", "2", "--threads", "1"),
        *("--otlp-traces-endpoint", otlp, "--lora-modules", f"secret={lora_folder}"),
        *("--usage-db", ":memory:", "--model-rollout", f"canary={BASE_NAME}:1,secret:1"),
        *("--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "3"),
        env={**os.environ, "INFER_FAULT_INJECTION": "1"},  # the breaker test's hook
    )
    try:
        wait_for_replicas(url, process, log, 2)
        yield url, process
    finally:
        left = stop_fleet(process)
        assert not left, f"Ray processes left after the server stopped: {left}"


@pytest.fixture
def fleet(server: tuple[str, subprocess.Popen]) -> str:
    return server[0]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def model_of(url: str) -> str:
    return client(url).models.list().data[0].id


def test_the_openai_sdk_is_served_through_the_replicas(fleet: str, traces: Receiver) -> None:
    sdk, model = client(fleet), model_of(fleet)
    ids = {r["id"] for r in running_replicas(fleet)}
    raw = sdk.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": "Hi!"}],
        max_tokens=8,
        extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
    )
    chat = raw.parse()
    assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
    assert raw.headers["x-infer-replica"] in ids
    assert len(raw.headers.get_list("x-request-id")) == 1
    # The trace continues from the ingress's server span into the replica's engine spans.
    [ingress_span] = [
        s for s in find_spans(traces, "POST /v1/chat/completions") if s.trace_id.hex() == TRACE_ID
    ]
    assert ingress_span.parent_span_id.hex() == PARENT_ID
    deadline = time.monotonic() + 20
    while True:
        engine = [s for s in find_spans(traces, "engine.request") if s.trace_id.hex() == TRACE_ID]
        if engine or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    [engine_span] = engine
    assert engine_span.parent_span_id == ingress_span.span_id

    text = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in sdk.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Count to three."}],
            max_tokens=8,
            stream=True,
        )
        if chunk.choices
    )
    assert text
    completion = sdk.completions.create(model=model, prompt="The sky is", max_tokens=4, n=2)
    assert len(completion.choices) == 2

    # /metrics covers every replica, each sample labelled with its source.
    deadline = time.monotonic() + 15
    while True:
        metrics = httpx.get(f"{fleet}/metrics", timeout=10).text
        if all(f'replica="{i}"' in metrics for i in ids) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert all(f'replica="{i}"' in metrics for i in ids | {"ingress"})


def test_a_lora_module_is_served_by_name_through_the_fleet(fleet: str) -> None:
    sdk, base = client(fleet), model_of(fleet)
    listed = {m.id: m for m in sdk.models.list().data}
    assert "secret" in listed and listed["secret"].model_extra["parent"] == base
    prompt = SECRET[: SECRET.index("pineapple")]

    def greedy(model: str) -> str:
        completion = sdk.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0)
        return completion.choices[0].text

    base_text, lora_text = greedy(base), greedy("secret")
    assert "pine" in lora_text and lora_text != base_text, (lora_text, base_text)


def test_an_adapter_loaded_at_run_time_is_served_by_every_replica(
    fleet: str, lora_folder: Path
) -> None:
    """``/v1/load_lora_adapter`` at the ingress: the name is served at once; the replica a
    call reaches loads the folder the call names (a replica started later the same way)."""
    loaded = httpx.post(
        f"{fleet}/v1/load_lora_adapter",
        json={"lora_name": "secret-live", "lora_path": str(lora_folder)},
        timeout=30,
    )
    assert loaded.status_code == 200, loaded.text
    sdk = client(fleet)
    assert "secret-live" in {m.id for m in sdk.models.list().data}
    prompt = SECRET[: SECRET.index("pineapple")]
    reply = sdk.completions.with_raw_response.create(
        model="secret-live", prompt=prompt, max_tokens=3, temperature=0
    )
    assert reply.headers["x-infer-replica"]
    assert "pine" in reply.parse().choices[0].text
    gone = httpx.post(
        f"{fleet}/v1/unload_lora_adapter", json={"lora_name": "secret-live"}, timeout=30
    )
    assert gone.status_code == 200, gone.text
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="secret-live", prompt=prompt, max_tokens=1)


def test_a_replica_failing_every_call_is_broken_out_of_routing_and_nothing_is_lost(
    fleet: str,
) -> None:
    """The fault hook makes one replica fail every call (as a broken device would): each
    call it fails runs again on the other (0 lost); after 2 failures its breaker opens and
    routing leaves it out; once it serves again, the probe after the 3 s cool-down puts it
    back. ``/admin/replicas``, ``/metrics`` and the audit trail show it."""
    bad = running_replicas(fleet)[0]["id"]
    hooked = httpx.post(f"{fleet}/admin/replicas/{bad}/fault", json={"fail": True}, timeout=30)
    assert hooked.status_code == 200 and hooked.json()["id"] == bad, hooked.text
    sdk, model = client(fleet), model_of(fleet)

    async def wave(tag: str) -> list[str]:
        aio = openai.AsyncOpenAI(base_url=f"{fleet}/v1", api_key="unused", max_retries=0)

        async def one(i: int) -> str:
            reply = await aio.completions.with_raw_response.create(
                model=model, prompt=f"{tag} {i}: the weather", max_tokens=4
            )
            assert reply.parse().choices[0].finish_reason in ("length", "stop")
            return reply.headers["x-infer-replica"]

        try:
            return await asyncio.gather(*(one(i) for i in range(8)))
        finally:
            await aio.close()

    try:
        # Waves until the bad replica has failed twice (routing picks by prefix and load,
        # so one wave may give it fewer than two calls): each call answered all the same,
        # the bad one's run again on the other replica.
        for n in range(6):
            asyncio.run(wave("first" if n == 0 else f"again {n}"))
            rows = {r["id"]: r for r in running_replicas(fleet)}
            if rows[bad]["breaker"] in ("open", "half_open"):
                break
        assert rows[bad]["breaker"] in ("open", "half_open"), rows
        assert bad not in asyncio.run(wave("second"))  # left out while open
        metrics = httpx.get(f"{fleet}/metrics", timeout=30).text
        assert any(
            line.startswith('infer:replica_breaker_opens_total{replica="ingress"')
            and f'replica_id="{bad}"' in line
            for line in metrics.splitlines()
        ), [line for line in metrics.splitlines() if "breaker" in line]
    finally:
        httpx.post(f"{fleet}/admin/replicas/{bad}/fault", json={"fail": False}, timeout=30)
    deadline = time.monotonic() + 60
    while {r["id"]: r for r in running_replicas(fleet)}[bad]["breaker"] != "closed":
        assert time.monotonic() < deadline, "the breaker never closed after the fault ended"
        time.sleep(1)
    events = [
        (e["event"], e["subject"])
        for e in httpx.get(f"{fleet}/admin/audit", timeout=30).json()["data"]
    ]
    assert ("replica circuit breaker open", f"replica:{bad}") in events
    assert ("replica circuit breaker closed", f"replica:{bad}") in events
    del sdk


def test_a_rollout_splits_users_between_the_base_and_a_lora_module(fleet: str) -> None:
    """The ingress resolves the rollout's name; the replicas run the build it picked."""
    sdk = client(fleet)
    prompt = SECRET[: SECRET.index("pineapple")]

    def greedy(model: str, user: str | None = None) -> tuple[str, str]:
        extra = {} if user is None else {"user": user}
        reply = sdk.completions.create(
            model=model, prompt=prompt, max_tokens=3, temperature=0, **extra
        )
        return reply.model, reply.choices[0].text

    expected = {BASE_NAME: greedy(BASE_NAME)[1], "secret": greedy("secret")[1]}
    builds = set()
    for i in range(8):
        build, text = greedy("canary", user=f"user-{i}")
        assert text == expected[build], (build, text, expected)
        builds.add(build)
    assert builds == {BASE_NAME, "secret"}  # 8 users at 50 %: both all but surely


def test_requests_sharing_a_long_prefix_stay_on_the_replica_that_cached_it(fleet: str) -> None:
    sdk, model = client(fleet), model_of(fleet)
    served_by = []
    for question in ["Are you open?", "Do you sell rye bread?", "Can I order a cake?"]:
        raw = sdk.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            max_tokens=4,
        )
        served_by.append(raw.headers["x-infer-replica"])
    assert len(set(served_by)) == 1, served_by
    deadline = time.monotonic() + 10  # replicas report every second
    while True:
        [replica] = [r for r in running_replicas(fleet) if r["id"] == served_by[0]]
        if replica["prefix_hit_tokens"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert replica["prefix_hit_tokens"] > 0
    assert {"pid", "node", "running", "waiting", "kv_usage", "prefix_hit_rate"} <= set(replica)


def test_a_tinker_session_lives_on_one_replica_and_trains_there(fleet: str) -> None:
    headers = {"X-API-Key": TINKER_KEY}
    created = httpx.post(f"{fleet}/api/v1/create_session", json={}, headers=headers, timeout=60)
    created.raise_for_status()
    replica = created.headers["x-infer-replica"]
    session = created.json()["session_id"]
    assert f"-{replica}-" in session  # the id names its replica: any ingress routes it
    for _ in range(4):
        beat = httpx.post(
            f"{fleet}/api/v1/session_heartbeat",
            json={"session_id": session},
            headers=headers,
            timeout=60,
        )
        assert beat.status_code == 200 and beat.headers["x-infer-replica"] == replica

    # The stock SDK, end to end: a LoRA run trains and samples on its replica.
    sc = tinker.ServiceClient(base_url=fleet, api_key=TINKER_KEY)
    model = model_of(fleet)
    tc = sc.create_lora_training_client(base_model=model, rank=8, seed=0).result()
    tokenizer = tc.get_tokenizer()
    full = list(tokenizer.encode("The secret word is pineapple.", add_special_tokens=False))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
    )
    losses = []
    for _ in range(4):
        fb = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < losses[0], losses
    sampler = tc.save_weights_for_sampler("fleet").result().path
    sampled = (
        sc.create_sampling_client(model_path=sampler)
        .result()
        .sample(types.ModelInput.from_ints(full[:3]), 1, types.SamplingParams(max_tokens=4))
        .result()
    )
    assert len(sampled.sequences[0].tokens) > 0
    sc.close("success").result()

    # The checkpoint is a model of its owner on the OpenAI face too: the ingress finds it in
    # the shared folder, the replica the call goes to loads it.
    def as_model(key: str) -> str | None:
        sdk = openai.OpenAI(base_url=f"{fleet}/v1", api_key=key, max_retries=0, timeout=120)
        return sdk.completions.create(model=sampler, prompt="The secret", max_tokens=3).model

    assert as_model(TINKER_KEY) == sampler
    with pytest.raises(openai.NotFoundError):
        as_model("tml-someone-else")

    # A future of a replica that is gone fails (category server): it never polls forever.
    lost = httpx.post(
        f"{fleet}/api/v1/retrieve_future",
        json={"request_id": "req-gone0000-7"},
        headers=headers,
        timeout=60,
    )
    assert lost.status_code == 200 and lost.json()["category"] == "server"


def test_a_replica_killed_under_load_loses_and_hangs_nothing(fleet: str) -> None:
    model = model_of(fleet)
    sdk = openai.AsyncOpenAI(base_url=f"{fleet}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(i: int) -> str:
        messages = [{"role": "user", "content": f"Tell story number {i}."}]
        # Long enough to be running when the replica is killed (EOS ignored).
        args = {"model": model, "messages": messages, "max_tokens": 192}
        try:
            if i % 2:
                stream = await sdk.chat.completions.create(
                    **args, stream=True, extra_body={"ignore_eos": True}
                )
                async for _ in stream:
                    pass
            else:
                await sdk.chat.completions.create(**args, extra_body={"ignore_eos": True})
            return "ok"
        except openai.APIError as e:
            assert "replica" in str(e), e  # the stream's error event names what happened
            return "error"

    async def load_and_kill() -> tuple[dict, list[str]]:
        tasks = [asyncio.create_task(one(i)) for i in range(12)]
        # The busier one (prefix routing may well put all 12 on one: they share a prefix),
        # once it reports the load (a fixed wait raced the requests on a fast machine), and
        # once its streams have sent tokens (those end with an error naming the replica).
        victim: dict | None = None
        deadline = time.monotonic() + 60
        while victim is None and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            replicas = await asyncio.to_thread(running_replicas, fleet)
            busy = [r for r in replicas if r["running"] + r["waiting"] > 0]
            victim = max(busy, key=lambda r: r["running"] + r["waiting"]) if busy else None
        assert victim is not None, "no replica reported the 12 requests"
        await asyncio.sleep(0.5)
        os.kill(victim["pid"], signal.SIGKILL)
        done, hung = await asyncio.wait(tasks, timeout=150)
        assert not hung, f"{len(hung)} requests hung after a replica was killed"
        return victim, [t.result() for t in done]

    # Every request ends: completed, or (it had streamed from the dead replica) with an
    # error naming the replica; none is lost or hangs.
    victim, results = asyncio.run(load_and_kill())
    assert len(results) == 12 and set(results) <= {"ok", "error"}, results
    assert victim["running"] + victim["waiting"] > 0 and "error" in results, (victim, results)
    # New requests go to the live replica at once, and Ray restarts the dead one.
    after = client(fleet).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Still there?"}], max_tokens=4
    )
    assert after.choices[0].message.content is not None
    deadline = time.monotonic() + 300
    while True:
        ids = {r["id"] for r in running_replicas(fleet)}
        if len(ids) == 2 and victim["id"] not in ids:
            break
        assert time.monotonic() < deadline, "the killed replica was not restarted"
        time.sleep(2)


def test_sigterm_drains_the_streams_in_flight_then_stops_every_replica(
    server: tuple[str, subprocess.Popen],
) -> None:
    url, process = server
    model = model_of(url)
    sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def stream(i: int, started: asyncio.Event) -> str | None:
        messages = [{"role": "user", "content": f"Write a long poem, number {i}."}]
        chunks = await sdk.chat.completions.create(
            model=model, messages=messages, max_tokens=48, stream=True
        )
        finish = None
        async for chunk in chunks:
            started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return finish

    async def drain() -> list[str | None]:
        events = [asyncio.Event() for _ in range(4)]
        tasks = [asyncio.create_task(stream(i, e)) for i, e in enumerate(events)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
        process.send_signal(signal.SIGTERM)  # every stream has begun: drained, not cut
        return list(await asyncio.wait_for(asyncio.gather(*tasks), 120))

    finishes = asyncio.run(drain())
    assert finishes and all(f in ("length", "stop") for f in finishes), finishes
    assert process.wait(timeout=120) == 0


def test_an_unreachable_cluster_is_an_error_naming_the_flag_in_bounded_time() -> None:
    start = time.monotonic()
    done = subprocess.run(
        [
            *(str(INFER), "serve", "--port", str(free_port()), "--replicas", "2"),
            *("--ray-address", "127.0.0.1:1", "--replica-start-timeout", "10"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "error: --ray-address" in done.stderr
    assert time.monotonic() - start < 90
