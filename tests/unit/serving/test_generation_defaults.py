"""The server's side of a request's sampling: the generation defaults a request that leaves
a field out gets, and the output cap (the server's, or the tenant's in its place) that a
request asking more, or none, runs to, noted in its record."""

import json
from pathlib import Path

import pytest

from adapters.weights.generation_config import generation_defaults
from application.serving.chat_prompts import ChatPrompts
from application.serving.completions import Caller, ChatJob, CompletionService, PromptJob
from application.serving.generation import GenerationDefaults
from application.serving.request_record import RequestRecord
from application.serving.tool_parsers import FORMATS
from domain.errors import InvalidParameterError
from domain.sampling import SamplingParams
from entrypoints.config.generation import GenerationSettings
from tests.fakes import fake_async_engine
from tests.unit.serving.test_completions import MESSAGES, Group, Limits

ALL_UNSET = frozenset({"temperature", "top_p", "top_k", "min_p", "repetition_penalty"})


def service(generation: GenerationDefaults, **config: object) -> CompletionService:
    inputs = fake_async_engine(**config).inputs  # type: ignore[arg-type]
    return CompletionService(inputs, ChatPrompts(FORMATS["hermes"], inputs), "none", generation)


def caller(tenant_cap: int | None = None) -> tuple[Caller, Group, RequestRecord]:
    group, record = Group(), RequestRecord()
    return Caller(group, record, Limits(), tenant_cap), group, record  # type: ignore[arg-type]


async def test_a_completion_over_the_cap_runs_to_it_and_its_record_names_the_cap() -> None:
    who, group, record = caller()
    job = PromptJob(params=SamplingParams(max_tokens=100, min_tokens=50), prompts=["ab"])
    started = await service(GenerationDefaults(max_output_tokens=8)).complete(job, who)
    assert (started.params.max_tokens, started.params.min_tokens) == (8, 8)
    assert group.admitted[0][2].max_tokens == 8 and record.output_cap == 8
    who, _, record = caller()
    job = PromptJob(params=SamplingParams(max_tokens=5), prompts=["ab"])
    started = await service(GenerationDefaults(max_output_tokens=8)).complete(job, who)
    assert started.params.max_tokens == 5 and record.output_cap is None  # under it: as asked


async def test_a_chat_asking_none_runs_to_the_cap_or_the_models_default() -> None:
    job = ChatJob(params=SamplingParams(max_tokens=1), messages=MESSAGES)
    who, _, record = caller()
    started = await service(GenerationDefaults(max_output_tokens=64), max_model_len=2048).chat(
        job, who
    )
    assert started.params.max_tokens == 64 and record.output_cap == 64
    who, _, record = caller()
    model_default = GenerationDefaults(max_tokens=32, max_output_tokens=64)
    started = await service(model_default, max_model_len=2048).chat(job, who)
    assert started.params.max_tokens == 32 and record.output_cap is None
    who, _, record = caller()
    started = await service(GenerationDefaults(), max_model_len=256).chat(job, who)
    assert started.params.max_tokens == 256 - len(started.prompts[0])  # no cap: the context


async def test_a_tenants_cap_replaces_the_servers() -> None:
    job = ChatJob(params=SamplingParams(), messages=MESSAGES, max_tokens=500)
    server = service(GenerationDefaults(max_output_tokens=100), max_model_len=2048)
    who, _, record = caller(tenant_cap=300)
    assert (await server.chat(job, who)).params.max_tokens == 300 and record.output_cap == 300
    who, _, record = caller(tenant_cap=1000)  # above the server's: the tenant's holds
    assert (await server.chat(job, who)).params.max_tokens == 500 and record.output_cap is None


async def test_defaults_fill_only_the_fields_a_request_left_out() -> None:
    defaults = GenerationDefaults({"temperature": 0.6, "top_k": 20})
    given = SamplingParams(max_tokens=4, temperature=0.9)
    job = PromptJob(params=given, prompts=["ab"], unset=ALL_UNSET - {"temperature"})
    started = await service(defaults).complete(job, caller()[0])
    assert (started.params.temperature, started.params.top_k) == (0.9, 20)
    chat = ChatJob(params=SamplingParams(), messages=MESSAGES, max_tokens=3, unset=ALL_UNSET)
    started = await service(defaults).chat(chat, caller()[0])
    assert (started.params.temperature, started.params.top_k) == (0.6, 20)


def test_the_models_generation_config_then_the_overrides(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_k": 20})
    )
    auto = generation_defaults(tmp_path, "auto", {"top_p": 0.95, "max_new_tokens": 99}, 1024)
    assert dict(auto.sampling) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert (auto.max_tokens, auto.max_output_tokens) == (99, 1024)
    assert not generation_defaults(tmp_path, "vllm", {}, None).sampling  # vLLM's: none
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"repetition_penalty": 1.1}')
    assert dict(generation_defaults(None, str(other), {}, None).sampling) == {
        "repetition_penalty": 1.1
    }
    with pytest.raises(InvalidParameterError) as error:
        generation_defaults(None, str(tmp_path / "missing"), {}, None)
    assert error.value.param == "generation_config"
    assert generation_defaults(None, "auto", {}, None) == GenerationDefaults()  # no model


@pytest.mark.parametrize(
    "override",
    ['{"temperature": -1}', '{"frobnicate": 1}', "[1]", "not json", '{"max_new_tokens": 0}'],
)
def test_a_bad_override_is_an_error_naming_the_flag(override: str) -> None:
    with pytest.raises(InvalidParameterError) as error:
        GenerationSettings(override_generation_config=override)
    assert error.value.param == "override_generation_config"


def test_the_cap_flag_defaults_to_the_seeds_1024_and_0_turns_it_off() -> None:
    assert GenerationSettings().cap == 1024
    assert GenerationSettings(max_output_tokens=0).cap is None
    with pytest.raises(InvalidParameterError):
        GenerationSettings(max_output_tokens=-1)
