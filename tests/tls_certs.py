"""Test PKI made at test time with `cryptography`: a CA, a server certificate for localhost /
127.0.0.1, and a client certificate, written as PEM files (no certificates in the repository).

    pki = ThrowawayPki.create(tmp_path)
    pki.ca_file, pki.server_cert_file, pki.server_key_file, pki.client_cert_file, pki.client_key_file
    pki.rotate_server_cert()       # a new server certificate in place (what a renewal does)
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _issue(common_name: str, issuer_key, issuer_name: x509.Name, ca: bool = False, server: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return key, builder.sign(issuer_key or key, hashes.SHA256())


@dataclass
class ThrowawayPki:
    folder: Path
    _ca_key: object = None
    _ca_name: x509.Name | None = None

    @classmethod
    def create(cls, folder: Path) -> "ThrowawayPki":
        pki = cls(Path(folder))
        pki.folder.mkdir(parents=True, exist_ok=True)
        pki._ca_name = _name("kvmesh test CA")
        pki._ca_key, ca_cert = _issue("kvmesh test CA", None, pki._ca_name, ca=True)
        pki.ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        pki.rotate_server_cert()
        key, cert = _issue("kvmesh test client", pki._ca_key, pki._ca_name)
        pki.client_key_file.write_bytes(_key_pem(key))
        pki.client_cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return pki

    def rotate_server_cert(self) -> bytes:
        """Write a new server key and certificate in place; the certificate's DER."""
        key, cert = _issue("localhost", self._ca_key, self._ca_name, server=True)
        self.server_key_file.write_bytes(_key_pem(key))
        self.server_cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cert.public_bytes(serialization.Encoding.DER)

    @property
    def server_cert_der(self) -> bytes:
        return x509.load_pem_x509_certificate(self.server_cert_file.read_bytes()).public_bytes(serialization.Encoding.DER)

    ca_file = property(lambda self: self.folder / "ca.pem")
    server_cert_file = property(lambda self: self.folder / "server.pem")
    server_key_file = property(lambda self: self.folder / "server-key.pem")
    client_cert_file = property(lambda self: self.folder / "client.pem")
    client_key_file = property(lambda self: self.folder / "client-key.pem")
