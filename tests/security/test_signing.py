"""sits.runtime.signing: what a signature covers, which keys verify it, and key files that change."""

from __future__ import annotations

from pathlib import Path

import pytest

from sits.runtime.signing import (
    KEY_ID_HEADER,
    SIGNATURE_HEADER,
    KeyFile,
    KeyFileError,
    SignatureError,
    Signer,
    SigningKey,
    Verifier,
    key_line,
    new_key,
    parse_keys,
    read_keys,
    write_key_file,
)

KEY = b"host/GPU-1//vllm-0"
VALUE = b"\x08\x01serialized command"


class Ticks:
    """A monotonic clock moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def category(verifier: Verifier, headers: list[tuple[str, bytes]], key: bytes = KEY, value: bytes = VALUE) -> str:
    with pytest.raises(SignatureError) as refused:
        verifier.verify(headers, key, value)
    return refused.value.category


def test_a_signature_verifies_and_names_its_key() -> None:
    a, b = new_key("a"), new_key("b")
    headers = Signer([a]).headers(KEY, VALUE)
    assert dict(headers)[KEY_ID_HEADER] == b"a"
    assert dict(headers)[SIGNATURE_HEADER].startswith(b"hmac-sha256=")
    assert Verifier([b, a]).verify([("ce_id", b"x"), *headers], KEY, VALUE) == "a"


def test_value_key_and_key_id_are_all_covered() -> None:
    a = new_key("a")
    verifier = Verifier([a, SigningKey("b", a.secret)])
    headers = Signer([a]).headers(KEY, VALUE)
    assert category(verifier, headers, value=VALUE + b"\x00") == "bad_signature"
    assert category(verifier, headers, value=VALUE[:-1]) == "bad_signature"
    assert category(verifier, headers, key=b"host/GPU-1//vllm-1") == "bad_signature"
    # The same secret under another id is another signature: the id is inside the MAC.
    relabelled = [(KEY_ID_HEADER, b"b"), (SIGNATURE_HEADER, dict(headers)[SIGNATURE_HEADER])]
    assert category(verifier, relabelled) == "bad_signature"


def test_unsigned_unknown_key_wrong_secret_and_malformed_headers_are_refused_by_category() -> None:
    a = new_key("a")
    verifier = Verifier([a])
    assert category(verifier, [("ce_id", b"x")]) == "unsigned"
    assert category(verifier, Signer([new_key("z")]).headers(KEY, VALUE)) == "unknown_key"
    assert category(verifier, Signer([SigningKey("a", b"w" * 32)]).headers(KEY, VALUE)) == "bad_signature"
    good = Signer([a]).headers(KEY, VALUE)
    assert category(verifier, [good[0]]) == "bad_signature"  # a key id without a signature
    assert category(verifier, [good[1]]) == "bad_signature"  # a signature without a key id
    assert category(verifier, [*good, good[1]]) == "bad_signature"  # two signatures
    assert category(verifier, [good[0], (SIGNATURE_HEADER, b"hmac-sha256=00")]) == "bad_signature"
    assert category(verifier, [good[0], (SIGNATURE_HEADER, b"md5=" + b"0" * 64)]) == "bad_signature"


def test_key_files_parse_with_comments_and_refuse_bad_lines_without_showing_secrets(tmp_path: Path) -> None:
    a, b = new_key("2026-12"), new_key("2027-01")
    text = f"# keys\n\n{key_line(a)}\n  {key_line(b)}  \n"
    assert parse_keys(text) == (a, b)
    secret_text = key_line(a).split()[1]
    bad_lines = {
        "nothing": "# only a comment\n",
        "three fields": f"{key_line(a)} extra\n",
        "short secret": "k c2hvcnQ=\n",
        "bad id": f"bad/id {secret_text}\n",
        "twice": f"{key_line(a)}\n{key_line(a)}\n",
    }
    for name, bad in bad_lines.items():
        with pytest.raises(KeyFileError) as refused:
            parse_keys(bad, "f")
        assert secret_text not in str(refused.value), name
    with pytest.raises(KeyFileError, match="cannot read"):
        read_keys(tmp_path / "missing")
    path = tmp_path / "keys"
    write_key_file(path, [b, a])
    assert read_keys(path) == (b, a)
    assert path.stat().st_mode & 0o077 == 0, "a key file is readable by its owner only"
    assert "secret" not in repr(a) and secret_text not in repr(a)


def test_a_key_file_is_reread_when_it_changes_and_a_bad_rewrite_keeps_the_last_keys(tmp_path: Path) -> None:
    old, new = new_key("old"), new_key("new")
    path = tmp_path / "ring"
    write_key_file(path, [old])
    ticks = Ticks()
    ring = KeyFile(path, recheck_s=1.0, monotonic=ticks)
    signer, verifier = Signer(ring), Verifier(ring)
    assert signer.key_id == "old"

    write_key_file(path, [new, old])  # the rotation's step 2: the new key signs, the old one still verifies
    assert signer.key_id == "old", "not re-checked before recheck_s"
    ticks.now = 1.0
    assert signer.key_id == "new"
    assert verifier.verify(Signer([old]).headers(KEY, VALUE), KEY, VALUE) == "old"

    path.write_text("half a line")
    ticks.now = 2.0
    assert [k.key_id for k in ring()] == ["new", "old"], "a broken file keeps the keys last read"
    assert ring.reloads == 1


def test_an_unknown_key_id_makes_the_verifier_look_at_the_file_at_once(tmp_path: Path) -> None:
    old, new = new_key("old"), new_key("new")
    path = tmp_path / "ring"
    write_key_file(path, [old])
    verifier = Verifier(KeyFile(path, recheck_s=3600.0, monotonic=Ticks()))
    headers = Signer([new]).headers(KEY, VALUE)
    assert category(verifier, headers) == "unknown_key"
    write_key_file(path, [old, new])
    assert verifier.verify(headers, KEY, VALUE) == "new"
