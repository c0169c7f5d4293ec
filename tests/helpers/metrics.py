"""Reading a node's metrics textfile in tests, with prometheus' own parser (what a
node exporter would read, not a regex of ours)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["one_sample"]


def one_sample(textfile: Path, name: str) -> float:
    """The value of the one sample called ``name`` in ``textfile``; fails (showing the
    file) when there is none or more than one."""
    text = textfile.read_text()
    got = [
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    ]
    assert len(got) == 1, text
    return got[0]
