"""Workload generators: exact token lengths under a real tokenizer, prefix sharing, the
fitted length distribution, seeding, and the JSONL trace round trip."""

import collections
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from kvmesh.load_tests.corpus import TokenCorpus, load_corpus_text
from kvmesh.load_tests.tiny_tokenizer import train_corpus_tokenizer
from kvmesh.load_tests.trace_format import read_trace, write_trace
from kvmesh.load_tests.workloads import (ARTICLE_OUTPUT, LengthDistribution, WorkloadSpec,
                                         generate_workload)
from kvmesh.core.errors import InvalidRequestError


@pytest.fixture(scope="module")
def corpus():
    return TokenCorpus(train_corpus_tokenizer())


def test_corpus_is_real_prose_without_header():
    text = load_corpus_text()
    assert len(text.encode()) > 20_000
    assert "It is a truth universally acknowledged" in text
    assert not any(line.startswith("#") for line in text.splitlines())


@pytest.mark.parametrize("kind", ["synthetic", "long_short", "shared_prefix"])
def test_prompts_have_exact_token_lengths_as_text_and_ids(corpus, kind):
    spec = WorkloadSpec(kind=kind, num_requests=30, scale=0.1, seed=3, prefix_tokens=300, long_fraction=0.3)
    reqs = generate_workload(spec, corpus)
    assert len(reqs) == 30
    for r in reqs:
        # The text re-tokenizes to exactly the ids the workload asked for.
        assert tuple(corpus.encode(r.prompt_text)) == r.prompt_token_ids
        assert r.prompt_tokens >= 1 and r.output_tokens >= 1


def test_synthetic_lengths_follow_the_sampled_distribution(corpus):
    spec = WorkloadSpec(num_requests=25, scale=0.05, seed=1)
    reqs = generate_workload(spec, corpus)
    rng = np.random.default_rng(1)
    expected_out = spec.output.scaled(0.05).sample(rng, 25)
    assert [r.output_tokens for r in reqs] == list(expected_out)


def test_shared_prefix_families_share_exact_prefix_ids(corpus):
    spec = WorkloadSpec(kind="shared_prefix", num_requests=40, num_families=3, prefix_tokens=64, seed=5,
                        input=LengthDistribution("fixed", 10, None, 1, 100))
    reqs = generate_workload(spec, corpus)
    families = {}
    for r in reqs:
        assert r.prompt_tokens == 64 + 10
        families.setdefault(r.family, set()).add(r.prompt_token_ids[:64])
    assert set(families) == {0, 1, 2}
    assert all(len(prefixes) == 1 for prefixes in families.values())  # one prefix per family
    assert len({next(iter(p)) for p in families.values()}) == 3  # and families differ
    suffixes = [r.prompt_token_ids[64:] for r in reqs]
    assert len(set(suffixes)) > 30  # suffixes are (almost surely) unique


def test_long_short_mix_has_the_requested_fraction(corpus):
    spec = WorkloadSpec(kind="long_short", num_requests=200, seed=2, long_fraction=0.25,
                        input=LengthDistribution("fixed", 8, None, 1, 100),
                        long_input=LengthDistribution("fixed", 120, None, 1, 1000))
    lengths = [r.prompt_tokens for r in generate_workload(spec, corpus)]
    assert set(lengths) == {8, 120}
    assert 0.15 < lengths.count(120) / 200 < 0.35


def test_same_seed_same_requests_other_seed_different(corpus):
    spec = WorkloadSpec(num_requests=10, scale=0.05, seed=9, cancel_fraction=0.5)
    a, b = generate_workload(spec, corpus), generate_workload(spec, corpus)
    c = generate_workload(WorkloadSpec(num_requests=10, scale=0.05, seed=10, cancel_fraction=0.5), corpus)
    assert a == b
    assert a != c


def test_cancel_points_cut_mid_stream(corpus):
    reqs = generate_workload(WorkloadSpec(num_requests=100, scale=0.05, seed=4, cancel_fraction=0.3), corpus)
    cancelled = [r for r in reqs if r.cancel_after_tokens is not None]
    assert 15 < len(cancelled) < 45
    assert all(1 <= r.cancel_after_tokens < r.output_tokens for r in cancelled)


def test_lognormal_fit_matches_the_articles_mean_and_p99():
    mu, sigma = ARTICLE_OUTPUT.lognormal_params()
    assert math.exp(mu + sigma ** 2 / 2) == pytest.approx(400)
    assert math.exp(mu + 2.3263478740408408 * sigma) == pytest.approx(2000)
    wide = LengthDistribution("lognormal", 400, 2000, 1, 10 ** 9)
    x = wide.sample(np.random.default_rng(0), 200_000)
    assert x.mean() == pytest.approx(400, rel=0.03)
    assert np.percentile(x, 99) == pytest.approx(2000, rel=0.05)
    assert ARTICLE_OUTPUT.scaled(0.1).sample(np.random.default_rng(0), 10_000).mean() == pytest.approx(40, rel=0.05)


def test_bad_specs_raise_typed_errors(corpus):
    with pytest.raises(InvalidRequestError):
        LengthDistribution("lognormal", 400, 300).validate()  # p99 below the mean
    with pytest.raises(InvalidRequestError):
        generate_workload(WorkloadSpec(kind="zipf"), corpus)
    with pytest.raises(InvalidRequestError):
        generate_workload(WorkloadSpec(kind="trace"), corpus)


def test_trace_round_trip_replays_the_same_requests(corpus, tmp_path):
    reqs = generate_workload(WorkloadSpec(num_requests=6, scale=0.05, seed=7, cancel_fraction=0.5), corpus)
    arrivals = [0.0, 0.1, 0.1, 0.5, 1.25, 2.0]
    path = tmp_path / "trace.jsonl"
    write_trace(path, reqs, arrivals)
    replay = generate_workload(WorkloadSpec(kind="trace", trace_path=str(path)), corpus)
    assert [r.prompt_token_ids for r in replay] == [r.prompt_token_ids for r in reqs]
    assert [r.output_tokens for r in replay] == [r.output_tokens for r in reqs]
    assert [r.cancel_after_tokens for r in replay] == [r.cancel_after_tokens for r in reqs]
    assert [r.arrival_offset_s for r in replay] == arrivals


def test_adapters_keep_the_prompts_and_follow_zipf_popularity(corpus, tmp_path):
    spec = WorkloadSpec(num_requests=200, scale=0.02, seed=3)
    base = generate_workload(spec, corpus)
    lora = generate_workload(dataclasses.replace(spec, adapters=8, adapter_zipf_s=1.1), corpus)
    assert [r.prompt_token_ids for r in lora] == [r.prompt_token_ids for r in base]  # like for like
    assert [r.output_tokens for r in lora] == [r.output_tokens for r in base]
    assert all(r.adapter is None for r in base)
    counts = collections.Counter(r.adapter for r in lora)
    assert set(counts) <= {f"adapter-{i}" for i in range(8)} and len(counts) >= 6
    assert counts["adapter-0"] > 2 * counts["adapter-7"]  # Zipf: the hot adapter, a long tail
    uniform = collections.Counter(r.adapter for r in generate_workload(
        dataclasses.replace(spec, adapters=2, adapter_zipf_s=0.0), corpus))
    assert abs(uniform["adapter-0"] - uniform["adapter-1"]) < 40
    path = tmp_path / "lora.jsonl"  # a trace carries each request's adapter
    write_trace(path, lora[:5], [0.0] * 5)
    replay = generate_workload(WorkloadSpec(kind="trace", trace_path=str(path)), corpus)
    assert [r.adapter for r in replay] == [r.adapter for r in lora[:5]]
    with pytest.raises(InvalidRequestError):
        generate_workload(dataclasses.replace(spec, adapters=-1), corpus)


def test_trace_with_lengths_and_texts(corpus, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('# my traffic\n{"arrival_s": 0, "tenant": "a", "prompt_tokens": 17, "output_tokens": 3}\n\n'
                    '{"arrival_s": 0.5, "tenant": "b", "prompt": "Call me Ishmael.", "output_tokens": 2}\n')
    reqs = generate_workload(WorkloadSpec(kind="trace", trace_path=str(path)), corpus)
    assert [r.tenant_id for r in reqs] == ["a", "b"]
    assert reqs[0].prompt_tokens == 17
    assert reqs[1].prompt_text == "Call me Ishmael."
    assert len(read_trace(path)) == 2


@pytest.mark.parametrize("line", ['{"arrival_s": 0, "output_tokens": 3}',
                                  '{"arrival_s": 0, "prompt_tokens": 3}',
                                  '{"arrival_s": -1, "prompt_tokens": 3, "output_tokens": 3}',
                                  '{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 3, "colour": 1}',
                                  'not json'])
def test_malformed_trace_lines_are_rejected(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(InvalidRequestError):
        read_trace(path)


def test_shipped_campaigns_parse_and_bad_ones_are_rejected():
    from pathlib import Path

    from kvmesh.load_tests import campaign as campaign_mod

    folder = Path(campaign_mod.__file__).parent / "campaigns"
    own_driver = {p for p in folder.glob("*.yaml") if "runner" in yaml.safe_load(p.read_text())}
    assert {p.stem for p in own_driver} == {"routing-under-load", "routing-two-replicas"}
    for path in own_driver:  # pointed at its driver, not parsed as something it is not
        with pytest.raises(InvalidRequestError, match="routing_campaign"):
            campaign_mod.load_campaign(path)
    names = {p.stem: campaign_mod.load_campaign(p) for p in folder.glob("*.yaml") if p not in own_driver}
    assert {"seed-table", "peers", "prefix-routing", "overload", "tenants", "cancel-storm", "lora"} <= set(names)
    lora = {r.name: r for r in names["lora"].runs}
    assert lora["base"].streams[0].workload.adapters == 0 and lora["adapters"].streams[0].workload.adapters == 8
    assert lora["cluster-adapter-aware"].config["router"]["policy"] == "prefix_aware"
    assert lora["cluster-round-robin"].config["router"]["policy"] == "round_robin"
    assert [r.name for r in names["seed-table"].runs] == [
        "static-batch-8", "continuous", "continuous-preemption", "continuous-max-4", "stop-max-tokens",
        "stop-expected-preemption", "stop-max-tokens-poisson", "stop-expected-preemption-poisson"]
    expected_row = names["seed-table"].runs[5]
    assert expected_row.config["scheduler"]["admission_reserve"] == "expected"
    assert tuple(expected_row.streams[0].workload.stop) == (".", "\n") and expected_row.streams[0].workload.max_tokens == 200
    sweep = campaign_mod.parse_campaign({"runs": [{"name": "c", "arrival": {"rate": [1, 2, 4]}}]})
    assert [(r.name, r.label, r.streams[0].arrival.rate) for r in sweep.runs] == [
        ("c@1", "c", 1.0), ("c@2", "c", 2.0), ("c@4", "c", 4.0)]
    for bad in ({"runs": []}, {"runs": [{"name": "x", "colour": 1}]},
                {"runs": [{"name": "x", "config": {"scheduler": {"max_num_seqs": 0}}}]},
                {"runs": [{"name": "x"}, {"name": "x"}]},
                {"runs": [{"name": "x", "workload": {"kind": "zipf"}}]}):
        with pytest.raises(InvalidRequestError):
            campaign_mod.parse_campaign(bad)


def test_a_stop_workload_asks_the_same_ceiling_and_lets_the_text_end_each_output(corpus):
    from kvmesh.load_tests.targets import TargetRequest

    spec = WorkloadSpec(num_requests=6, scale=0.05, seed=3, stop=(".",), max_tokens=200)
    reqs = generate_workload(spec, corpus)
    assert {r.output_tokens for r in reqs} == {200} and {r.stop for r in reqs} == {(".",)}
    sent = TargetRequest("r", reqs[0].prompt_token_ids, "", 200, stop=(".",)).sampling()
    assert (sent.max_tokens, sent.stop, sent.ignore_eos) == (200, (".",), False)
    assert TargetRequest("r", (1,), "", 7).sampling().ignore_eos  # exact length: ignore_eos
    for bad in ({"stop": (".",)}, {"max_tokens": 200}, {"stop": (".",), "max_tokens": 0}):
        with pytest.raises(InvalidRequestError):
            generate_workload(WorkloadSpec(num_requests=2, **bad), corpus)


def test_a_structured_workload_carries_its_constraints_and_checks_each_output(corpus, tmp_path):
    import json

    from kvmesh.load_tests.structured_workload import http_fields, output_is_valid
    from kvmesh.load_tests.targets import TargetRequest

    shipped = "load_tests/data/structured-constraints.json"
    path = str(Path(__file__).resolve().parents[1] / shipped)
    reqs = generate_workload(WorkloadSpec(num_requests=8, scale=0.05, seed=3, constraints_path=path), corpus)
    kinds = [r.structured.kind for r in reqs]
    assert kinds == ["json_schema"] * 4 + ["regex", "choice", "json_schema", "json_schema"]  # cycled
    assert reqs[0].structured == reqs[6].structured
    sent = TargetRequest("r", (1,), "", 96, structured=reqs[4].structured).sampling()
    assert (sent.structured, sent.ignore_eos) == (reqs[4].structured, False)  # the grammar ends it
    assert http_fields(reqs[5].structured) == {"structured_outputs": {"choice": list(reqs[5].structured.choices)}}

    person = reqs[0].structured
    assert output_is_valid(person, '{"name":"Ada","age":36,"tags":["vip"]}')
    assert not output_is_valid(person, '{"name":"Ada","age":360,"tags":[]}')  # out of bounds
    assert not output_is_valid(person, '{"name":"Ada","age":3')  # cut at max_tokens
    assert output_is_valid(reqs[4].structured, "AB-1234") and not output_is_valid(reqs[4].structured, "AB-12345")
    assert output_is_valid(reqs[5].structured, "reject") and not output_is_valid(reqs[5].structured, "rejected")
    assert json.loads(json.dumps(http_fields(person)))["structured_outputs"]["json"]["required"] == ["name", "age", "tags"]

    for i, bad in enumerate(([], [{"xml": "<a/>"}], [{"regex": "a", "choice": ["b"]}], [{"choice": []}], "{")):
        bad_path = tmp_path / f"bad-{i}.json"
        bad_path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
        with pytest.raises(InvalidRequestError):
            generate_workload(WorkloadSpec(num_requests=2, constraints_path=str(bad_path)), corpus)
    with pytest.raises(InvalidRequestError, match="traces"):
        WorkloadSpec(kind="trace", trace_path="t.jsonl", constraints_path=path).validate()
