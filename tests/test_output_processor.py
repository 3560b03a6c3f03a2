"""The output processor: stop conditions in their documented order, min_tokens, the closing
delta's usage and timings, and the per-sample generators of a seeded request."""

import pytest
import torch

from kvmesh.core.seams import FinishReason, SamplingParams
from kvmesh.worker.engine_loop.output_processor import OutputProcessor
from kvmesh.worker.engine_loop.request import Request

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def start(tokenizer, max_model_len=64, sample_index=0, **params):
    processor = OutputProcessor(tokenizer, (EOS,), max_model_len)
    request = Request("internal-1", tokenizer.encode("Hello"), SamplingParams(**params), arrival_time=0.0,
                      sample_index=sample_index)
    processor.add(request, "caller-1", arrival_wall_s=1000.0)
    return processor, request


def feed(processor, request, token_ids):
    """Append and process tokens until one finishes the request; (deltas, reason)."""
    deltas = []
    for token_id in token_ids:
        request.append_output_token(token_id)
        delta, reason = processor.on_token(request, token_id, None)
        deltas.append(delta)
        if reason is not None:
            return deltas, reason
    return deltas, None


def words(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_eos_stops_and_its_text_is_not_emitted(tokenizer):
    processor, request = start(tokenizer, max_tokens=16)
    deltas, reason = feed(processor, request, words(tokenizer, " fine") + [EOS])
    assert reason is FinishReason.STOP
    assert "".join(d.text for d in deltas) == " fine"
    assert all(d.request_id == "caller-1" for d in deltas)


def test_ignore_eos_runs_to_max_tokens(tokenizer):
    processor, request = start(tokenizer, max_tokens=3, ignore_eos=True)
    deltas, reason = feed(processor, request, [EOS, EOS, EOS])
    assert reason is FinishReason.LENGTH and len(deltas) == 3


def test_min_tokens_holds_back_eos_and_the_sampler_is_told(tokenizer):
    processor, request = start(tokenizer, max_tokens=8, min_tokens=2, stop_token_ids=(7,))
    assert set(processor.sampling_row(request).min_tokens_block) == {EOS, 7}
    _, reason = feed(processor, request, [EOS])
    assert reason is None  # one token out, min_tokens is 2
    _, reason = feed(processor, request, [7])
    assert reason is FinishReason.STOP


def test_no_block_list_without_min_tokens(tokenizer):
    processor, request = start(tokenizer, max_tokens=8)
    assert processor.sampling_row(request).min_tokens_block == ()


def test_stop_string_stops_and_is_cut(tokenizer):
    processor, request = start(tokenizer, max_tokens=32, stop=("world",))
    deltas, reason = feed(processor, request, words(tokenizer, " hello world and more"))
    assert reason is FinishReason.STOP
    assert "".join(d.text for d in deltas) == " hello "


def test_context_limit_ends_with_length(tokenizer):
    prompt_len = len(tokenizer.encode("Hello"))
    processor, request = start(tokenizer, max_model_len=prompt_len + 2, max_tokens=50)
    _, reason = feed(processor, request, words(tokenizer, " a b c d e"))
    assert reason is FinishReason.LENGTH and request.num_output_tokens == 2


def test_final_delta_carries_usage_timings_and_clears_the_state(tokenizer):
    processor, request = start(tokenizer, max_tokens=2)
    processor.mark_scheduled(request)
    feed(processor, request, words(tokenizer, " ok then"))
    request.num_cached_tokens = 1
    final = processor.final_delta(request, FinishReason.LENGTH)
    assert final.finished and final.finish_reason is FinishReason.LENGTH and final.request_id == "caller-1"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_tokens) == \
        (request.num_prompt_tokens, 2, 1)
    t = final.timings
    assert t.arrival_time == 1000.0 and t.first_scheduled_time is not None and t.first_token_time is not None
    assert t.first_scheduled_time <= t.first_token_time <= t.finished_time
    assert request.request_id not in processor.states


def test_error_final_delta_names_the_error_and_drops_pending_text(tokenizer):
    processor, request = start(tokenizer, max_tokens=8, stop=("zzz-never",))
    feed(processor, request, words(tokenizer, " partial"))
    final = processor.final_delta(request, FinishReason.ERROR, error="queue timeout", error_type="OverloadedError",
                                  retry_after_s=1.5)
    assert (final.text, final.error, final.error_type, final.retry_after_s) == \
        ("", "queue timeout", "OverloadedError", 1.5)


def test_logprobs_are_kept_per_token(tokenizer):
    processor, request = start(tokenizer, max_tokens=4, logprobs=True)
    request.append_output_token(5)
    delta, _ = processor.on_token(request, 5, -0.25)
    assert delta.logprobs == (-0.25,) and processor.states[request.request_id].logprobs == [-0.25]


def test_seeded_samples_get_distinct_reproducible_generators(tokenizer):
    draws = {}
    for index in (0, 1, 0):
        processor, request = start(tokenizer, sample_index=index, seed=42)
        generator = processor.sampling_row(request).generator
        draws.setdefault(index, []).append(torch.rand(4, generator=generator).tolist())
    assert draws[0][0] == draws[0][1]  # same seed and index: same stream
    assert draws[0][0] != draws[1][0]  # another sample of the same request: another stream
    processor, request = start(tokenizer)
    assert processor.sampling_row(request).generator is None  # unseeded: the engine's generator
