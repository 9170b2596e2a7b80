"""What one service sees of the run's config: InfraSection and the sections it declares
(`Service.reads`), as typed read-only objects, and the values that join only those sections
(`config.buffer_capacity`). Any other section, or a flag read around its section, is an
AttributeError that says which declaration is missing. Plugins get the flat read-only config that
docs/tasks.md promises them (FlatConfig), through `for_plugins`, built from this view's sections.

A multi-LoRA partition is a view whose sections carry that adapter's values (`replace`), not a
copy of the whole config."""

from __future__ import annotations

from services.common.config.base import Section
from services.common.config.infra import InfraSection
from services.common.config.run import DERIVED, FLAGS, SECTION_NAMES, RunConfig, by_section, home_of

_ATTR_SECTION = {attr: cls for cls, attr in SECTION_NAMES.items()}
_FLAT_DERIVED = {**{name: (attr, name) for name, attr in DERIVED.items()},
                 "multi_lora_adapter_pairs": ("multi_lora", "adapter_pairs")}  # its flat name before the sections


class ConfigView:
    """A service's part of a RunConfig (see the module docstring)."""

    __slots__ = ("_run", "_reads", "_parts", "_flat", "_owner")

    def __init__(self, run: RunConfig, reads: tuple[type[Section], ...], owner: str = "this service",
                 parts: dict[type[Section], Section] | None = None):  # fmt: skip
        object.__setattr__(self, "_run", run)
        object.__setattr__(self, "_reads", frozenset({InfraSection, *reads}))
        object.__setattr__(self, "_parts", dict(parts or {}))
        object.__setattr__(self, "_flat", None if parts else run)
        object.__setattr__(self, "_owner", owner)

    def __getattr__(self, name: str):
        cls = _ATTR_SECTION.get(name)
        if cls is not None:
            if cls not in self._reads:
                raise AttributeError(f"{self._owner} reads config.{name} without declaring {cls.__name__} in its "
                                     "`reads`: add it there")  # fmt: skip
            return self._parts[cls] if cls in self._parts else getattr(self._run, name)
        member = RunConfig.__dict__.get(name)
        fn = member.fget if isinstance(member, property) else None
        if fn is not None and hasattr(fn, "joins"):
            missing = [c.__name__ for c in fn.joins if c not in self._reads]
            if missing:
                raise AttributeError(f"{self._owner} reads config.{name}, which joins {', '.join(missing)} that it "
                                     "does not declare in its `reads`: add them there")  # fmt: skip
            return fn(self)
        if (home := home_of(name)) is not None:
            raise AttributeError(f"{self._owner} reads config.{name} around its section: read {home}")
        raise AttributeError(name)

    def __setattr__(self, name, value):
        raise AttributeError("a service's config is read-only")

    def __reduce__(self):
        return ConfigView, (self._run, tuple(self._reads), self._owner, self._parts or None)

    def replace(self, **flags: object) -> ConfigView:
        """This view with flags changed (by flag name), each in its own section (a partition's batch
        size, data, budget): the changed sections are new objects, the rest are shared."""
        parts = dict(self._parts)
        for attr, changed in by_section(flags).items():
            cls = _ATTR_SECTION[attr]
            parts[cls] = (parts[cls] if cls in parts else getattr(self._run, attr)).model_copy(update=changed)
        return ConfigView(self._run, tuple(self._reads), self._owner, parts)

    def whole(self) -> RunConfig:
        """The RunConfig with this view's section values (a partition's), for what takes a whole one."""
        if self._flat is None:  # built once: the sections are frozen
            parts = {a: self._parts.get(c) or getattr(self._run, a) for a, c in _ATTR_SECTION.items()}
            object.__setattr__(self, "_flat", RunConfig.model_construct(**parts))
        return self._flat

    def model_dump(self, **kw) -> dict:
        """The flat config's fields (as RunConfig.model_dump), for a process this service starts."""
        return self.whole().model_dump(**kw)


class FlatConfig:
    """A RunConfig as plugins read it (docs/tasks.md): every flag by its name (`config.rm_type`,
    `config.rollout_batch_size`), each section's derived values (`config.mode`), the sections and
    the joined values; read-only."""

    __slots__ = ("_run",)

    def __init__(self, run: RunConfig):
        object.__setattr__(self, "_run", run)

    def __getattr__(self, name: str):
        if name in FLAGS:
            return self._run.flag(name)
        home = _FLAT_DERIVED.get(name)  # a section's derived value, flat as before (`config.mode`)
        return getattr(self._run, name) if home is None else getattr(getattr(self._run, home[0]), home[1])

    def __setattr__(self, name, value):
        raise AttributeError("the run's config is read-only")

    def __reduce__(self):
        return FlatConfig, (self._run,)

    def __dir__(self):
        return sorted({*FLAGS, *_FLAT_DERIVED, *SECTION_NAMES.values(), *dir(RunConfig)})

    def model_copy(self, *, update: dict | None = None, deep: bool = False) -> FlatConfig:
        return FlatConfig(self._run.model_copy(update=update, deep=deep))


def view(config: RunConfig | ConfigView, reads: tuple[type[Section], ...], owner: str) -> ConfigView:
    """`config` narrowed to `reads`; a view is narrowed again (to these sections, its values kept)."""
    if isinstance(config, ConfigView):
        return ConfigView(config._run, reads, owner, config._parts or None)
    return ConfigView(config, reads, owner)


def for_plugins(config: RunConfig | ConfigView | FlatConfig) -> FlatConfig:
    """The flat, read-only config of docs/tasks.md a plugin (custom generate, reward, buffer, filter
    and log functions) gets, from a service's view (its section values) or a whole config alike."""
    if isinstance(config, FlatConfig):
        return config
    return FlatConfig(config.whole() if isinstance(config, ConfigView) else config)
