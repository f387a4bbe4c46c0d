"""The engine process behind the asyncio front: generate, abort, stats, a quiet shutdown."""
import asyncio
import logging

from pdserve.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.sampling_params import SamplingParams

from tests.helpers_models import make_tiny_hf_model


def test_generate_abort_stats_and_quiet_shutdown(tmp_path, caplog):
    config = EngineConfig(model=ModelConfig(model=make_tiny_hf_model(tmp_path, "llama")),
                          cache=CacheConfig(kv_cache_memory=8 << 20), num_threads=1)

    async def main():
        engine = AsyncEngine(config)
        await engine.start()
        outs = [o async for o in engine.generate("a", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0))]
        assert sum(len(o.new_token_ids) for o in outs) == 5 and outs[-1].finished
        gen = engine.generate("b", [4, 5], SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=0))
        await gen.__anext__()
        await gen.aclose()  # the caller went away: the engine aborts the request
        for _ in range(50):
            await asyncio.sleep(0.1)
            if engine.stats().get("num_requests_running") == 0 and engine.stats()["kv_cache_usage_perc"] == 0:
                break
        assert engine.stats()["num_requests_running"] == 0 and engine.stats()["kv_cache_usage_perc"] == 0
        assert engine.is_healthy()
        await engine.shutdown()

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    assert not [r for r in caplog.records if "engine process exited" in r.getMessage()]
