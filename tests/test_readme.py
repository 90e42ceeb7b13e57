"""The README's settings table lists every setting the code has."""

from __future__ import annotations

from pathlib import Path

from sits_app.settings_cli import all_settings

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_setting_is_documented_in_the_readme() -> None:
    text = README.read_text()
    missing = [variable for variable, *_ in all_settings() if f"`{variable}`" not in text]
    assert missing == [], f"add these to the README (sits settings --markdown): {missing}"


def test_readme_gives_the_two_commands() -> None:
    text = README.read_text()
    assert "make demo" in text and "make test" in text
