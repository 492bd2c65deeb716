"""``infer serve``'s model flags: what they parse to, and bad values refused naming the
flag's setting."""

import argparse
from datetime import date
from pathlib import Path

import pytest

from application.serving.served_models import LoraModule
from domain.errors import InvalidParameterError
from entrypoints.cli import _parser
from entrypoints.config.model import ModelSettings


def parse(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(["serve", *argv])


def test_the_flags_parse_to_names_aliases_modules_and_dates() -> None:
    args = parse(
        "--served-model-name", "smollm2", "gpt-4o-mini", "mini",
        "--model-version", "2026-01-01",
        "--model-deprecation", "mini=2026-06-30",
        "--lora-modules", "sql=/a/sql", "chat=/a/chat",
        "--lora-modules", "more=/a/more",
    )  # fmt: skip
    settings = ModelSettings.from_args(args)
    assert settings.served_model_name == "smollm2"
    assert settings.aliases == ("gpt-4o-mini", "mini")
    assert settings.model_version == "2026-01-01"
    assert settings.deprecations == {"mini": date(2026, 6, 30)}
    assert settings.lora_modules == (
        LoraModule("sql", Path("/a/sql")),
        LoraModule("chat", Path("/a/chat")),
        LoraModule("more", Path("/a/more")),
    )


def test_no_flags_serve_the_model_under_its_own_name() -> None:
    settings = ModelSettings.from_args(parse())
    assert settings.served_model_name is None
    assert (settings.aliases, settings.lora_modules, settings.deprecations) == ((), (), {})


@pytest.mark.parametrize(
    ("argv", "setting"),
    [
        (["--model-deprecation", "mini"], "model_deprecation"),
        (["--model-deprecation", "mini=30/06/2026"], "model_deprecation"),
        (["--lora-modules", "sql"], "lora_modules"),
        (["--lora-modules", "=/a/sql"], "lora_modules"),
        (["--model-version", "2026 01"], "model_version"),
        (["--max-loras", "0"], "max_loras"),
        (["--max-loras", "1", "--lora-modules", "a=/a", "b=/b"], "max_loras"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(argv: list[str], setting: str) -> None:
    with pytest.raises(InvalidParameterError) as error:
        ModelSettings.from_args(parse(*argv))
    assert error.value.param == setting


def test_the_model_comes_from_the_tag_or_the_flag_not_two_different_ones() -> None:
    assert ModelSettings.from_args(parse("dummy:SmolLM2-135M")).model == "dummy:SmolLM2-135M"
    assert ModelSettings.from_args(parse("--model", "m", "m")).model == "m"
    with pytest.raises(InvalidParameterError, match="given twice") as error:
        ModelSettings.from_args(parse("a", "--model", "b"))
    assert error.value.param == "model"


@pytest.mark.parametrize(
    ("field", "value"),
    [("runner", "jax"), ("dtype", "int3"), ("quantization", "q3"), ("tool_call_parser", "x")],
)
def test_an_unknown_choice_is_refused_naming_its_field(field: str, value: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelSettings(**{field: value})  # type: ignore[arg-type]
