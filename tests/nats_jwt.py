"""NATS decentralised auth for tests: an operator, accounts and users as nkeys and signed JWTs (v2),
the ``.creds`` files clients use, and the nats-server config that trusts them (memory resolver).

What ``nsc`` would make, minted here so the tests need no other tool: each JWT is
``base64url(header).base64url(claims).base64url(ed25519 signature of the first two parts)``, without
padding; the header is ``{"typ": "JWT", "alg": "ed25519-nkey"}``; the claims name the signer
(``iss``, a public nkey), the subject (``sub``) and carry a ``nats`` object with the claim ``type`` and
``version`` 2. The operator signs itself and the accounts, each account signs its users.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys

__all__ = ["NatsOperator"]

UNLIMITED = -1
# Connections, subscriptions, data, payload, imports and exports without limits.
_ACCOUNT_LIMITS: dict[str, Any] = {
    "subs": UNLIMITED,
    "data": UNLIMITED,
    "payload": UNLIMITED,
    "imports": UNLIMITED,
    "exports": UNLIMITED,
    "wildcards": True,
    "conn": UNLIMITED,
    "leaf": UNLIMITED,
}
# An account has JetStream when its memory or disk storage limit is not 0.
_JETSTREAM_LIMITS: dict[str, Any] = {
    "mem_storage": UNLIMITED,
    "disk_storage": UNLIMITED,
    "streams": UNLIMITED,
    "consumer": UNLIMITED,
}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _keypair(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


def _public(key: nkeys.KeyPair) -> str:
    return str(key.public_key.decode())


def _jwt(signer: nkeys.KeyPair, subject: str, name: str, nats: dict[str, Any]) -> str:
    claims = {
        "jti": base64.b32encode(secrets.token_bytes(20)).decode().rstrip("="),
        "iat": int(time.time()),
        "iss": _public(signer),
        "name": name,
        "sub": subject,
        "nats": {**nats, "version": 2},
    }
    signed = f"{_b64(json.dumps({'typ': 'JWT', 'alg': 'ed25519-nkey'}).encode())}.{_b64(json.dumps(claims).encode())}"
    return f"{signed}.{_b64(signer.sign(signed.encode()))}"


@dataclass
class _Account:
    key: nkeys.KeyPair
    jwt: str


class NatsOperator:
    """An operator with a system account; `account` adds accounts, `creds` users of one of them."""

    def __init__(self, name: str = "kv-router-test") -> None:
        self._key = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
        self.jwt = _jwt(self._key, _public(self._key), name, {"type": "operator"})
        self._accounts: dict[str, _Account] = {}
        self.account("SYS", jetstream=False)  # JetStream needs a system account

    def account(self, name: str, *, jetstream: bool = True) -> str:
        """Add an account (with JetStream unless told otherwise); returns its public key."""
        key = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
        limits = {**_ACCOUNT_LIMITS, **(_JETSTREAM_LIMITS if jetstream else {})}
        self._accounts[name] = _Account(key, _jwt(self._key, _public(key), name, {"type": "account", "limits": limits}))
        return _public(key)

    def creds(self, path: Path, account: str, user: str) -> Path:
        """Write a ``.creds`` file for a new user of ``account`` (no permission limits) to ``path``."""
        key = _keypair(nkeys.PREFIX_BYTE_USER)
        nats = {"type": "user", "pub": {}, "sub": {}, "subs": UNLIMITED, "data": UNLIMITED, "payload": UNLIMITED}
        user_jwt = _jwt(self._accounts[account].key, _public(key), user, nats)
        seed = key.seed.decode()
        path.write_text(
            f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
        )
        path.chmod(0o600)
        return path

    def server_config(self) -> str:
        """The nats-server config lines that trust this operator and know its accounts."""
        preload = ", ".join(f"{_public(account.key)}: {account.jwt}" for account in self._accounts.values())
        return (
            f"operator: {self.jwt}\n"
            f"system_account: {_public(self._accounts['SYS'].key)}\n"
            "resolver: MEMORY\n"
            f"resolver_preload: {{ {preload} }}\n"
        )
