"""The served-models registry: names, aliases, the pinned version,
deprecation dates, LoRA modules and Tinker checkpoints as models, over a recording fake of
the ServingAdapters port (no torch)."""

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date
from pathlib import Path

import pytest

from adapters.fake.toy_backend import ToyBackend
from adapters.storage.checkpoints import FileCheckpointStorage
from application.serving.served_models import LoraModule, ServedModels
from application.tinker.service import TinkerService
from domain.errors import InvalidParameterError, ModelNotFoundError
from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.values import LoraSpec, RunRecord

WEIGHTS = "adapter_model.safetensors"


class FakeAdapters:
    """The ServingAdapters port: what is loaded, and what is pinned."""

    def __init__(self, max_adapters: int = 16) -> None:
        self.loaded: list[str] = []
        self.pins: dict[str, int] = {}
        self.loads = 0

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self.loaded

    def weights_file(self, folder: Path) -> Path:
        return folder / WEIGHTS

    def load_folder(self, adapter_id: str, folder: Path) -> None:
        if (folder / WEIGHTS).read_text() != "lora":
            raise InvalidTrainingRequest("the checkpoint is not a readable LoRA adapter")
        self.loads += 1
        self.loaded.append(adapter_id)

    def add_live(self, adapter_id: str, model_id: str) -> None:
        raise AssertionError("not used")

    def remove(self, adapter_id: str) -> None:
        self.loaded.remove(adapter_id)

    @contextmanager
    def pinned(self, adapter_id: str) -> Iterator[None]:
        self.pins[adapter_id] = self.pins.get(adapter_id, 0) + 1
        try:
            yield
        finally:
            self.pins[adapter_id] -= 1


def peft_folder(root: Path, name: str, content: str = "lora") -> Path:
    folder = root / name
    folder.mkdir()
    (folder / WEIGHTS).write_text(content)
    return folder


def test_the_first_name_is_the_id_the_others_aliases_and_the_version_pinned() -> None:
    models = ServedModels(["smollm2", "gpt-4o-mini"], "HuggingFaceTB/SmolLM2", version="2026-01-01")
    assert [e.id for e in models.entries()] == ["smollm2", "gpt-4o-mini", "smollm2-2026-01-01"]
    for name in ("smollm2", "gpt-4o-mini", "smollm2-2026-01-01"):
        entry = models.resolve(name)
        assert (entry.id, entry.root, entry.parent, entry.adapter_id) == (
            name,
            "HuggingFaceTB/SmolLM2",
            None,
            None,
        )
    assert models.resolve(None).id == "smollm2"  # model left out: the base model
    with pytest.raises(ModelNotFoundError, match="`gpt-4o` does not exist"):
        models.resolve("gpt-4o")


def test_a_key_allowed_the_id_may_use_every_alias_but_an_alias_only_itself() -> None:
    models = ServedModels(["smollm2", "mini"], "w", version="v1")
    alias, pinned, base = models.resolve("mini"), models.resolve("smollm2-v1"), models.resolve(None)
    allows_id = {"smollm2"}.__contains__
    allows_alias = {"mini"}.__contains__
    assert alias.allowed(allows_id) and pinned.allowed(allows_id) and base.allowed(allows_id)
    assert alias.allowed(allows_alias)
    assert not base.allowed(allows_alias) and not pinned.allowed(allows_alias)


def test_a_deprecated_name_is_served_until_its_day_then_gone() -> None:
    today = date(2026, 1, 1)
    models = ServedModels(
        ["smollm2", "old"],
        "w",
        deprecations={"old": date(2026, 3, 1)},
        today=lambda: today,
    )
    assert models.resolve("old").deprecation_date == date(2026, 3, 1)
    assert models.resolve("smollm2").deprecation_date is None
    assert "old" in [e.id for e in models.entries()]
    today = date(2026, 3, 1)
    with pytest.raises(ModelNotFoundError, match="retired on 2026-03-01"):
        models.resolve("old")
    assert [e.id for e in models.entries()] == ["smollm2"]


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"names": ["a", "a"]}, "served_model_name"),
        ({"names": ["tinker://x/sampler_weights/y"]}, "served_model_name"),
        ({"names": [" a"]}, "served_model_name"),
        ({"deprecations": {"nope": date(2026, 1, 1)}}, "model_deprecation"),
        ({"lora_modules": [LoraModule("m", Path("/x"))]}, "lora_modules"),  # no adapters
    ],
)
def test_bad_settings_are_refused_naming_the_setting(kwargs: dict, setting: str) -> None:
    names = kwargs.pop("names", ["m"])
    with pytest.raises(InvalidParameterError) as error:
        ServedModels(names, "w", **kwargs)
    assert error.value.param == setting


def test_lora_modules_load_at_start_stay_pinned_and_list_with_their_parent(tmp_path: Path) -> None:
    adapters = FakeAdapters()
    sql = peft_folder(tmp_path, "sql")
    models = ServedModels(["base"], "w", lora_modules=[LoraModule("sql", sql)], adapters=adapters)
    models.load_lora_modules()
    entry = models.resolve("sql")
    assert (entry.parent, entry.root, entry.grants) == ("base", str(sql), ("sql",))
    assert entry.adapter_id in adapters and adapters.pins[entry.adapter_id] == 1
    with models.use(entry):
        assert adapters.pins[entry.adapter_id] == 2
    assert adapters.pins[entry.adapter_id] == 1  # the server's own pin stays
    assert [e.id for e in models.entries()] == ["base", "sql"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: root / "missing", "no such folder"),
        (lambda root: (root / "empty").mkdir() or root / "empty", "not a PEFT LoRA adapter"),
        (lambda root: peft_folder(root, "bad", "junk"), "not a readable LoRA adapter"),
    ],
)
def test_a_bad_lora_module_fails_the_start_naming_it(tmp_path: Path, make, message: str) -> None:
    folder = make(tmp_path)
    models = ServedModels(
        ["base"], "w", lora_modules=[LoraModule("sql", folder)], adapters=FakeAdapters()
    )
    with pytest.raises(InvalidParameterError, match=message) as error:
        models.load_lora_modules()
    assert error.value.param == "lora_modules" and f"sql={folder}" in str(error.value)


@pytest.fixture
def tinker(tmp_path: Path) -> TinkerService:
    backend = ToyBackend("base", aliases=("tinker/alias",))
    return TinkerService(backend, backend, FileCheckpointStorage(tmp_path / "ckpt"))


def save_sampler(service: TinkerService, owner: str, run_id: str, name: str, base: str) -> str:
    run = RunRecord(run_id, owner, "session", base, LoraSpec(rank=4), 1.0, 1.0)
    service.checkpoints.save_run(run)
    service.checkpoints.reserve(run, "sampler", name, overwrite=False)
    record = service.checkpoints.write(
        run,
        "sampler",
        name,
        lambda folder: (folder / WEIGHTS).write_text("lora"),
        ttl_seconds=None,
        user_metadata=None,
        overwrite=False,
    )
    return record.tinker_path


def test_tinker_checkpoints_are_models_of_their_owner_only(tinker: TinkerService) -> None:
    adapters = FakeAdapters()
    models = ServedModels(
        ["served"],
        "w",
        adapters=adapters,
        tinker=tinker,
        tinker_base_names=["base", "tinker/alias"],
    )
    mine = save_sampler(tinker, "alice", "run-a", "s1", "tinker/alias")
    other = save_sampler(tinker, "bob", "run-b", "s1", "base")
    foreign = save_sampler(tinker, "alice", "run-c", "s1", "another/model")

    entry = models.resolve(mine, owner="alice")
    assert (entry.id, entry.parent, entry.grants) == (mine, "served", (mine, "served"))
    assert entry.adapter_id is not None and entry.adapter_id not in adapters  # loaded on use
    with models.use(entry):
        assert entry.adapter_id in adapters and adapters.pins[entry.adapter_id] == 1
    assert adapters.pins[entry.adapter_id] == 0
    with models.use(models.resolve(mine, owner="alice")):  # the same save: loaded once
        pass
    assert adapters.loads == 1

    for path, owner in [
        (other, "alice"),  # another tenant's
        (mine, None),  # no Tinker key
        (foreign, "alice"),  # on a base model this server does not serve
        ("tinker://run-a/sampler_weights/nope", "alice"),
        ("tinker://garbage", "alice"),
    ]:
        with pytest.raises(ModelNotFoundError):
            models.resolve(path, owner=owner)
    assert [e.id for e in models.entries("alice")] == ["served", mine]
    assert [e.id for e in models.entries("bob")] == ["served", other]
    assert [e.id for e in models.entries(None)] == ["served"]


def test_without_lora_serving_tinker_checkpoints_are_not_models(tinker: TinkerService) -> None:
    models = ServedModels(["base"], "w", tinker=tinker)
    path = save_sampler(tinker, "alice", "run-a", "s1", "base")
    with pytest.raises(ModelNotFoundError):
        models.resolve(path, owner="alice")
