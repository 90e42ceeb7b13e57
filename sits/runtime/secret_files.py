"""Secrets live in files, and never in logs.

Passwords and keys are read from files named by settings (`*_FILE`), so they
stay out of environment listings and process tables; URLs that may carry a
password are shown through `mask_url`.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

MASK = "***"


class SecretFileError(ValueError):
    """A secret file is missing, unreadable or empty; the message names the file, never its content."""


def read_secret(path: Path, what: str = "secret") -> str:
    """The file's content without its trailing newline; SecretFileError when it is missing or empty."""
    try:
        value = path.read_text().rstrip("\r\n")
    except OSError as err:
        raise SecretFileError(f"cannot read the {what} file {path}: {err.strerror or err}") from None
    if not value:
        raise SecretFileError(f"the {what} file {path} is empty")
    return value


def mask_url(url: str) -> str:
    """`url` with any password replaced by ***, for logs and progress messages."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url  # no password (a user name alone is not one)
    user = userinfo.split(":", 1)[0]
    return urlunsplit((parts.scheme, f"{user}:{MASK}@{hostport}", parts.path, parts.query, parts.fragment))
