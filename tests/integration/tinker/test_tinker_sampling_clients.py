"""A sampling session's clients, with the flags our ``/client/config`` turns on: the stock
SDK's samples complete through ``retrieve_futures`` (one long poll per client, results
acknowledged so the server drops them), an unpickled client joins for its own clone id,
and an abandoned sample is cancelled on the server (``cancel_future``: its work stops, in
the serving engine too, with no slot, stream or pinned adapter left behind)."""

import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tinker
from litestar.testing import TestClient
from tinker import types

from adapters.fake.toy_backend import ToyBackend
from adapters.http.auth import tenant_id
from adapters.storage.checkpoints import FileCheckpointStorage
from application.tinker.completions import Retrieved
from application.tinker.engine_sampler import EngineSampler
from application.tinker.futures import CancelledByClient
from application.tinker.sampling import SamplerRecord
from application.tinker.service import TinkerService
from tests.support.tinker_client import KEY, Api
from tests.support.tinker_server import (
    API_KEY,
    BASE_MODEL,
    GatedSampler,
    lora_service,
    serve,
    tinker_app,
    toy_service,
)

PROMPT = types.ModelInput.from_ints([5, 17, 42])
PARAMS = types.SamplingParams(max_tokens=4, seed=1)
Poll = tuple[str, int, int, float, tuple[str, ...]]


def eventually(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def spy_polls(service: TinkerService, polling: threading.Event | None = None) -> list[Poll]:
    """Record every retrieve_futures poll (sampler, clone, prev_cursor, wait, acks); set
    ``polling`` when a long poll waits."""
    polls: list[Poll] = []
    retrieve = service.completions.retrieve

    async def spy(
        sampler: SamplerRecord, clone: int, prev: int, wait: float, acks: list[str]
    ) -> Retrieved:
        polls.append((sampler.id, clone, prev, wait, tuple(acks)))
        if polling is not None and wait > 0:
            polling.set()
        return await retrieve(sampler, clone, prev, wait, acks)

    service.completions.retrieve = spy  # type: ignore[method-assign, assignment]
    return polls


def test_samples_complete_through_retrieve_futures_and_are_dropped_once_read(
    tmp_path: Path,
) -> None:
    service = toy_service(tmp_path)
    polls = spy_polls(service)
    with serve(tinker_app(service)) as url:
        sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        try:
            sampler = sc.create_sampling_client(base_model=BASE_MODEL).result()
            futures = [sampler.sample(PROMPT, 2, PARAMS) for _ in range(6)]
            results = [f.result(timeout=60) for f in futures]
            assert all(len(r.sequences) == 2 for r in results)
            assert polls and {clone for _, clone, *_ in polls} == {0}
            assert max(wait for *_, wait, _ in polls) > 0  # a long poll, not a busy loop
            # Every result was fetched and acknowledged: the server keeps none of them.
            eventually(lambda: len(service.futures) == 0)
            acked = {rid for *_, acks in polls for rid in acks}
            assert len(acked) == 6
            eventually(lambda: service.completions.queued() == 0)  # trimmed by the cursor

            # An unpickled copy joins the session for its own clone id (1): its samples
            # are its own clone's completions.
            clone = pickle.loads(pickle.dumps(sampler))
            again = clone.sample(PROMPT, 1, PARAMS).result(timeout=60)
            assert len(again.sequences) == 1
            assert {c for _, c, *_ in polls} == {0, 1}
        finally:
            sc.close("success").result()
    assert service.completions.queued() == 0  # the session's queues went with it


def test_an_abandoned_sample_is_cancelled_on_the_server(tmp_path: Path) -> None:
    backend = ToyBackend(BASE_MODEL)
    gate = GatedSampler(backend)
    service = TinkerService(backend, gate, FileCheckpointStorage(tmp_path))
    polling = threading.Event()
    spy_polls(service, polling)
    cancels: list[str] = []
    cancel = service.cancel_future

    def spy_cancel(owner: str, request_id: str) -> None:
        cancels.append(request_id)
        cancel(owner, request_id)

    service.cancel_future = spy_cancel  # type: ignore[method-assign]
    with serve(tinker_app(service)) as url:
        sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        try:
            sampler = sc.create_sampling_client(base_model=BASE_MODEL).result()
            abandoned = sampler.sample(PROMPT, 1, PARAMS)
            assert gate.started.wait(30) and polling.wait(30)  # running; its client waits
            abandoned.future().cancel()
            assert gate.cancelled.wait(30), "the server kept sampling"
            eventually(lambda: bool(cancels))
            future = service.futures.get(tenant_id(API_KEY), cancels[0])
            assert future.finished and isinstance(future.error, CancelledByClient)
            # The client goes on: its next sample (its poller too) works.
            gate.open.set()
            assert len(sampler.sample(PROMPT, 1, PARAMS).result(timeout=60).sequences) == 1
        finally:
            sc.close("success").result()


def test_cancelling_a_sample_frees_the_engine_slots_streams_and_adapter(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A sample on a saved checkpoint (its adapter pinned), more samples than the engine
    slots (some wait for one): cancelled, every slot, stream and pin is given back."""
    service, engine = lora_service(tmp_path, tiny_model)
    sampler = service.sampling.backend
    assert isinstance(sampler, EngineSampler)
    lora: Any = sampler.lora
    with TestClient(tinker_app(service, engine=engine)) as client:
        api = Api(client)
        session = api.session()
        model_id = api.model(session)
        path = api.run("save_weights_for_sampler", {"model_id": model_id, "path": "s"})["path"]
        sampling = api.sampler(session, model_path=path)
        params = {"max_tokens": 200, "seed": 1, "stop_token_ids": []}
        body = {
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 14, 15]}]},
            "sampling_params": params,
            "num_samples": 2 * sampler.slots.size,
            "sampling_session_id": sampling,
            "seq_id": 0,
        }
        request_id = api.post("asample", body)["request_id"]
        eventually(lambda: sampler.slots.held == sampler.slots.size and lora._pinned)
        assert api.post("cancel_future", {"request_id": request_id}) == {}
        failed = api.result(request_id)
        assert failed["category"] == "user" and "cancelled" in failed["error"]
        eventually(
            lambda: (
                sampler.slots.held == 0
                and not sampler.slots.waiting(tenant_id(KEY))
                and engine.engine.scheduler.counts() == (0, 0)
                and len(engine.sink) == 0
                and not lora._pinned
            )
        )
        # A completion for the clone's poll: failed, with its cursor.
        found = api.post(
            "retrieve_futures",
            {"target": {"sampling_session_id": sampling}, "timeout": 0},
        )
        assert found["completions"] == [{"state": "failed", "request_id": request_id}]
        assert found["cursor"] > 0
        # Cancelling again, or a finished sample, changes nothing.
        assert api.post("cancel_future", {"request_id": request_id}) == {}


def test_retrieve_futures_long_polls_until_a_completion_and_trims_by_cursor(
    tmp_path: Path,
) -> None:
    backend = ToyBackend(BASE_MODEL)
    gate = GatedSampler(backend)
    service = TinkerService(backend, gate, FileCheckpointStorage(tmp_path))
    with TestClient(tinker_app(service)) as client:
        api = Api(client)
        session = api.session()
        sampling = api.sampler(session, base_model=BASE_MODEL)
        body = {
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 14, 15]}]},
            "sampling_params": {"max_tokens": 2},
            "sampling_session_id": sampling,
            "seq_id": 0,
        }
        first = api.post("asample", body)["request_id"]
        target = {"sampling_session_id": sampling}
        start = time.monotonic()
        empty = api.post("retrieve_futures", {"target": target, "timeout": 0.2})
        assert empty == {"completions": [], "cursor": 0}
        assert time.monotonic() - start >= 0.2
        threading.Timer(0.3, gate.open.set).start()
        found = api.post("retrieve_futures", {"target": target, "timeout": 20})
        assert [c["request_id"] for c in found["completions"]] == [first]
        cursor = found["cursor"]
        # Seen (at or before the cursor): not reported again; acknowledged: dropped.
        second = api.post("asample", {**body, "seq_id": 1})["request_id"]
        api.result(second)
        found = api.post(
            "retrieve_futures",
            {"target": target, "prev_cursor": cursor, "retrieved_request_ids": [first]},
        )
        assert [c["request_id"] for c in found["completions"]] == [second]
        api.post("retrieve_future", {"request_id": first}, status=404)  # its payload dropped
        assert api.result(second)["sequences"]  # not acknowledged: still there
