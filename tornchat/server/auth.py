"""Credentials: a Bearer API key and/or HTTP Basic user:password, compared in constant time."""
import base64
import binascii
import hmac

from tornchat.config import Config


def required(config: Config) -> bool:
    return bool(config.api_key or config.api_auth)


def authorized(config: Config, header: str | None) -> bool:
    """Whether an Authorization header satisfies the configured credentials (either, if both are set)."""
    if not required(config):
        return True
    scheme, _, credentials = (header or "").strip().partition(" ")
    scheme, credentials = scheme.lower(), credentials.strip()
    if scheme == "bearer" and config.api_key:
        return hmac.compare_digest(credentials.encode(), config.api_key.encode())
    if scheme == "basic" and config.api_auth:
        try:
            decoded = base64.b64decode(credentials, validate=True)
        except (binascii.Error, ValueError):
            return False
        return hmac.compare_digest(decoded, config.api_auth.encode())
    return False


def challenges(config: Config) -> list[str]:
    """WWW-Authenticate values for a 401: one per accepted scheme."""
    found = []
    if config.api_key:
        found.append('Bearer realm="tornchat"')
    if config.api_auth:
        found.append('Basic realm="tornchat", charset="UTF-8"')
    return found
