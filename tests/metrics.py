"""The tests' one reader of a Prometheus text exposition, on prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["sample"]


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` whose labels are exactly ``labels``; None when the series is
    not exported (absent is not zero: a dashboard shows "no data", and a test should tell the two apart)."""
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and found.labels == labels:
                return float(found.value)
    return None
