"""Never print a secret: URLs lose their password, secret-looking fields are masked."""

from __future__ import annotations

import re

# a secret-looking word as a whole part of the field name (`aws_session_token`,
# `secret_access_key`, `password`), not inside another word (`prefetch_min_tokens`); the tenant key itself, not the
# path of its file
_SECRET_FIELD = re.compile(
    r"(?:^|_)(?:password|passwd|secret|access_key|token|api_key)(?:_|$)"
    r"|(?:^|_)tenant_key$",
    re.IGNORECASE,
)


def redact_url(url: str) -> str:
    """`scheme://user:***@host...` for a URL with a password; other strings unchanged."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest.split("/", 1)[0]:
        return url
    cred, _, host = rest.partition("@")
    user = cred.split(":", 1)[0]
    if ":" not in cred:
        return url  # a user name alone is no secret
    return f"{scheme}{sep}{user}:***@{host}" if user else f"{scheme}{sep}***@{host}"


def shown(field: str, value):
    """What may be printed of setting `field`."""
    if value is not None and _SECRET_FIELD.search(field):
        return "***"
    if isinstance(value, str):
        return redact_url(value)
    return value
