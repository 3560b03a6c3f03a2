"""End to end with TLS on (router.tls: a throwaway CA and server certificate written by the test
with `cryptography`, tests/tls_certs.py): the real Serve app, one router replica, one worker of
the tiny random Llama.

* gRPC (the replica's own server, router/grpc_ingress.py -> tls.add_grpc_port): the kvmesh
  client over TLS streams; a plaintext client, and a TLS client that does not trust the CA,
  are refused; a certificate rewritten in place reaches the next connections, no restart.
* HTTP (Serve's proxy, HTTPS from the same files): the OpenAI Python SDK over https:// works;
  plain http:// and an untrusting client are refused.
Mutual TLS is refused at start while Serve's proxy is the HTTP edge (it cannot require client
certificates, router/tls.py serve_http_ssl_options); on gRPC it is the same add_grpc_port,
tested over real sockets in tests/test_tls.py."""

from __future__ import annotations

import grpc
import httpx
import pytest
from test_tls import _served_cert_der  # the certificate a new connection is shown
from tls_certs import ThrowawayPki

from e2e_cluster import serving, tiny_cluster_config, wait_for
from kvmesh.core.errors import WorkerFailedError
from kvmesh.core.seams import SamplingParams
from kvmesh.router import tls
from kvmesh.router.client import KvmeshClient
from kvmesh.router.retry import RetryPolicy

APP_NAME = "kvmesh-tls"
NO_RETRY = RetryPolicy(max_attempts=1)
RELOAD_CHECK_S = 0.2  # how soon the gRPC edge notices a rotation (router.tls.reload_check_s)

pytestmark = [pytest.mark.e2e, pytest.mark.shared_ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return ThrowawayPki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, pki):
    config = tiny_cluster_config(tiny_model_dir, num_workers=1, max_num_seqs=4, num_blocks=64, router={
        "tls": {"cert_file": str(pki.server_cert_file), "key_file": str(pki.server_key_file),
                "reload_check_s": RELOAD_CHECK_S}})
    with serving(config, APP_NAME) as served:
        yield served


def _grpc_target(cluster) -> str:
    return f"localhost:{cluster.router.grpc_port}"  # the name the certificate is for


def _generate(target: str, credentials: grpc.ChannelCredentials | None) -> list[int]:
    """One 4-token greedy stream through the kvmesh client (no retries: a refusal raises)."""
    with KvmeshClient(target, retry_policy=NO_RETRY, credentials=credentials) as client:
        deltas = list(client.generate("The north warehouse lists", timeout_s=60,
                                      sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
    assert deltas[-1].finished
    return [t for d in deltas for t in d.token_ids]


def test_grpc_over_tls_streams_and_a_plaintext_or_untrusting_client_is_refused(cluster, pki):
    target = _grpc_target(cluster)
    assert len(_generate(target, tls.grpc_channel_credentials(str(pki.ca_file)))) == 4
    with pytest.raises(WorkerFailedError):  # UNAVAILABLE: the handshake never completes
        _generate(target, None)
    stranger = ThrowawayPki.create(pki.folder / "stranger")
    with pytest.raises(WorkerFailedError):
        _generate(target, tls.grpc_channel_credentials(str(stranger.ca_file)))


def test_openai_sdk_over_https_and_plain_http_is_refused(cluster, pki):
    import openai

    base = f"127.0.0.1:{cluster.router.http_port}"  # the certificate names 127.0.0.1 too
    with httpx.Client(verify=str(pki.ca_file), timeout=60) as http:
        client = openai.OpenAI(base_url=f"https://{base}/v1", api_key="unused", max_retries=0, http_client=http)
        [model] = client.models.list().data
        full = client.completions.create(model=model.id, prompt="The north warehouse lists", max_tokens=4,
                                         temperature=0, extra_body={"ignore_eos": True})
        assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 4
        chunks = list(client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=4, temperature=0, stream=True))
        assert chunks[-1].choices[0].finish_reason is not None
    with pytest.raises(httpx.TransportError):  # the TLS listener drops a plaintext request
        httpx.get(f"http://{base}/v1/models", timeout=10)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://{base}/v1/models", verify=str(ThrowawayPki.create(pki.folder / "other").ca_file),
                  timeout=10)


def test_a_certificate_rewritten_in_place_reaches_new_grpc_connections(cluster, pki):
    """What a cert-manager renewal does to the mounted Secret: the replica re-reads the files
    (at most every reload_check_s) at the next handshake; the tokens stay the same."""
    port = cluster.router.grpc_port
    credentials = tls.grpc_channel_credentials(str(pki.ca_file))
    before = _generate(_grpc_target(cluster), credentials)
    assert _served_cert_der(port, pki) == pki.server_cert_der
    rotated = pki.rotate_server_cert()
    wait_for(lambda: _served_cert_der(port, pki) == rotated, timeout_s=30,
             what="the rewritten certificate on a new gRPC connection")
    assert _generate(_grpc_target(cluster), credentials) == before
