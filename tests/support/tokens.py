"""What a rank reports about a secret it was given: a digest, never the value."""

from __future__ import annotations

import hashlib
import os


def token_digest(name: str = "MY_TOKEN") -> str:
    return hashlib.sha256(os.environ[name].encode()).hexdigest()


def digest_of(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()
