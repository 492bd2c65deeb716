"""Shared test doubles: one definition of each fake the tests use (port fakes with a real
implementation of their own live in adapters/fake/), and the builders that wire them."""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from adapters.fake.runner import FakeModelRunner
from adapters.fake.tokenizer import ByteTokenizer
from application.engine.async_engine import AsyncEngine
from domain.config import EngineConfig
from domain.observer import StepObserver
from domain.ports import GrammarCompiler, ModelRunner, Tokenizer
from domain.request import Request, StepOutput
from domain.sampling import StructuredOutput
from domain.scheduler import Scheduler

if TYPE_CHECKING:
    from adapters.torch.lora.serving import LoraServing
    from adapters.torch.models.transformer import Transformer
    from entrypoints.container import Container


class ListSink:
    """OutputSink that keeps every output in order (tests read them after the steps)."""

    def __init__(self) -> None:
        self.outputs: list[StepOutput] = []

    def publish(self, output: StepOutput) -> None:
        self.outputs.append(output)

    def of(self, request_id: str) -> list[StepOutput]:
        return [o for o in self.outputs if o.request_id == request_id]


def fake_async_engine(
    runner: ModelRunner | None = None,
    *,
    tokenizer: Tokenizer | None = None,
    script: Callable[[Request], int] | None = None,
    step_latency_s: float = 0.0,
    observer: StepObserver | None = None,
    scheduler: Scheduler | None = None,
    grammar: GrammarCompiler | None = None,
    **config: Any,
) -> AsyncEngine:
    """An :class:`AsyncEngine` (not started) on ``runner`` (default: a
    :class:`FakeModelRunner` with ``script`` and ``step_latency_s``) and ``tokenizer``
    (default: :class:`ByteTokenizer`); ``grammar``: structured outputs' checks (None: they
    are refused); ``config``: :class:`EngineConfig` fields."""
    if runner is None:
        runner = FakeModelRunner(script=script, step_latency_s=step_latency_s)
    return AsyncEngine(
        EngineConfig(**config),
        runner,
        tokenizer or ByteTokenizer(),
        observer=observer,
        scheduler=scheduler,
        grammar=grammar,
    )


class AcceptingGrammar:
    """A ``GrammarCompiler`` that accepts every constraint: for faces over the fake runner,
    which does not enforce constraints anyway (the real compiler: ``adapters/grammar``)."""

    def check(self, structured: StructuredOutput) -> None:
        pass


def torch_async_engine(
    model: "Transformer",
    config: EngineConfig,
    *,
    lora: "LoraServing | None" = None,
    tokenizer: Tokenizer | None = None,
) -> AsyncEngine:
    """An :class:`AsyncEngine` (not started) on a :class:`TorchModelRunner` over ``model``
    (with multi-LoRA serving when ``lora`` is given) and ``tokenizer`` (default:
    :class:`ByteTokenizer`); the model's vocabulary bounds token-id prompts."""
    from adapters.torch.runtime.runner import TorchModelRunner

    runner = TorchModelRunner(model, config, lora=lora)
    return AsyncEngine(
        config, runner, tokenizer or ByteTokenizer(), vocab_size=model.config.vocab_size
    )


class ManualClock:
    """A clock that stands still until a test moves it (``clock.now += 5``)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def fake_container(runner: ModelRunner | None = None, **overrides: Any) -> "Container":
    """The composition root on the fake backend (no model loaded); ``runner`` replaces
    the default :class:`FakeModelRunner`; ``overrides`` go to ``ServerConfig.for_model``
    (groups or fields by name: ``cache_dir=...``, ``http=TransportSettings(...)``)."""
    from dependency_injector import providers

    from entrypoints.backends import FakeBackend
    from entrypoints.config import ServerConfig
    from entrypoints.container import create_container

    backend = FakeBackend()
    if runner is not None:
        backend.runner.override(providers.Object(runner))
    return create_container(ServerConfig.for_model(runner="fake", **overrides), backend=backend)
