"""Each job done in one place: the served engine offers no synchronous analyses, the engine
core is stopped the way its entry point needs, and the browser modules share one element
builder."""

from __future__ import annotations

import re

from envoykit.analyses.surface import EngineSurface
from envoykit.engine import Engine, EngineLifetime
from envoykit.explorer.assets import asset, module
from envoykit.runtime.cleanup import stop_engine_core
from envoykit.serve.server import ServedEngine


def test_served_engine_has_an_engines_lifetime_and_none_of_its_analyses():
    assert issubclass(ServedEngine, EngineLifetime) and issubclass(Engine, EngineLifetime)
    assert not issubclass(ServedEngine, EngineSurface)
    for name in ("lens", "attribute", "patch_sweep", "generate", "exclusive", "_greedy"):
        assert hasattr(Engine, name) and not hasattr(ServedEngine, name), name


class _Core:
    def __init__(self) -> None:
        self.stopped = False

    def shutdown(self) -> None:
        self.stopped = True


class _SyncEntry:
    """What `vllm.LLM` offers here: the core's client inside its LLMEngine, no shutdown."""

    def __init__(self) -> None:
        self.llm_engine = type("LLMEngine", (), {"engine_core": _Core()})()


class _AsyncEntry:
    """What `AsyncLLM` offers here: a shutdown of its own (core and output loop)."""

    def __init__(self) -> None:
        self.stopped = False

    def shutdown(self) -> None:
        self.stopped = True


def test_the_engine_core_is_stopped_through_the_entry_points_own_path():
    sync, served = _SyncEntry(), _AsyncEntry()
    stop_engine_core(sync)
    stop_engine_core(served)
    assert sync.llm_engine.engine_core.stopped and served.stopped


def test_browser_modules_share_one_element_builder():
    definition = re.compile(r"^function element\(", re.MULTILINE)
    assert len(definition.findall(asset("dom.js"))) == 1
    for name in ("heatmap.js", "layer_picker.js"):
        assert not definition.findall(asset(name)), f"{name} defines its own element()"
        assert module(name).startswith(asset("dom.js")) and module(name).endswith(asset(name))
