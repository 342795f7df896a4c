"""The throughput replica's own code on the SGLang engine (SGLang replaced by the in-process
stand-in of tests/replicas/engines/sglang_stand_in.py): the builder's settings start it, a stream
that the router closes aborts the request in SGLang, and Serve's teardown shuts SGLang down."""

from __future__ import annotations

from megaserve.deploy import builder
from megaserve.deploy.config import AppConfig
from megaserve.deploy.env import Environment
from megaserve.replicas.deployments import ReplicaSpec, _Replica
from megaserve.replicas.protocol import FinishReason, GenerateRequest, SamplingParams, Tier
from tests.model_factory import make_tiny_model
from tests.replicas.engines.sglang_stand_in import StandInSGLang

ANY_FREE_PORT = 0


def _replica(tmp_path) -> _Replica:
    config = AppConfig.model_validate({
        "model": {"name": "tiny-sglang-replica"}, "latency": {"enabled": False},
        "throughput": {"device": "cuda", "engine": "sglang", "tp_size": 2, "max_seq_len": 256, "max_batch": 4},
    })
    env = Environment(home=tmp_path, kernel_cache=tmp_path / "k", api_keys=())
    settings = builder._engine_settings(Tier.THROUGHPUT, config.throughput, config, env, "sglang", 4)
    spec = ReplicaSpec(engine="sglang", engine_settings=settings | {"launch": StandInSGLang},
                       model_dir=str(make_tiny_model(tmp_path / "model", "llama")), metrics_port=ANY_FREE_PORT)
    return _Replica(spec)


async def test_the_replica_streams_from_sglang_and_aborts_when_the_router_closes(tmp_path):
    replica = _replica(tmp_path)
    sglang = replica.engine._runtime
    assert sglang.launch_args["tp_size"] == 2 and sglang.launch_args["max_running_requests"] == 4
    finished = [item async for item in replica.generate(
        GenerateRequest("done", (1, 2), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))]
    assert finished[-1].finish_reason == FinishReason.LENGTH
    stream = replica.generate(GenerateRequest("left", (1, 2), SamplingParams(max_tokens=200, temperature=0)))
    await anext(stream)
    await stream.aclose()  # what Ray does when the client goes away
    assert sglang.tokenizer_manager.aborted == [sglang.requests[-1]["rid"]]
    await replica.check_health()  # raises if SGLang does not answer
    await replica.__del__()  # what Serve calls on teardown
    assert sglang.shut_down
