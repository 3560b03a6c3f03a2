"""bench_lora's engine part runs end to end on the tiny model (the figures are the benchmark's
business; here: every request finishes, the adapter rows really ran eagerly, adapters were
loaded into slots and evicted through the 4 slots)."""

from kvmesh.load_tests.bench_lora import bench_throughput
from kvmesh.load_tests.workloads import zipf_adapter_choices


def test_throughput_part_runs_every_request(tiny_model_dir):
    figures = bench_throughput(tiny_model_dir, quick=True, rounds=1)
    assert figures.failed_requests == 0
    assert figures.adapter_loads >= 8, "8 adapters through 4 slots: each loaded at least once"
    assert figures.eager_lora_steps > 0 and figures.ratio > 0


def test_zipf_popularity_is_skewed_and_seeded():
    choices = zipf_adapter_choices(2000, 8, s=1.1, seed=3)
    counts = [choices.count(i) for i in range(8)]
    assert counts == sorted(counts, reverse=True) or counts[0] > 3 * counts[-1]
    assert choices == zipf_adapter_choices(2000, 8, s=1.1, seed=3)
