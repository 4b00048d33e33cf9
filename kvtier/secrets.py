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


# `user:password@` anywhere in a text: a URL (its scheme kept), or what was meant as one
# (`redis//u:pw@h`). The password runs to the last '@' of the word: a client splits the user
# info there (urllib), so a password may hold '@' or '/', and none of it is shown
_CREDENTIALS = re.compile(
    r"((?:[A-Za-z][A-Za-z0-9+.\-]*:/+)?[^\s'\"/@:,\[\]]*):[^\s'\"]+@"
)
# settings not secret in `tierctl config` but never quoted in an error: an operator may
# use a customer's name as the salt, and an error goes to logs others read
_UNQUOTED_IN_ERRORS = ("tenant_salt",)


def redact_url(url: str) -> str:
    """`scheme://user:***@host...` for a URL with a password (or a string meant as one,
    such as `redis//user:pw@host`); other strings unchanged."""
    return mask_credentials(url)


def shown(field: str, value):
    """What may be printed of setting `field`."""
    if value is not None and _SECRET_FIELD.search(field):
        return "***"
    if isinstance(value, str):
        return redact_url(value)
    return value


def mask_credentials(text: str) -> str:
    """`text` with every `user:password@` written as `user:***@`."""
    return _CREDENTIALS.sub(r"\1:***@", text)


def scrub_error(message: str, values: dict) -> str:
    """An error `message` about settings `values` (key -> value) with every secret in it
    masked: the value of a secret field (`shown`) or of `tenant_salt`, whole or any string
    inside it (a list), and every password in a URL."""
    secrets = []
    for key, value in values.items():
        if value is not None and (
            shown(key, value) == "***" or key in _UNQUOTED_IN_ERRORS
        ):
            secrets.extend(_strings(value))
    for s in sorted(set(secrets), key=len, reverse=True):
        message = message.replace(repr(s), "***")
        if (
            len(s) >= 4
        ):  # a shorter one would mask words of the message; errors quote reprs
            message = message.replace(s, "***")
    return mask_credentials(message)


def _strings(value) -> list[str]:
    if isinstance(value, (list, tuple, set)):
        return [repr(value)] + [s for v in value for s in _strings(v)]
    if isinstance(value, dict):
        return [repr(value)] + [s for v in value.values() for s in _strings(v)]
    return [repr(value), str(value)]
