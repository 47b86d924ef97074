"""Every wire style by its profile name: the one module that knows them all.

`wire.py` defines the base styles, `wire_servers.py` and `wire_vllm.py` subclass them; this
module sits above all three, so the imports form a tree (no cycle, no import inside a function).
"""

from __future__ import annotations

from mlxproxy.sim.wire import Style, WireContext
from mlxproxy.sim.wire_native import LmStudioStyle, OllamaStyle
from mlxproxy.sim.wire_servers import MlxLmStyle, MlxOmniServerStyle, MlxOpenAIServerStyle, MlxVlmStyle
from mlxproxy.sim.wire_vllm import OmlxStyle, RapidMlxStyle, VllmMlxStyle

STYLES: dict[str, type[Style]] = {
    cls.name: cls
    for cls in (
        Style,
        MlxLmStyle,
        MlxOpenAIServerStyle,
        MlxOmniServerStyle,
        VllmMlxStyle,
        RapidMlxStyle,
        OmlxStyle,
        MlxVlmStyle,
        OllamaStyle,
        LmStudioStyle,
    )
}


def style_class(name: str) -> type[Style]:
    """The style class for a profile's `wire` name; raises KeyError for an unknown one."""
    return STYLES[name]


def style_for(name: str, ctx: WireContext) -> Style:
    """A style object formatting one response."""
    return style_class(name)(ctx)
