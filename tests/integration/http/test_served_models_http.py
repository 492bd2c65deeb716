"""Model names on the HTTP faces, through the composition root with the fake
runner and the official openai SDK: aliases and the pinned version work and are echoed,
``/v1/models`` and ``/v1/models/{id}`` shapes, deprecation headers, retired names and
unknown ones (404 ``model_not_found``), keys' model scopes with aliases."""

import json
from collections.abc import Iterator
from datetime import date
from pathlib import Path

import openai
import pytest
from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from application.access.keys import hash_key
from application.serving.served_models import LoraModule
from domain.errors import InvalidParameterError
from entrypoints.config.model import ModelSettings
from tests.fakes import fake_container

REPLY = "Paris"
SUNSET = date(2099, 1, 1)
SETTINGS = ModelSettings(
    aliases=("gpt-4o-mini", "legacy", "gone"),
    model_version="2026-01-01",
    deprecations={"legacy": SUNSET, "gone": date(2000, 1, 1)},
)
NAMES = ["smollm2", "gpt-4o-mini", "legacy", "smollm2-2026-01-01"]  # "gone" is retired


def app_client(tmp_path: Path, **kwargs: object) -> TestClient:
    runner = FakeModelRunner(script=reply_script(ByteTokenizer(), REPLY))
    container = fake_container(
        runner, cache_dir=str(tmp_path), served_model_name="smollm2", model=SETTINGS, **kwargs
    )
    return TestClient(app=container.http_app())  # type: ignore[arg-type]


@pytest.fixture
def http(tmp_path: Path) -> Iterator[TestClient]:
    with app_client(tmp_path) as client:
        yield client


@pytest.mark.parametrize("name", NAMES)
def test_every_name_serves_the_model_and_is_echoed(client: openai.OpenAI, name: str) -> None:
    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=8
    )
    assert (chat.model, chat.choices[0].message.content) == (name, REPLY)
    text = client.completions.create(model=name, prompt="Q:", max_tokens=8)
    assert (text.model, text.choices[0].text) == (name, REPLY)
    chunks = list(client.completions.create(model=name, prompt="Q:", max_tokens=8, stream=True))
    assert {c.model for c in chunks} == {name}


def test_models_lists_every_name_with_its_root_and_deprecation(client: openai.OpenAI) -> None:
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert list(cards) == NAMES
    for card in cards.values():
        assert (card["root"], card["parent"], card["object"]) == ("fake", None, "model")
        assert card["max_model_len"] > 0 and card["task"] == "generate"
    assert cards["legacy"]["deprecation_date"] == "2099-01-01"
    assert cards["smollm2"]["deprecation_date"] is None
    one = client.models.retrieve("smollm2-2026-01-01")
    assert (one.id, one.object) == ("smollm2-2026-01-01", "model")


@pytest.mark.parametrize("name", ["nope", "gone", "org/nope"])
def test_an_unknown_or_retired_model_is_a_404_in_openai_format(
    client: openai.OpenAI, name: str
) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve(name)
    assert error.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model=name, prompt="Q:", max_tokens=4)
    body = error.value.body
    assert (body["code"], body["param"]) == ("model_not_found", "model")  # type: ignore[index]
    if name == "gone":
        assert "retired on 2000-01-01" in body["message"]  # type: ignore[index]


def test_a_deprecated_name_answers_with_deprecation_and_sunset_headers(
    client: openai.OpenAI,
) -> None:
    raw = client.completions.with_raw_response.create(model="legacy", prompt="Q:", max_tokens=4)
    assert raw.headers["deprecation"] == "@4070908800"  # 2099-01-01T00:00:00Z
    assert raw.headers["sunset"] == "Thu, 01 Jan 2099 00:00:00 GMT"
    assert raw.parse().model == "legacy"
    with client.chat.completions.with_streaming_response.create(
        model="legacy", messages=[{"role": "user", "content": "hi"}], stream=True
    ) as streamed:
        assert streamed.headers["sunset"] == "Thu, 01 Jan 2099 00:00:00 GMT"
    current = client.completions.with_raw_response.create(
        model="smollm2", prompt="Q:", max_tokens=4
    )
    assert "deprecation" not in current.headers and "sunset" not in current.headers


def test_tokenize_and_generate_take_the_same_names(http: TestClient) -> None:
    tokens = http.post("/tokenize", json={"model": "gpt-4o-mini", "prompt": "ab"})
    assert tokens.status_code == 200 and tokens.json()["count"] == 3
    missing = http.post("/detokenize", json={"model": "nope", "tokens": [70]})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    body = {"model": "legacy", "prompt": "Q:", "max_tokens": 4}
    generated = http.post("/v1/generate", json=body)
    assert generated.status_code == 200 and "event: done" in generated.text
    assert generated.headers["sunset"] == "Thu, 01 Jan 2099 00:00:00 GMT"
    unknown = http.post("/v1/generate", json={**body, "model": "nope"})
    assert unknown.status_code == 422 and unknown.json()["error"]["param"] == "model"


def test_a_key_allowed_the_id_uses_its_aliases_one_allowed_an_alias_only_that(
    tmp_path: Path,
) -> None:
    tenants = [
        {"id": "whole", "keys": [hash_key("sk-whole")], "models": ["smollm2"]},
        {"id": "alias", "keys": [hash_key("sk-alias")], "models": ["gpt-4o-mini"]},
    ]
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": tenants}))
    with app_client(tmp_path, api_keys_file=str(path)) as http:

        def sdk(key: str) -> openai.OpenAI:
            return openai.OpenAI(
                base_url=f"{http.base_url}/v1", api_key=key, http_client=http, max_retries=0
            )

        whole, alias = sdk("sk-whole"), sdk("sk-alias")
        assert [m.id for m in whole.models.list().data] == NAMES
        assert [m.id for m in alias.models.list().data] == ["gpt-4o-mini"]
        reply = whole.completions.create(model="smollm2-2026-01-01", prompt="Q:", max_tokens=4)
        assert reply.model == "smollm2-2026-01-01"
        assert alias.completions.create(model="gpt-4o-mini", prompt="Q:", max_tokens=4).model
        with pytest.raises(openai.PermissionDeniedError):
            alias.completions.create(model="smollm2", prompt="Q:", max_tokens=4)
        with pytest.raises(openai.NotFoundError):  # not listed for it: not retrievable either
            alias.models.retrieve("smollm2")


def test_serve_refuses_a_bad_model_flag_before_loading_anything(capsys) -> None:
    from entrypoints.cli import main

    assert main(["serve", "--model-deprecation", "legacy=someday"]) == 2
    assert "--model-deprecation" in capsys.readouterr().err


def test_lora_modules_need_the_torch_runner(tmp_path: Path) -> None:
    settings = ModelSettings(lora_modules=(LoraModule("sql", tmp_path),))
    with pytest.raises(InvalidParameterError, match="torch runner") as error:
        fake_container(cache_dir=str(tmp_path), model=settings).http_app()
    assert error.value.param == "lora_modules"
