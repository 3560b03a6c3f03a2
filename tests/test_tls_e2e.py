"""End to end with mutual TLS on (router.tls with client_ca_file: a throwaway CA, server and
client certificates written by the test with `cryptography`, tests/tls_certs.py): the real Serve
app, one router replica, one worker of the tiny random Llama. Both edges are the replica's own
servers, with the same router/tls.py configuration.

* gRPC (router/grpc_ingress.py -> tls.add_grpc_port): the kvmesh client over TLS with its client
  certificate streams; a plaintext client, a TLS client that does not trust the CA, and one
  without a client certificate are refused.
* HTTP (router/http_ingress.py, ReloadingSSLContext): the OpenAI Python SDK over https:// with
  its client certificate works (completion, streamed chat, models); plain http://, an untrusting
  client and a client without a certificate are refused.
* A certificate rewritten in place (a cert-manager renewal) reaches the next connections on
  both ports, no restart; the tokens are unchanged.
"""

from __future__ import annotations

import ssl

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
RELOAD_CHECK_S = 0.2  # how soon both edges notice a rotation (router.tls.reload_check_s)

pytestmark = [pytest.mark.e2e, pytest.mark.shared_ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return ThrowawayPki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, pki):
    config = tiny_cluster_config(tiny_model_dir, num_workers=1, max_num_seqs=4, num_blocks=64, router={
        "tls": {"cert_file": str(pki.server_cert_file), "key_file": str(pki.server_key_file),
                "client_ca_file": str(pki.ca_file), "reload_check_s": RELOAD_CHECK_S}})
    with serving(config, APP_NAME) as served:
        yield served


def _grpc_target(cluster) -> str:
    return f"localhost:{cluster.router.grpc_port}"  # the name the certificate is for


def _grpc_credentials(pki, with_client_cert: bool = True) -> grpc.ChannelCredentials:
    if not with_client_cert:
        return tls.grpc_channel_credentials(str(pki.ca_file))
    return tls.grpc_channel_credentials(str(pki.ca_file), str(pki.client_cert_file), str(pki.client_key_file))


def _https_context(pki, with_client_cert: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca_file))
    if with_client_cert:
        context.load_cert_chain(str(pki.client_cert_file), str(pki.client_key_file))
    return context


def _generate(target: str, credentials: grpc.ChannelCredentials | None) -> list[int]:
    """One 4-token greedy stream through the kvmesh client (no retries: a refusal raises)."""
    with KvmeshClient(target, retry_policy=NO_RETRY, credentials=credentials) as client:
        deltas = list(client.generate("The north warehouse lists", timeout_s=60,
                                      sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
    assert deltas[-1].finished
    return [t for d in deltas for t in d.token_ids]


def _openai_completion(base: str, pki) -> list[str]:
    """The OpenAI SDK over https:// with the client certificate: one 4-token greedy completion
    (its text) after listing the model."""
    import openai

    with httpx.Client(verify=_https_context(pki), timeout=60) as http:
        client = openai.OpenAI(base_url=f"https://{base}/v1", api_key="unused", max_retries=0, http_client=http)
        [model] = client.models.list().data
        full = client.completions.create(model=model.id, prompt="The north warehouse lists", max_tokens=4,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 4
    return full.choices[0].text


def test_grpc_over_mutual_tls_streams_and_other_clients_are_refused(cluster, pki):
    target = _grpc_target(cluster)
    assert len(_generate(target, _grpc_credentials(pki))) == 4
    with pytest.raises(WorkerFailedError):  # UNAVAILABLE: the handshake never completes
        _generate(target, None)
    with pytest.raises(WorkerFailedError):  # no client certificate
        _generate(target, _grpc_credentials(pki, with_client_cert=False))
    stranger = ThrowawayPki.create(pki.folder / "stranger")
    with pytest.raises(WorkerFailedError):
        _generate(target, tls.grpc_channel_credentials(str(stranger.ca_file), str(pki.client_cert_file),
                                                       str(pki.client_key_file)))


def test_openai_sdk_over_mutual_tls_and_other_clients_are_refused(cluster, pki):
    import openai

    base = f"127.0.0.1:{cluster.router.http_port}"  # the certificate names 127.0.0.1 too
    assert _openai_completion(base, pki)
    with httpx.Client(verify=_https_context(pki), timeout=60) as http:
        client = openai.OpenAI(base_url=f"https://{base}/v1", api_key="unused", max_retries=0, http_client=http)
        chunks = list(client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4,
                                                     messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                                     stream=True))
        assert chunks[-1].choices[0].finish_reason is not None
        assert http.get(f"https://{base}/health").json()["status"] == "ok"
    with pytest.raises(httpx.TransportError):  # the TLS listener drops a plaintext request
        httpx.get(f"http://{base}/v1/models", timeout=10)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://{base}/v1/models", verify=str(ThrowawayPki.create(pki.folder / "other").ca_file),
                  timeout=10)
    with pytest.raises(httpx.TransportError):  # trusts the server but shows no certificate
        httpx.get(f"https://{base}/v1/models", verify=_https_context(pki, with_client_cert=False), timeout=10)


def test_a_certificate_rewritten_in_place_reaches_new_connections_on_both_ports(cluster, pki):
    """What a cert-manager renewal does to the mounted Secret: the replica re-reads the files
    (at most every reload_check_s) for the next handshakes; the tokens stay the same."""
    ports = (cluster.router.grpc_port, cluster.router.http_port)
    base = f"127.0.0.1:{cluster.router.http_port}"
    before_tokens, before_text = _generate(_grpc_target(cluster), _grpc_credentials(pki)), _openai_completion(base, pki)
    assert all(_served_cert_der(port, pki, with_client_cert=True) == pki.server_cert_der for port in ports)
    rotated = pki.rotate_server_cert()
    for port in ports:
        wait_for(lambda: _served_cert_der(port, pki, with_client_cert=True) == rotated, timeout_s=30,
                 what=f"the rewritten certificate on a new connection to port {port}")
    assert _generate(_grpc_target(cluster), _grpc_credentials(pki)) == before_tokens
    assert _openai_completion(base, pki) == before_text
