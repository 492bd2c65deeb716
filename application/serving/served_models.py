"""The models the OpenAI faces serve, by the names clients send.

- The base model under its id (the first ``--served-model-name``), its aliases (the other
  names) and its pinned version ``<id>-<version>`` (``smollm2-2026-01-01``): all the same
  weights, listed as models of their own with ``root`` = the weights.
- LoRA adapters as models: ``--lora-modules name=path`` (PEFT folders), loaded into the
  engine's multi-LoRA serving at start and kept loaded; listed with ``parent`` = the base.
- With the Tinker API, the caller's saved checkpoints by their ``tinker://`` path, loaded on
  first use (the Tinker sampler's adapters: one load serves both); another tenant's
  checkpoint does not exist for the caller (public ones excepted, as in Tinker).
- Any static name may have a deprecation date (its shutdown): until then it is served and
  listed with ``deprecation_date`` (the faces add ``Deprecation`` / ``Sunset`` headers);
  from that day on it is neither (``ModelNotFoundError``).

Resolving a name gives a :class:`ModelEntry`: what ``/v1/models`` shows and what the engine
needs (the adapter id, None for the base model).
"""

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from datetime import date
from pathlib import Path
from typing import Protocol

from application.tinker.checkpoints import CheckpointStore
from application.tinker.engine_sampler import checkpoint_adapter_id
from domain.errors import InvalidParameterError, ModelNotFoundError
from domain.rollout import Rollout
from domain.tinker.errors import TrainingError
from domain.tinker.ports import ServingAdapters

TINKER_SCHEME = "tinker://"
_LORA_PREFIX = "lora-module:"


@dataclass(frozen=True, slots=True)
class LoraModule:
    """A PEFT adapter folder served as the model ``name``."""

    name: str
    path: Path


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """A model as ``/v1/models`` shows it, and how a request runs on it.

    ``grants``: the names a key's model scope may list to let it use this model (its own
    name, and for an alias, pinned version or Tinker checkpoint the base's id);
    ``adapter_id``: the engine's LoRA adapter (None: the base model); ``folder``: where a
    Tinker checkpoint's adapter is loaded from (never shown)."""

    id: str
    root: str
    created: int
    parent: str | None = None
    deprecation_date: date | None = None
    grants: tuple[str, ...] = ()
    adapter_id: str | None = None
    folder: Path | None = field(default=None, repr=False)
    rollout: str | None = None  # the rollout that sent the request here

    def allowed(self, allows_model: Callable[[str], bool]) -> bool:
        """Whether a tenant whose scope answers ``allows_model`` may use this model."""
        return any(allows_model(name) for name in self.grants)


class NameSettings(Protocol):
    """The model settings that name what is served (``infer serve``'s flags)."""

    @property
    def aliases(self) -> Sequence[str]: ...
    @property
    def model_version(self) -> str | None: ...
    @property
    def lora_modules(self) -> Sequence[LoraModule]: ...
    @property
    def deprecations(self) -> Mapping[str, date]: ...
    @property
    def rollouts(self) -> Sequence[Rollout]: ...


def check_lora_module(module: LoraModule, adapters: ServingAdapters) -> None:
    """``InvalidParameterError`` naming the module unless its folder holds an adapter's
    weights file (a PEFT LoRA folder)."""
    where = f"{module.name}={module.path}"
    if not module.path.is_dir():
        raise InvalidParameterError("lora_modules", f"{where}: no such folder")
    weights = adapters.weights_file(module.path)
    if not weights.is_file():
        raise InvalidParameterError(
            "lora_modules", f"{where}: no {weights.name} (not a PEFT LoRA adapter folder)"
        )


class TinkerCheckpoints(Protocol):
    """Where the Tinker checkpoints served by path are found."""

    @property
    def checkpoints(self) -> CheckpointStore: ...


@dataclass(frozen=True, slots=True)
class SharedCheckpoints:
    """Tinker's checkpoints without the Tinker service: a fleet's ingress reading the
    ``--checkpoint-dir`` its replicas share (each checkpoint is loaded by the replica that
    runs the request, from the folder the call names)."""

    checkpoints: CheckpointStore


class ServedModels:
    @classmethod
    def from_settings(
        cls,
        names: list[str],
        root: str,
        settings: NameSettings,
        lora: ServingAdapters | None,
        tinker: TinkerCheckpoints | None,
    ) -> "ServedModels":
        """The names the OpenAI faces serve: ``names[0]`` and the aliases of ``settings``,
        the LoRA modules (loaded now: a bad folder fails the start), Tinker's checkpoints
        (on the base model under any of ``names``, Tinker's aliases included)."""
        models = cls(
            [names[0], *settings.aliases],
            root,
            version=settings.model_version,
            lora_modules=settings.lora_modules,
            adapters=lora,
            tinker=tinker,
            tinker_base_names=names,
            deprecations=settings.deprecations,
            rollouts=settings.rollouts,
        )
        models.load_lora_modules()
        return models

    def __init__(
        self,
        names: Sequence[str],
        root: str,
        *,
        version: str | None = None,
        lora_modules: Sequence[LoraModule] = (),
        adapters: ServingAdapters | None = None,
        tinker: TinkerCheckpoints | None = None,
        tinker_base_names: Sequence[str] = (),
        deprecations: Mapping[str, date] | None = None,
        rollouts: Sequence[Rollout] = (),
        today: Callable[[], date] = date.today,
    ) -> None:
        """``names``: the base model's id, then its aliases; ``root``: its weights;
        ``version``: its pinned version (served as ``<id>-<version>``); ``adapters``: the
        engine's multi-LoRA serving (needed by ``lora_modules`` and Tinker checkpoints);
        ``tinker``: serve its checkpoints (the Tinker service's, or a fleet ingress's
        :class:`SharedCheckpoints`) by path, those on ``tinker_base_names`` (the
        names the Tinker API knows this base model by); ``deprecations``: name -> the day
        it stops being served; ``rollouts``: names split between served models (see
        :meth:`set_rollout`). Raises ``InvalidParameterError`` naming the setting."""
        if not names:
            raise InvalidParameterError("served_model_name", "give at least one name")
        if lora_modules and adapters is None:
            raise InvalidParameterError("lora_modules", "LoRA serving needs the torch runner")
        self.base = names[0]
        self.adapters = adapters
        self.tinker = tinker if adapters is not None else None
        self.tinker_base_names = frozenset(tinker_base_names or names[:1])
        self.today = today
        self.created = int(time.time())
        self.lora_modules = list(lora_modules)
        self.deprecations = dict(deprecations or {})
        self._static: dict[str, ModelEntry] = {}
        pinned = [f"{self.base}-{version}"] if version else []
        for name in [*names, *pinned]:
            grants = (name,) if name == self.base else (name, self.base)
            self._add("served_model_name", ModelEntry(name, root, self.created, grants=grants))
        for module in lora_modules:
            entry = ModelEntry(
                module.name,
                str(module.path),
                self.created,
                parent=self.base,
                grants=(module.name,),
                adapter_id=_LORA_PREFIX + module.name,
            )
            self._add("lora_modules", entry)
        for name, day in self.deprecations.items():
            if name not in self._static:
                raise InvalidParameterError(
                    "model_deprecation", f"{name!r} is not a served model name"
                )
            self._static[name] = replace(self._static[name], deprecation_date=day)
        self._pins: dict[str, ExitStack] = {}  # each LoRA adapter's pin, while it is served
        self._adapters_lock = threading.Lock()  # adapters loaded and unloaded one at a time
        self._rollouts: dict[str, Rollout] = {}
        self._rollouts_lock = threading.Lock()
        for rollout in rollouts:
            try:
                self.set_rollout(rollout)
            except InvalidParameterError as e:
                raise InvalidParameterError("model_rollout", e.message) from e

    def _add(self, setting: str, entry: ModelEntry) -> None:
        name = entry.id
        if not name or name != name.strip() or name.startswith(TINKER_SCHEME):
            raise InvalidParameterError(setting, f"{name!r} is not a usable model name")
        if name in self._static:
            raise InvalidParameterError(setting, f"the model name {name!r} is given twice")
        self._static[name] = entry

    def load_lora_modules(self) -> None:
        """Load every ``--lora-modules`` folder (kept loaded: never evicted); raises
        ``InvalidParameterError`` naming the module and its folder."""
        for module in self.lora_modules:
            assert self.adapters is not None  # checked in __init__
            adapter_id = _LORA_PREFIX + module.name
            where = f"{module.name}={module.path}"
            check_lora_module(module, self.adapters)
            self._pins[module.name] = self._loaded(adapter_id, module.path, "lora_modules", where)

    def _loaded(self, adapter_id: str, folder: Path, param: str, where: str) -> ExitStack:
        """Load ``folder`` under ``adapter_id``, pinned (kept loaded) until the stack
        closes; ``InvalidParameterError`` naming ``param`` and ``where`` and what is wrong."""
        assert self.adapters is not None
        pin = ExitStack()
        pin.enter_context(self.adapters.pinned(adapter_id))
        try:
            self.adapters.load_folder(adapter_id, folder)
        except (TrainingError, OSError, ValueError) as e:  # the operator's own folder
            pin.close()
            why = f"{e} ({e.__cause__})" if e.__cause__ is not None else str(e)
            raise InvalidParameterError(param, f"{where}: {why}") from e
        return pin

    # --- LoRA adapters loaded at run time -------------------------------------------

    def add_lora(self, module: LoraModule) -> ModelEntry:
        """Serve the PEFT folder ``module.path`` as the model ``module.name`` from now on
        (vLLM's ``load_lora_adapter``): loaded now and kept loaded until
        :meth:`remove_lora`. ``InvalidParameterError`` naming ``lora_name`` (a name served
        already, or unusable) or ``lora_path`` (no such folder, not a PEFT adapter, an
        adapter of another base model, a rank over the limit)."""
        if self.adapters is None:
            raise InvalidParameterError(
                "lora_name", "LoRA serving is off: start the server with --enable-lora"
            )
        with self._adapters_lock:
            name = module.name
            if name in self._static or self.rollout(name) is not None:
                raise InvalidParameterError("lora_name", f"the model name {name!r} is served")
            where = f"{name}: {module.path}"
            try:
                check_lora_module(module, self.adapters)
            except InvalidParameterError as e:
                raise InvalidParameterError("lora_path", e.message.removeprefix(f"{name}=")) from e
            # An id of its own for each load: a fleet's replica holding an earlier load of
            # this name (another folder) loads this one afresh.
            adapter_id = f"{_LORA_PREFIX}{name}@{time.time_ns()}"
            pin = self._loaded(adapter_id, module.path, "lora_path", where)
            entry = ModelEntry(
                name,
                str(module.path),
                int(time.time()),
                parent=self.base,
                grants=(name,),
                adapter_id=adapter_id,
                folder=module.path,
            )
            try:
                self._add("lora_name", entry)
            except InvalidParameterError:
                pin.close()
                self.adapters.remove(adapter_id)
                raise
            self._pins[name] = pin
            return entry

    def remove_lora(self, name: str) -> ModelEntry:
        """Stop serving the LoRA adapter ``name`` (vLLM's ``unload_lora_adapter``): new
        requests no longer find it; those running finish on it, and its weights go when
        the last one ends. ``ModelNotFoundError`` when no adapter has that name;
        ``InvalidParameterError`` when a rollout sends requests to it."""
        with self._adapters_lock:
            entry = self._static.get(name)
            if entry is None or name not in self._pins or entry.adapter_id is None:
                raise ModelNotFoundError(f"The LoRA adapter `{name}` cannot be found")
            targeting = [r.name for r in self.rollouts() if name in r.shares()]
            if targeting:
                raise InvalidParameterError(
                    "lora_name", f"the rollout {targeting[0]!r} sends requests to {name!r}"
                )
            del self._static[name]
            self._pins.pop(name).close()
            assert self.adapters is not None
            self.adapters.remove(entry.adapter_id)
            return entry

    def runtime_adapters(self) -> dict[str, Path]:
        """The LoRA adapters served now (``--lora-modules`` and loaded at run time), by
        name: their folders."""
        return {
            name: entry.folder or Path(entry.root)
            for name, entry in list(self._static.items())
            if name in self._pins
        }

    # --- rollouts -------------------------------------------------------------------

    def check_rollout(self, rollout: Rollout) -> None:
        """``InvalidParameterError`` naming what is wrong unless ``rollout``'s targets are
        served model names of this server (the base's names, LoRA modules), none retired
        nor a rollout, and its name no other model's."""
        where = f"rollout {rollout.name!r}"
        if rollout.name in self._static or rollout.name.startswith(TINKER_SCHEME):
            raise InvalidParameterError("name", f"{where}: the name is a served model's")
        for target in rollout.targets:
            entry = self._static.get(target.model)
            if target.model in self._rollouts:
                raise InvalidParameterError(
                    "targets", f"{where}: {target.model!r} is a rollout, not a model"
                )
            if entry is None or self._retired(entry):
                raise InvalidParameterError(
                    "targets", f"{where}: {target.model!r} is not a served model name"
                )

    def set_rollout(self, rollout: Rollout) -> Rollout | None:
        """Serve ``rollout`` (replacing the one of its name: a weight moved, a rollback);
        the one it replaced (checked by :meth:`check_rollout` first)."""
        with self._rollouts_lock:
            self.check_rollout(rollout)
            before = self._rollouts.get(rollout.name)
            self._rollouts[rollout.name] = rollout
        return before

    def remove_rollout(self, name: str) -> Rollout | None:
        """Stop serving the rollout ``name``; the one removed (None: there was none)."""
        with self._rollouts_lock:
            return self._rollouts.pop(name, None)

    def rollout(self, name: str) -> Rollout | None:
        """The rollout served as ``name`` (None: there is none)."""
        with self._rollouts_lock:
            return self._rollouts.get(name)

    def rollouts(self) -> list[Rollout]:
        with self._rollouts_lock:
            return sorted(self._rollouts.values(), key=lambda r: r.name)

    # --- resolving ------------------------------------------------------------------

    def resolve(
        self,
        requested: str | None,
        owner: str | None = None,
        *,
        tenant: str | None = None,
        sticky: str | None = None,
    ) -> ModelEntry:
        """The model a request names (None: the base model). ``owner``: the caller's
        Tinker tenant (None: it has none, so no checkpoint of its own); for a rollout's
        name, the target picked for ``tenant`` and the ``sticky`` key (see
        :meth:`Rollout.pick`)."""
        if requested is None:
            return self._static[self.base]
        rollout = self._rollouts.get(requested)
        if rollout is not None:
            target = self.resolve(rollout.pick(tenant, sticky))
            return replace(target, grants=(rollout.name, self.base), rollout=rollout.name)
        entry = self._static.get(requested)
        if entry is not None:
            if self._retired(entry):
                raise ModelNotFoundError(
                    f"The model `{requested}` was retired on {entry.deprecation_date}"
                )
            return entry
        if requested.startswith(TINKER_SCHEME) and self.tinker is not None and owner:
            found = self._checkpoint(requested, owner)
            if found is not None:
                return found
        raise ModelNotFoundError(
            f"The model `{requested}` does not exist or you do not have access to it"
        )

    def _checkpoint(self, path: str, owner: str) -> ModelEntry | None:
        assert self.tinker is not None and self.adapters is not None
        try:
            record, folder = self.tinker.checkpoints.resolve(owner, path)
            adapter_id = checkpoint_adapter_id(self.adapters, folder)
        except TrainingError:  # a malformed path, another's checkpoint, one deleted
            return None
        if record.base_model not in self.tinker_base_names:  # saved by another server
            return None
        return ModelEntry(
            path,
            path,
            int(record.created_at),
            parent=self.base,
            grants=(path, self.base),
            adapter_id=adapter_id,
            folder=folder,
        )

    @contextmanager
    def use(self, entry: ModelEntry) -> Iterator[None]:
        """Keep ``entry``'s adapter loaded while a request runs on it (a Tinker
        checkpoint's is loaded now if it is not)."""
        if entry.adapter_id is None or self.adapters is None:
            yield
            return
        with self.adapters.pinned(entry.adapter_id):  # before loading: never evicted by it
            if entry.adapter_id not in self.adapters:
                if entry.folder is None:  # a LoRA module evicted: cannot happen (pinned)
                    raise ModelNotFoundError(f"The model `{entry.id}` is not loaded")
                try:
                    self.adapters.load_folder(entry.adapter_id, entry.folder)
                except TrainingError as e:
                    raise InvalidParameterError("model", f"`{entry.id}`: {e}") from e
            yield

    # --- listing --------------------------------------------------------------------

    def entries(self, owner: str | None = None) -> list[ModelEntry]:
        """Every model served now: the base's names, the LoRA modules, then (with an
        ``owner``) its Tinker sampler checkpoints on this base model, oldest first."""
        listed = [e for e in self._static.values() if not self._retired(e)]
        listed += [
            ModelEntry(r.name, r.name, self.created, grants=(r.name, self.base))
            for r in self.rollouts()
        ]
        if self.tinker is None or not owner:
            return listed
        for record in self.tinker.checkpoints.find(owner):
            if record.kind == "sampler" and record.base_model in self.tinker_base_names:
                listed.append(
                    ModelEntry(
                        record.tinker_path,
                        record.tinker_path,
                        int(record.created_at),
                        parent=self.base,
                        grants=(record.tinker_path, self.base),
                    )
                )
        return listed

    def _retired(self, entry: ModelEntry) -> bool:
        return entry.deprecation_date is not None and self.today() >= entry.deprecation_date
