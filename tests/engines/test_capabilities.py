"""The engine capability protocols (reef_core.engines.capabilities) match the engines that have the methods."""

from reef_core.engines.capabilities import AdapterSink, WeightSink
from reef_core.engines.remote import RemoteEngine
from reef_core.engines.sglang import SGLangEngine
from reef_core.engines.upstream import UpstreamEngine
from reef_core.engines.vllm import VLLMEngine


def test_serving_engines_take_weights_and_adapters():
    for cls in (RemoteEngine, SGLangEngine, VLLMEngine):
        assert issubclass(cls, WeightSink) and issubclass(cls, AdapterSink), cls


def test_a_proxy_takes_neither():
    assert not issubclass(UpstreamEngine, WeightSink)
    assert not issubclass(UpstreamEngine, AdapterSink)


def test_an_engine_with_only_full_weights_is_no_adapter_sink():
    class Full:
        async def swap_weights(self, version, state_dict=None):  # pragma: no cover - never called
            pass

    assert isinstance(Full(), WeightSink) and not isinstance(Full(), AdapterSink)
