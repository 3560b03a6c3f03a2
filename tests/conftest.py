"""Shared fixtures. Keep expensive ones (model loads, Ray clusters, redis) session/module scoped."""

import torch

# The test process shares 2 cores with Ray actors and servers; OpenMP threads that spin-wait
# under oversubscription make small matmuls many times slower than one thread.
torch.set_num_threads(1)

import pytest


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real redis-server on a free loopback port (tests/redis_server.py), one per test module.
    Skips when the binary is missing (CI: apt-get install -y redis-server)."""
    from redis_server import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server not installed (apt-get install -y redis-server)")
    server = RedisServer.start(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded SmolLM2-135M-Instruct as a cached HF folder (GGUF converted once)."""
    from kvmesh.core.config import ModelConfig
    from kvmesh.worker.model.loader import ensure_hf_dir

    return str(ensure_hf_dir(ModelConfig()).hf_dir)


def _tiny_checkpoint(path, smollm2_dir, model_type: str) -> str:
    """A random `model_type` model (2 layers, GQA 4:2, head_dim 16, 1024 positions) saved as
    a HF folder with SmolLM2's tokenizer: text in and out works while every forward is cheap."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.for_model(model_type, vocab_size=49152, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=False,
                                  bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # logits of std ~1: sampled tokens vary, greedy ties are unlikely
        model.lm_head.weight.normal_(0.0, 0.125)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # HF initialises biases to 0: make them matter
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir):
    """The tiny random Llama (_tiny_checkpoint)."""
    return _tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smollm2_dir):
    """The tiny Llama's sizes as a Qwen2 (plus the q/k/v biases every Qwen2 / 2.5 checkpoint
    carries): a non-Llama family for the end-to-end modules."""
    return _tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), smollm2_dir, "qwen2")


# Fixtures that start Ray (a Serve app, worker actors or a multi-node cluster). A test that
# uses one must carry the `e2e` marker, or `pytest -m "not e2e"` would quietly start clusters.
RAY_FIXTURES = frozenset({"cluster", "ray_cluster", "worker"})


def pytest_collection_modifyitems(config, items):
    unmarked = [item.nodeid for item in items
                if RAY_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("e2e") is None]
    if unmarked:
        raise pytest.UsageError(f"tests using a Ray fixture ({', '.join(sorted(RAY_FIXTURES))}) without the e2e "
                                f"marker: {unmarked}")
    # The tests marked `shared_ray` run last and together (in their own order), so the Ray
    # cluster they share (tests/e2e_cluster.py) starts once and never idles beside the rest.
    shared = [item for item in items if item.get_closest_marker("shared_ray")]
    if shared:
        items[:] = [item for item in items if not item.get_closest_marker("shared_ray")] + shared
    # `slow` tests (a cluster of their own, past the suite's time budget) run only when a -m
    # expression names them: `pytest -m slow`. A plain `pytest` (CI) skips them.
    if "slow" not in (config.getoption("markexpr") or ""):
        skip = pytest.mark.skip(reason="slow: run with `pytest -m slow`")
        for item in items:
            if item.get_closest_marker("slow") is not None:
                item.add_marker(skip)
