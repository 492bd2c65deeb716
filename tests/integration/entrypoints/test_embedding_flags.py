"""`infer serve`'s embedding flags reach the container; bad values are refused by flag."""

from typing import Any

import pytest

from adapters.weights.embedding import MINILM_NAME, resolve_embedding_model
from domain.errors import ModelLoadError
from entrypoints.cli import main
from entrypoints.config import ServerConfig
from entrypoints.config.embedding import EmbeddingSettings


def served_embeddings(monkeypatch: pytest.MonkeyPatch, *argv: str) -> EmbeddingSettings:
    """What ``infer serve`` hands the container: the config's embeddings group."""
    from entrypoints import cli

    seen: dict[str, Any] = {}

    def fake_create_container(config: ServerConfig, **kwargs: Any) -> None:
        seen["embeddings"] = config.embeddings
        raise cli.InvalidParameterError("model", "stop here")  # nothing is loaded

    monkeypatch.setattr(cli, "create_container", fake_create_container)
    assert main(["serve", *argv]) == 2
    embeddings: EmbeddingSettings = seen["embeddings"]
    return embeddings


def test_the_wheels_minilm_is_served_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert served_embeddings(monkeypatch).embedding_model == MINILM_NAME


def test_none_turns_embeddings_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert served_embeddings(monkeypatch, "--embedding-model", "none").embedding_model is None


def test_the_limits_come_from_their_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ["--max-embedding-inputs", "5", "--max-embedding-queue", "6"]
    flags += ["--embedding-batch-inputs", "7", "--max-prompt-bytes", "8"]
    limits = served_embeddings(monkeypatch, *flags).limits
    assert (limits.max_embedding_inputs, limits.max_embedding_queue) == (5, 6)
    assert (limits.embedding_batch_inputs, limits.max_input_bytes) == (7, 8)


@pytest.mark.parametrize(
    "flag", ["--max-embedding-inputs", "--max-embedding-queue", "--embedding-batch-inputs"]
)
def test_a_bad_limit_is_refused_by_its_flag_before_anything_loads(
    flag: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from entrypoints import cli

    monkeypatch.setattr(cli, "create_container", lambda *a, **k: pytest.fail("loaded"))
    assert main(["serve", flag, "0"]) == 2
    assert f"error: {flag}: must be at least 1" in capsys.readouterr().err


def test_embedding_model_specs(tmp_path: Any) -> None:
    for spec in (None, "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        resolved = resolve_embedding_model(spec)
        assert resolved.name == MINILM_NAME and (resolved.path / "model.safetensors").is_file()
    with pytest.raises(ModelLoadError, match="unknown embedding model"):
        resolve_embedding_model("no/such-model")
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        resolve_embedding_model(str(tmp_path))
