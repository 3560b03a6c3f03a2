"""KvmeshConfig <-> Ray Serve config file, and `kvmesh serve-config` (deploy/serve_config.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from kvmesh.deploy import cli
from kvmesh.core.config import ConfigError, KvmeshConfig, apply_overrides
from kvmesh.deploy.serve_config import (API_KEY_HASHES_FILE_ENV, REDIS_URL_ENV, SERVE_APP_IMPORT_PATH,
                                        ServeOptions, build_serve_config,
                                        config_field_paths, config_from_serve_args,
                                        kvmesh_config_from_serve_config, serve_config_yaml,
                                        validate_with_ray_schema)

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "deploy" / "serve_config_example.yaml"


def _run_command(argv: list[str], capsys) -> tuple[int, str, str]:
    """`kvmesh serve-config ...` through the real entry point (kvmesh.deploy.cli:main)."""
    code = cli.main(["serve-config", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _custom_config() -> KvmeshConfig:
    return KvmeshConfig().replace(
        model={"path": "/models/m", "served_model_name": "m", "max_model_len": 4096},
        cache={"block_size": 32, "kv_cache_dtype": "int8", "num_blocks": 1000},
        scheduler={"policy": "dynamic", "max_num_seqs": 16, "max_queue_time_s": 5.5},
        parallel={"num_workers": 3, "tensor_parallel_size": 2, "worker_resource": "GPU"},
        quant={"weight": "int4", "group_size": 64},
        router={"host": "0.0.0.0", "http_port": 8080, "policy": "round_robin"},
        tenants={"auth_required": True, "tenants": [{"id": "a", "api_key_hashes": ["sha256$s$ab"],
                                                     "prompt_tokens_per_minute": 2_000_000}]},
        observability={"tracing_exporter": "otlp", "otlp_endpoint": "http://c:4317"},
    )


def test_command_is_registered_in_the_cli():
    assert "serve_config" in cli.COMMAND_MODULES


def test_round_trip_every_field_through_the_serve_yaml():
    config = _custom_config()
    text = serve_config_yaml(build_serve_config(config))
    back = kvmesh_config_from_serve_config(yaml.safe_load(text))
    assert back == config
    for path in config_field_paths():
        section, name = path.split(".")
        assert getattr(getattr(back, section), name) == getattr(getattr(config, section), name), path


def test_serve_file_shape():
    config = _custom_config()
    serve = build_serve_config(config, ServeOptions(app_name="llm"))
    (app,) = serve["applications"]
    assert app["import_path"] == SERVE_APP_IMPORT_PATH == "kvmesh.deploy.serve_app:build_app"
    assert (app["name"], app["route_prefix"]) == ("llm", "/")
    assert app["args"] == config.to_dict()
    # No Serve proxies: the router replicas serve router.http_port and router.grpc_port themselves.
    assert serve["proxy_location"] == "Disabled"
    assert "http_options" not in serve and "grpc_options" not in serve


@pytest.mark.parametrize("options", [ServeOptions(app_name=""), ServeOptions(route_prefix="/llm"),
                                     ServeOptions(proxy_location="HeadOnly"),
                                     ServeOptions(grpc_servicer_functions=("my.servicer:add",))])
def test_bad_serve_options_are_config_errors(options):
    with pytest.raises(ConfigError):
        build_serve_config(KvmeshConfig(), options)


def test_ray_schema_rejects_a_broken_serve_file():
    serve = build_serve_config(KvmeshConfig())
    serve["applications"][0]["import_path"] = 42
    with pytest.raises(ConfigError, match="ServeDeploySchema"):
        validate_with_ray_schema(serve)


def test_loader_rejects_bad_args_and_missing_app():
    serve = build_serve_config(KvmeshConfig())
    bad = copy.deepcopy(serve)
    bad["applications"][0]["args"]["scheduler"]["policy"] = "fifo"
    with pytest.raises(ConfigError, match="scheduler.policy"):
        kvmesh_config_from_serve_config(bad)
    other = copy.deepcopy(serve)
    other["applications"][0]["import_path"] = "other.module:app"
    with pytest.raises(ConfigError, match="exactly one application"):
        kvmesh_config_from_serve_config(other)


def test_overrides_use_the_config_field_names():
    config = apply_overrides(KvmeshConfig(), ["scheduler.max_num_seqs=32", "cache.num_blocks=null",
                                              "router.retry_lane_fraction=0.5", "cache.enable_prefix_caching=false",
                                              "tenants.tenants=[{id: t1, priority: 2}]"])
    assert config.scheduler.max_num_seqs == 32
    assert config.cache.num_blocks is None
    assert config.router.retry_lane_fraction == 0.5
    assert config.cache.enable_prefix_caching is False
    assert config.tenants.tenants[0].id == "t1" and config.tenants.tenants[0].priority == 2


@pytest.mark.parametrize("override,message", [
    ("scheduler.max_num_seq=3", "unknown field"),
    ("sched.max_num_seqs=3", "unknown section"),
    ("max_num_seqs=3", "section.field=value"),
    ("scheduler.max_num_seqs", "section.field=value"),
    ("scheduler.max_num_seqs=three", "expected an integer"),
    ("parallel.tensor_parallel_size=0", ">= 1"),
    ("scheduler.policy=fifo", "scheduler.policy"),
])
def test_bad_overrides_fail_with_the_field_named(override, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(KvmeshConfig(), [override])


def test_secret_plumbing_merges_back(tmp_path):
    args = KvmeshConfig().replace(tenants={"tenants": [{"id": "a"}, {"id": "b", "api_key_hashes": ["s$1$aa"]}]}).to_dict()
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"a": ["s$2$bb"], "b": ["s$1$aa", "s$3$cc"]}))
    env = {REDIS_URL_ENV: "redis://r:6379/0", API_KEY_HASHES_FILE_ENV: str(keys)}
    config = config_from_serve_args(args, env)
    assert config.tenants.redis_url == "redis://r:6379/0"
    assert {t.id: t.api_key_hashes for t in config.tenants.tenants} == {"a": ("s$2$bb",),
                                                                       "b": ("s$1$aa", "s$3$cc")}
    assert config_from_serve_args(args, {}) == KvmeshConfig.from_dict(args)  # no plumbing: args as given


def test_secret_plumbing_refuses_ambiguity_and_junk(tmp_path):
    with_url = KvmeshConfig().replace(tenants={"redis_url": "redis://a:6379/0"}).to_dict()
    with pytest.raises(ConfigError, match="keep one"):
        config_from_serve_args(with_url, {REDIS_URL_ENV: "redis://b:6379/0"})
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"ghost": ["s$1$aa"]}))
    with pytest.raises(ConfigError, match="ghost"):
        config_from_serve_args(KvmeshConfig().to_dict(), {API_KEY_HASHES_FILE_ENV: str(keys)})
    keys.write_text(yaml.safe_dump({"default": ["plain-text-key"]}))
    with pytest.raises(ConfigError, match="scheme\\$salt\\$hexdigest"):
        config_from_serve_args(KvmeshConfig().to_dict(), {API_KEY_HASHES_FILE_ENV: str(keys)})
    with pytest.raises(ConfigError, match="cannot read"):
        config_from_serve_args({}, {API_KEY_HASHES_FILE_ENV: str(tmp_path / "absent.yaml")})


def test_command_prints_a_valid_serve_file(capsys):
    code, out, _ = _run_command(["--set", "parallel.tensor_parallel_size=2", "--set", "router.host=0.0.0.0"], capsys)
    assert code == 0
    serve = yaml.safe_load(out)
    config = kvmesh_config_from_serve_config(serve)
    assert config.parallel.tensor_parallel_size == 2 and config.router.host == "0.0.0.0"
    assert serve["proxy_location"] == "Disabled" and "grpc_options" not in serve  # the replicas serve both


def test_command_reads_a_config_file_and_a_serve_file(tmp_path, capsys):
    config_file = tmp_path / "kvmesh.yaml"
    config_file.write_text(yaml.safe_dump({"scheduler": {"max_num_seqs": 7}}))
    code, out, _ = _run_command(["--config", str(config_file), "-o", str(tmp_path / "serve.yaml")], capsys)
    assert code == 0 and out == ""
    code, again, _ = _run_command(["--config", str(tmp_path / "serve.yaml"), "--set", "quant.weight=int8"], capsys)
    config = kvmesh_config_from_serve_config(yaml.safe_load(again))
    assert (config.scheduler.max_num_seqs, config.quant.weight) == (7, "int8")


def test_command_reports_bad_input_with_exit_2(tmp_path, capsys):
    code, out, err = _run_command(["--set", "scheduler.policy=fifo"], capsys)
    assert (code, out) == (2, "") and "scheduler.policy" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("scheduler: [unclosed")
    code, _, err = _run_command(["--config", str(broken)], capsys)
    assert code == 2 and "cannot read" in err


def test_example_file_is_valid_and_in_the_command_s_shape():
    """deploy/serve_config_example.yaml loads, and what it states survives a rebuild (fields
    added to the config later take their defaults, so the example need not list them)."""
    example = yaml.safe_load(EXAMPLE.read_text())
    config = kvmesh_config_from_serve_config(example)
    rebuilt = build_serve_config(config)
    rebuilt_args = rebuilt["applications"][0].pop("args")
    example_args = example["applications"][0].pop("args")
    assert rebuilt == example
    for section, fields in example_args.items():
        for name, value in fields.items():
            assert rebuilt_args[section][name] == value, f"{section}.{name}"


def test_worker_cpus_are_derived_from_the_machine_or_refused_naming_the_setting():
    from kvmesh.deploy.cmd_serve import config_from_args
    from kvmesh.core.resources import derive_worker_num_cpus, resolve_worker_num_cpus
    from kvmesh.router.app import ROUTER_REPLICA_NUM_CPUS, router_num_cpus

    # `kvmesh serve --workers 2` on 2 CPUs: both workers and the router (one replica spare) fit.
    config = config_from_args(cli.build_parser().parse_args(["serve", "--workers", "2"]))
    assert config.parallel.worker_num_cpus is None
    fitted = resolve_worker_num_cpus(config, 2.0, router_num_cpus(config))
    share = fitted.parallel.worker_num_cpus
    assert share == 0.75 and 2 * share + ROUTER_REPLICA_NUM_CPUS <= 2.0
    assert derive_worker_num_cpus(64.0, 4, 0.5) == 1.0  # a big machine: one core per rank
    assert derive_worker_num_cpus(2.0, 3, 0.5) == 0.5  # floored to 0.05, never rounded up
    tp = config.replace(parallel={"num_workers": 2, "tensor_parallel_size": 2})
    assert resolve_worker_num_cpus(tp, 2.0, 0.5).parallel.worker_num_cpus == 0.35  # per rank
    with_fallback = config.replace(degradation={"fallback_pool": {"num_workers": 1}})  # 3 engines share
    assert resolve_worker_num_cpus(with_fallback, 2.0, 0.5).parallel.worker_num_cpus == 0.5
    with pytest.raises(ConfigError, match="parallel.worker_num_cpus"):
        derive_worker_num_cpus(2.0, 64, 0.5)
    explicit = config.replace(parallel={"worker_num_cpus": 1.0})
    with pytest.raises(ConfigError, match="parallel.worker_num_cpus=1"):
        resolve_worker_num_cpus(explicit, 2.0, router_num_cpus(explicit))
    assert resolve_worker_num_cpus(explicit, 8.0, 0.5) is explicit  # given and it fits: kept


def test_serve_whose_ray_never_started_stops_nothing(monkeypatch):
    """Ray's start failing (a raylet that never registered on a loaded machine) leaves nothing
    to stop: `kvmesh serve` raises it, and does not call Serve's shutdown, whose calls would
    start a local Ray of their own just to find nothing there."""
    import ray

    from kvmesh.deploy import cmd_serve

    def start_serving(*_):
        raise RuntimeError("The current node timed out during startup")

    stopped = []
    monkeypatch.setattr(cmd_serve, "start_serving", start_serving)
    monkeypatch.setattr(cmd_serve, "stop_serving", lambda *args: stopped.append(args))
    with pytest.raises(RuntimeError, match="timed out during startup"):
        cmd_serve.run(cli.build_parser().parse_args(["serve", "--workers", "1"]))
    assert stopped == [] and not ray.is_initialized()


def test_tls_and_mutual_tls_stay_in_the_app_s_args():
    """The replicas' own servers read router.tls (HTTP and gRPC): the Serve file carries it only
    as the app's args, mutual TLS included."""
    mutual = KvmeshConfig().replace(router={"tls": {"cert_file": "/c", "key_file": "/k", "client_ca_file": "/ca"}})
    serve = build_serve_config(mutual)
    assert "http_options" not in serve and "grpc_options" not in serve
    assert kvmesh_config_from_serve_config(serve).router.tls == mutual.router.tls
