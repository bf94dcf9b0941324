"""Client credentials for a node that serves mutual TLS (``fencemark node --tls-dir``).

The node verifies every caller's certificate against the cluster CA and
authorizes by the identity in it (``fencemark://client/NAME``); the client
verifies the node's certificate against the same CA. ``fencemark certs init``
(or ``certs issue --client NAME``) writes the files this reads.
"""

from __future__ import annotations

from pathlib import Path

import grpc

__all__ = ["tls_credentials"]


def tls_credentials(
    tls_dir: str | Path, name: str, *, ca_file: str = "ca.pem"
) -> grpc.ChannelCredentials:
    """Credentials from ``tls_dir``: the CA ``ca.pem``, ``NAME.pem`` and ``NAME-key.pem``.

    Pass them to ``AsyncClient``/``Client`` as ``credentials=``. Raises OSError
    naming a file that cannot be read.
    """
    directory = Path(tls_dir)
    contents = []
    for path in (directory / ca_file, directory / f"{name}.pem", directory / f"{name}-key.pem"):
        try:
            contents.append(path.read_bytes())
        except OSError as exc:
            raise OSError(f"cannot read {path}: {exc.strerror or exc}") from exc
    ca, cert, key = contents
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )
